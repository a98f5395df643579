#!/usr/bin/env bash
# The short-context decode graphs (model_runner.FINE_KV_BUCKETS, docs/engine.md "Context buckets") on the lent GPU,
# one call (~7 min): the engine's GPU tests; then batch-1 decode at context 512 as a user runs it (max_model_len
# 40,960, the Qwen3 default: the graph's bucket decides the attention's split plan) with the short-context graphs
# and without (FINE_KV_MAX_BATCH=0: the 2,048-key graph), and as `xserv bench latency` runs it by default
# (max_model_len = prompt + output: one tight bucket), on the 0.6B, 8B, 8B-FP8 and 30B-A3B (12 layers) shapes; then
# the engine's start-up time with 256 sequences' graphs, with and without.
#   bash tools/gpu_check_kv_buckets.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${BUCKETS_DEADLINE:-570}
source "$(dirname "$0")/gpu_step.sh"
declare -A MAKE=([q-0.6b]="--preset 0.6b" [q-8b]="--preset 8b" [q-8b-fp8]="--preset 8b --fp8"
                 [moe30-l12]="--preset 30b-a3b --layers 12")
MODELS="q-0.6b q-8b q-8b-fp8 moe30-l12"
(for m in $MODELS; do [ -f /dev/shm/$m/config.json ] || python3 -m xserv make-test-model ${MAKE[$m]} \
  --out /dev/shm/$m --workers 8 --no-progress; done > $OUT/make.log 2>&1) &
step tests 200 3 python3 -m pytest -q -m gpu tests/test_engine.py -p no:cacheprovider
wait
# bench NAME FINE_MAX_BATCH ARGS...: xserv bench latency with model_runner.FINE_KV_MAX_BATCH set
bench() {
  local name=$1 fine=$2
  shift 2
  step "$name" 100 1 python3 -m tools.with_setting xserv.engine.model_runner.FINE_KV_MAX_BATCH=$fine -- xserv bench \
    latency --gpu-memory-fraction 0.5 --json "$OUT/$name.json" "$@"
}
for round in 1 2; do
  for m in $MODELS; do
    args=(--model /dev/shm/$m --input-len 512 --output-len 128 --iters 5)
    bench "$m-user-fine-$round" 16 "${args[@]}" --max-model-len 40960
    bench "$m-user-coarse-$round" 0 "${args[@]}" --max-model-len 40960
    [ $round = 1 ] && bench "$m-tight" 16 "${args[@]}"
  done
done
for fine in 16 0; do
  bench "startup-fine$fine" $fine --model /dev/shm/q-0.6b --input-len 16 --output-len 4 --iters 1 \
    --max-model-len 40960 --max-num-seqs 256
done
echo "=== summary (device above)"
python3 - "$OUT" $MODELS <<'PY'
import json, sys
out, models = sys.argv[1], sys.argv[2:]
def rate(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["decode_tokens_per_s"]
    except (OSError, ValueError, KeyError):
        return None
fmt = lambda v: "-" if v is None else f"{v:,.1f}"
for m in models:
    fine = [rate(f"{m}-user-fine-{r}") for r in (1, 2)]
    coarse = [rate(f"{m}-user-coarse-{r}") for r in (1, 2)]
    print(f"{m}: max_model_len 40960: short-context graphs {' / '.join(map(fmt, fine))} tok/s, 2048-key graph "
          f"{' / '.join(map(fmt, coarse))}; tight max_model_len (bench default) {fmt(rate(m + '-tight'))}")
for fine in (16, 0):
    try:
        s = json.load(open(f"{out}/startup-fine{fine}.json"))["load_s"]
        print(f"0.6B start-up, 256 sequences' graphs, FINE_KV_MAX_BATCH={fine}: engine {s.get('engine_s', 0):.2f} s "
              f"({s})")
    except (OSError, ValueError, KeyError) as e:
        print(f"startup {fine}: {e}")
PY
