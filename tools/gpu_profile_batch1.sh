#!/usr/bin/env bash
# Where the batch-1 step's time goes on the two models whose batch-1 goals are open, one call (~6 min): the device's
# ceilings; an 8B-shaped FP8 checkpoint (issue 31) and a 12-layer 30B-A3B-shaped MoE checkpoint (issue 30) in
# /dev/shm; for each, `xserv bench latency` at context 512 against its roofline and a profile of one request at
# context 512 (tools/profile_engine.py: kernels by total time and a timeline of consecutive kernels of one step).
#   bash tools/gpu_profile_batch1.sh [fp8] [moe]      (default both; logs under $OUT)
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${PROFILE_DEADLINE:-560}
source "$(dirname "$0")/gpu_step.sh"
WHICH=" ${*:-fp8 moe} "
step ceilings 120 4 python3 -m tools.kernel_harness ceilings
declare -A MAKE=([fp8]="--preset 8b --fp8" [moe]="--preset 30b-a3b --layers 12")
declare -A DIR=([fp8]=/dev/shm/q-8b-fp8 [moe]=/dev/shm/moe30-l12)
declare -A LINES=([fp8]=${FP8_TIMELINE:-24} [moe]=${MOE_TIMELINE:-24})
for m in fp8 moe; do
  [[ "$WHICH" == *" $m "* ]] || continue
  d=${DIR[$m]}
  [ -f "$d/config.json" ] || step "make-$m" 240 2 python3 -m xserv make-test-model ${MAKE[$m]} --out "$d" \
    --workers 16 --no-progress
  step "latency-$m" 150 3 python3 -m xserv bench latency --model "$d" --input-len 512 --output-len 128 --iters 5 \
    --roofline --gpu-memory-fraction 0.5
  step "profile-$m" 150 $((LINES[$m] + 20)) python3 -m tools.profile_engine --model "$d" --single-context 512 \
    --warm 32 --steps 20 --top 16 --timeline "${LINES[$m]}"
done
