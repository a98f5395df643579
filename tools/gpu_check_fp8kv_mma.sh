#!/usr/bin/env bash
# The FP8 KV cache's decode on tensor cores (decode.py's FP8_DECODE_MMA, attention_decode_fp8.cu's _mma entries;
# docs/kernels/attention.md "FP8 KV cache on tensor cores"; on by default), its A/B on the lent GPU, one call (~6 min):
#   1. its GPU tests natively and with XSERV_ARCH=sm_80 side by side (against the float64 reference, against the
#      CUDA-core form, the fused entry's cache bytes);
#   2. the standard offline workload with an FP8 KV cache, FP8_DECODE_MMA 0 and 1 (8B-shaped FP8 weights, then
#      0.6B-shaped bf16), and a profile of the 8B step's kernels with it on.
#   bash tools/gpu_check_fp8kv_mma.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${MMA_DEADLINE:-570}
source "$(dirname "$0")/gpu_step.sh"
declare -A MAKE=([q-0.6b]="--preset 0.6b" [q-8b-fp8]="--preset 8b --fp8")
(for m in q-8b-fp8 q-0.6b; do [ -f /dev/shm/$m/config.json ] || python3 -m xserv make-test-model ${MAKE[$m]} \
  --out /dev/shm/$m --workers 8 --no-progress; done > $OUT/make.log 2>&1) &
T=tests/ops/test_attention_fp8_kv.py
MMA="python3 -m tools.with_setting xserv.ops.attention.decode.FP8_DECODE_MMA"  # $MMA=0|1 -- MODULE ARGS...
run_test_paths "$T -k mma" 200 native sm_80
wait
for m in q-8b-fp8 q-0.6b; do
  for on in 0 1; do
    step "tp-$m-mma$on" 120 2 $MMA=$on -- xserv bench throughput --model /dev/shm/$m --kv-cache-dtype fp8_e4m3 \
      --gpu-memory-fraction 0.75 --json "$OUT/tp-$m-mma$on.json"
  done
done
step profile 100 8 $MMA=1 -- tools.profile_engine --model /dev/shm/q-8b-fp8 --kv-cache-dtype fp8_e4m3 --top 4
echo "=== summary (device above)"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for m in ("q-8b-fp8", "q-0.6b"):
    r = {}
    for on in (0, 1):
        try:
            j = json.load(open(f"{out}/tp-{m}-mma{on}.json"))
            r[on] = (j["output_tokens_per_s"], (j.get("limit") or {}).get("limit_output_tokens_per_s") or 0)
        except (OSError, ValueError, KeyError):
            r[on] = None
    line = ", ".join(f"mma {on}: {v[0]:,.0f} tok/s ({v[0] / v[1]:.0%} of {v[1]:,.0f})" if v and v[1] else f"mma {on}: -"
                     for on, v in r.items())
    ratio = f"; on / off = {r[1][0] / r[0][0]:.3f}x" if r[0] and r[1] else ""
    print(f"{m}, FP8 KV, offline: {line}{ratio}")
PY
