#!/usr/bin/env bash
# `xserv bench serve` (256 streaming HTTP clients, the standard workload) against `xserv serve`, and `xserv bench
# throughput` on the same workload and model in the same call: the serving/offline ratio.
#   bash tools/gpu_bench_serve.sh [MODEL_DIR] [extra bench args, e.g. --temperature 0]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/xserv-out}; mkdir -p "$OUT"
bash tools/gpu_session.sh env >/dev/null
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache PYTHONPATH=/tmp/site:$PWD
m=${1:-/tmp/model-0.6b}; shift || true
[ -d $m ] || python3 -m tools.make_test_model --preset 0.6b --out $m --no-progress
echo "=== offline"; python3 -m xserv bench throughput --model $m "$@" --json $OUT/offline.json 2>&1 | grep -v "it/s\|tok/s]" | tail -4
python3 -m xserv serve --model $m --port 8011 --max-model-len 2048 --log-level warning > $OUT/serve.log 2>&1 &
sp=$!
python3 - <<'PY'
import time, httpx
for _ in range(300):
    try:
        if httpx.get("http://127.0.0.1:8011/health").status_code == 200:
            break
    except Exception:
        pass
    time.sleep(1)
PY
echo "=== serve"; python3 -m xserv bench serve --url http://127.0.0.1:8011 "$@" --json $OUT/serve.json 2>&1 | tail -12
kill -TERM $sp; wait $sp; echo "server exit status $?"
python3 - "$OUT" <<'PY'
import json, sys
o = json.load(open(f"{sys.argv[1]}/offline.json")); s = json.load(open(f"{sys.argv[1]}/serve.json"))
print(f"serve / offline output tok/s: {s['output_tokens_per_s']:,.0f} / {o['output_tokens_per_s']:,.0f} = "
      f"{s['output_tokens_per_s'] / o['output_tokens_per_s']:.0%}")
PY
