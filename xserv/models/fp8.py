"""Fine-grained FP8 checkpoints (Qwen's `-FP8` checkpoints, DeepSeek-V3's format) as a model loads them: the
`quantization_config` that describes them and the dequantization of what loads in bf16. The format itself (the
e4m3 type, `Fp8Weight`, the block (de)quantization reference) is xserv/fp8_format.py, below the ops that take it:
code that needs those names imports them from there.

A quantized linear layer's `*.weight` is float8_e4m3fn and its `*.weight_scale_inv` float32, in blocks of
`weight_block_size` (xserv/fp8_format.py). Embeddings, norms, `lm_head`, the MoE router (`mlp.gate`) and the
modules listed in `modules_to_not_convert` stay in the checkpoint's float dtype.

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

import numpy as np

from ..fp8_format import DEFAULT_BLOCK, Fp8Weight, dequantize_blockwise, scale_shape

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




SCALE_SUFFIX = ".scale_inv"  # a kept FP8 field's scales travel through loading as the field "<field>.scale_inv"


@functools.lru_cache(maxsize=16)
def _exclusion_pattern(entries: tuple[str, ...]) -> re.Pattern:
    alternatives = "|".join(re.escape(e).replace(r"\*", r"[^.]+") for e in entries)
    return re.compile(rf"^(?:.*\.)?(?:{alternatives})(?:\..*)?$")



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
