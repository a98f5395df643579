"""cuBLASLt through nvmath-python's low-level bindings: `out = x @ w^T` with bf16 (or fp16/fp32) inputs and fp32
accumulation, strided-batched, algorithm chosen by cuBLASLt's heuristic once per shape and cached.

Weights are stored [out_features, in_features] as in the checkpoints. cuBLASLt is column-major, so a row-major
[M, N] output is the column-major N x M matrix  W(as K x N col-major, transposed) @ X(as K x M col-major).
All calls run on xserv's stream with a preallocated workspace, so they can be captured in a CUDA graph.
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
from cuda.bindings import driver

from .errors import CublasError, check_driver
from .timing import EventTimer

# cudaDataType_t and cublasComputeType_t values (ABI-stable enums of the CUDA headers).
_CUDA_TYPE = {np.dtype("float32"): 0, np.dtype("float16"): 2, np.dtype(ml_dtypes.bfloat16): 14}
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
                 candidates: int = 1):
        L = _lt()
        self.handles = []
        self.desc = _call("cublasLtMatmulDescCreate", L.matmul_desc_create, _COMPUTE_32F, 0)
        for attr, value in ((L.MatmulDescAttribute.TRANSA, _OP_T), (L.MatmulDescAttribute.TRANSB, _OP_N)):
            buf = np.array(value, np.int32)
            _call("cublasLtMatmulDescSetAttribute", L.matmul_desc_set_attribute, self.desc, attr, buf.ctypes.data, 4)

        def layout(dtype, rows, cols, ld, stride):
            lay = _call("cublasLtMatrixLayoutCreate", L.matrix_layout_create, dtype, rows, cols, ld)
            if batch > 1:
                count, offset = np.array(batch, np.int32), np.array(stride, np.int64)
                L.matrix_layout_set_attribute(lay, L.MatrixLayoutAttribute.BATCH_COUNT, count.ctypes.data, 4)
                L.matrix_layout_set_attribute(lay, L.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, offset.ctypes.data, 8)
            self.handles.append(lay)
            return lay

        self.a = layout(in_type, k, n, k, stride_w)  # the weight, [N, K] row-major
        self.b = layout(in_type, k, m, k, stride_x)  # the input, [M, K] row-major
        self.c = layout(out_type, n, m, n, stride_out)  # the output, [M, N] row-major
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

    def choose(self, index: int) -> None:
        self.chosen = index
        # The algo struct is the first field of a heuristic result, so its address is the result's address.
        self.algo_ptr = self.results.ctypes.data + index * self.results.dtype.itemsize


def _autotune_default() -> bool:
    return os.environ.get("XSERV_GEMM_AUTOTUNE", "1") != "0"


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

    def version(self) -> int:
        return _lt().get_version()

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
                self._tune(plan, x_ptr, w_ptr, out_ptr)
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

    def _tune(self, plan: _Plan, x_ptr, w_ptr, out_ptr, reps: int = 5) -> None:
        timer = EventTimer()
        # In a model the weights stream from HBM, not L2: each timed run starts after overwriting a buffer twice
        # the size of L2. (Tuned on a warm L2, a skinny GEMM picks algorithms that lose once the weight is cold.)
        flush_bytes = 2 * self.device.info.l2_cache_bytes
        flush = self._allocator.allocate(flush_bytes)

        def cold_run():
            check_driver(driver.cuMemsetD8Async(flush.ptr, 0, flush_bytes, self.device.stream_handle), "cuMemsetD8Async")
            return timer.time_ms(lambda: self._matmul(plan, x_ptr, w_ptr, out_ptr, False))

        best, best_ms = 0, float("inf")
        for i in range(len(plan.results)):
            plan.choose(i)
            try:
                self._matmul(plan, x_ptr, w_ptr, out_ptr, False)  # warm-up; some candidates fail at run time
                ms = sorted(cold_run() for _ in range(reps))[reps // 2]
            except CublasError:
                continue
            if ms < best_ms:
                best, best_ms = i, ms
        plan.choose(best)
