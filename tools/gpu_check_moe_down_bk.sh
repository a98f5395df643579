#!/usr/bin/env bash
# The one-token MoE down GEMM's rings (ops/moe.py DOWN_ONE_BK 64 / 128, the default, / 256; docs/kernels/moe.md "v6")
# compared on the lent GPU, one call (~6 min): the MoE op GPU tests natively and with XSERV_ARCH=sm_80 side by
# side; 30B-A3B-shaped batch-1 decode at context 512 (`xserv bench latency`, as issue 30 measures it) with each ring,
# alternating, on 12 layers (two rounds) and on the whole 48-layer model; a profile of the 12-layer step at 256.
#   bash tools/gpu_check_moe_down_bk.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${BK_DEADLINE:-570}
source "$(dirname "$0")/gpu_step.sh"
(for pair in moe30-l12:"--layers 12" moe30:""; do m=${pair%%:*}; [ -f /dev/shm/$m/config.json ] || python3 -m xserv \
  make-test-model --preset 30b-a3b ${pair#*:} --out /dev/shm/$m --workers 8 --no-progress; done > $OUT/make.log 2>&1) &
run_test_paths "tests/ops/test_moe.py tests/test_moe_model.py" 240 native sm_80
wait
BK="python3 -m tools.with_setting xserv.ops.moe.DOWN_ONE_BK"  # $BK=N -- MODULE ARGS...
lat() {  # NAME MODEL BK
  step "$1" 100 1 $BK=$3 -- xserv bench latency --model $2 --input-len 512 --output-len 128 --iters 5 \
    --gpu-memory-fraction 0.5
}
for round in 1 2; do for b in 64 128 256; do lat "l12-k$b-$round" /dev/shm/moe30-l12 $b; done; done
for b in 64 256 128; do lat "l48-k$b" /dev/shm/moe30 $b; done
step profile 100 24 $BK=256 -- tools.profile_engine --model /dev/shm/moe30-l12 --single-context 512 --warm 32 \
  --steps 20 --top 4 --timeline 16
