#!/usr/bin/env bash
# Branch pending/moe-fp8-dequantized (a MoE -FP8 checkpoint loads dequantized whole by default; XSERV_FP8_EXPERTS=e4m3
# keeps it FP8): the FP8 checkpoint tests and the FP8 parity test (its MoE checkpoint now loads with e4m3), natively
# and with sm_80; then the 30B-A3B-shaped 12-layer FP8 checkpoint by default against its bf16 twin at batch 1 (expected:
# equal, ~1,063 tok/s on an H100) and the load notice. One call, ~8 min.
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${DEQ_DEADLINE:-575}
source "$(dirname "$0")/gpu_step.sh"
(for pair in moe30-l12-fp8:--fp8 moe30-l12:""; do m=${pair%%:*}; [ -f /dev/shm/$m/config.json ] || python3 -m xserv \
  make-test-model --preset 30b-a3b --layers 12 ${pair#*:} --out /dev/shm/$m --workers 8 --no-progress; done \
  > $OUT/make.log 2>&1) &
# with them the MoE suite (the op, the model, the transformers parity: prefill runs the wgmma tiles natively)
PYTEST_ADDOPTS="-k moe" run_test_paths "tests/ops/test_moe.py tests/test_moe_model.py tests/test_moe_parity_gpu.py \
  tests/test_fp8_checkpoint.py tests/test_fp8_tp_parity_gpu.py" 400 native sm_80
wait
for round in 1 2; do for m in moe30-l12-fp8 moe30-l12; do
  step "lat-$m-$round" 60 1 python3 -m xserv bench latency --model /dev/shm/$m --input-len 512 --output-len 128 \
    --iters 5 --gpu-memory-fraction 0.5
done; done
grep -a "mixture-of-experts" $OUT/lat-moe30-l12-fp8-1.log | cut -c1-400
