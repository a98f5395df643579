"""Hugging Face-format checkpoint folders with random weights, for any registered architecture at any preset's real
shapes (the tensors are the model class's weight table).

Linear and embedding weights ~ N(0, initializer_range), as transformers initialises them. RMSNorm weights are
1 + N(0, 0.1) by default (perturb_norms), not transformers' 1: a kernel that ignores a norm weight, or swaps
q_norm and k_norm, then gives wrong logits in the end-to-end tests. Tensors are generated and written one at a
time, large ones in row chunks, so an 8B model is written with bounded RAM. Each tensor's values depend only on
(seed, tensor name): the same seed gives the same weights whatever the sharding, and the same bytes whatever the
number of workers (`workers`: threads writing runs of tensors in parallel at their offsets in the shard files).

Every folder gets the Qwen3 tokenizer (xserv/presets/tokenizer), whatever the architecture: the Llama presets
therefore use Qwen3's vocabulary size and special token ids.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import zlib
from statistics import NormalDist
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .. import settings
from ..tensor import as_dtype
from .checkpoint import INDEX_FILE, SINGLE_FILE
from .config import DenseConfig, preset_dict, presets_dir
from ..fp8_format import DEFAULT_BLOCK, E4M3, quantize_blockwise
from .fp8 import Fp8BlockQuantization
from .registry import config_from_dict, model_class
from .safetensors_writer import (DEFAULT_SHARD_SIZE, TensorEntry, default_workers, parse_size,  # noqa: F401
                                 save_safetensors, write_sharded)

CHUNK_ELEMENTS = 1 << 24  # rows of at most this many elements are generated at once (64 MB of float32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MARKER_FILE = "xserv_random.json"  # what made the folder; its presence marks a folder make_test_model may replace
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_OWN_FILES = frozenset({"config.json", "generation_config.json", MARKER_FILE, SINGLE_FILE, INDEX_FILE,
                        *TOKENIZER_FILES})
_DTYPES = {"bfloat16", "float16", "float32"}


def _rng_for(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


@functools.lru_cache(maxsize=1)
def _normal_quantiles() -> np.ndarray:
    """Phi^-1((k + 0.5) / 65536), k = 0..65535: indexing it with uniform 16-bit integers draws from N(0, 1)
    discretised to 65536 equal-probability levels (tails cut at 4.3 sigma) - finer than bf16 resolution, and five
    times faster than Generator.standard_normal, which matters for writing an 8B model."""
    nd = NormalDist()
    return np.array([nd.inv_cdf((k + 0.5) / 65536) for k in range(65536)], dtype=np.float64)


def _normal_fill(seed: int, name: str, shape, std: float, mean: float, dtype: np.dtype):
    def fill() -> Iterable[np.ndarray]:
        rng = _rng_for(seed, name)
        table = (_normal_quantiles() * std + mean).astype(np.float32).astype(dtype)
        rows = shape[0]
        row_elems = math.prod(shape[1:])
        step = max(1, CHUNK_ELEMENTS // max(row_elems, 1))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            idx = rng.integers(0, 65536, (n,) + tuple(shape[1:]), dtype=np.uint16)
            yield table[idx]
    return fill


def _ones_fill(shape, dtype):
    return lambda: [np.ones(shape, dtype)]


def _whole_blocks(chunks: Iterable[np.ndarray], rows: int) -> Iterable[np.ndarray]:
    """The same rows re-cut into chunks of a multiple of `rows` rows (the last one: what is left)."""
    pending: list[np.ndarray] = []
    have = 0
    for chunk in chunks:
        pending.append(chunk)
        have += chunk.shape[0]
        if have >= rows:
            whole = np.concatenate(pending) if len(pending) > 1 else pending[0]
            cut = have - have % rows
            yield whole[:cut]
            pending, have = ([whole[cut:]], have - cut) if cut < have else ([], 0)
    if have:
        yield np.concatenate(pending) if len(pending) > 1 else pending[0]


class _Fp8Pair:
    """The two entries of a quantized weight: its e4m3 values and its float32 inverse scales, both from the bf16
    (`dtype`) draws a float checkpoint of the same seed holds, quantized block row by block row
    (fp8.quantize_blockwise). Writing the weight keeps its scales for the scale entry that follows it; a scale
    entry written first (by another worker) draws the weight again: the same bytes either way."""

    def __init__(self, draws: Callable, block: tuple[int, int]):
        self.draws, self.block = draws, block
        self.scales: np.ndarray | None = None

    def _quantized(self) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        for rows in _whole_blocks(self.draws(), self.block[0]):
            yield quantize_blockwise(rows, self.block)

    def weight_fill(self) -> Iterable[np.ndarray]:
        scales = []
        for q, s in self._quantized():
            scales.append(s)
            yield q
        self.scales = np.concatenate(scales)

    def scale_fill(self) -> Iterable[np.ndarray]:
        scales, self.scales = self.scales, None
        if scales is not None:
            yield scales
        else:
            for _, s in self._quantized():
                yield s


def random_weight_entries(config: DenseConfig, seed: int = 0, dtype: str = "bfloat16",
                          perturb_norms: bool = True) -> list[TensorEntry]:
    """The tensors of a random checkpoint of config's architecture, in weight-table order, not yet generated. With
    an FP8 quantization_config, each quantized weight is its float draws quantized blockwise (e4m3, then its
    `*.weight_scale_inv` float32 scales), as in Qwen's -FP8 checkpoints."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    dt = as_dtype(dtype)
    entries = []
    cls = model_class(config)
    extra = cls.extra_tensors(config) if hasattr(cls, "extra_tensors") else []
    for w in cls.weight_table(config) + extra:
        if hasattr(cls, "random_init"):  # the model's own initialisation (zero-centred norms, recurrent gates, ...)
            mean, std = cls.random_init(w, config, perturb_norms)
            fill = _normal_fill(seed, w.name, w.shape, std, mean, dt)
        elif w.is_norm:
            fill = _normal_fill(seed, w.name, w.shape, 0.1, 1.0, dt) if perturb_norms else _ones_fill(w.shape, dt)
        else:
            fill = _normal_fill(seed, w.name, w.shape, config.initializer_range, 0.0, dt)
        if w.quantized:
            pair = _Fp8Pair(fill, w.block)
            entries += [TensorEntry(w.name, E4M3, w.shape, pair.weight_fill),
                        TensorEntry(w.scale_name, np.float32, w.scale_shape, pair.scale_fill)]
        else:
            entries.append(TensorEntry(w.name, dt, w.shape, fill))
    return entries


def fp8_quantization_config(config: DenseConfig, block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """The quantization_config Qwen's -FP8 checkpoints carry, for config's architecture: fine-grained e4m3 in
    `block` blocks, dynamic activations; for an MoE model, modules_to_not_convert lists lm_head and every router
    (what transformers needs to leave them in bf16)."""
    d = Fp8BlockQuantization(block).to_dict()
    table = model_class(config).weight_table(config.replace(quantization_config=Fp8BlockQuantization(block)))
    routers = [w.name.removesuffix(".weight") for w in table if w.field == "router"]
    if routers:
        d["modules_to_not_convert"] = ["lm_head"] + routers
    return d


# config.json fields that stay at the top level of a config that nests its text model (`text_config`)
_OUTER_FIELDS = ("architectures", "model_type", "tie_word_embeddings", "quantization_config", "vision_config")


def _apply_overrides(d: dict, overrides: dict) -> None:
    """Apply config.json overrides in place; for a config nesting its text model, the text fields go into
    `text_config`. A new num_hidden_layers drops a layer_types list of another length (the model's schedule rule,
    e.g. every fourth layer full attention, then rebuilds it)."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    for key, value in overrides.items():
        (d if key in _OUTER_FIELDS or text is d else text)[key] = value
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) != text.get("num_hidden_layers", len(types)):
        del text["layer_types"]


def preset_file(config: DenseConfig, kind: str) -> Path:
    """The bundled file (or folder) of `kind` ("tokenizer", "generation_config") a random checkpoint of config's
    architecture gets: its model class's own (e.g. the hybrids' Qwen3.5 tokenizer), else Qwen3's."""
    cls = model_class(config)
    own = {"tokenizer": getattr(cls, "TOKENIZER_PRESET", None),
           "generation_config": getattr(cls, "GENERATION_CONFIG_PRESET", None)}[kind]
    return presets_dir() / (own or {"tokenizer": "tokenizer", "generation_config": "generation_config.json"}[kind])


def generation_config_dict(config: DenseConfig) -> dict:
    d = json.loads(preset_file(config, "generation_config").read_text())
    if config.bos_token_id is not None:
        d["bos_token_id"] = config.bos_token_id
    return d


def free_bytes(folder) -> int:
    """Free space of the filesystem holding `folder` (what a new checkpoint there may take)."""
    return shutil.disk_usage(folder).free


def make_test_model(preset: str | DenseConfig, out_dir, seed: int = 0, *, dtype: str = "bfloat16",
                    perturb_norms: bool = True, shard_size=DEFAULT_SHARD_SIZE, overrides: dict | None = None,
                    progress: bool | None = None, overwrite: bool = True, workers: int | None = None,
                    fp8: bool = False, force: bool = False) -> Path:
    """Write a Hugging Face-format folder with random weights to out_dir and return its path.

    preset: a name from xserv.models.config.PRESET_NAMES ('tiny', '0.6b', ..., 'llama3-1b', ...) or a config
    object. overrides: config.json fields to change (e.g. {"tie_word_embeddings": False, "num_hidden_layers": 1}).
    perturb_norms=False gives transformers' all-ones norm weights. progress: a bar when stderr is a terminal (None:
    for checkpoints over 256 MiB; False: never). The folder is built next to out_dir and renamed
    into place, so a reader never sees a half-written model; a ValueError with the sizes says so before anything
    is written when the filesystem there has too little free space. workers: threads generating and writing the
    tensors (None: one for checkpoints under 1 GiB, else one per core); any count gives the same bytes.
    fp8: an FP8 checkpoint in the layout of Qwen's -FP8 ones (their quantization_config, e4m3 linear weights in
    128 x 128 blocks with float32 *.weight_scale_inv; embeddings, norms, lm_head and routers in `dtype`): the same
    draws as the float checkpoint of this seed, quantized (fp8.quantize_blockwise). Another block size: a
    quantization_config in overrides.

    An existing out_dir must be empty or a folder this function wrote (its marker file and nothing but the files it
    writes: written_here); overwrite=True replaces such a folder, overwrite=False refuses any non-empty one.
    force=True replaces whatever is at out_dir. A refusal raises FileExistsError before anything is written."""
    if isinstance(preset, DenseConfig):
        d = preset.to_dict()
    else:
        d = preset_dict(preset)
    _apply_overrides(d, overrides or {})
    d["torch_dtype"] = dtype
    d.pop("dtype", None)
    config = config_from_dict(d)
    if fp8 and config.quantization_config is None:
        config = config_from_dict({**d, "quantization_config": fp8_quantization_config(config)})
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, (int, np.integer))
                                or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    out = Path(out_dir).expanduser().resolve()
    check_replaceable(out, overwrite=overwrite, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries = random_weight_entries(config, int(seed), dtype, perturb_norms)
    total = sum(e.nbytes for e in entries)
    # the weights, the tokenizer, and a MiB for the headers and small JSON files
    tokenizer = preset_file(config, "tokenizer")
    need = total + sum((tokenizer / name).stat().st_size for name in TOKENIZER_FILES) + 2**20
    free = free_bytes(out.parent)
    if free < need:
        raise ValueError(f"not enough free space for {out}: the checkpoint takes {need / 1e9:.2f} GB ({need} bytes), "
                         f"the filesystem of {out.parent} has {free / 1e9:.2f} GB free")
    workers = default_workers(total) if workers is None else int(workers)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        config_json = config.to_dict()
        config_json["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config_dict(config), indent=2) + "\n")
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / name, tmp / name)
        from ..progress import progress_bar

        bar = progress_bar(total, f"writing {out.name}", unit="B", unit_scale=True, unit_divisor=1024,
                           enabled=progress if progress is not None else total > 256 * 1024**2)
        try:
            write_sharded(tmp, entries, parse_size(shard_size), bar, workers=workers)
        finally:
            if bar is not None:
                bar.close()
        (tmp / MARKER_FILE).write_text(json.dumps({
            "preset": preset if isinstance(preset, str) else None, "seed": int(seed), "dtype": dtype,
            "perturb_norms": perturb_norms, "overrides": overrides or {}, "fp8": config.quantization_config is not None,
            "config_hash": _config_hash(config_json),
        }, indent=2) + "\n")
        # checked again: writing a large model takes minutes, and someone may have put a file there meanwhile
        if check_replaceable(out, overwrite=overwrite, force=force):
            if out.is_dir() and not out.is_symlink():
                shutil.rmtree(out)
            else:
                out.unlink()
        os.replace(tmp, out)  # fails (OSError) if another process filled `out` meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _own_file_name(name: str) -> bool:
    return name in _OWN_FILES or bool(_SHARD_FILE.fullmatch(name))


def written_here(folder: Path) -> bool:
    """Whether `folder` holds make_test_model's marker file and nothing but files make_test_model writes: a folder it
    wrote that no one added to, which it may replace without losing anything of anyone's."""
    entries = list(folder.iterdir())
    return (any(e.name == MARKER_FILE for e in entries)
            and all(e.is_file() and not e.is_symlink() and _own_file_name(e.name) for e in entries))


def check_replaceable(out: Path, *, overwrite: bool = True, force: bool = False,
                      force_name: str = "force=True") -> bool:
    """Whether something is at `out` that make_test_model would replace (False: nothing, or an empty folder).
    Raises FileExistsError, naming what is in the way, for what it must not replace: a file, or a non-empty folder
    that is not one it wrote (written_here), unless force; any non-empty folder when overwrite is False.
    force_name: how the message names force to its reader (the command line's `--force`)."""
    if not out.exists() and not out.is_symlink():
        return False
    if force:
        return True
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder: nothing was changed (choose another folder, or "
                              f"replace it with {force_name})")
    entries = sorted(e.name for e in out.iterdir())
    if not entries:
        return False
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    if not written_here(out):
        foreign = [n for n in entries if not _own_file_name(n) or (out / n).is_dir()] or entries
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise FileExistsError(f"{out} is not empty and is not a model folder make-test-model wrote ({shown} in it): "
                              f"nothing was changed (choose another folder, or replace it and all it holds with "
                              f"{force_name})")
    return True


def _config_hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return settings.CACHE_DIR.get()


def bundled_tiny_model() -> Path:
    """The tiny random Qwen3 model (norm weights off 1) under $XSERV_CACHE_DIR/models/tiny-random (default
    ~/.cache/xserv), made on first use (and remade if the tiny preset or the way it is made changed since)."""
    path = cache_dir() / "models" / "tiny-random"
    want = config_from_dict(preset_dict("tiny")).to_dict()
    marker = path / MARKER_FILE
    try:
        info = json.loads(marker.read_text())
        ok = (info.get("config_hash") == _config_hash(want) and info.get("perturb_norms") is True
              and (path / SINGLE_FILE).is_file() and all((path / f).is_file() for f in TOKENIZER_FILES))
    except (OSError, json.JSONDecodeError):
        ok = False
    if not ok:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)  # stale (made by an older tiny preset) or half-deleted
        try:
            make_test_model("tiny", path, seed=0, progress=False, overwrite=False)
        except OSError:
            # another process made it at the same moment (its rename won): use theirs if it is whole
            if not ((path / MARKER_FILE).is_file() and (path / SINGLE_FILE).is_file()):
                raise
    return path
