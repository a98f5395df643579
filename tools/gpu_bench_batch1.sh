#!/usr/bin/env bash
# Batch-1 benchmarks on the lent GPU, one call: device ceilings, the GEMV table at M = 1, decode at batch 1 and 64
# (fused one-token path vs the unfused ops as the peer), long context, and time to first token of a 16-token prompt.
#   bash tools/gpu_bench_batch1.sh [0.6b] [8b]        (HF=1 also runs the transformers static-cache + compile peer)
set -u
cd "$(dirname "$0")/.."
bash tools/gpu_session.sh env >/dev/null
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache PYTHONPATH=/tmp/site:$PWD
presets=("${@:-0.6b}")
for p in "${presets[@]}"; do [ -d /tmp/model-$p ] || python3 -m tools.make_test_model --preset $p --out /tmp/model-$p --no-progress >/dev/null & done; wait
if [ -n "${HF:-}" ]; then
  for p in "${presets[@]}"; do echo "=== $p transformers"; python3 -m tools.bench_hf_decode --model /tmp/model-$p --batch-sizes ${HF_BATCH:-1,64} --steps 32 2>&1 | grep -v Warning | tail -3; done
  exit 0
fi
echo "=== ceilings"; python3 -m tools.kernel_harness ceilings 2>&1 | tail -3
echo "=== gemv at M = 1"; python3 -m tools.bench_gemv --m 1 --models "$(IFS=,; echo "${presets[*]}")" --skip-torch 2>&1 | tail -12
for p in "${presets[@]}"; do
  m=/tmp/model-$p
  echo "=== $p decode, fused one-token path (batch 1) / unfused (batch 64)"; python3 -m tools.bench_decode --model $m --batch-sizes 1,64 2>&1 | tail -3
  echo "=== $p decode, unfused ops (the previous path)"; python3 -m tools.bench_decode --model $m --batch-sizes 1 --unfused 2>&1 | tail -1
  echo "=== $p decode at 32,000 tokens of context"; python3 -m tools.bench_decode --model $m --batch-sizes 1 --context 32000 --steps 64 2>&1 | tail -1
  echo "=== $p ttft 16"; python3 -m xserv bench latency --model $m --input-len 16 --output-len 8 --iters 20 2>&1 | tail -1
done
