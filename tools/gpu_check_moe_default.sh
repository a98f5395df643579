#!/usr/bin/env bash
# The MoE model's GPU tests (against the NumPy backend, and the transformers parity) natively with the default wgmma
# form, and the 48-layer 30B-A3B-shaped TTFT against its FLOP limit. One call, ~2 min.
#   bash tools/gpu_check_moe_default.sh
set -u
source tools/gpu_env.sh
START=0; DEADLINE=300; source tools/gpu_step.sh
M=/dev/shm/moe30
([ -f $M/config.json ] || python3 -m xserv make-test-model --preset 30b-a3b --out $M --workers 12 --no-progress) > $OUT/make.log 2>&1 &
step models 200 4 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_model.py tests/test_moe_parity_gpu.py
wait
step ttft 90 3 python3 -m xserv bench latency --model $M --input-len 2048 --output-len 2 --iters 10 --roofline --gpu-memory-fraction 0.5
