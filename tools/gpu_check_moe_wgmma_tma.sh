#!/usr/bin/env bash
# Branch pending/moe-wgmma-tma: the wgmma grouped GEMMs with their weight rows by TMA (the _tma entries of
# moe_sm90.cu, xserv.ops.moe.MOE_WGMMA=2) against the cp.async ring (1). One call, ~4 min: the wgmma GPU tests
# natively (the TMA entries give the cp.async entries' bits; the portable path has neither), and the prefill
# attention's (its KV-cache tensor maps come from the same encoder now); the launches at 2,048
# and 8,192 tokens, both forms in one process; the 48-layer 30B-A3B-shaped model's time to first token of 2,048-token
# prompts with each form, alternating (tools/ab_latency.py).
#   bash tools/gpu_check_moe_wgmma_tma.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${TMA_DEADLINE:-330}
source "$(dirname "$0")/gpu_step.sh"
M=/dev/shm/moe30
([ -f $M/config.json ] || python3 -m xserv make-test-model --preset 30b-a3b --out $M --workers 12 --no-progress) \
  > $OUT/make.log 2>&1 &
PYTEST_ADDOPTS="-k wgmma" run_test_paths "tests/ops/test_moe.py" 150 native
# runtime/tma.py's descriptors now come from one encoder: the prefill attention's KV-cache maps through it
step attention 90 3 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_attention.py -k "prefill_gpu and not dev"
step ops 60 8 python3 -m tools.bench_moe --tokens 2048,8192 --size large --wgmma 2,1 --iters 10
wait
tail -1 $OUT/make.log
step ttft48 100 6 python3 -m tools.ab_latency --model $M --setting xserv.ops.moe.MOE_WGMMA=2,1 --input-len 2048 \
  --output-len 2 --rounds 3 --iters 2
