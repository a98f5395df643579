#!/usr/bin/env bash
# The portable kernel path (XSERV_ARCH=sm_80: the code an A100 runs, assembled for this GPU) against the native one
# on the same machine, one call (issue 28): the standard offline workload and batch-1 decode per model preset, then
# prefill attention (portable v3, Hopper v5) against PyTorch SDPA's flash and cuDNN kernels.
#   [PATHS="native sm_80 sm_89"] [PREFILL=0] bash tools/gpu_bench_paths.sh [0.6b] [8b]
# (sm_89: the 99 KB-shared-memory GPUs' plans, XSERV_ARCH narrowing the H100's limits; default PATHS "native sm_80")
set -u
source "$(dirname "$0")/gpu_env.sh"
python3 -m tools.kernel_harness ceilings 2>&1 | tail -3
for preset in "${@:-0.6b}"; do
  m=/tmp/model-$preset
  [ -d $m ] || python3 -m tools.make_test_model --preset $preset --out $m --no-progress >/dev/null
  for path in ${PATHS:-native sm_80}; do
    if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
    echo "=== $preset, $path path: offline workload (greedy)"
    python3 -m xserv bench throughput --model $m --temperature 0 --json $OUT/tp-$preset-$path.json 2>&1 \
      | grep -v "it/s\|tok/s]" | tail -3
    echo "=== $preset, $path path: batch-1 decode at context 512"
    python3 -m xserv bench latency --model $m --input-len 512 --output-len 256 --json $OUT/lat-$preset-$path.json \
      2>&1 | tail -1
  done
  unset XSERV_ARCH
done
[ "${PREFILL:-1}" = 0 ] && exit 0
echo "=== prefill attention: portable v3 and Hopper v5 against SDPA (native build)"
python3 -m tools.bench_attention --prefill v3,v5 --prefill-only --quick 2>&1 | tail -14
