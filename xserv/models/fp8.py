"""Fine-grained FP8 weights (Qwen's `-FP8` checkpoints, DeepSeek-V3's format): the `quantization_config` that
describes them and the NumPy reference of their block quantization.

A quantized linear layer's `*.weight` [out, in] is float8_e4m3fn and its `*.weight_scale_inv` float32
[ceil(out / bo), ceil(in / bi)] for blocks of bo x bi (`weight_block_size`, [128, 128] in the published
checkpoints; the edge blocks of a dimension that is not a multiple are partial and have scales of their own). The
weight is `weight * weight_scale_inv`, blockwise. Embeddings, norms, `lm_head`, the MoE router (`mlp.gate`) and the
modules listed in `modules_to_not_convert` stay in the checkpoint's float dtype.

The rounding, which the FP8 kernels of the next phases must reproduce:
- dequantize: float32(e4m3) * float32(scale_inv), a float32 product, then rounded to the destination dtype
  (bfloat16: round to nearest even);
- quantize (what `make-test-model --fp8` writes, as Qwen's and DeepSeek's quantizers do): per block
  scale_inv = float32(amax(|w|)) / 448 (1 for an all-zero block), weight = e4m3(clip(w / scale_inv, +-448)),
  float32 division, rounded to nearest even.

Loading (DenseModel.from_checkpoint): a fused projection field (qkv, o_proj, gate_up, down) whose every part is
quantized in 128 x 128 blocks and starts on a block row is kept as the checkpoint stores it, an `Fp8Weight` (the
e4m3 bytes and their scales, the parts' scale rows stacked), and the linear layers dispatch on it
(xserv/ops/fp8_linear.py). Anything else quantized (other block sizes, parts off the block grid, the MoE experts,
whose grouped GEMMs read bf16) is dequantized at load, one checkpoint tensor at a time, into the model's dtype.
"""
from __future__ import annotations

import functools
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..tensor import Tensor

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)

# The quantization_config keys of an FP8 config.json: the ones xserv reads, and the ones it accepts and ignores
# (transformers' `dequantize` flag asks for what phase 1 always does).
_FP8_KEYS = ("quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "dequantize", "kv_cache_scheme")


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """A validated `quantization_config` of quant_method "fp8": e4m3 weights in blocks of `weight_block_size`
    [rows, columns] with float32 inverse scales, dynamic activation scaling (nothing stored for activations)."""

    weight_block_size: tuple[int, int] = DEFAULT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()

    QUANT_METHOD = "fp8"

    def __post_init__(self):
        block = self.weight_block_size
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive integers [rows, columns], "
                             f"got {block!r}")
        object.__setattr__(self, "weight_block_size", (int(block[0]), int(block[1])))
        mods = self.modules_to_not_convert
        if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) and m for m in mods):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module names, "
                             f"got {mods!r}")
        object.__setattr__(self, "modules_to_not_convert", tuple(mods))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Fp8BlockQuantization":
        """Read an "fp8" quantization_config; anything xserv cannot load as fine-grained e4m3 is a ValueError that
        names the field."""
        if d.get("quant_method") != cls.QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method must be 'fp8' here, got {d.get('quant_method')!r}")
        unknown = [k for k in d if k not in _FP8_KEYS]
        if unknown:
            raise ValueError(f"quantization_config field(s) {', '.join(map(repr, unknown))} of quant_method 'fp8' are "
                             f"not supported by xserv (it reads {', '.join(_FP8_KEYS[:5])})")
        fmt = d.get("fmt")
        if fmt not in (None, "e4m3", "float8_e4m3fn"):
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported: xserv reads FP8 weights in e4m3 "
                             f"(float8_e4m3fn)")
        scheme = d.get("activation_scheme")
        if scheme not in (None, "dynamic"):
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported: xserv reads FP8 "
                             f"checkpoints with dynamic activation scaling (no stored input scales)")
        if d.get("kv_cache_scheme") is not None:
            raise ValueError(f"quantization_config.kv_cache_scheme={d['kv_cache_scheme']!r} is not supported: xserv "
                             f"has no FP8 KV cache yet")
        if d.get("dequantize") not in (None, True, False):
            raise ValueError(f"quantization_config.dequantize must be a bool, got {d['dequantize']!r}")
        if d.get("weight_block_size") is None:
            raise ValueError("quantization_config.weight_block_size is required: xserv reads fine-grained (block-wise) "
                             "FP8 checkpoints (*.weight_scale_inv per block), not per-tensor FP8 (*.weight_scale)")
        mods = []
        for key in ("modules_to_not_convert", "ignored_layers"):
            value = d.get(key)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"quantization_config.{key} must be a list of module names, got {value!r}")
            mods += [m for m in value if m not in mods]
        return cls(weight_block_size=d["weight_block_size"], modules_to_not_convert=tuple(mods))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Qwen's key order; modules_to_not_convert only when there are some)."""
        d: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": self.QUANT_METHOD,
                             "weight_block_size": list(self.weight_block_size)}
        if self.modules_to_not_convert:
            d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return d

    def excludes(self, module: str) -> bool:
        """Is `module` (e.g. 'model.layers.0.mlp.gate') listed in modules_to_not_convert? An entry matches a
        module at dot boundaries: the module itself, a parent ('model.layers.0.mlp') or a trailing path
        ('mlp.gate': every layer's); '*' stands for any one path component ('model.layers.*.mlp.gate'). Unlike a
        plain substring test, 'model.layers.1.mlp.gate' matches neither layer 11 nor 'mlp.gate_proj'."""
        if not self.modules_to_not_convert:
            return False
        return _exclusion_pattern(self.modules_to_not_convert).match(module) is not None

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return scale_shape(shape, self.weight_block_size)

    def describe(self) -> str:
        bo, bi = self.weight_block_size
        return f"FP8 e4m3, {bo}x{bi} blocks"


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight kept in FP8: `weight` float8_e4m3fn [N, K] and its float32 inverse scales
    `scale_inv` [ceil(N / 128), ceil(K / 128)], one per 128 x 128 block (DEFAULT_BLOCK): the value is
    weight * scale_inv, blockwise. What the model's projections hold in place of a bf16 Tensor."""
    weight: Tensor
    scale_inv: Tensor

    def __post_init__(self):
        if self.scale_inv.shape != scale_shape(self.weight.shape, DEFAULT_BLOCK):
            raise ValueError(f"Fp8Weight: scales {list(self.scale_inv.shape)} do not cover a weight of "
                             f"{list(self.weight.shape)} in 128 x 128 blocks")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    @property
    def device(self) -> str:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale_inv.nbytes

    @property
    def num_parameters(self) -> int:
        return int(np.prod(self.weight.shape))

    def tensors(self) -> tuple[Tensor, Tensor]:
        return self.weight, self.scale_inv

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """The weight's values on the host (tests, tools): fp8.py's dequantize_blockwise."""
        return dequantize_blockwise(self.weight.numpy(), self.scale_inv.numpy(), DEFAULT_BLOCK, dtype)


SCALE_SUFFIX = ".scale_inv"  # a kept FP8 field's scales travel through loading as the field "<field>.scale_inv"


@functools.lru_cache(maxsize=16)
def _exclusion_pattern(entries: tuple[str, ...]) -> re.Pattern:
    alternatives = "|".join(re.escape(e).replace(r"\*", r"[^.]+") for e in entries)
    return re.compile(rf"^(?:.*\.)?(?:{alternatives})(?:\..*)?$")


# ---- the reference --------------------------------------------------------------------------------------------
def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """The inverse scales' shape of a [rows, columns] weight: [ceil(rows / bo), ceil(columns / bi)]."""
    rows, cols = shape
    return (math.ceil(rows / block[0]), math.ceil(cols / block[1]))


_E4M3_TO_FLOAT32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)  # every code's value (NaN too)


def quantize_blockwise(w: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight [rows, columns], float32 scale_inv [ceil(rows / bo), ceil(columns / bi)]) of a float weight:
    per block scale_inv = amax(|w|) / 448 (1 for an all-zero block), weight = e4m3(clip(w / scale_inv, +-448))
    with float32 arithmetic and round-to-nearest-even."""
    w = np.asarray(w)
    if w.ndim != 2 or w.size == 0:
        raise ValueError(f"quantize_blockwise takes a non-empty 2-D weight, got shape {w.shape}")
    bo, bi = block
    rows, cols = w.shape
    nbo, nbi = scale_shape(w.shape, block)
    wf = w.astype(np.float32)
    if (rows, cols) != (nbo * bo, nbi * bi):  # partial edge blocks: zeros change no block's amax
        wf = np.pad(wf, ((0, nbo * bo - rows), (0, nbi * bi - cols)))
    blocks = wf.reshape(nbo, bo, nbi, bi)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    scaled = (blocks / scale_inv[:, None, :, None]).reshape(nbo * bo, nbi * bi)[:rows, :cols]
    q = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale_inv


def dequantize_blockwise(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK,
                         out_dtype=ml_dtypes.bfloat16, out: np.ndarray | None = None) -> np.ndarray:
    """The weight of an e4m3 q [rows, columns] and its float32 scale_inv [ceil(rows / bo), ceil(columns / bi)]:
    float32(q) * scale_inv (a float32 product) rounded to out_dtype (bfloat16: nearest even). Writes into `out`
    when given."""
    q = np.asarray(q)
    if q.dtype != E4M3 or q.ndim != 2:
        raise ValueError(f"dequantize_blockwise takes a 2-D float8_e4m3fn weight, got {q.dtype} {q.shape}")
    want = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv of a {list(q.shape)} weight in {block[0]}x{block[1]} blocks must be "
                         f"{list(want)}, got {list(scale_inv.shape)}")
    qf = np.take(_E4M3_TO_FLOAT32, q.view(np.uint8))  # = q.astype(np.float32), faster
    scale = np.asarray(scale_inv, dtype=np.float32)
    bo = block[0]
    cols_scale = np.repeat(scale, block[1], axis=1)[:, :q.shape[1]]  # [blocks of rows, columns]
    for i in range(scale.shape[0]):  # one block row at a time: no full-size scale matrix
        qf[i * bo:(i + 1) * bo] *= cols_scale[i]
    result = qf.astype(out_dtype)
    if out is None:
        return result
    if out.shape != q.shape:
        raise ValueError(f"out has shape {out.shape}, expected {q.shape}")
    out[...] = result
    return out


# ---- loading ----------------------------------------------------------------------------------------------------
_CHUNK_ELEMENTS = 1 << 21  # a worker dequantizes about this many elements at a time (8 MB of float32)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def join_fp8_fields(fields: dict) -> dict:
    """A loaded layer's (or model's) fields with each "<field>" + "<field>.scale_inv" pair made one Fp8Weight."""
    out = dict(fields)
    for name in [n for n in fields if n.endswith(SCALE_SUFFIX)]:
        field = name[:-len(SCALE_SUFFIX)]
        out[field] = Fp8Weight(out[field], out.pop(name))
    return out


def _workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores))


def dequantize_for_load(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], out_dtype) -> np.ndarray:
    """dequantize_blockwise of one checkpoint tensor into a new host array, in row chunks (whole blocks of rows)
    spread over a thread pool (NumPy's casts and products release the GIL; one core does about 100M elements/s):
    the same bytes as one call. Memory: the result and a few chunks' float32 temporaries per worker."""
    global _pool
    rows, cols = q.shape
    out = np.empty((rows, cols), dtype=out_dtype)
    step = max(1, _CHUNK_ELEMENTS // max(cols * block[0], 1)) * block[0]
    spans = [(r, min(r + step, rows)) for r in range(0, rows, step)]

    def one(span):
        r0, r1 = span
        dequantize_blockwise(q[r0:r1], scale_inv[r0 // block[0]:math.ceil(r1 / block[0])], block, out_dtype,
                             out=out[r0:r1])

    if len(spans) == 1 or _workers() == 1:
        for span in spans:
            one(span)
        return out
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="xserv-fp8")
    for future in [_pool.submit(one, span) for span in spans]:
        future.result()
    return out
