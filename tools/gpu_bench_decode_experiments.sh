#!/usr/bin/env bash
# Decode-attention experiments on the lent GPU: the shipped and the development kernels' GPU tests, then the model
# end to end with each decode path, alternating in one process (bench_decode --decode-kernels --attention --rounds),
# greedy tokens compared across paths, one-step timelines (0.6B), and the plain kernel's split sweep at one long
# sequence. About 7 minutes for 0.6b alone on an H200; a device call is at most 10, so run the 8B in a second call:
#   bash tools/gpu_bench_decode_experiments.sh 0.6b
#   SKIP_TESTS=1 SKIP_SWEEP=1 bash tools/gpu_bench_decode_experiments.sh 8b
#   v4c: the split combine through a thread-block cluster; folded: the qkv projection folded in too (0.6B shape);
#   v4s3 / v4s4: 3 and 4 ring stages (for the 32k context)
set -u
cd "$(dirname "$0")/.."
bash tools/gpu_session.sh env >/dev/null
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache PYTHONPATH=/tmp/site:$PWD
presets=("${@:-0.6b}")
for p in "${presets[@]}"; do [ -d /tmp/model-$p ] || python3 -m tools.make_test_model --preset $p --out /tmp/model-$p --no-progress >/dev/null & done
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "=== shipped decode, runtime and model GPU tests (the production v4 cubin changed with the shared helpers)"
  timeout 300 python3 -m pytest -q -m gpu tests/ops/test_attention.py tests/test_runtime.py tests/test_model.py 2>&1 | tail -3
  echo "=== dev decode tests (v4c, folded qkv, v4s3, v4s4)"
  XSERV_DEV_TESTS=1 timeout 300 python3 -m pytest -q -m gpu tests/ops/test_attention.py -k "v4c or folded or v4_experiments" 2>&1 | tail -6
fi
wait
echo "=== ceilings"; python3 -m tools.kernel_harness ceilings 2>&1 | tail -3
for p in "${presets[@]}"; do
  m=/tmp/model-$p
  echo "=== $p context 512: fused v4 / fused v4c / folded (0.6B shape only; elsewhere the two ops), greedy tokens compared"
  timeout 300 python3 -m tools.bench_decode --model $m --batch-sizes 1 --decode-kernels v4c,v4 --attention fused,folded \
    --rounds 2 --tokens 64 2>&1 | tail -12
  echo "=== $p context 32,000: v4 / v4s3 / v4s4"
  timeout 240 python3 -m tools.bench_decode --model $m --batch-sizes 1 --context 32000 --steps 64 \
    --decode-kernels v4,v4s3,v4s4 2>&1 | tail -4
done
if [ -d /tmp/model-0.6b ]; then
  for opts in "" "--decode-kernel v4c" "--fold-qkv"; do
    echo "=== 0.6b one-step timeline (context 512) $opts"
    timeout 120 python3 -m tools.profile_engine --model /tmp/model-0.6b --single-context 512 --warm 32 --steps 20 \
      --timeline 12 $opts 2>&1 | tail -15
  done
fi
if [ -z "${SKIP_SWEEP:-}" ]; then
  echo "=== plain decode at one long sequence: stages x splits"
  timeout 240 python3 -m tools.sweep_decode_plan --only "1x32768 32/8" --variants v4,v4s3,v4s4 --no-rope --quick 2>&1 \
    | grep -v "^$"
fi
