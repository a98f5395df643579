"""FP8 weight-only skinny GEMM (cuda_src/gemv_fp8.cu; the M <= 8 path of ops/fp8_linear.py's linear_fp8):

    linear_fp8_gemv(x, weight_fp8, scale_inv)    out = x @ dequant(weight_fp8, scale_inv)^T

x bf16 [m, K] (m = 1..8), weight float8_e4m3fn [N, K], scale_inv float32 [ceil(N / 128), ceil(K / 128)] (Qwen's
-FP8 checkpoints: 128 x 128 blocks, xserv/fp8_format.py), out bf16 or float32 [m, N]; K % 16 == 0 (the kernel
reads 16 weights per 16-byte load and a chunk never straddles a scale block), any N; N and K need not be multiples
of 128 (partial edge blocks have scales of their own).

The CPU path runs `linear_fp8_reference`: the weight dequantized as fp8.py does (float32(e4m3) * scale_inv, a
float32 product), then x @ W^T summed in float64 and rounded once to the output dtype. The kernel applies the scale
to each 16-weight partial sum instead (gemv_fp8.cu, "the block scale and the rounding"): equal in exact arithmetic,
the fp32 roundings differ at about 1e-7 relative.

The family is compiled per model as its one piece gemv_fp8:f1 (`// xserv-shapes: fp8=1`): a start-up compiles it
for FP8-quantized models only (the model class's kernel_shapes). Its measured share of copy bandwidth at 1 and 8 rows
is in docs/kernels/gemv.md, "FP8 weight-only".
"""
from __future__ import annotations

import numpy as np

from ..fp8_format import DEFAULT_BLOCK, E4M3, dequantize_blockwise, scale_shape
from ..runtime import get_device, kernel
from ..runtime.compiler import piece
from ..tensor import Tensor, bfloat16, float8_e4m3fn, float32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias

FAMILY = "gemv_fp8"
MAX_M = 8
K_MULTIPLE = 16  # weights per 16-byte chunk
ENTRY_ROWS = (1, 2, 4, 8)  # gemv_fp8_m<M>: the entry for m rows is the smallest M >= m
# gemv_fp8.cu's launch shape: warps per CTA, weight rows per row group, chunks in flight per lane, CTAs per SM.
WARPS, GROUP_ROWS, CHUNKS_IN_FLIGHT, CTAS_PER_SM = 4, 4, 4, 2
_STEP_K = 32 * CHUNKS_IN_FLIGHT * K_MULTIPLE  # K values one load step of a warp covers (2048)
_OUT_DTYPE = {bfloat16: 0, float32: 1}
CONVERSIONS = ("auto", "soft")


def linear_fp8_reference(x: np.ndarray, weight: np.ndarray, scale_inv: np.ndarray,
                         block: tuple[int, int] = DEFAULT_BLOCK) -> np.ndarray:
    """float64 [m, N]: x [m, K] @ dequant(weight)^T with the dequantized weight float32(e4m3) * scale_inv rounded to
    float32 (fp8_format.py's dequantize_blockwise) and the sums in float64."""
    w = dequantize_blockwise(np.asarray(weight), np.asarray(scale_inv, np.float32), block, out_dtype=np.float32)
    return np.asarray(x).astype(np.float64) @ w.astype(np.float64).T


def plan(m: int, n: int, k: int, multiprocessor_count: int) -> tuple[str, int, int]:
    """(kernel, split, grid): the entry gemv_fp8_m<M> (the smallest compiled M >= m); split = warps sharing a row
    group's K, the fewest in (1, 2, 4) whose tiles fill every CTA slot (CTAS_PER_SM per SM) at least once, but no
    more than leave each warp a whole load step of K (2048 values; 1 always allowed); grid = min(tiles, slots), a
    persistent grid. A first guess, to be swept on a GPU (docs/kernels/gemv.md, "FP8 weight-only")."""
    rows = next(r for r in ENTRY_ROWS if r >= m)
    slots = multiprocessor_count * CTAS_PER_SM

    def tiles(s: int) -> int:
        return cdiv(n, GROUP_ROWS * (WARPS // s))

    split = 1
    while split < WARPS and tiles(split) < slots and k >= 2 * split * _STEP_K:
        split *= 2
    return f"gemv_fp8_m{rows}", split, min(tiles(split), slots)


def check_fp8_scale(scale_inv: Tensor, n: int, k: int) -> None:
    """scale_inv float32 [ceil(N / 128), ceil(K / 128)] for an e4m3 weight [N, K] in 128 x 128 blocks."""
    want = scale_shape((n, k), DEFAULT_BLOCK)
    check_tensor("scale_inv", scale_inv, dtype=float32, ndim=2)
    if scale_inv.shape != want:
        raise ValueError(f"scale_inv: shape {list(scale_inv.shape)}, expected {list(want)} (ceil(N / 128), "
                         f"ceil(K / 128)) for a weight of [{n}, {k}]")


def check_fp8_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, out: Tensor | None, out_dtype,
                     weight_name: str = "weight") -> tuple[int, int, int, str, Tensor]:
    """The checks of every FP8 linear entry point (this GEMV, ops/fp8_linear.py): x bf16 [m, K], the weight e4m3
    [N, K], scale_inv float32 [ceil(N / 128), ceil(K / 128)], one device, out bf16 or float32 [m, N] (made when
    None) and not x. Returns (m, N, K, device, out)."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    m, k = x.shape
    check_tensor(weight_name, weight, dtype=float8_e4m3fn, ndim=2)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"{weight_name}: shape {list(weight.shape)} does not match x's in_features {k}")
    check_fp8_scale(scale_inv, n, k)
    device = same_device(x=x, **{weight_name: weight}, scale_inv=scale_inv, out=out)
    dtype = out.dtype if out is not None else (out_dtype or bfloat16)
    if dtype not in _OUT_DTYPE:
        raise ValueError(f"out: dtype {np.dtype(dtype)}, expected bfloat16 or float32")
    out = output("out", out, (m, n), dtype, device)
    check_alias("out", out, "x", x, allow_identical=False)
    return m, n, k, device, out


def linear_fp8_gemv(x: Tensor, weight_fp8: Tensor, scale_inv: Tensor, out: Tensor | None = None,
                    out_dtype=None, conversion: str = "auto") -> Tensor:
    """x bf16 [m, K] @ dequant(weight_fp8 [N, K], scale_inv)^T -> out [m, N] (bf16, the default, or float32).
    conversion: "auto" (the hardware e4m3 conversion on sm_89+, the bit-manipulation one below) or "soft" (the
    bit-manipulation one everywhere: the kernel's _soft entries); the CPU path ignores it."""
    m, n, k, device, out = check_fp8_linear(x, weight_fp8, scale_inv, out, out_dtype, "weight_fp8")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x: {m} rows; linear_fp8_gemv takes 1..{MAX_M}")
    if k == 0 or k % K_MULTIPLE:
        raise ValueError(f"x: in_features {k} must be a positive multiple of {K_MULTIPLE} (16-byte weight chunks)")
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion: {conversion!r}, expected one of {CONVERSIONS}")
    if device == "cpu":
        out.array[...] = linear_fp8_reference(x.array, weight_fp8.array, scale_inv.array).astype(out.dtype)
        return out
    if n == 0:
        return out
    if not aligned(x, weight_fp8):
        raise ValueError("linear_fp8_gemv: x and weight_fp8 must be 16-byte aligned")
    name, split, grid = plan(m, n, k, get_device().info.multiprocessor_count)
    if conversion == "soft":
        name += "_soft"
    # gemv_fp8_m<M>[_soft](x, x_stride, W, scale_inv, out, out_dtype, m, N, K, split): block 128, no dynamic smem;
    # programmatic dependent launch (the first weights load before the kernel waits for x: gemv_fp8.cu)
    kernel(piece(FAMILY, fp8=1), name)(grid, WARPS * 32, x, np.int64(k), weight_fp8, scale_inv, out,
                                       np.int32(_OUT_DTYPE[out.dtype]), np.int32(m), np.int32(n), np.int32(k),
                                       np.int32(split), pdl=True)
    return out


# ---- the e4m3 -> float conversions of the kernel, re-implemented on the host (tests) --------------------------
def _byte_perm(x: np.ndarray, selector: int) -> np.ndarray:
    """CUDA's __byte_perm(x, 0, selector) on uint32 words: result byte i = byte (selector nibble i) of the 8-byte
    {x, 0}."""
    out = np.zeros_like(x)
    for i in range(4):
        src = (selector >> (4 * i)) & 0x7
        byte = (x >> np.uint32(8 * src)) & np.uint32(0xff) if src < 4 else np.zeros_like(x)
        out |= byte << np.uint32(8 * i)
    return out


def e4m3_words_to_float_soft(words: np.ndarray) -> np.ndarray:
    """gemv_fp8.cu's e4m3x4_to_half2x2_soft then f16 -> f32, word for word in NumPy: uint32 words (4 codes each,
    byte 0 first) -> float32 [4 * len(words)] in column order."""
    v = np.asarray(words, dtype=np.uint32)
    a, b = _byte_perm(v, 0x1404), _byte_perm(v, 0x3424)
    lo = ((a >> np.uint32(1)) & np.uint32(0x3F803F80)) | (a & np.uint32(0x80008000))
    hi = ((b >> np.uint32(1)) & np.uint32(0x3F803F80)) | (b & np.uint32(0x80008000))
    nan = ((v & np.uint32(0x7F7F7F7F)) + np.uint32(0x01010101)) & np.uint32(0x80808080)
    na, nb = _byte_perm(nan, 0x1404), _byte_perm(nan, 0x3424)
    lo = lo | (na - (na >> np.uint32(6)))
    hi = hi | (nb - (nb >> np.uint32(6)))
    halves = np.stack([lo & np.uint32(0xFFFF), lo >> np.uint32(16), hi & np.uint32(0xFFFF), hi >> np.uint32(16)],
                      axis=-1).astype(np.uint16).view(np.float16)
    return (halves * np.float16(256)).astype(np.float32).reshape(-1)  # HMUL2 by 256: exact, then f16 -> f32


def e4m3_to_float_soft(codes: np.ndarray) -> np.ndarray:
    """The soft conversion of e4m3 codes (uint8 or float8_e4m3fn, length a multiple of 4) -> float32."""
    c = np.ascontiguousarray(codes).view(np.uint8).reshape(-1)
    if c.size % 4:
        raise ValueError("e4m3_to_float_soft takes a multiple of 4 codes (whole 32-bit words)")
    return e4m3_words_to_float_soft(c.view("<u4"))


__all__ = ["linear_fp8_gemv", "linear_fp8_reference", "plan", "e4m3_to_float_soft", "E4M3"]
