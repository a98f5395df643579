"""Linear layers on FP8 block-quantized weights: out = x @ dequant(weight, scale_inv)^T.

    linear_fp8(x, weight, scale_inv, out=None, out_dtype=None, scratch=None, path="auto")

x bf16 [M, K]; weight float8_e4m3fn [N, K] with float32 scale_inv [ceil(N / 128), ceil(K / 128)] (Qwen's -FP8
layout: 128 x 128 blocks, xserv/fp8_format.py); out bf16 (default) or float32 [M, N]. On CUDA, K % 16 == 0. The
model's projections call this for every quantized weight (xserv/models/dense.py), whatever M is.

The dispatch rule (choose_path; docs/kernels/fp8.md says why):
  CPU                   the reference: dequantize as fp8.py does (float32 products), multiply in float64.
  M < 8 (M <= 8 below   "gemv": the FP8 weight-only GEMV (ops/gemv_fp8.py): e4m3 read once, dequantized in
   sm_90)               registers (every arch).
  M >= 8, sm_90 and up  "cublas_fp8": x quantized on the fly to e4m3 with one float32 scale per row and 128-column
                        group (ops/fp8_quant.py, quantize_1x128), then cuBLASLt's block-scaled FP8 GEMM (the weight's
                        128 x 128 scales as they are; runtime/cublas.py, gemm_fp8_block_scaled), fp32 accumulation,
                        for the first M - M % 4 rows (cuBLASLt 13.1 takes multiples of 4); the last M % 4 rows
                        through the GEMV.
                        Where cuBLASLt has no algorithm for it (an older cuBLASLt, a GPU or shape it refuses), the
                        call falls back to "dequant", warning once per shape.
  M > 8, below sm_90    "dequant": the weight dequantized into a bf16 scratch (dequantize_bf16: bf16(e4m3 *
                        scale_inv), as fp8.py rounds), then the bf16 cuBLAS GEMM. sm_80 has no FP8 tensor cores;
                        the compute capability is the target's (XSERV_ARCH=sm_89 on an H100 takes this path).
`path` forces one ("gemv" takes M <= 8 only): tests run both large-M paths on one GPU; benchmarks compare them.
XSERV_FP8_ACTIVATIONS=bf16 (w8a8_enabled) makes the rule weight-only on every arch (the GEMV up to 8 rows, "dequant"
above): no activation rounding (on a random-weight 0.6B-shaped checkpoint the W8A8 logits are ~1.4e-1 mean relative
from the float32 dequantized run, weight-only 1.8e-2; tests/parallel/test_fp8_tp_parity_gpu.py), at the bf16 GEMM's speed.

Scratch: the large-M paths need device buffers: "cublas_fp8" the quantized x and its scales (and the weight's scales
copied at a 16-byte row stride when ceil(K / 128) % 4 != 0 or scale_inv is not 16-byte aligned), "dequant" the bf16
weight. A caller that captures CUDA graphs (the model's decode step) creates one `Fp8Scratch(max_rows, max_k,
max_weight_elems)` for its largest M, in_features and weight, and passes it to every call: the hot path then
allocates nothing. Without `scratch`, a call allocates its own (through the caching allocator). An Fp8Scratch holds
the buffers of the path the device's rule picks; the other path's (a fallback of "cublas_fp8", or a forced path)
are allocated on first use, which must come before any graph capture (a warm-up step does it): inside a capture it
raises instead.
"""
from __future__ import annotations

import warnings

from .. import settings
from ..runtime import get_device, get_runtime
from ..runtime.arch import compute_capability
from ..runtime.errors import CublasError
from ..tensor import Tensor, bfloat16, float8_e4m3fn, float32
from ._launch import aligned, cdiv, round_up
from .fp8_quant import GROUP, K_MULTIPLE, dequantize_bf16, pad_scales, quantize_1x128
from .gemv_fp8 import MAX_M, check_fp8_linear, linear_fp8_gemv, linear_fp8_reference

PATHS = ("auto", "gemv", "cublas_fp8", "dequant")
FP8_GEMM_MIN_CC = (9, 0)  # cuBLASLt's block-scaled FP8 GEMM (VEC128_32F x BLK128x128_32F): Hopper and later
_warned: set[tuple] = set()


# From this many rows on, cuBLASLt's FP8 GEMM beats the FP8 GEMV where it exists (H100, Qwen3-8B's projections at 8
# rows: 16.3 / 43.7 / 26.2 us against the GEMV's 40.4 / 98.3 / 67.7 us for qkv / gate_up / down; 4 to 7 rows are
# unmeasured and stay on the GEMV). cuBLASLt 13.1 takes M % 4 == 0 only (the activations' scale rows are read at a
# 16-byte stride): an M-row call runs its first M - M % 4 rows there and the last M % 4 through the GEMV.
FP8_GEMM_FROM_M = 8
FP8_GEMM_M_MULTIPLE = 4


ACTIVATIONS_ENV = settings.FP8_ACTIVATIONS.name


def w8a8_enabled() -> bool:
    """XSERV_FP8_ACTIVATIONS: "e4m3" (the default: from 8 rows on sm_90+, the activations are quantized per 1 x 128
    group, Qwen's dynamic scheme, for the FP8 GEMM) or "bf16" (weight-only everywhere: bf16 activations, the weight
    dequantized for the bf16 GEMM; slower prefill, no activation rounding)."""
    return settings.FP8_ACTIVATIONS.get() == "e4m3"


def choose_path(m: int, target: str) -> str:
    """The kernel path of an M-row call on `target` (a device's arch string, "sm_90a" or "sm_89@sm_90a");
    XSERV_FP8_ACTIVATIONS=bf16 takes the weight-only paths where the rule would quantize activations."""
    fp8_gemm = compute_capability(target) >= FP8_GEMM_MIN_CC and w8a8_enabled()
    if m < FP8_GEMM_FROM_M or (m <= MAX_M and not fp8_gemm):
        return "gemv"
    return "cublas_fp8" if fp8_gemm else "dequant"


def _padded_scale_capacity(max_k: int, max_weight_elems: int) -> int:
    # ceil(N/128) * round_up(ceil(K/128), 4) <= (N/128 + 1)(K/128 + 4) = NK/16384 + 4N/128 + K/128 + 4, and
    # N <= max_weight_elems / K with K >= 16
    return cdiv(max_weight_elems, 128 * 128) + cdiv(max_weight_elems, 512) + cdiv(max_k, 128) + 4


def _capturing() -> bool:
    return get_runtime().cublas._capturing()


class Fp8Scratch:
    """Device buffers for linear_fp8's large-M paths, for every call with at most `max_rows` rows, `max_k`
    in_features and a weight of at most `max_weight_elems` elements. Create it once, outside graph capture."""

    def __init__(self, max_rows: int, max_k: int, max_weight_elems: int, device: str = "cuda",
                 paths: tuple[str, ...] | None = None):
        if min(max_rows, max_k, max_weight_elems) < 1:
            raise ValueError(f"Fp8Scratch: max_rows {max_rows}, max_k {max_k}, max_weight_elems {max_weight_elems} "
                             f"must be positive")
        self.max_rows, self.max_k, self.max_weight_elems, self.device = max_rows, max_k, max_weight_elems, device
        self.q = self.scales = self.padded_scales = self.weight_bf16 = None
        if device == "cpu":
            return
        if paths is None:
            paths = (choose_path(MAX_M + 1, get_device().arch),)
        for p in paths:
            self.ensure(p)

    def ensure(self, path: str) -> None:
        """Allocate the buffers of `path` ("cublas_fp8" or "dequant") if not yet there (never inside a capture)."""
        if path not in ("cublas_fp8", "dequant"):
            raise ValueError(f"Fp8Scratch.ensure: path {path!r}, expected 'cublas_fp8' or 'dequant'")
        have = self.q is not None if path == "cublas_fp8" else self.weight_bf16 is not None
        if have or self.device == "cpu":
            return
        if _capturing():
            raise RuntimeError(f"linear_fp8: the scratch has no buffers for the {path!r} path and a CUDA graph is "
                               f"being captured: allocate them before capture (Fp8Scratch(..., paths=(...)) or a "
                               f"warm-up call)")
        if path == "cublas_fp8":
            self.q = Tensor.empty((self.max_rows * self.max_k,), float8_e4m3fn, self.device)
            self.scales = Tensor.empty((cdiv(self.max_k, GROUP) * self.max_rows,), float32, self.device)
            self.padded_scales = Tensor.empty((_padded_scale_capacity(self.max_k, self.max_weight_elems),), float32,
                                              self.device)
        else:
            self.weight_bf16 = Tensor.empty((self.max_weight_elems,), bfloat16, self.device)

    def check(self, m: int, n: int, k: int) -> None:
        if m > self.max_rows or k > self.max_k or n * k > self.max_weight_elems:
            raise ValueError(f"scratch: sized for {self.max_rows} rows, in_features {self.max_k} and "
                             f"{self.max_weight_elems} weight elements; this call has {m} rows and a [{n}, {k}] weight")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.q, self.scales, self.padded_scales, self.weight_bf16) if t is not None)


def linear_fp8(x: Tensor, weight: Tensor, scale_inv: Tensor, out: Tensor | None = None, out_dtype=None,
               scratch: Fp8Scratch | None = None, path: str = "auto") -> Tensor:
    """x bf16 [M, K] @ dequant(weight [N, K], scale_inv)^T -> out [M, N] (bf16 by default, or float32)."""
    m, n, k, device, out = check_fp8_linear(x, weight, scale_inv, out, out_dtype)
    if path not in PATHS:
        raise ValueError(f"path: {path!r}, expected one of {PATHS}")
    if device == "cpu":
        out.array[...] = linear_fp8_reference(x.array, weight.array, scale_inv.array).astype(out.dtype)
        return out
    if m == 0 or n == 0:
        return out
    chosen = choose_path(m, get_device().arch) if path == "auto" else path
    if chosen == "gemv":
        if m > MAX_M:
            raise ValueError(f"path: 'gemv' takes 1..{MAX_M} rows, x has {m}")
        return linear_fp8_gemv(x, weight, scale_inv, out=out)
    if k % K_MULTIPLE:
        raise ValueError(f"x: in_features {k} must be a multiple of {K_MULTIPLE} on CUDA (16-byte weight chunks)")
    if not aligned(x, weight, out):
        raise ValueError("linear_fp8: x, weight and out must be 16-byte aligned")
    if scratch is None:
        scratch = Fp8Scratch(m, k, n * k, device, paths=())
    scratch.check(m, n, k)
    cublas = get_runtime().cublas
    if chosen == "cublas_fp8":
        main = m - m % FP8_GEMM_M_MULTIPLE  # cuBLASLt's rows; the other m % 4 go through the GEMV
        plan = cublas.fp8_block_scaled_plan(main, n, k, out.dtype) if main else None
        if plan is not None:
            try:
                _cublas_fp8(x[:main], weight, scale_inv, out[:main], scratch, cublas, main, n, k)
            except CublasError:
                if cublas.fp8_block_scaled_plan(main, n, k, out.dtype) is not None:
                    raise  # not a refusal of this shape: a real error
            else:
                if main < m:
                    linear_fp8_gemv(x[main:], weight, scale_inv, out=out[main:])
                return out
        key = (main, n, k, out.dtype)
        if path == "auto" and m <= MAX_M:  # refused at 8 rows (an odd N): the GEMV takes them whole
            return linear_fp8_gemv(x, weight, scale_inv, out=out)
        if path == "cublas_fp8":
            raise CublasError(f"linear_fp8: path 'cublas_fp8' forced, but cuBLASLt refuses M={main} N={n} K={k}: "
                              f"{cublas.fp8_refusals.get(('fp8_block',) + key)}")
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"linear_fp8: cuBLASLt has no block-scaled FP8 GEMM for M={main} N={n} K={k} "
                          f"({cublas.fp8_refusals.get(('fp8_block',) + key)}); using the dequantize + bf16 GEMM path",
                          RuntimeWarning, stacklevel=2)
    scratch.ensure("dequant")
    w = scratch.weight_bf16[:n * k].view(n, k)
    dequantize_bf16(weight, scale_inv, out=w)
    cublas.gemm(x.ptr, w.ptr, out.ptr, m, n, k, bfloat16, out.dtype)
    return out


def _cublas_fp8(x, weight, scale_inv, out, scratch, cublas, m, n, k) -> None:
    scratch.ensure("cublas_fp8")
    groups = cdiv(k, GROUP)
    q = scratch.q[:m * k].view(m, k)
    scales = scratch.scales[:groups * m].view(groups, m)
    quantize_1x128(x, q, scales)
    w_scales = scale_inv
    if groups % 4 or scale_inv.ptr % 16:  # cuBLASLt reads the weight's scale rows at a 16-byte-aligned stride
        nb, ld = scale_inv.shape[0], round_up(groups, 4)
        if nb * ld > scratch.padded_scales.numel:
            raise ValueError(f"scratch: {scratch.padded_scales.numel} padded scales, this weight needs {nb * ld}")
        w_scales = pad_scales(scale_inv, scratch.padded_scales[:nb * ld].view(nb, ld))
    cublas.gemm_fp8_block_scaled(q.ptr, scales.ptr, weight.ptr, w_scales.ptr, out.ptr, m, n, k, out.dtype)


__all__ = ["linear_fp8", "linear_fp8_reference", "Fp8Scratch", "choose_path", "PATHS"]
