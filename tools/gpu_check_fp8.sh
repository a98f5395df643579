#!/usr/bin/env bash
# One call: linear_fp8 (issue 31) on the lent GPU. Its GPU tests and the FP8 GEMV's on the native path and forced onto
# the portable paths (XSERV_ARCH=sm_80, sm_89: the dequantize + bf16 GEMM path) side by side; then, unless
# BENCH=0, the graph-timed benches: the device's ceilings, linear_fp8 at Qwen3-8B's projections for M = 16..2048
# by the device's rule, the bf16 cuBLAS peer and the dequant path at the same shapes, the FP8 GEMM at 8192^3, the
# quantize / dequantize kernels, and the crossover rows (M = 8, 16: GEMV vs cuBLASLt FP8). Logs under $OUT.
# First `python -m tools.probe_fp8_gemm`: the cuBLASLt version and which FP8 scale modes it takes on this GPU.
#   [BENCH=0|all] [PATHS="native sm_80 sm_89"] bash tools/gpu_check_fp8.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
TESTS=${TESTS:-"tests/ops/test_fp8_linear.py tests/ops/test_gemv_fp8.py"}
run_test_paths "$TESTS" ${TEST_TIMEOUT:-200} ${PATHS:-native sm_80 sm_89}
[ "${BENCH:-1}" = 0 ] && exit 0
bench() { echo "=== bench $*"; timeout ${BENCH_TIMEOUT:-100} python3 -m tools.kernel_harness bench "$@" --graph 2>&1 \
  | grep -v "^timing" | tee -a $OUT/bench.log; }
bench linear_fp8
bench linear_fp8 --variant bf16
bench linear_fp8 --shapes 8192x8192x8192
bench linear_fp8 --shapes 8192x8192x8192 --variant bf16
bench linear_fp8 --variant cublas_fp8 --shapes 8x6144x4096,8x24576x4096,8x4096x12288,16x6144x4096
[ "${BENCH:-1}" = all ] || exit 0
bench linear_fp8 --variant dequant
bench linear_fp8 --variant gemv --shapes 8x6144x4096,8x24576x4096,8x4096x12288
bench fp8_quantize
bench fp8_dequantize
