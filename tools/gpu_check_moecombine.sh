#!/usr/bin/env bash
# One call: the one-token MoE combine folded into the down GEMM (branch pending/moecombine; docs/kernels/moe.md v4).
#   tests   the moe op GPU tests (the fused kernel against the two launches it replaces bit for bit, poisoned; graph
#           replays with new routings; the NumPy reference) and the MoE model's CUDA-vs-NumPy decode test, natively
#           and with XSERV_ARCH=sm_80, side by side
#   l12     Qwen3-30B-A3B-shaped, 12 of 48 layers, batch-1 decode at context 512 (`xserv bench latency --roofline`):
#           fused (the default), unfused (XSERV_MOE_FUSE_COMBINE=0), fused with the early trigger
#           (XSERV_MOE_DOWN_TRIGGER=early), then fused and unfused again
#   l48     the whole 48 layers (61 GB written to /dev/shm with 16 threads, ~24 s): fused, unfused, fused
#   launch  tools/bench_moe --tokens 1 --combine fused,early,unfused (per launch, the same token, same run)
#   batch   the MoE batch-of-64 invariance test (decode steps alone in graphs vs the batch), both paths
#   [STEPS="tests l12 l48 launch batch"] bash tools/gpu_check_moecombine.sh      logs under $OUT; summary last
# Steps never start past DEADLINE seconds (default 470), each has its own limit (tools/gpu_step.sh).
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0
DEADLINE=${DEADLINE:-470}
source "$(dirname "$0")/gpu_step.sh"
STEPS=" ${STEPS:-tests l12 l48 launch batch} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
L12=/dev/shm/moe30-l12 L48=/dev/shm/moe30  # tools/gpu_bench_moe.sh's folders: a warm machine keeps them

# run_test_paths writes $OUT/tests-PATH.log: each group (ops, batch) keeps its logs as $OUT/GROUP-PATH.log
test_group() { run_test_paths "$2" "$3" native sm_80; for p in native sm_80; do mv $OUT/tests-$p.log $OUT/$1-$p.log; done; }
want tests && test_group ops "tests/ops/test_moe.py tests/test_moe_model.py" 200

make_model() {  # DIR [LAYERS]: the random 30B-A3B-shaped checkpoint, once; /dev/shm holds one of the two
  [ -f "$1/config.json" ] && ls "$1"/*.safetensors >/dev/null 2>&1 && return 0
  for other in $L12 $L48; do [ "$other" != "$1" ] && rm -rf "$other"; done
  step make${2:-48} 120 1 python3 -m xserv make-test-model --preset 30b-a3b --out "$1" ${2:+--layers $2} \
    --workers 16 --no-progress
}
latency() {  # NAME DIR [VAR=VALUE ...]: one batch-1 run, its JSON $OUT/NAME.json
  local name=$1 dir=$2; shift 2
  step $name 150 1 env "$@" python3 -m xserv bench latency --model "$dir" --input-len 512 --output-len 128 \
    --iters 5 --roofline --gpu-memory-fraction 0.5 --json "$OUT/$name.json"
}
UNFUSED=XSERV_MOE_FUSE_COMBINE=0 EARLY=XSERV_MOE_DOWN_TRIGGER=early
if want l12 && make_model $L12 12; then
  latency l12-fused $L12; latency l12-unfused $L12 $UNFUSED; latency l12-early $L12 $EARLY
  latency l12-fused2 $L12; latency l12-unfused2 $L12 $UNFUSED
fi
if want l48 && make_model $L48; then
  latency l48-fused $L48; latency l48-unfused $L48 $UNFUSED; latency l48-fused2 $L48
fi
want launch && step launch 90 5 python3 -m tools.bench_moe --tokens 1 --combine fused,early,unfused --iters 30
want batch && test_group batch tests/test_moe_parity_gpu.py::test_moe_batch_of_64_equals_each_request_alone_up_to_near_ties 150

echo "=== summary ($((SECONDS - START)) s in; device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
for f in $OUT/ops-*.log $OUT/batch-*.log; do [ -f $f ] && echo "$(basename $f .log): $(tail -2 $f | head -1 | cut -c1-110)"; done
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def run(name):
    try:
        j = json.load(open(os.path.join(out, name + ".json")))
        return j["decode_tokens_per_s"], j["roofline"]["decode_limit_tokens_per_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
for layers in ("l12", "l48"):
    rows = {n: run(f"{layers}-{n}") for n in ("fused", "unfused", "early", "fused2", "unfused2")}
    rows = {n: r for n, r in rows.items() if r}
    if not rows:
        continue
    roof = next(iter(rows.values()))[1]
    print(f"{layers}: batch-1 decode, context 512, roofline {roof:,.1f} tok/s; tok/s (share):")
    print("  " + ", ".join(f"{n} {r:,.1f} ({r / lim:.1%})" for n, (r, lim) in rows.items()))
    fused = [r for n, (r, _) in rows.items() if n.startswith("fused")]
    unfused = [r for n, (r, _) in rows.items() if n.startswith("unfused")]
    if fused and unfused:
        f, u = sum(fused) / len(fused), sum(unfused) / len(unfused)
        us = (1 / f - 1 / u) * 1e6 / (12 if layers == "l12" else 48)
        print(f"  fused / unfused (means) {f / u:.4f}x; {us:+.2f} us a layer")
    if "early" in rows and fused:
        print(f"  early / fused {rows['early'][0] / (sum(fused) / len(fused)):.4f}x")
try:
    for line in open(os.path.join(out, "launch.log")):
        if line.startswith(("T=", "copy")):
            print("launch: " + line.rstrip()[:150])
except OSError:
    pass
EOF
