"""Reading Hugging Face safetensors checkpoints without a framework.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}), then the raw little-endian tensor bytes (offsets relative to
the end of the header). Each file is memory-mapped once; `get` returns a read-only NumPy view of the mapped bytes,
so nothing is copied or converted on the host until the caller uploads it.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NUMPY_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _TensorInfo:
    __slots__ = ("file", "dtype", "shape", "begin", "end")

    def __init__(self, file: Path, dtype: np.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def read_safetensors_header(path) -> tuple[dict, int]:
    """(header dict, byte offset where the data section starts) of one safetensors file."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is implausible; not a safetensors file?")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    return header, 8 + n


class CheckpointReader:
    """The tensors of a Hugging Face checkpoint folder (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`), memory-mapped."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder not found: {self.folder}")
        self._tensors: dict[str, _TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.metadata: dict[str, dict] = {}
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.folder / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shard(s) that are not in the folder: {', '.join(missing)}")
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
            if not files:
                raise FileNotFoundError(f"{self.folder} has no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file")
        for name in files:
            self._add_file(self.folder / name)
        if weight_map is not None:
            wrong = [n for n, f in weight_map.items() if n not in self._tensors or self._tensors[n].file.name != f]
            if wrong:
                shown = ", ".join(wrong[:10]) + (f" (+{len(wrong) - 10} more)" if len(wrong) > 10 else "")
                raise ValueError(f"{index}: tensor(s) not found in the shard the index names: {shown}")

    def _add_file(self, path: Path) -> None:
        header, data_start = read_safetensors_header(path)
        size = path.stat().st_size
        self.metadata[path.name] = header.pop("__metadata__", None) or {}
        for name, info in header.items():
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except KeyError as e:
                raise ValueError(f"{path}: tensor {name!r} has a bad header entry ({e!s} unknown or missing)") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or data_start + end > size:
                raise ValueError(f"{path}: tensor {name!r} offsets [{begin}, {end}) do not fit its shape {shape} "
                                 f"{info['dtype']} or the file size {size}")
            if name in self._tensors:
                raise ValueError(f"tensor {name!r} appears in both {self._tensors[name].file.name} and {path.name}")
            self._tensors[name] = _TensorInfo(path, dtype, shape, data_start + begin, data_start + end)

    # ---- queries ------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._info(name).dtype

    def nbytes(self, name: str) -> int:
        info = self._info(name)
        return info.end - info.begin

    @property
    def files(self) -> list[Path]:
        return sorted({i.file for i in self._tensors.values()})

    @property
    def total_bytes(self) -> int:
        return sum(i.end - i.begin for i in self._tensors.values())

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in the memory-mapped file (no copy, no conversion)."""
        info = self._info(name)
        mm = self._maps.get(info.file)
        if mm is None:
            with open(info.file, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[info.file] = mm
        count = math.prod(info.shape)
        return np.frombuffer(mm, dtype=info.dtype, count=count, offset=info.begin).reshape(info.shape)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.get(name)

    def items(self):
        """(name, array) pairs in file order (sequential reads of each mapping)."""
        for name in sorted(self._tensors, key=lambda n: (self._tensors[n].file, self._tensors[n].begin)):
            yield name, self.get(name)

    # ---- checks -------------------------------------------------------------------------------------------
    def validate(self, expected: dict[str, tuple[int, ...]],
                 dtypes: dict[str, tuple[np.dtype, ...]] | None = None, ignored_prefixes: tuple[str, ...] = ()) -> None:
        """Raise one ValueError listing every missing, unexpected, wrongly-shaped and (with `dtypes`: name ->
        accepted dtypes) wrongly-typed tensor. Tensors named with one of `ignored_prefixes` (parts of a checkpoint
        the model does not read, such as a vision tower) are not unexpected."""
        problems = []
        missing = [n for n in expected if n not in self._tensors]
        unexpected = [n for n in self._tensors if n not in expected and not n.startswith(ignored_prefixes)]
        wrong = [(n, tuple(expected[n]), self._tensors[n].shape) for n in expected
                 if n in self._tensors and self._tensors[n].shape != tuple(expected[n])]
        bad_types = [(n, self._tensors[n].dtype, accepted) for n, accepted in (dtypes or {}).items()
                     if n in self._tensors and self._tensors[n].dtype not in accepted]
        if missing:
            problems.append(f"missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            problems.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        if wrong:
            problems.append(f"wrong shape ({len(wrong)}): " + ", ".join(
                f"{n} is {list(got)}, expected {list(want)}" for n, want, got in wrong))
        if bad_types:
            problems.append(f"wrong dtype ({len(bad_types)}): " + ", ".join(
                f"{n} is {NUMPY_TO_SAFETENSORS.get(got, str(got))}, expected "
                f"{' or '.join(NUMPY_TO_SAFETENSORS.get(np.dtype(a), str(a)) for a in accepted)}"
                for n, got, accepted in bad_types))
        if problems:
            raise ValueError(f"checkpoint at {self.folder} does not match the model config:\n  " + "\n  ".join(problems))

    # ---- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the files. Arrays returned by `get` must not be used afterwards (they would hold the mapping open;
        mappings with live views are left to the garbage collector)."""
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a NumPy view still references it; it is unmapped when that view dies
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"CheckpointReader({str(self.folder)!r}, {len(self)} tensors in {len(self.files)} file(s))"


# ---- model source -----------------------------------------------------------------------------------------------
_HINT = ("pass a local Hugging Face model folder instead: one made by `xserv make-test-model --preset tiny --out DIR` "
         "or downloaded elsewhere (config.json, *.safetensors, tokenizer.json)")


def resolve_model_source(name_or_path, revision: str | None = None) -> Path:
    """The local folder of a model: `name_or_path` itself when it is a folder (it must hold config.json), else a
    Hugging Face hub id fetched with huggingface_hub (from its cache when offline). revision: the hub branch, tag or
    commit to fetch (default: the main branch); a local folder takes none."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision {revision!r} picks a version on the Hugging Face hub; {path} is a local folder")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; a model is a folder holding config.json and *.safetensors")
    if text.startswith((".", "/", "~")) or not _HUB_ID.match(text):
        raise FileNotFoundError(f"model folder not found: {path}")
    return _download(text, revision)


def _download(repo_id: str, revision: str | None = None) -> Path:
    try:
        import huggingface_hub
    except ImportError:
        raise RuntimeError(f"{repo_id!r} is not a local folder and huggingface_hub is not installed to fetch it "
                           f"from the hub; {_HINT}") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
    try:  # the local cache first: works offline and avoids a network round trip
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                                      local_files_only=True))
    except Exception:
        pass
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as e:
        at = f" at revision {revision!r}" if revision is not None else ""
        raise RuntimeError(f"{repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub{at} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); {_HINT}") from None
