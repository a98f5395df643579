#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped mixture of experts on the lent GPU, one call: the device's ceilings, a random checkpoint in
# /dev/shm (made once, kept while the machine stays warm), its page-cache read time against xserv's load time,
# batch-1 decode at context 512 against its roofline (attention + router weights, the 8 routed experts per layer,
# lm_head and embeddings, K/V, at the measured copy bandwidth), the time to first token of a 2,048-token prompt against
# its FLOP limit (active parameters at the measured GEMM rate), the standard offline workload against its limit
# (decode steps read the experts their sequences touch: E(1-(1-k/E)^B) per layer under uniform routing), and the
# transformers bf16 peer (eager and static cache, after xserv's processes have exited). A summary ends the output.
#
#   bash tools/gpu_bench_moe.sh [STEP ...]         steps: ceilings make read latency ttft throughput hf (default all)
#   MOE_LAYERS=12 bash tools/gpu_bench_moe.sh       a quick first run on 12 of the 48 layers (its own folder)
#
# Every step has a timeout and none starts after MOE_DEADLINE seconds (default 540: a call's limit is 600 s), so one
# failure or a slow step leaves the rest their time; each step's whole log is $OUT/<step>.log, its JSON $OUT/*.json.
# Env: MOE_PRESET (30b-a3b), MOE_LAYERS, MOE_DIR (/dev/shm/moe30[-l<layers>]), MOE_WORKERS (16), MOE_DEADLINE,
# MOE_TESTS=1 (tests/test_moe_parity_gpu.py first), TP_ARGS (extra `bench throughput` options, e.g. --temperature 0),
# HF_MODES (tools/bench_hf_moe.py --modes; default eager,static,ttft,compiled).
set -u
source "$(dirname "$0")/gpu_env.sh"
START=0  # the deadline counts from the script's start ($SECONDS), set-up included
DEADLINE=${MOE_DEADLINE:-540}
PRESET=${MOE_PRESET:-30b-a3b}
LAYERS=${MOE_LAYERS:-}
M=${MOE_DIR:-/dev/shm/moe30${LAYERS:+-l$LAYERS}}
STEPS=" ${*:-ceilings make read latency ttft throughput hf} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

source "$(dirname "$0")/gpu_step.sh"  # step NAME LIMIT TAIL CMD...

echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2 " GB RAM, " $7 " GB available"}')," \
  "/dev/shm $(df -h /dev/shm | awk 'NR == 2 {print $4 " free"}')"
echo "model: preset $PRESET${LAYERS:+, $LAYERS layers}, folder $M; steps:$STEPS"
python3 -c "import importlib.util as u, torch, transformers; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'accelerate', 'yes' if u.find_spec('accelerate') else 'NO (hf: through host memory)')" \
  2>/dev/null || echo "(torch or transformers not importable: the hf step will say so)"

if [ -n "${MOE_TESTS:-}" ]; then
  step tests 300 15 python3 -m pytest -q -x tests/test_moe_parity_gpu.py -s -p no:cacheprovider
fi

want ceilings && step ceilings 120 4 python3 -m tools.kernel_harness ceilings

if want make; then
  if [ -f "$M/config.json" ] && ls "$M"/*.safetensors >/dev/null 2>&1; then
    echo "=== make: $M exists ($(du -sh "$M" | cut -f1)), kept"
  else
    for other in /dev/shm/moe30 /dev/shm/moe30-l*; do  # this script's other folders: /dev/shm is host memory
      [ -d "$other" ] && [ "$other" != "$M" ] && rm -rf "$other" && echo "removed $other"
    done
    workers=()
    python3 -m xserv make-test-model --help 2>/dev/null | grep -q -- --workers \
      && workers=(--workers "${MOE_WORKERS:-16}")
    step make 300 2 python3 -m xserv make-test-model --preset "$PRESET" --out "$M" ${LAYERS:+--layers "$LAYERS"} \
      ${workers[@]+"${workers[@]}"} --no-progress
    echo "    $(du -sh "$M" 2>/dev/null | cut -f1) in $M"
  fi
fi
[ -f "$M/config.json" ] || { echo "no model at $M: nothing more to run"; exit 1; }

# the folder's page-cache read time (it lives in /dev/shm: reading it is a memory copy), one cat and 16 in parallel
want read && step read 120 3 python3 - "$M" "$OUT/read.json" <<'EOF'
import glob, json, os, subprocess, sys, time
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors")))
size = sum(os.path.getsize(f) for f in files)
t = time.perf_counter()
subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
cat_s = time.perf_counter() - t
t = time.perf_counter()
subprocess.run(["xargs", "-0", "-P", "16", "-n", "1", "cat"], input="\0".join(files).encode(),
               stdout=subprocess.DEVNULL, check=True)
par_s = time.perf_counter() - t
print(f"{len(files)} files, {size / 1e9:.2f} GB: cat {cat_s:.2f} s ({size / cat_s / 1e9:.1f} GB/s), 16 cats in "
      f"parallel {par_s:.2f} s ({size / par_s / 1e9:.1f} GB/s)")
json.dump({"bytes": size, "files": len(files), "cat_s": cat_s, "parallel_cat_s": par_s}, open(sys.argv[2], "w"))
EOF

# batch-1 decode at context 512 and its roofline; the JSON also carries the load times (LLM.timings)
want latency && step latency 240 5 python3 -m xserv bench latency --model "$M" --input-len 512 --output-len 128 \
  --iters 5 --roofline --gpu-memory-fraction 0.5 --json "$OUT/moe-latency.json"

want ttft && step ttft 150 4 python3 -m xserv bench latency --model "$M" --input-len 2048 --output-len 2 --iters 10 \
  --roofline --gpu-memory-fraction 0.5 --json "$OUT/moe-ttft.json"

# the standard workload (256 requests, 100..1024 in and out, temperature 0.6); 0.75 of free memory for the KV cache
# leaves room for the ceilings measured after the run
want throughput && step throughput 300 6 python3 -m xserv bench throughput --model "$M" --gpu-memory-fraction 0.75 \
  ${TP_ARGS:-} --json "$OUT/moe-throughput.json"

# transformers after xserv's processes have exited: 61 GB of bf16 weights fill the GPU alone; compiling comes last
want hf && step hf 300 8 python3 -m tools.bench_hf_moe --model "$M" --context 512 --steps 32 --ttft 2048 \
  --modes "${HF_MODES:-eager,static,ttft,compiled}"

echo "=== summary ($((SECONDS - START)) s in; device above)"
python3 - "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
lat, ttft, tp, rd = load("moe-latency.json"), load("moe-ttft.json"), load("moe-throughput.json"), load("read.json")
ce = (lat or ttft or tp or {}).get("ceilings")
if ce:
    print(f"ceilings: copy {ce['copy_bytes_per_s'] / 1e9:,.0f} GB/s, GEMM {ce['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s")
if rd and lat and lat.get("load_s"):
    ld = lat["load_s"]
    w = ld.get("weights_s")
    print(f"load: {rd['bytes'] / 1e9:.1f} GB read by cat in {rd['cat_s']:.2f} s ({rd['parallel_cat_s']:.2f} s by 16 "
          f"cats); xserv weights {w:.2f} s = {w / rd['cat_s']:.2f}x the cat (goal <= 1.20x), engine "
          f"{ld.get('engine_s', 0):.2f} s, kernel check/compile {ld.get('kernel_compile_s') or 0:.2f} s")
if lat and lat.get("roofline"):
    r = lat["roofline"]
    rate = lat["decode_tokens_per_s"] or 0
    roof = r["decode_limit_tokens_per_s"]
    other = r.get("decode_limit_tokens_per_s_with_embedding")
    print(f"batch-1 decode, context 512: {rate:,.1f} tok/s; roofline {roof:,.1f} tok/s "
          f"({r['decode_step_bytes'] / 1e9:.2f} GB a step: attention + router weights, {r.get('moe', {}).get('top_k')} "
          f"experts per layer, lm_head, K/V) -> {rate / roof:.1%} (goal >= 70%)"
          + (f"; with the embedding table counted as the dense rooflines do {other:,.1f} tok/s -> {rate / other:.1%}"
             if other else ""))
if ttft and ttft.get("roofline"):
    r = ttft["roofline"]
    ms = ttft["ttft_ms"]
    flop_ms, read_ms = r["ttft_flop_limit_s"] * 1e3, r["ttft_weight_read_s"] * 1e3
    print(f"TTFT, 2048-token prompt: {ms:.1f} ms; FLOP limit (active parameters) {flop_ms:.1f} ms -> "
          f"{flop_ms / ms:.1%}; the weights its tokens touch (nearly all) read at copy bandwidth {read_ms:.1f} ms")
if tp and tp.get("limit"):
    lim = tp["limit"]
    print(f"standard workload: {tp['output_tokens_per_s']:,.0f} output tok/s ({tp['elapsed_s']:.1f} s, "
          f"{tp['num_preemptions']} preemptions); limit {lim['limit_output_tokens_per_s']:,.0f} tok/s (touched "
          f"experts, uniform routing) -> {lim['limit_s'] / tp['elapsed_s']:.1%} (goal >= 65%)")
try:
    for line in open(os.path.join(out, "hf.log")):
        if re.match(r"(transformers bf16|transformers peer|device:|peak GPU)", line):
            print("peer: " + line.rstrip()[:200])
except OSError:
    pass
EOF
