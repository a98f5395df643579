#!/usr/bin/env bash
# Issue 31's offline goal on the lent GPU, one call (~6 min): the standard offline workload (`xserv bench
# throughput`, 256 requests) on an 8B-shaped bf16 checkpoint and its FP8 twin (same seed), each with the bf16 and
# the FP8 (e4m3) KV cache, every run against its own limit (the weights and K/V a step reads at the copy bandwidth
# measured in the run, prefill FLOPs at the measured GEMM rate); first the engine's GPU tests. A summary ends it.
#   bash tools/gpu_bench_fp8_offline.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${FP8_OFFLINE_DEADLINE:-570}
source "$(dirname "$0")/gpu_step.sh"
(for pair in q-8b:"" q-8b-fp8:--fp8; do m=${pair%%:*}; [ -f /dev/shm/$m/config.json ] || python3 -m xserv \
  make-test-model --preset 8b ${pair#*:} --out /dev/shm/$m --workers 8 --no-progress; done > $OUT/make.log 2>&1) &
step tests 200 3 python3 -m pytest -q -m gpu tests/test_engine.py -p no:cacheprovider
wait
for m in q-8b q-8b-fp8; do
  for kv in bfloat16 fp8_e4m3; do
    step "tp-$m-$kv" 150 2 python3 -m xserv bench throughput --model /dev/shm/$m --kv-cache-dtype $kv \
      --gpu-memory-fraction 0.75 --json "$OUT/tp-$m-$kv.json"
  done
done
echo "=== summary (device above)"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {}
for m in ("q-8b", "q-8b-fp8"):
    for kv in ("bfloat16", "fp8_e4m3"):
        try:
            runs[m, kv] = json.load(open(f"{out}/tp-{m}-{kv}.json"))
        except (OSError, ValueError):
            print(f"{m} {kv}: no result")
base = runs.get(("q-8b", "bfloat16"), {}).get("output_tokens_per_s")
for (m, kv), r in runs.items():
    rate, lim = r.get("output_tokens_per_s"), (r.get("limit") or {}).get("limit_output_tokens_per_s")
    print(f"{m} weights, {kv} KV: {rate:,.0f} output tok/s" + (f", limit {lim:,.0f} ({rate / lim:.0%})" if lim else "")
          + (f", {rate / base:.3f}x bf16 / bf16 KV" if base else ""))
PY
