#!/usr/bin/env bash
# Does a MoE -FP8 checkpoint gain from its FP8 attention projections? 30B-A3B-shaped, 12 layers: the FP8 checkpoint
# as loaded by default (experts dequantized, attention projections FP8) against its bf16 twin (every projection bf16:
# what dequantizing the attention projections too would run), batch-1 decode at context 512 (two alternating rounds)
# and the standard offline workload; then the FP8 checkpoint with FP8 experts offline. One call, ~5 min.
#   [STEPS="lat tp tp-e4m3"] bash tools/gpu_check_moe_fp8_dense.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${DENSE_DEADLINE:-400}
source "$(dirname "$0")/gpu_step.sh"
for pair in moe30-l12-fp8:--fp8 moe30-l12:""; do m=${pair%%:*}; [ -f /dev/shm/$m/config.json ] || python3 -m xserv \
  make-test-model --preset 30b-a3b --layers 12 ${pair#*:} --out /dev/shm/$m --workers 8 --no-progress & done
wait
LAT="--input-len 512 --output-len 128 --iters 5 --gpu-memory-fraction 0.5"
STEPS=${STEPS:-"lat tp tp-e4m3"}
# the first FP8 load compiles the FP8 families: a warm-up run so that round 1 is not cut off
[[ $STEPS == *lat* ]] && step "warm-fp8" 120 1 python3 -m xserv bench latency --model /dev/shm/moe30-l12-fp8 $LAT
for round in 1 2; do for m in moe30-l12-fp8 moe30-l12; do
  [[ $STEPS == *lat* ]] && step "lat-$m-$round" 50 1 python3 -m xserv bench latency --model /dev/shm/$m $LAT
done; done
for m in moe30-l12-fp8 moe30-l12; do
  [[ " $STEPS " == *" tp "* ]] && step "tp-$m" 120 5 python3 -m xserv bench throughput --model /dev/shm/$m \
    --gpu-memory-fraction 0.75
done
[[ $STEPS == *tp-e4m3* ]] && XSERV_FP8_EXPERTS=e4m3 step "tp-fp8-experts" 90 5 python3 -m xserv bench throughput \
  --model /dev/shm/moe30-l12-fp8 --gpu-memory-fraction 0.75
