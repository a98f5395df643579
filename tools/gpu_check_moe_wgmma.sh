#!/usr/bin/env bash
# The hopper path's MoE grouped GEMMs on wgmma (cuda_src/moe_sm90.cu), each form of xserv.ops.moe.MOE_WGMMA: 2 the
# weights by TMA (the default), 1 by cp.async, 0 off (moe.cu's mma.sync tiles). One call, ~8 min: the moe op's GPU
# tests natively and with XSERV_ARCH=sm_80; each form's launches at 2,048 and 8,192 tokens with the mid and the large
# token tile, one process (tools/bench_moe.py); the 30B-A3B-shaped 48-layer model loaded once, each form's time to
# first token of 2,048-token prompts, alternating (tools/ab_latency.py); the offline workload with the default form
# and with 0 if time is left.
#   bash tools/gpu_check_moe_wgmma.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${WGMMA_DEADLINE:-575}
FORMS=${WGMMA_FORMS:-2,1,0}
source "$(dirname "$0")/gpu_step.sh"
M=/dev/shm/moe30
([ -f $M/config.json ] || python3 -m xserv make-test-model --preset 30b-a3b --out $M --workers 12 --no-progress) \
  > $OUT/make.log 2>&1 &
run_test_paths "tests/ops/test_moe.py" 240 native sm_80
step ops 150 40 python3 -m tools.bench_moe --tokens 2048,8192 --size mid,large --wgmma $FORMS --iters 10
wait
tail -2 $OUT/make.log
step ttft48 150 8 python3 -m tools.ab_latency --model $M --setting xserv.ops.moe.MOE_WGMMA=$FORMS --input-len 2048 \
  --output-len 2 --rounds 3 --iters 2
for on in 2 0; do
  step "tp48-wg$on" 120 3 python3 -m tools.with_setting xserv.ops.moe.MOE_WGMMA=$on -- xserv bench throughput \
    --model $M --gpu-memory-fraction 0.85
done
