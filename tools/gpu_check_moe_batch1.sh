#!/usr/bin/env bash
# One call (or one per step): the batch-1 MoE decode work of branch pending/moe-batch1 on the lent GPU.
#   tests      the decode attention GPU tests (the _lean entries of the query-head subgroup kernels: 32/4, 48/8, 40/8)
#              and the MoE model GPU tests, natively and forced onto the portable path (XSERV_ARCH=sm_80), side by side
#   attention  tools/bench_attention, decode at batch 1 with 4 and 8 kv heads, 512 and 4,096 keys, against PyTorch SDPA
#              (graph replays), and the fused op's plan sweep at the 30B-A3B's 32/4 heads (tools/sweep_decode_plan)
#   moe        MOE_LAYERS=12 bash tools/gpu_bench_moe.sh ceilings make latency (30B-A3B-shaped, 12 layers, batch 1 at
#              context 512 against its roofline)
#   dense      the dense 8B batch-1 `xserv bench latency` (context 512), to show nothing regressed
#   [STEPS="tests attention moe dense"] bash tools/gpu_check_moe_batch1.sh        (logs under $OUT)
set -u
source "$(dirname "$0")/gpu_env.sh"
STEPS=" ${STEPS:-tests attention moe dense} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
TESTS=${TESTS:-"tests/ops/test_attention.py tests/test_moe_parity_gpu.py tests/test_shape_pieces_gpu.py"}
one_path() {
  local path=$1
  if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
  export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS -k "${TEST_FILTER:-decode or moe or piece}" \
    > $OUT/tests-$path.log 2>&1
  echo "rc=$?" >> $OUT/tests-$path.log
}
if want tests; then
  for path in native sm_80; do one_path $path & done
  wait
  for path in native sm_80; do
    echo "=== tests, $path path"; grep -E "^(FAILED|ERROR|E  )" $OUT/tests-$path.log | cut -c1-300 | head -12
    tail -2 $OUT/tests-$path.log
  done
fi
unset XSERV_ARCH
export XSERV_CACHE_DIR=/tmp/xserv-cache-native
if want attention; then
  echo "=== bench_attention, batch-1 decode at 4 and 8 kv heads"
  timeout 150 python3 -m tools.bench_attention --decode-only --quick --decode-variants v4,v4w4 \
    --decode-only-labels "1x512 32/4,1x4096 32/4,1x512 32/8,1x4096 32/8" 2>&1 | tee $OUT/bench_attention.log | tail -20
  echo "=== sweep_decode_plan, 32/4 (the fused op's plan and forced split counts)"
  timeout 150 python3 -m tools.sweep_decode_plan --only "32/4" --sweep "32/4" --quick 2>&1 \
    | tee $OUT/sweep_32_4.log | tail -30
fi
if want moe; then
  MOE_LAYERS=${MOE_LAYERS:-12} MOE_DEADLINE=${MOE_DEADLINE:-400} bash tools/gpu_bench_moe.sh ceilings make latency 2>&1 \
    | tee $OUT/moe.log | tail -25
fi
if want dense; then
  [ -d /tmp/model-8b ] || timeout 200 python3 -m tools.make_test_model --preset 8b --out /tmp/model-8b --no-progress \
    >/dev/null
  echo "=== dense 8B, batch 1, context 512"
  timeout 200 python3 -m xserv bench latency --model /tmp/model-8b --input-len 512 --output-len 128 --iters 5 \
    --roofline 2>&1 | tail -3
fi
