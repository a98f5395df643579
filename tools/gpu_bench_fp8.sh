#!/usr/bin/env bash
# FP8 weights (issue 31) on the lent GPU, one call: the device's ceilings; an 8B-shaped FP8 checkpoint and the bf16
# checkpoint of the same seed in /dev/shm (kept while the machine stays warm); the FP8 GPU tests; then for both
# checkpoints, batch-1 decode at context 512 against its roofline (the weight bytes the model holds: e4m3 + scales
# for the FP8 projections, bf16 lm_head / embeddings, + K/V, at the measured copy bandwidth), the time to first token
# of a 2,048-token prompt against its FLOP limit, and the standard offline workload. A summary ends the output.
#
#   bash tools/gpu_bench_fp8.sh [STEP ...]     steps: ceilings make tests latency ttft throughput (default all)
# Env: FP8_PRESET (8b), FP8_DEADLINE (560 s), FP8_TESTS (the pytest files of the tests step).
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${FP8_DEADLINE:-560}
source "$(dirname "$0")/gpu_step.sh"
PRESET=${FP8_PRESET:-8b}
BF16=/dev/shm/q-$PRESET FP8=/dev/shm/q-$PRESET-fp8
STEPS=" ${*:-ceilings make tests latency ttft throughput} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

want ceilings && step ceilings 120 4 python3 -m tools.kernel_harness ceilings
if want make; then
  for pair in "$BF16:" "$FP8:--fp8"; do
    dir=${pair%%:*} flag=${pair#*:}
    [ -f "$dir/config.json" ] && { echo "=== make: $dir kept"; continue; }
    step "make$flag" 240 2 python3 -m xserv make-test-model --preset "$PRESET" --out "$dir" $flag --workers 16 \
      --no-progress
    echo "    $(du -sh "$dir" | cut -f1) in $dir"
  done
fi
want tests && step tests 300 12 python3 -m pytest -m gpu -q -p no:cacheprovider \
  ${FP8_TESTS:-tests/test_fp8_checkpoint.py tests/ops/test_fp8_linear.py tests/ops/test_gemv_fp8.py}
for m in "$BF16" "$FP8"; do
  name=$(basename "$m")
  want latency && step "latency-$name" 150 3 python3 -m xserv bench latency --model "$m" --input-len 512 \
    --output-len 128 --iters 5 --roofline --gpu-memory-fraction 0.5 --json "$OUT/latency-$name.json"
  want ttft && step "ttft-$name" 100 3 python3 -m xserv bench latency --model "$m" --input-len 2048 --output-len 2 \
    --iters 10 --roofline --gpu-memory-fraction 0.5 --json "$OUT/ttft-$name.json"
done
for m in "$BF16" "$FP8"; do
  name=$(basename "$m")
  want throughput && step "throughput-$name" 200 5 python3 -m xserv bench throughput --model "$m" \
    --gpu-memory-fraction 0.75 --json "$OUT/throughput-$name.json"
done

echo "=== summary ($((SECONDS - START)) s in; device above)"
python3 - "$OUT" "$(basename $BF16)" "$(basename $FP8)" <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
def load(kind, name):
    try:
        return json.load(open(os.path.join(out, f"{kind}-{name}.json")))
    except (OSError, ValueError):
        return None
rows = {}
for name in names:
    lat, ttft, tp = load("latency", name), load("ttft", name), load("throughput", name)
    r = {}
    if lat and lat.get("roofline"):
        rate, roof = lat["decode_tokens_per_s"] or 0, lat["roofline"]["decode_limit_tokens_per_s"]
        r["decode"] = rate
        print(f"{name}: batch-1 decode ctx 512 {rate:,.1f} tok/s, roofline {roof:,.1f} "
              f"({lat['roofline']['decode_step_bytes'] / 1e9:.2f} GB a step) -> {rate / roof:.1%}")
    if ttft:
        t = ttft["ttft_ms"] / 1e3
        lim = (ttft.get("roofline") or {}).get("ttft_flop_limit_s")
        r["ttft"] = t
        print(f"{name}: TTFT 2,048 tokens {t * 1e3:.1f} ms" + (f", FLOP limit at the bf16 GEMM rate {lim * 1e3:.1f} "
                                                              f"ms -> {lim / t:.1%}" if lim else ""))
    if tp:
        r["throughput"] = tp.get("output_tokens_per_s")
        print(f"{name}: offline workload {r['throughput']:,.0f} output tok/s")
    rows[name] = r
a, b = (rows.get(n, {}) for n in names)
for key in ("decode", "throughput"):
    if a.get(key) and b.get(key):
        print(f"FP8 / bf16 {key}: {b[key] / a[key]:.2f}x")
if a.get("ttft") and b.get("ttft"):
    print(f"FP8 / bf16 TTFT: {b['ttft'] / a['ttft']:.2f}x the time")
PY
