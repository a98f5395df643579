#!/usr/bin/env bash
# One call: the fused one-token FP8 GEMVs (docs/kernels/fp8.md, "v4") on the lent GPU. Their GPU tests, the FP8 GEMV's
# and the FP8 model's (fused against unfused and against the NumPy model) on the native path and forced onto the
# portable paths (XSERV_ARCH=sm_80: the soft e4m3 conversion; sm_89: the 99 KB plans) side by side, each with its own
# kernel cache; then, unless BENCH=0, the graph-timed harness benches (`bench gemv_fp8 --graph`: the plain FP8 GEMV at
# 1 and 8 rows, then the fused entries at the Qwen3-8B projections; the bf16 fused ops at the same shapes beside
# them: rmsnorm_linear and rmsnorm_linear_silu_mul, the plain bf16 GEMV at o / down) and the 8B batch-1 figure, FP8 against bf16 in the same call (tools/gpu_bench_fp8.sh ceilings make latency).
# Logs under $OUT.
#   [BENCH=0] [PATHS="native sm_80 sm_89"] bash tools/gpu_check_fp8_fused.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
TESTS=${TESTS:-"tests/ops/test_gemv_fp8_fused.py tests/ops/test_gemv_fp8.py tests/ops/test_gemv.py
  tests/test_fp8_checkpoint.py"}
run_test_paths "$TESTS" ${TEST_TIMEOUT:-300} ${PATHS:-native sm_80 sm_89}
[ "${BENCH:-1}" = 0 ] && exit 0
bench() { echo "=== bench $*"; timeout ${BENCH_TIMEOUT:-120} python3 -m tools.kernel_harness bench "$@" --graph 2>&1 \
  | grep -v "^timing" | tee -a $OUT/bench.log; }
bench gemv_fp8
bench rmsnorm_linear --shapes 1x6144x4096
bench rmsnorm_linear_silu_mul --shapes 1x24576x4096
bench gemv --shapes 1x4096x4096,1x4096x12288
bash tools/gpu_bench_fp8.sh ceilings make latency
