"""Skinny GEMMs (M <= 16 rows) with the decoder layer's neighbours fused in (cuda_src/gemv.cu):

    linear_gemv(x, W)                        out = x @ W^T
    rmsnorm_linear(residual, norm_w, eps, W) out = rmsnorm(residual[rows]) @ W^T   (fp32 residual stream)
    rmsnorm_linear_silu_mul(residual, norm_w, eps, W_gate_up)
                                             out = silu_and_mul(bf16(rmsnorm(residual) @ W_gate_up^T))  (one row)
    linear_add(x, W, residual)               residual += bf16(x @ W^T)
    silu_mul_linear_add(gate_up, W, residual) residual += bf16(silu_and_mul(gate_up) @ W^T)

Each is, bit for bit in its rounding points, the composition of the unfused ops (fused_add_rmsnorm_f32res's
normalisation, silu_and_mul, linear, the residual add), so the CPU backend runs exactly that composition of the
NumPy references. Only the order of the fp32 sums differs from cuBLASLt's.

FP8 weights: rmsnorm_linear, rmsnorm_linear_silu_mul and linear_add also take an `Fp8Weight` (e4m3
[N, K] with float32 128 x 128 block scales, xserv/fp8_format.py) for one row, the one-token decode step's projections:
the same prologues and epilogues on the FP8 GEMV (gemv_fp8.cu's gemv_fp8_row_* entries: gemv_row.cuh's one-row
kernel with the e4m3 format, the weights dequantized in registers). Their references compose the same NumPy
references around linear_fp8_reference (dequantize, then multiply). `fp8_row_supported(n, k, paired)` says whether
a shape fits.

`gemv_supported(m, k)` says whether a shape fits (one row stages all of x in shared memory; more rows slice K
when they would not fit); `prefer_gemv(m, n, k)` is the measured choice between these kernels and cuBLASLt for a
plain linear (docs/kernels/gemv.md).
"""
from __future__ import annotations

import numpy as np

from .. import runtime as _runtime
from ..runtime import get_device, kernel
from ..runtime.device import CTA_SMEM_RESERVED, SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR
from ..runtime.compiler import piece
from ..tensor import Tensor, bfloat16, float32, int32
from ._checks import check_tensor, output, same_device
from ._launch import aligned, cdiv, check_alias, check_eps, pooled_buffer, round_up
from ..fp8_format import Fp8Weight
from ..tensor import float8_e4m3fn
from .activation import silu_and_mul_reference
from .gemv_fp8 import FAMILY as FP8_FAMILY
from .gemv_fp8 import K_MULTIPLE as FP8_K_MULTIPLE
from .gemv_fp8 import check_fp8_scale, linear_fp8_reference
from .linear import linear_reference
from .rmsnorm import rmsnorm_reference

MAX_M = 16
# Launch shapes of the two kernels (gemv.cu): warps per CTA, weight rows per row group, the row-padding of staged x.
_ROW_WARPS, _ROW_ROWS = 4, 4  # gemv_row (m = 1)
_ROW_STEP_K = 32 * 4 * 8  # gemv_row: K values one load step of a warp covers (32 lanes x 4 16-byte chunks)
_FP8_ROW_STEP_K = 32 * 4 * 16  # the same kernel on e4m3 weights (gemv_fp8_row_*): 16 weights a 16-byte chunk
_MMA_WARPS, _MMA_ROWS, _MMA_PAD = 8, 16, 32  # gemv_mma_m8 / _m16
# The staged x rows live in shared memory; two CTAs of this size still fit an sm_90 SM's 228 KB. The device's own
# limits lower it where they are smaller (smem_limit, k_slices: sm_80 allows 163 KB per CTA and 164 KB per SM,
# sm_86 / sm_89 / sm_120 99 KB and 100 KB; docs/kernels/portability.md, "Shared memory per arch").
SMEM_LIMIT = 112 * 1024
# The mma kernel deals K out to several CTAs ("K slices", each staging its range of x) where a CTA would otherwise
# stage more x than this: shared memory takes L1 space from the weights' loads in flight (docs/kernels/gemv.md,
# "K slices"), and 16 rows of a long K would not fit at all. A module attribute so that benchmarks can sweep it.
STAGE_BYTES = 72 * 1024
# The one-row kernel lets the next kernel launch at its very start (gemv.cu's early_trigger) where its weights are at
# most this many bytes (short kernels: the next one's launch then overlaps them): 0.6B +1.6% at batch 1, while on
# the 8B's 33-201 MB projections it cost 0.6% (docs/kernels/gemv.md). A module attribute so that benchmarks
# can compare settings.
EARLY_TRIGGER_BYTES = 16 << 20
# At most 2 CTAs per SM: enough loads in flight for the bandwidth, and each CTA stages x (once) the fewest times.
CTAS_PER_SM = 2
# Where a warp's share of a row is one load step (one_load_step), the one-row kernel's _1step entries fit 3 CTAs per
# SM with the RMSNorm prologue and 4 with the others (gemv.cu's one_step_ctas_per_sm), and the grid takes up to
# this many (the split still aims at two tiles per SM): the 0.6B's gate/up projection runs its 384 tiles in one
# round instead of 1.45, its lm_head on 396 CTAs (docs/kernels/gemv.md). Module attributes so that benchmarks can compare
# settings (tools/bench_decode --gemv-set).
ONE_STEP_CTAS_PER_SM = 3  # the RMSNorm prologue's entries
ONE_STEP_PLAIN_CTAS_PER_SM = 4  # the others'
# The one-row plan takes the split that makes a tile one load step where the CTA's warps allow it (the 8B's qkv, o
# and lm_head at K = 4096: split 4, against 2 / 2 / 1 for the looping entries): 8B +1.0% (gemv.md).
# The one-row kernel takes one split fewer than "every CTA slot gets a tile" asks for where that split would leave
# a warp's share of K short of one load step and the fewer tiles still fill this share of the slots (0.6B qkv,
# K = 1024: 256 tiles of whole rows on 264 slots, not 512 of half rows; docs/kernels/gemv.md). A module
# attribute so that benchmarks can compare settings (tools/bench_decode --gemv-set; above 1: never).
ROW_SHORT_K_FILL = 0.9
# The FP8 one-row entries (gemv_fp8_row_*) take the same plan with their own load step (2048 values a warp) and these
# two plan parameters of their own, so that benchmarks can compare them apart from the bf16 kernel's (tools/bench_decode
# --gemv-set; FP8_PREFER_ONE_STEP 0: the fewest splits that fill the SMs, the looping entries). The early trigger counts the e4m3 bytes: the 8B's o projection (16 MiB) is then triggered early as the
# bf16 0.6B projections of that size are (a kernel about as long); its qkv (24 MiB) and the rest are not. Unmeasured
# on a GPU when written (docs/kernels/fp8.md).
FP8_EARLY_TRIGGER_BYTES = 16 << 20
FP8_PREFER_ONE_STEP = True
_PROLOGUE = {"bf16": 0, "rmsnorm": 1, "silu_mul": 2}
_EPILOGUE = {bfloat16: 0, float32: 1, "add": 2, "silu_mul": 3}
# gemv_row's entries carry their prologue and epilogue compiled in (gemv.cu): (prologue, epilogue) -> the suffix.
_ROW_ENTRY = {(_PROLOGUE[p], _EPILOGUE[e]): f"{p}_{name}" for p, e, name in (
    ("bf16", bfloat16, "bf16"), ("bf16", float32, "f32"), ("bf16", "add", "add"), ("rmsnorm", bfloat16, "bf16"),
    ("rmsnorm", float32, "f32"), ("rmsnorm", "silu_mul", "silu_mul"), ("silu_mul", "add", "add"))}


def _smem(m: int, k: int) -> int:
    """Dynamic shared memory of the kernel that takes m rows of a k-long slice (or the whole row): partial sums,
    RMS scratch, staged x (gemv.cu)."""
    if m == 1:
        return (_ROW_WARPS * _ROW_ROWS + _ROW_WARPS) * 4 + k * 2
    return _mma_buffers(m) + m * (k + _MMA_PAD) * 2


def _mma_buffers(m: int) -> int:
    """The mma kernel's shared memory besides the staged x: the split warps' partial sums and the RMS scratch."""
    kernel_m = 8 if m <= 8 else 16
    return (_MMA_WARPS * 32 * 4 * (kernel_m // 8) + kernel_m * _MMA_WARPS) * 4


def device_smem() -> tuple[int, int]:
    """(per-block opt-in, per-SM) shared memory of the GPU xserv runs on, or sm_90's where no runtime has started
    (CPU-only processes and tests: the planning functions below take the numbers as arguments)."""
    rt = _runtime._runtime
    if rt is None:
        return SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR
    info = rt.device.info
    return info.max_shared_memory_per_block_optin, info.max_shared_memory_per_multiprocessor


def smem_limit(smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN) -> int:
    """The most dynamic shared memory a GEMV CTA may ask on a device allowing smem_per_block per CTA."""
    return min(SMEM_LIMIT, smem_per_block)


def resident_ctas(smem: int, smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> int:
    """CTAs of `smem` bytes of dynamic shared memory that one SM holds at once (each also takes the 1 KB the
    runtime reserves): caps the CTAs per SM the plan launches."""
    return max(1, smem_per_sm // (smem + CTA_SMEM_RESERVED))


def k_slices(m: int, k: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
             smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> tuple[int, int]:
    """(slices, slice length) for m rows of in_features k: one slice for the one-row kernel and wherever the staged
    x is within STAGE_BYTES (and smem_limit, and CTAS_PER_SM CTAs within an SM's smem_per_sm), else the fewest
    slices (a multiple of 32 values long, the mma blocks') that bring it there. On sm_90 and sm_80 STAGE_BYTES is
    the binding term; on sm_86 / sm_89 / sm_120 (100 KB per SM) two CTAs per SM are."""
    per_cta = min(smem_limit(smem_per_block), smem_per_sm // CTAS_PER_SM - CTA_SMEM_RESERVED)
    budget = min(STAGE_BYTES, per_cta - _mma_buffers(m))
    if m == 1 or m * (k + _MMA_PAD) * 2 <= budget:
        return 1, k
    longest = max(32, (budget // (2 * m) - _MMA_PAD) // 32 * 32)  # the longest slice within the budget
    slices = cdiv(k, longest)
    kc = round_up(cdiv(k, slices), 32)  # the same count of slices, as even as multiples of 32 allow
    return cdiv(k, kc), kc


def gemv_supported(m: int, k: int, smem_per_block: int | None = None, smem_per_sm: int | None = None) -> bool:
    """Can the GEMV kernels take m rows of an in_features-k input (before any alignment check)? The shared memory
    limits default to the device's (device_smem)."""
    if smem_per_block is None or smem_per_sm is None:
        block, sm = device_smem()
        smem_per_block = block if smem_per_block is None else smem_per_block
        smem_per_sm = sm if smem_per_sm is None else smem_per_sm
    return (1 <= m <= MAX_M and k % 8 == 0
            and _smem(m, k_slices(m, k, smem_per_block, smem_per_sm)[1]) <= smem_limit(smem_per_block))


def launch_smem(m: int, k: int, smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
                smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR) -> int:
    """The dynamic shared memory the launcher asks for m rows of in_features k (what _launch passes)."""
    return _smem(m, k_slices(m, k, smem_per_block, smem_per_sm)[1])


# Above one row, the mma kernel or cuBLASLt (docs/kernels/gemv.md): the rule is a list of (rows up to, N x K up to,
# N up to) where the mma kernel is taken: up to 8 rows of at most 4096 outputs and 16M weights (not the 0.6B's
# gate_up). With the norms and the activation between the projections in the PDL chain (rmsnorm.cu,
# activation.ptx), the mma kernel's early start pays in the model: 0.6B decode at batch 2 / 4 / 8 +12% / +10% / +9%
# over cuBLASLt everywhere, 1.6% ahead of taking it for every 0.6B projection at batch 4 and even elsewhere; from 9
# rows and on the larger 8B weights cuBLASLt keeps them. The other rules measured are tools/bench_decode's
# --gemv-rule.
MMA_PREFERRED: tuple[tuple[int, int, int], ...] = ((8, 1 << 24, 4096),)


def prefer_gemv(m: int, n: int, k: int, smem_per_block: int | None = None, smem_per_sm: int | None = None) -> bool:
    """The measured choice for a plain linear: the GEMV kernel for one row (1.03-1.9x cuBLASLt on every Qwen3
    projection measured), the mma kernel for 2..16 rows where MMA_PREFERRED takes it, else cuBLASLt."""
    if not gemv_supported(m, k, smem_per_block, smem_per_sm):
        return False
    return m == 1 or any(m <= rows and n * k <= elements and n <= outputs
                         for rows, elements, outputs in MMA_PREFERRED)


# ---- references (NumPy; the composition of the unfused ops' references) ------------------------------------------
# `weight` is a bf16 array [N, K], or an FP8 weight as its pair (e4m3 [N, K], scale_inv float32 [ceil(N / 128),
# ceil(K / 128)]): the projection is then linear_fp8's reference (dequantize as fp8.py does, multiply in float64),
# what the unfused FP8 path computes.
def project_reference(x: np.ndarray, weight) -> np.ndarray:
    """x @ W^T: linear_reference for a bf16 weight (float32), linear_fp8_reference for an (e4m3, scale_inv) pair."""
    if isinstance(weight, tuple):
        return linear_fp8_reference(x, *weight)
    return linear_reference(x, weight)


def rmsnorm_linear_reference(residual: np.ndarray, norm_weight: np.ndarray, eps: float, weight,
                             rows: np.ndarray | None = None) -> np.ndarray:
    """float32 [m, N] (float64 for an FP8 weight): rmsnorm of fp32 residual rows (fused_add_rmsnorm_f32res's
    rounding), bf16, times W^T."""
    r = residual if rows is None else residual[rows]
    normed = rmsnorm_reference(r.astype(np.float32), norm_weight, eps).astype(bfloat16)
    return project_reference(normed, weight)


def rmsnorm_linear_silu_mul_reference(residual: np.ndarray, norm_weight: np.ndarray, eps: float,
                                      gate_up_weight) -> np.ndarray:
    """bf16 [m, I]: the gate/up projection of the normalised rows rounded to bf16 (as `linear` stores it), then
    silu_and_mul."""
    gate_up = rmsnorm_linear_reference(residual, norm_weight, eps, gate_up_weight).astype(bfloat16)
    return silu_and_mul_reference(gate_up).astype(bfloat16)


def silu_mul_linear_reference(gate_up: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return linear_reference(silu_and_mul_reference(gate_up).astype(bfloat16), weight)


def _host_weight(weight: Tensor | Fp8Weight):
    """What the references take: the array, or an FP8 weight's (e4m3, scale_inv) arrays."""
    return (weight.weight.array, weight.scale_inv.array) if isinstance(weight, Fp8Weight) else weight.array


def add_rounded(residual: np.ndarray, y: np.ndarray) -> np.ndarray:
    """residual + bf16(y) in fp32: what `hidden = linear(...)` then the fused residual add give."""
    return (residual.astype(np.float32) + y.astype(bfloat16).astype(np.float32)).astype(np.float32)


# ---- ops ---------------------------------------------------------------------------------------------------------
def _check_weight(weight: Tensor | Fp8Weight, k: int, m: int | None = None, paired: bool = False,
                  name: str = "weight") -> int:
    """N of a bf16 weight [N, K], or of an Fp8Weight where the op takes one (m: its rows; the FP8 entries take one,
    K % 16 == 0, and for the paired SiLU-and-mul epilogue N % 8 == 0)."""
    if not isinstance(weight, Fp8Weight):
        check_tensor(name, weight, dtype=bfloat16, ndim=2)
        if weight.shape[1] != k:
            raise ValueError(f"{name}: shape {list(weight.shape)} does not match the input's in_features {k}")
        return weight.shape[0]
    if m is None:
        raise ValueError(f"{name}: an Fp8Weight; this op takes bf16 weights only (linear_fp8 projects FP8 weights)")
    check_tensor(f"{name}.weight", weight.weight, dtype=float8_e4m3fn, ndim=2)
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"{name}: shape {list(weight.shape)} does not match the input's in_features {k}")
    check_fp8_scale(weight.scale_inv, n, k)
    if m != 1:
        raise ValueError(f"{name}: an Fp8Weight takes one row in the fused GEMVs (the one-token step), this call has "
                         f"{m}")
    if not fp8_row_supported(n, k, paired):
        raise ValueError(f"{name}: an Fp8Weight of [{n}, {k}] does not fit the fused FP8 GEMV (in_features a positive "
                         f"multiple of {FP8_K_MULTIPLE} within {smem_limit(device_smem()[0])} bytes of staged x"
                         + (f"; a gate/up weight's rows a multiple of {2 * _ROW_ROWS}" if paired else "") + ")")
    return n


def fp8_row_supported(n: int, k: int, paired: bool = False, smem_per_block: int | None = None,
                      smem_per_sm: int | None = None) -> bool:
    """Can the fused one-row FP8 GEMVs (gemv_fp8_row_*) take a weight of [n, k]? The staged x row as the bf16 row
    kernel's (gemv_supported), K a multiple of 16 (16 e4m3 a 16-byte chunk, never across a scale block), and with
    the paired SiLU-and-mul epilogue (n = 2I gate and up rows) I % 4 == 0, so that an up row group shares a scale
    row as a gate row group does."""
    return (k > 0 and k % FP8_K_MULTIPLE == 0 and gemv_supported(1, k, smem_per_block, smem_per_sm)
            and (not paired or n % (2 * _ROW_ROWS) == 0))


def _check_m(m: int, k: int) -> None:
    if not gemv_supported(max(m, 1), k):
        raise ValueError(f"gemv: {m} rows of in_features {k} do not fit the GEMV kernels (rows <= {MAX_M}, "
                         f"in_features % 8 == 0, the staged rows within {smem_limit(device_smem()[0])} bytes of "
                         f"shared memory)")


def linear_gemv(x: Tensor, weight: Tensor, out: Tensor | None = None, out_dtype=None) -> Tensor:
    """x bf16 [m, K] @ weight[N, K]^T -> out [m, N] (bf16 or float32)."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    m, k = x.shape
    n = _check_weight(weight, k)
    _check_m(m, k)
    device = same_device(x=x, weight=weight, out=out)
    out = output("out", out, (m, n), out.dtype if out is not None else (out_dtype or bfloat16), device)
    if out.dtype not in (bfloat16, float32):
        raise ValueError(f"out: dtype {out.dtype}, expected bfloat16 or float32")
    check_alias("out", out, "x", x, allow_identical=False)
    if device == "cpu":
        out.array[...] = linear_reference(x.array, weight.array).astype(out.dtype)
        return out
    _launch("bf16", x, k, None, None, 0.0, weight, out, _EPILOGUE[out.dtype], m, n, k)
    return out


def rmsnorm_linear(residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor | Fp8Weight,
                   out: Tensor | None = None, rows: Tensor | None = None, out_dtype=None) -> Tensor:
    """rmsnorm(residual[rows]) @ weight^T -> out [m, N] (bf16 or float32): residual fp32 [T, K] (the decoder's
    stream), rows int32 [m] picking residual rows (default: all T), norm_weight bf16 [K]; weight bf16 [N, K], or an
    Fp8Weight for one row (m = 1)."""
    check_tensor("residual", residual, dtype=float32, ndim=2)
    k = residual.shape[1]
    check_tensor("norm_weight", norm_weight, dtype=bfloat16, shape=(k,))
    eps32 = check_eps(eps)
    if rows is not None:
        check_tensor("rows", rows, dtype=int32, ndim=1)
    m = residual.shape[0] if rows is None else rows.shape[0]
    n = _check_weight(weight, k, m)
    _check_m(m, k)
    device = same_device(residual=residual, norm_weight=norm_weight, weight=weight, rows=rows, out=out)
    out = output("out", out, (m, n), out.dtype if out is not None else (out_dtype or bfloat16), device)
    if out.dtype not in (bfloat16, float32):
        raise ValueError(f"out: dtype {out.dtype}, expected bfloat16 or float32")
    if isinstance(weight, Fp8Weight) and out.dtype != bfloat16:
        raise ValueError(f"out: dtype {out.dtype}; with an Fp8Weight rmsnorm_linear stores bfloat16 (the qkv "
                         f"projection's entry)")
    check_alias("out", out, "residual", residual, allow_identical=False)
    if device == "cpu":
        idx = None if rows is None else rows.array
        if idx is not None and (idx.min(initial=0) < 0 or idx.max(initial=0) >= residual.shape[0]):
            raise ValueError(f"rows: an index is outside [0, {residual.shape[0]})")
        out.array[...] = rmsnorm_linear_reference(residual.array, norm_weight.array, eps32, _host_weight(weight),
                                                  idx).astype(out.dtype)
        return out
    _launch("rmsnorm", residual, k, rows, norm_weight, eps32, weight, out, _EPILOGUE[out.dtype], m, n, k)
    return out


def rmsnorm_linear_silu_mul(residual: Tensor, norm_weight: Tensor, eps: float, gate_up_weight: Tensor | Fp8Weight,
                            out: Tensor | None = None) -> Tensor:
    """silu_and_mul(bf16(rmsnorm(residual) @ gate_up_weight^T)) -> out bf16 [1, I]: residual fp32 [1, K] (one row:
    the one-token decode step), gate_up_weight bf16 [2I, K] (gate rows, then up rows) or an Fp8Weight of that shape
    (I % 4 == 0). The activation is computed in the projection's epilogue, once per step (the down projection then
    takes it as a plain bf16 input)."""
    check_tensor("residual", residual, dtype=float32, ndim=2)
    m, k = residual.shape
    check_tensor("norm_weight", norm_weight, dtype=bfloat16, shape=(k,))
    eps32 = check_eps(eps)
    n = _check_weight(gate_up_weight, k, m, paired=True, name="gate_up_weight")
    if n % 2:
        raise ValueError(f"gate_up_weight: {n} rows, expected an even count (gate rows then up rows)")
    if m != 1:
        raise ValueError(f"residual: {m} rows; rmsnorm_linear_silu_mul takes one (use rmsnorm_linear, then "
                         f"silu_and_mul)")
    _check_m(m, k)
    device = same_device(residual=residual, norm_weight=norm_weight, gate_up_weight=gate_up_weight, out=out)
    out = output("out", out, (m, n // 2), bfloat16, device)
    check_alias("out", out, "residual", residual, allow_identical=False)
    if device == "cpu":
        out.array[...] = rmsnorm_linear_silu_mul_reference(residual.array, norm_weight.array, eps32,
                                                           _host_weight(gate_up_weight))
        return out
    _launch("rmsnorm", residual, k, None, norm_weight, eps32, gate_up_weight, out, _EPILOGUE["silu_mul"], m, n, k)
    return out


def linear_add(x: Tensor, weight: Tensor | Fp8Weight, residual: Tensor) -> Tensor:
    """residual fp32 [m, N] += bf16(x bf16 [m, K] @ weight^T), weight bf16 [N, K] or an Fp8Weight for one row.
    Returns residual."""
    check_tensor("x", x, dtype=bfloat16, ndim=2)
    return _add_into_residual("x", x, x.shape[1], "bf16", project_reference, weight, residual, fp8=True)


def silu_mul_linear_add(gate_up: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """residual fp32 [m, N] += bf16(silu_and_mul(gate_up bf16 [m, 2I]) @ weight[N, I]^T). Returns residual."""
    check_tensor("gate_up", gate_up, dtype=bfloat16, ndim=2)
    width = gate_up.shape[1]
    if width % 2:
        raise ValueError(f"gate_up: last dimension {width} must be even (gate and up halves)")
    return _add_into_residual("gate_up", gate_up, width // 2, "silu_mul", silu_mul_linear_reference, weight, residual)


def _add_into_residual(name: str, x: Tensor, k: int, prologue: str, reference, weight: Tensor | Fp8Weight,
                       residual: Tensor, fp8: bool = False) -> Tensor:
    """The residual-add epilogue ops: x (checked by the caller) gives the K = k input of the projection; fp8: the op
    takes an Fp8Weight too."""
    m = x.shape[0]
    n = _check_weight(weight, k, m if fp8 else None)
    _check_m(m, k)
    check_tensor("residual", residual, dtype=float32, shape=(m, n))
    device = same_device(**{name: x}, weight=weight, residual=residual)
    check_alias("residual", residual, name, x, allow_identical=False)
    if device == "cpu":
        residual.array[...] = add_rounded(residual.array, reference(x.array, _host_weight(weight)))
        return residual
    _launch(prologue, x, x.shape[1], None, None, 0.0, weight, residual, _EPILOGUE["add"], m, n, k)
    return residual


# ---- launch -------------------------------------------------------------------------------------------------------
def plan(m: int, n: int, multiprocessor_count: int, paired: bool = False, k: int = 0, normed: bool = False,
         smem_per_block: int = SM90_SMEM_PER_BLOCK_OPTIN,
         smem_per_sm: int = SM90_SMEM_PER_MULTIPROCESSOR, fp8: bool = False) -> tuple[str, int, int, int, int]:
    """(kernel, threads, split, grid, slices): kernel = the base name (the launcher picks the entry: gemv_row's
    _<prologue>_<epilogue>[_1step], the mma kernel's _bf16_bf16 or _sliced), split = warps sharing a row group's K
    (the fewest that give every SM two tiles and keep the last round of tiles >= 90% full; for one row, one fewer
    where that one would leave a warp's load step part empty (ROW_SHORT_K_FILL), more where they make a tile one
    load step), slices = the K slices (k_slices; each CTA takes one and loops over the tiles),
    grid = the CTAs, at most CTAS_PER_SM per multiprocessor (each stages its x once; for the one-row kernel's
    one-step tiles ONE_STEP_CTAS_PER_SM with the RMSNorm prologue (normed), ONE_STEP_PLAIN_CTAS_PER_SM without).
    paired (the SiLU-and-mul epilogue, one row; normed): a tile pairs gate and up row groups, so split <= 2.
    smem_per_block / smem_per_sm: the device's shared memory (sm_90's by default): they size the K slices and cap
    the CTAs per SM at what an SM holds (resident_ctas; never binding on sm_90).
    fp8: the same one-row kernel on e4m3 weights (gemv_fp8_row; m = 1): its load step covers 2048 values of K, and
    FP8_PREFER_ONE_STEP says whether it takes more splits to make a tile one load step."""
    if fp8 and m != 1:
        raise ValueError(f"plan: the FP8 row kernel takes one row, not {m}")
    row_step_k = _FP8_ROW_STEP_K if fp8 else _ROW_STEP_K
    prefer_one_step = FP8_PREFER_ONE_STEP if fp8 else True
    if m == 1:
        name, warps, rows = ("gemv_fp8_row" if fp8 else "gemv_row"), _ROW_WARPS, _ROW_ROWS
    else:
        name, warps, rows = ("gemv_mma_m8" if m <= 8 else "gemv_mma_m16"), _MMA_WARPS, _MMA_ROWS
    slices, slice_k = k_slices(m, k, smem_per_block, smem_per_sm) if k else (1, 0)
    resident = resident_ctas(_smem(m, slice_k), smem_per_sm)
    max_split = 2 if paired else warps
    slots = max(1, multiprocessor_count * min(CTAS_PER_SM, resident) // slices)  # CTAs per slice

    def tiles(s: int) -> int:
        return cdiv(n, rows * (warps // s))

    step_k = row_step_k if m == 1 else 32 * 4  # K values a warp's load step covers (mma: lanes x kU blocks)
    if slices > 1:  # a warp's share of a slice keeps at least two load steps (split: a power of two)
        while max_split > 1 and slice_k < 2 * max_split * step_k:
            max_split //= 2
    split = next((s for s in (1, 2, 4, 8) if s <= max_split and tiles(s) * slices >= 2 * multiprocessor_count),
                 max_split)
    if m == 1 and 1 < split and slice_k < split * step_k and tiles(split // 2) >= ROW_SHORT_K_FILL * slots:
        split //= 2
    # More splits while the last round of tiles leaves over 10% of the CTAs idle (8B qkv: 384 tiles on 264 CTAs,
    # 16.5 us; 768 tiles, 15.4 us on an H200), as long as a warp's share of K still fills its loads (a load step
    # covers `step_k` values per warp: 0.6B gate_up, K = 1024, lost 5.2 -> 6.1 us at split 2).
    while (split < max_split and tiles(split) / (slots * cdiv(tiles(split), slots)) < 0.9
           and slice_k >= 2 * split * step_k):
        split *= 2
    if m == 1 and prefer_one_step and not one_load_step(k, split, fp8):  # more splits where a tile is then one step
        split = next((s for s in (2, 4) if split < s <= max_split and one_load_step(k, s, fp8)), split)
    if m == 1 and one_load_step(k, split, fp8):
        slots = multiprocessor_count * min(resident, ONE_STEP_CTAS_PER_SM if normed or paired
                                           else ONE_STEP_PLAIN_CTAS_PER_SM)
    return name, warps * 32, split, min(tiles(split), slots) * slices, slices


def one_load_step(k: int, split: int, fp8: bool = False) -> bool:
    """Is a warp's share of a k-long row at most one of gemv_row's load steps (32 lanes x 4 chunks of 8 values; of
    16 e4m3 values with fp8)? Then the launcher takes the row kernel's _1step entry (gemv_row.cuh: one register set,
    3-4 CTAs per SM)."""
    return 0 < k <= split * (_FP8_ROW_STEP_K if fp8 else _ROW_STEP_K)


_workspaces: list[Tensor] = []  # K-slice partial sums (pooled_buffer: kept for the life of the process)
_counters: list[Tensor] = []  # tile-set counters: zeroed once, reset by the kernel


def _launch(prologue: str, x: Tensor, x_stride: int, rows: Tensor | None, norm_weight: Tensor | None, eps32,
            weight: Tensor | Fp8Weight, out: Tensor, epilogue: int, m: int, n: int, k: int) -> None:
    if m == 0 or n == 0:
        return
    fp8 = isinstance(weight, Fp8Weight)
    w = weight.weight if fp8 else weight
    if not aligned(x, w) or (x_stride * x.dtype.itemsize) % 16:
        raise ValueError("gemv: x and weight must be 16-byte aligned with 16-byte aligned rows")
    paired = epilogue == _EPILOGUE["silu_mul"]
    info = get_device().info
    block_smem, sm_smem = info.max_shared_memory_per_block_optin, info.max_shared_memory_per_multiprocessor
    name, threads, split, grid, slices = plan(m, n, info.multiprocessor_count, paired, k, prologue == "rmsnorm",
                                              block_smem, sm_smem, fp8=fp8)
    slice_k = k_slices(m, k, block_smem, sm_smem)[1]
    x_rows = rows if rows is not None else 0  # a null pointer: rows 0..m-1
    norm = norm_weight if norm_weight is not None else 0
    modes = (np.int32(_PROLOGUE[prologue]), np.int32(epilogue))
    if m == 1:  # gemv[_fp8]_row_<prologue>_<epilogue>[_1step](x, x_stride, x_rows, norm_w, eps, W, [scale_inv: FP8],
        #                                                      out, N, K, split, early_trigger)
        name += "_" + _ROW_ENTRY[_PROLOGUE[prologue], epilogue] + ("_1step" if one_load_step(k, split, fp8) else "")
        early = n * k * w.dtype.itemsize <= (FP8_EARLY_TRIGGER_BYTES if fp8 else EARLY_TRIGGER_BYTES)
        scales = (weight.scale_inv,) if fp8 else ()
        args = (x, np.int64(x_stride), x_rows, norm, np.float32(eps32), w, *scales, out, np.int32(n), np.int32(k),
                np.int32(split), np.int32(early))
    else:  # gemv_mma_m*(x, x_stride, x_rows, norm_w, eps, W, out, out_stride, m, N, K, split,
        #              [slices, kc, partials, counters: the _sliced entries], [prologue, epilogue: not _bf16_bf16])
        sliced = ()
        if slices == 1 and prologue == "bf16" and epilogue == _EPILOGUE[bfloat16]:
            name, modes = name + "_bf16_bf16", ()  # the plain entry: no prologue / epilogue arguments
        if slices > 1:
            name += "_sliced"
            partials = pooled_buffer(_workspaces, slices * m * n, float32, 1 << 18)
            counters = pooled_buffer(_counters, grid // slices, int32, 1024, zeroed=True)
            sliced = (np.int32(slices), np.int32(slice_k), partials, counters)
        args = (x, np.int64(x_stride), x_rows, norm, np.float32(eps32), weight, out, np.int64(out.shape[1]),
                np.int32(m), np.int32(n), np.int32(k), np.int32(split), *sliced, *modes)
    kernel(_PIECES[name], name)(grid, threads, *args, smem=_smem(m, slice_k), pdl=True)


# gemv.cu is compiled as pieces by rows and part (runtime/compiler.py, "shape pieces"): gemv:m1_* (gemv_row_*),
# gemv:m8_* (gemv_mma_m8*), gemv:m16_* (gemv_mma_m16*); part 0 = the entries a Qwen3 decode step launches (one row:
# the fused chain's four, with their _1step forms; more rows: the plain _bf16_bf16 entry), which a start-up compiles
# (gemv.cu's `// xserv-startup:` line: m1 and m8), part 1 = the rest, compiled on first use. Entry -> piece.
_FUSED_ROW_ENTRIES = ("bf16_add", "rmsnorm_bf16", "rmsnorm_f32", "rmsnorm_silu_mul")
_PIECES = {f"gemv_row_{entry}{step}": piece("gemv", rows=1, part=int(entry not in _FUSED_ROW_ENTRIES))
           for entry in _ROW_ENTRY.values() for step in ("", "_1step")}
# gemv_fp8.cu's one-row entries (its one piece gemv_fp8:f1, compiled at an FP8 model's start): the fused one-token
# step's three (qkv, o and down, gate/up)
_FP8_ROW_ENTRIES = ("rmsnorm_bf16", "bf16_add", "rmsnorm_silu_mul")
_PIECES.update({f"gemv_fp8_row_{entry}{step}": piece(FP8_FAMILY, fp8=1)
                for entry in _FP8_ROW_ENTRIES for step in ("", "_1step")})
_PIECES.update({f"gemv_mma_m{rows}{suffix}": piece("gemv", rows=rows, part=int(suffix != "_bf16_bf16"))
                for rows in (8, 16) for suffix in ("", "_sliced", "_bf16_bf16")})
