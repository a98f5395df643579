#!/usr/bin/env bash
# Batch-1 decode experiments on the lent GPU in one call (about 5 minutes on an H200; a call is at most 10): the
# GEMV and decode/model GPU tests, the ceilings, then the model end to end with and without the projections' L2
# prefetch (model.prefetch_projections; gemv_row_prefetch; docs/kernels/gemv.md "v8"), alternating in one
# process, greedy tokens compared, at a 512-token and a 32,000-token context, 0.6B and 8B, and one-step timelines.
#   bash tools/gpu_bench_decode_experiments.sh              # from the checkout, .whl/ beside it (README)
#   SKIP_TESTS=1 bash tools/gpu_bench_decode_experiments.sh 0.6b
# Run from a copy made with `git archive` (e.g. .clean/), the wheels are taken from the checkout above it.
set -u
cd "$(dirname "$0")/.."
[ -d .whl ] || { [ -d ../.whl ] && cp -r ../.whl .; }
bash tools/gpu_session.sh env >/dev/null
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache PYTHONPATH=/tmp/site:$PWD
python3 -c "import nvmath" 2>/dev/null || { echo "nvmath-python is missing: carry .whl (README)"; exit 1; }
presets=("$@"); [ ${#presets[@]} -gt 0 ] || presets=(0.6b 8b)
for p in "${presets[@]}"; do [ -d /tmp/model-$p ] || python3 -m tools.make_test_model --preset $p --out /tmp/model-$p --no-progress >/dev/null & done
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "=== gemv, decode attention and model GPU tests"
  timeout 240 python3 -m pytest -q -m gpu tests/ops/test_gemv.py tests/ops/test_attention.py tests/test_model.py 2>&1 | tail -3
fi
wait
echo "=== ceilings"; python3 -m tools.kernel_harness ceilings 2>&1 | tail -3
for p in "${presets[@]}"; do
  m=/tmp/model-$p
  sets=none,o,o+gate_up+down,qkv+o+gate_up+down
  echo "=== $p context 512: L2 prefetch sets $sets, greedy tokens compared (they must not change)"
  timeout 150 python3 -m tools.bench_decode --model $m --prefetch $sets --rounds 2 --tokens 32 2>&1 \
    | grep -v "loading\|^$" | tail -9
  echo "=== $p context 32,000: none / o / all, prefetch applied up to 65536 keys"
  timeout 150 python3 -m tools.bench_decode --model $m --context 32000 --steps 64 --prefetch none,o,qkv+o+gate_up+down \
    --prefetch-max-kv 65536 2>&1 | grep -v "loading\|^$" | tail -4
  for pf in none o; do
    echo "=== $p one-step timeline (context 512), L2 prefetch: $pf"
    timeout 100 python3 -m tools.profile_engine --model $m --single-context 512 --warm 32 --steps 20 --timeline 12 \
      --prefetch $pf 2>&1 | tail -14
  done
done
