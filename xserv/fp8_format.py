"""The fine-grained FP8 weight format (Qwen's `-FP8` checkpoints, DeepSeek-V3's) as data: the e4m3 element
type, `Fp8Weight` (the e4m3 bytes of a weight and their per-block inverse scales) and the NumPy reference of block
(de)quantization. It stands below xserv/ops/ because the FP8 kernels take this format and check against this
reference; what a checkpoint's `quantization_config` says and how a model loads it live in xserv/models/fp8.py.

A quantized weight [out, in] is float8_e4m3fn with float32 inverse scales [ceil(out / bo), ceil(in / bi)] for
blocks of bo x bi (128 x 128 in the published checkpoints; the edge blocks of a dimension that is not a multiple
are partial and have scales of their own). Its value is `weight * scale_inv`, blockwise.

The rounding, which the FP8 kernels must reproduce:
- dequantize: float32(e4m3) * float32(scale_inv), a float32 product, then rounded to the destination dtype
  (bfloat16: round to nearest even);
- quantize (what `make-test-model --fp8` writes, as Qwen's and DeepSeek's quantizers do): per block
  scale_inv = float32(amax(|w|)) / 448 (1 for an all-zero block), weight = e4m3(clip(w / scale_inv, +-448)),
  float32 division, rounded to nearest even.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .tensor import Tensor

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


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
        """The weight's values on the host (tests, tools): dequantize_blockwise."""
        return dequantize_blockwise(self.weight.numpy(), self.scale_inv.numpy(), DEFAULT_BLOCK, dtype)


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
