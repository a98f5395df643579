#!/usr/bin/env bash
# The FP8 KV cache (issue 31) on the lent GPU, one call: the FP8-KV GPU tests (kernels and model against the NumPy
# path, 512 and 8,192 tokens of context, max / mean relative errors printed) on the native path and forced onto
# the portable paths (XSERV_ARCH=sm_80: the soft e4m3 conversions; sm_89: the hardware cvt with the 99 KB limits)
# side by side, each with its own kernel cache; then a 0.6B-shaped checkpoint in /dev/shm and, in the same call,
# `xserv bench throughput` (the standard offline workload) and batch-1 latency at context 512, bf16 KV against
# --kv-cache-dtype fp8_e4m3. The issue's goal: fp8_e4m3 >= 1.3x bf16 output tok/s. Logs under $OUT.
# The tests include the quantizing rope kernel (qk_norm_rope_write_kv_fp8: bit-identical to the two ops it replaced) and
# attention_decode_rope over an FP8 cache. At most 3 pytest processes at once (9 ran out of host memory).
#   bash tools/gpu_check_fp8_kv.sh [STEP ...]     steps: tests make bench (default all)
# FP8KV_TESTS, FP8KV_PATHS (default: native sm_80 sm_89), FP8KV_TEST_LIMIT (s, default 300) and FP8KV_DEADLINE (s) set
# what it runs (tools/gpu_check_kvv4.sh: this script with the v4-on-FP8 tests on two paths).
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${FP8KV_DEADLINE:-560}
source "$(dirname "$0")/gpu_step.sh"
STEPS=" ${*:-tests make bench} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
TESTS=${FP8KV_TESTS:-"tests/ops/test_attention_fp8_kv.py tests/test_fp8_kv_model.py"}
PATHS=${FP8KV_PATHS:-"native sm_80 sm_89"}
MODEL=/dev/shm/q-0.6b

one_path() {
  local path=$1
  if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
  export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
  timeout ${FP8KV_TEST_LIMIT:-300} python3 -m pytest -m gpu -q -s -p no:cacheprovider $TESTS > $OUT/fp8kv-tests-$path.log 2>&1
  echo "rc=$?" >> $OUT/fp8kv-tests-$path.log
}
if want tests; then
  for path in $PATHS; do one_path $path & done
  wait
  unset XSERV_ARCH
  export XSERV_CACHE_DIR=/tmp/xserv-cache
  for path in $PATHS; do
    echo "=== FP8 KV tests, $path path"
    grep -E "^(FAILED|ERROR)|rel err" $OUT/fp8kv-tests-$path.log | head -40
    tail -2 $OUT/fp8kv-tests-$path.log
  done
fi
if want make; then
  [ -f "$MODEL/config.json" ] && echo "=== make: $MODEL kept" || \
    step make 180 2 python3 -m xserv make-test-model --preset 0.6b --out "$MODEL" --workers 16 --no-progress
fi
if want bench; then
  for kv in bfloat16 fp8_e4m3; do
    step "throughput-$kv" 150 4 python3 -m xserv bench throughput --model "$MODEL" --kv-cache-dtype $kv \
      --gpu-memory-fraction 0.75 --json "$OUT/fp8kv-throughput-$kv.json"
    step "latency-$kv" 100 3 python3 -m xserv bench latency --model "$MODEL" --kv-cache-dtype $kv --input-len 512 \
      --output-len 128 --iters 5 --gpu-memory-fraction 0.5 --json "$OUT/fp8kv-latency-$kv.json"
  done
  echo "=== summary ($((SECONDS - START)) s in; device above)"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(kind, kv):
    try:
        with open(os.path.join(out, f"fp8kv-{kind}-{kv}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
tp = {kv: load("throughput", kv).get("output_tokens_per_s") for kv in ("bfloat16", "fp8_e4m3")}
for kv in ("bfloat16", "fp8_e4m3"):
    lat = load("latency", kv)
    keys = {k: v for k, v in lat.items() if isinstance(v, (int, float))}
    print(f"{kv}: offline workload {tp[kv]} output tok/s; batch-1 latency figures {keys}")
if all(tp.values()):
    r = tp["fp8_e4m3"] / tp["bfloat16"]
    print(f"fp8_e4m3 / bfloat16 offline output tok/s: {r:.3f}x (goal >= 1.3x: {'met' if r >= 1.3 else 'NOT met'})")
PY
fi
