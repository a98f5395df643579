#!/usr/bin/env bash
# FP8 MoE experts (XSERV_FP8_EXPERTS=e4m3; docs/kernels/moe.md "FP8 experts") on the lent GPU, one call (~4 min):
# their GPU tests natively and with XSERV_ARCH=sm_80 side by side (the op's FP8 entries bit for bit against the bf16
# entries on the dequantized experts, the model bit for bit against its dequantized twin); then 30B-A3B-shaped
# batch-1 decode at context 512 on 12 layers, the FP8 checkpoint with its experts FP8 and dequantized (bf16),
# alternating, two rounds, and a profile of each.
#   bash tools/gpu_check_moe_fp8.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${MOE_FP8_DEADLINE:-420}
source "$(dirname "$0")/gpu_step.sh"
([ -f /dev/shm/moe30-l12-fp8/config.json ] || python3 -m xserv make-test-model --preset 30b-a3b --layers 12 --fp8 \
  --out /dev/shm/moe30-l12-fp8 --workers 8 --no-progress) > $OUT/make.log 2>&1 &
run_test_paths "tests/ops/test_moe.py tests/test_fp8_checkpoint.py -k fp8_experts" 200 native sm_80
wait
for round in 1 2; do for experts in e4m3 bf16; do
  export XSERV_FP8_EXPERTS=$experts
  step "lat-$experts-$round" 60 1 python3 -m xserv bench latency \
    --model /dev/shm/moe30-l12-fp8 --input-len 512 --output-len 128 --iters 5 --gpu-memory-fraction 0.5
done; done
for experts in e4m3 bf16; do
  export XSERV_FP8_EXPERTS=$experts
  step "profile-$experts" 60 9 python3 -m tools.profile_engine \
    --model /dev/shm/moe30-l12-fp8 --single-context 512 --warm 16 --steps 10 --top 7
done
