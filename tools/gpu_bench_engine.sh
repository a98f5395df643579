#!/usr/bin/env bash
# Engine benchmarks on the lent GPU, one call: the standard workload greedy and sampled, batch-1 latency, and the
# engine before this session (.old, a worktree at 3b00985, carried) as the peer on the same workload.
#   bash tools/gpu_bench_engine.sh [0.6b] [8b]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/xserv-out}; mkdir -p "$OUT"
bash tools/gpu_session.sh env >/dev/null
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache PYTHONPATH=/tmp/site:$PWD
for preset in "${@:-0.6b}"; do
  m=/tmp/model-$preset
  [ -d $m ] || python3 -m tools.make_test_model --preset $preset --out $m --no-progress
  echo "=== $preset ceilings"; python3 -m tools.kernel_harness ceilings 2>&1 | tail -4
  echo "=== $preset greedy"; python3 -m xserv bench throughput --model $m --temperature 0 --profile --json $OUT/tp-$preset-greedy.json 2>&1 | grep -v "it/s\|tok/s]" | tail -5
  echo "=== $preset sampled"; python3 -m xserv bench throughput --model $m --temperature 0.6 --top-p 0.95 --top-k 20 --json $OUT/tp-$preset-sampled.json 2>&1 | grep -v "it/s\|tok/s]" | tail -5
  echo "=== $preset latency"; python3 -m xserv bench latency --model $m --input-len 512 --output-len 256 --json $OUT/lat-$preset.json 2>&1 | tail -1
  echo "=== $preset ttft 16"; python3 -m xserv bench latency --model $m --input-len 16 --output-len 8 --iters 20 2>&1 | tail -1
  echo "=== $preset shared prefix"; python3 -m xserv bench latency --model $m --shared-prefix 2000 --input-len 64 --output-len 16 --iters 64 --json $OUT/prefix-$preset.json 2>&1 | tail -2
  OLD=${OLD:-.old}
  if [ -d "$OLD" ] && [ -z "${NO_PEER:-}" ]; then
    echo "=== $preset peer (engine at 3b00985)"
    (cd "$OLD" && XSERV_CACHE_DIR=/tmp/xserv-cache-old PYTHONPATH=/tmp/site:$PWD python3 peer_bench.py $m 0 $OUT/peer-$preset-greedy.json 2>&1 | tail -1)
  fi
done
