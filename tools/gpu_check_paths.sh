#!/usr/bin/env bash
# One call: the kernels whose selection depends on the arch (attention prefill / decode, GEMV, MoE, the dev FP8 GEMV)
# and the model tests, on the native path and forced onto the portable paths of the 163 KB (XSERV_ARCH=sm_80) and
# the 99 KB (XSERV_ARCH=sm_89: RTX 4090 / L40S limits, also the RTX 5090's) GPUs; then the 99 KB path's prefill
# against SDPA and the FP8 GEMV's bandwidth. Logs under $OUT.
#   [BENCH=1] bash tools/gpu_check_paths.sh [native sm_80 sm_89]
set -u
source "$(dirname "$0")/gpu_env.sh"
TESTS=${TESTS:-"tests/ops/test_attention.py tests/ops/test_gemv.py tests/ops/test_moe.py
  tests/test_parallel_load.py tests/test_model.py tests/test_arch_gpu.py tests/test_moe_model.py
  tests/test_fp8_checkpoint.py"}
# the paths run side by side (one GPU is plenty for correctness tests; compiling is what takes the time), each
# with its own kernel cache
one_path() {
  local path=$1
  if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
  export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
  timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS > $OUT/tests-$path.log 2>&1
  echo "rc=$?" >> $OUT/tests-$path.log
  XSERV_DEV_TESTS=1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_gemv_fp8.py \
    > $OUT/fp8-$path.log 2>&1
  echo "rc=$?" >> $OUT/fp8-$path.log
}
PATHS=${*:-native sm_80 sm_89}
for path in $PATHS; do one_path $path & done
wait
for path in $PATHS; do
  for log in tests fp8; do
    echo "=== $log, $path path"; grep -E "^(FAILED|ERROR)" $OUT/$log-$path.log | head -20; tail -2 $OUT/$log-$path.log
  done
done
unset XSERV_ARCH
[ -n "${BENCH:-}" ] || exit 0
echo "=== prefill attention (native build): shipped v3, the 99 KB arches' v3_m2w8_b3_k32, v5, against SDPA"
timeout 150 python3 -m tools.bench_attention --prefill v3,v3_m2w8_b3_k32,v5 --prefill-only --quick 2>&1 | tail -16
echo "=== FP8 weight-only GEMV (dev), graph-timed, hardware and soft e4m3 conversion"
python3 -m tools.kernel_harness ceilings 2>&1 | tail -3
timeout 60 python3 -m tools.kernel_harness bench gemv_fp8 --graph 2>&1 | tail -8
timeout 60 python3 -m tools.kernel_harness bench gemv_fp8 --graph --variant soft 2>&1 | tail -8
