"""cuBLASLt through nvmath-python's low-level bindings: `out = x @ w^T` with bf16 (or fp16/fp32) inputs and fp32
accumulation, strided-batched, algorithm chosen by cuBLASLt's heuristic once per shape and cached.

Weights are stored [out_features, in_features] as in the checkpoints. cuBLASLt is column-major, so a row-major
[M, N] output is the column-major N x M matrix  W(as K x N col-major, transposed) @ X(as K x M col-major).
All calls run on xserv's stream with a preallocated workspace, so they can be captured in a CUDA graph.

`gemm_fp8_block_scaled` is the FP8 form (ops/fp8_linear.py's large-M path on sm_90+): e4m3 operands, the weight with
one float32 scale per 128 x 128 block (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, cuBLASLt's operand A here), the
activations with one per row and 128-column group (VEC128_32F, operand B), fp32 accumulation, bf16 or fp32 out.
FP8 on Hopper wants "TN" (both operands K-major): ours are. Its plans are cached per shape as the bf16 ones are; a
shape cuBLASLt has no algorithm for is remembered as refused (fp8_block_scaled_plan returns None), so the caller
falls back without asking again.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from cuda.bindings import driver

from .. import settings
from .errors import CublasError, check_driver
from .timing import EventTimer

# cudaDataType_t and cublasComputeType_t values (ABI-stable enums of the CUDA headers).
_CUDA_TYPE = {np.dtype("float32"): 0, np.dtype("float16"): 2, np.dtype(ml_dtypes.bfloat16): 14}
_CUDA_R_8F_E4M3 = 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20


def _cuda_type(dtype) -> int:
    if dtype not in _CUDA_TYPE:
        raise ValueError(f"cuBLAS GEMM does not take dtype {dtype}")
    return _CUDA_TYPE[dtype]


def _lt():
    try:
        from nvmath.bindings import cublasLt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CublasError("nvmath-python is not installed (pip install nvmath-python); xserv uses it for cuBLAS") from exc
    return cublasLt


def _call(what: str, fn, *args):
    L = _lt()
    try:
        return fn(*args)
    except L.cuBLASLtError as exc:
        raise CublasError(f"{what} failed: {exc}") from exc


class _Plan:
    """Descriptors, layouts and the chosen algorithm for one (M, N, K, batch, dtypes) problem."""

    def __init__(self, handle: int, m, n, k, batch, in_type, out_type, stride_x, stride_w, stride_out, workspace_bytes,
                 candidates: int = 1, scale_modes: tuple[int, int] | None = None, swap: bool = False,
                 scale_ptr_hint: int = 0):
        L = _lt()
        self.handles = []
        self.desc = _call("cublasLtMatmulDescCreate", L.matmul_desc_create, _COMPUTE_32F, 0)
        attrs = [(L.MatmulDescAttribute.TRANSA, _OP_T), (L.MatmulDescAttribute.TRANSB, _OP_N)]
        if scale_modes is not None:  # cuBLASLt's A and B scale modes (block scaling)
            attrs += [(L.MatmulDescAttribute.A_SCALE_MODE, int(scale_modes[0])),
                      (L.MatmulDescAttribute.B_SCALE_MODE, int(scale_modes[1]))]
        self.swap = swap
        for attr, value in attrs:
            buf = np.array(value, np.int32)
            _call("cublasLtMatmulDescSetAttribute", L.matmul_desc_set_attribute, self.desc, attr, buf.ctypes.data, 4)
        self.scale_ptrs = np.zeros(2, np.uint64)  # block scaling: the A and B scale pointers, set per call
        if scale_modes is not None:
            # cuBLASLt 13.1's heuristic refuses a block-scale mode without its scale pointer ("requires a custom
            # pointer for A scale", CUBLAS_STATUS_INVALID_VALUE): any device address stands in until the call's own
            self.scale_ptrs[:] = scale_ptr_hint
            for i, attr in enumerate((L.MatmulDescAttribute.A_SCALE_POINTER, L.MatmulDescAttribute.B_SCALE_POINTER)):
                _call("cublasLtMatmulDescSetAttribute", L.matmul_desc_set_attribute, self.desc, attr,
                      self.scale_ptrs.ctypes.data + 8 * i, 8)

        def layout(dtype, rows, cols, ld, stride):
            lay = _call("cublasLtMatrixLayoutCreate", L.matrix_layout_create, dtype, rows, cols, ld)
            if batch > 1:
                count, offset = np.array(batch, np.int32), np.array(stride, np.int64)
                L.matrix_layout_set_attribute(lay, L.MatrixLayoutAttribute.BATCH_COUNT, count.ctypes.data, 4)
                L.matrix_layout_set_attribute(lay, L.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, offset.ctypes.data, 8)
            self.handles.append(lay)
            return lay

        in_a, in_b = in_type if isinstance(in_type, tuple) else (in_type, in_type)
        if not swap:
            self.a = layout(in_a, k, n, k, stride_w)  # the weight, [N, K] row-major
            self.b = layout(in_b, k, m, k, stride_x)  # the input, [M, K] row-major
            self.c = layout(out_type, n, m, n, stride_out)  # the output, [M, N] row-major
        else:  # A = the input, B = the weight, D = [M, N] in row order (a layout attribute)
            self.a = layout(in_a, k, m, k, stride_x)
            self.b = layout(in_b, k, n, k, stride_w)
            self.c = layout(out_type, m, n, n, stride_out)
            order = np.array(1, np.int32)  # CUBLASLT_ORDER_ROW
            _call("cublasLtMatrixLayoutSetAttribute", L.matrix_layout_set_attribute, self.c,
                  L.MatrixLayoutAttribute.ORDER, order.ctypes.data, 4)
        pref = _call("cublasLtMatmulPreferenceCreate", L.matmul_preference_create)
        ws = np.array(workspace_bytes, np.uint64)
        L.matmul_preference_set_attribute(pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, ws.ctypes.data, 8)
        self.results = np.zeros(candidates, L.matmul_heuristic_result_dtype)
        count = np.zeros(1, np.int32)
        _call(
            "cublasLtMatmulAlgoGetHeuristic", L.matmul_algo_get_heuristic,
            handle, self.desc, self.a, self.b, self.c, self.c, pref, candidates, self.results.ctypes.data, count.ctypes.data,
        )
        L.matmul_preference_destroy(pref)
        if count[0] < 1:
            raise CublasError(f"cuBLASLt found no algorithm for M={m} N={n} K={k} batch={batch}")
        self.results = self.results[: int(count[0])]
        self.choose(0)

    tuned = False  # gemm_fp8_block_scaled: candidates timed (or not to be)

    def choose(self, index: int) -> None:
        self.chosen = index
        # The algo struct is the first field of a heuristic result, so its address is the result's address.
        self.algo_ptr = self.results.ctypes.data + index * self.results.dtype.itemsize


def _autotune_default() -> bool:
    return settings.GEMM_AUTOTUNE.get()


class Cublas:
    """One cuBLASLt handle for xserv's stream, with its workspace.

    With autotuning on (default; XSERV_GEMM_AUTOTUNE=0 turns it off), the first call of a shape outside CUDA-graph
    capture times cuBLASLt's top heuristic candidates on the call's own buffers and keeps the fastest, as
    PyTorch's TunableOp does; the heuristic's first choice is often not the fastest for skinny decode GEMMs.
    """

    TUNE_CANDIDATES = 16
    # Only skinny GEMMs are tuned: there the heuristic's choice is often slow, and their M values are few (the
    # decode batch buckets). Prefill GEMMs take the heuristic's choice, so a new prompt length costs no tuning.
    TUNE_MAX_M = 128

    def __init__(self, device, allocator, autotune: bool | None = None):
        L = _lt()
        self.device = device
        self.handle = _call("cublasLtCreate", L.create)
        self._allocator = allocator
        self.workspace = allocator.allocate(WORKSPACE_BYTES)
        self._plans: dict[tuple, _Plan] = {}
        self._alpha = np.array(1.0, np.float32)
        self._beta = np.array(0.0, np.float32)
        self._beta_one = np.array(1.0, np.float32)
        self.autotune = _autotune_default() if autotune is None else autotune
        self.fp8_refusals: dict[tuple, str] = {}

    def version(self) -> int:
        return _lt().get_version()

    def fp8_block_scaled_plan(self, m, n, k, out_dtype) -> _Plan | None:
        """The plan of an FP8 block-scaled GEMM of this shape (built on first use: the heuristic's candidates), or
        None where cuBLASLt refuses it (no algorithm: an older cuBLASLt, a GPU without FP8 block scaling, a shape
        it does not take). A refusal is remembered, with its reason in `fp8_refusals`."""
        key = ("fp8_block", m, n, k, out_dtype)
        if key in self._plans:
            return self._plans[key]
        L = _lt()
        blk, vec = int(L.MatmulMatrixScale.BLK128x128_32F), int(L.MatmulMatrixScale.VEC128_32F)
        plan, errors = None, []
        # Two formulations of the same product: A = the weight (128 x 128 blocks), B = x (1 x 128 groups), D column
        # order (= [M, N] row-major); or A = x, B = the weight, D in row order. The first cuBLASLt takes is kept.
        for modes, swap in (((blk, vec), False), ((vec, blk), True)):
            try:
                plan = _Plan(self.handle, m, n, k, 1, (_CUDA_R_8F_E4M3, _CUDA_R_8F_E4M3), _cuda_type(out_dtype),
                             0, 0, 0, WORKSPACE_BYTES, self.TUNE_CANDIDATES if self.autotune else 1,
                             scale_modes=modes, swap=swap, scale_ptr_hint=self.workspace.ptr)
                break
            except CublasError as exc:
                errors.append(f"{'x @ W' if swap else 'W @ x'}: {exc}")
        if plan is None:
            self.fp8_refusals[key] = f"cuBLASLt {self.version()}: " + "; ".join(errors)
        self._plans[key] = plan
        return plan

    def gemm_fp8_block_scaled(self, x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, m, n, k, out_dtype) -> None:
        """out[M, N] = (x[M, K] * x_scale) @ (w[N, K] * w_scale)^T on raw device pointers: x and w e4m3; x_scale
        float32 [ceil(K / 128), M] (x_scale[g * M + m] for row m, columns 128g..128g+127); w_scale float32
        [ceil(N / 128), ld] with ld = round_up(ceil(K / 128), 4) (a 16-byte-aligned row per 128 weight rows); every
        pointer 16-byte aligned. Raises CublasError where fp8_block_scaled_plan is None."""
        plan = self.fp8_block_scaled_plan(m, n, k, out_dtype)
        if plan is None:
            raise CublasError(f"cuBLASLt has no FP8 block-scaled algorithm for M={m} N={n} K={k}: "
                              f"{self.fp8_refusals[('fp8_block', m, n, k, out_dtype)]}")

        def run():
            L = _lt()
            a, b = (x_ptr, w_ptr) if plan.swap else (w_ptr, x_ptr)
            plan.scale_ptrs[:] = (x_scale_ptr, w_scale_ptr) if plan.swap else (w_scale_ptr, x_scale_ptr)
            for i, attr in enumerate((L.MatmulDescAttribute.A_SCALE_POINTER, L.MatmulDescAttribute.B_SCALE_POINTER)):
                _call("cublasLtMatmulDescSetAttribute", L.matmul_desc_set_attribute, plan.desc, attr,
                      plan.scale_ptrs.ctypes.data + 8 * i, 8)
            self._matmul(plan, b, a, out_ptr, False)  # _matmul(plan, B, A, D): its A is the weight slot

        if plan.tuned:
            run()
            return
        plan.tuned = True
        try:  # the first call of a shape: some cuBLASLt versions offer candidates that then fail at run time
            if len(plan.results) > 1 and m <= self.TUNE_MAX_M and not self._capturing():
                self._tune(plan, run)
            run()
        except CublasError as exc:
            key = ("fp8_block", m, n, k, out_dtype)
            self._plans[key], self.fp8_refusals[key] = None, f"its algorithm failed: {exc}"
            raise

    def gemm(self, x_ptr, w_ptr, out_ptr, m, n, k, in_dtype, out_dtype, batch=1,
             stride_x=0, stride_w=0, stride_out=0, accumulate=False) -> None:
        """out[b, M, N] (+)= x[b, M, K] @ w[b, N, K]^T on raw device pointers."""
        key = (m, n, k, batch, in_dtype, out_dtype, stride_x, stride_w, stride_out)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(
                self.handle, m, n, k, batch, _cuda_type(in_dtype), _cuda_type(out_dtype),
                stride_x, stride_w, stride_out, WORKSPACE_BYTES, self.TUNE_CANDIDATES if self.autotune else 1,
            )
            # Timing overwrites `out`, so an accumulating call keeps the heuristic's choice.
            if len(plan.results) > 1 and m <= self.TUNE_MAX_M and not accumulate and not self._capturing():
                self._tune(plan, lambda: self._matmul(plan, x_ptr, w_ptr, out_ptr, False))
        self._matmul(plan, x_ptr, w_ptr, out_ptr, accumulate)

    def _matmul(self, plan: _Plan, x_ptr, w_ptr, out_ptr, accumulate: bool) -> None:
        L = _lt()
        beta = self._beta_one if accumulate else self._beta
        _call(
            "cublasLtMatmul", L.matmul,
            self.handle, plan.desc, self._alpha.ctypes.data, w_ptr, plan.a, x_ptr, plan.b, beta.ctypes.data,
            out_ptr, plan.c, out_ptr, plan.c, plan.algo_ptr, self.workspace.ptr, WORKSPACE_BYTES,
            self.device.stream_handle,
        )

    def _capturing(self) -> bool:
        status = check_driver(driver.cuStreamIsCapturing(self.device.stream_handle), "cuStreamIsCapturing")
        return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def _tune(self, plan: _Plan, run, reps: int = 5) -> None:
        """Time each of the plan's candidates (run(): one matmul with the plan's current choice) and keep the
        fastest."""
        timer = EventTimer()
        # In a model the weights stream from HBM, not L2: each timed run starts after overwriting a buffer twice
        # the size of L2. (Tuned on a warm L2, a skinny GEMM picks algorithms that lose once the weight is cold.)
        flush_bytes = 2 * self.device.info.l2_cache_bytes
        flush = self._allocator.allocate(flush_bytes)

        def cold_run():
            check_driver(driver.cuMemsetD8Async(flush.ptr, 0, flush_bytes, self.device.stream_handle), "cuMemsetD8Async")
            return timer.time_ms(run)

        best, best_ms = 0, float("inf")
        for i in range(len(plan.results)):
            plan.choose(i)
            try:
                run()  # warm-up; some candidates fail at run time
                ms = sorted(cold_run() for _ in range(reps))[reps // 2]
            except CublasError:
                continue
            if ms < best_ms:
                best, best_ms = i, ms
        plan.choose(best)
