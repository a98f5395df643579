#!/usr/bin/env bash
# Branch pending/moe-wgmma (moe_sm90.cu: the hopper path's mid and large grouped GEMMs on wgmma), written without a
# GPU. One call, ~6 min: the moe op's GPU tests natively and with XSERV_ARCH=sm_80; the launches at 2,048 and 8,192
# tokens with the wgmma entries and the mma.sync ones (tools/bench_moe.py); 30B-A3B-shaped, 12 layers: time to first
# token of a 2,048-token prompt and the offline workload, wgmma on and off.
#   bash tools/gpu_check_moe_wgmma.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${WGMMA_DEADLINE:-560}
source "$(dirname "$0")/gpu_step.sh"
([ -f /dev/shm/moe30-l12/config.json ] || python3 -m xserv make-test-model --preset 30b-a3b --layers 12 \
  --out /dev/shm/moe30-l12 --workers 8 --no-progress) > $OUT/make.log 2>&1 &
run_test_paths "tests/ops/test_moe.py tests/test_moe_model.py" 240 native sm_80
wait
WG="python3 -m tools.with_setting xserv.ops.moe.MOE_WGMMA"
# MOE_WGMMA: 1 the plain wgmma entries, 2 the pipelined ones, 0 moe.cu's mma.sync tiles
for tokens in 2048 8192; do for on in 1 2 0; do
  step "ops-$tokens-wg$on" 50 9 $WG=$on -- tools.bench_moe --tokens $tokens
done; done
for on in 1 2 0; do
  step "ttft-wg$on" 50 1 $WG=$on -- xserv bench latency --model /dev/shm/moe30-l12 --input-len 2048 --output-len 2 \
    --iters 10 --gpu-memory-fraction 0.5
done
for on in 1 0; do
  step "tp-wg$on" 90 3 $WG=$on -- xserv bench throughput --model /dev/shm/moe30-l12 --gpu-memory-fraction 0.75
done
