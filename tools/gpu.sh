#!/usr/bin/env bash
# xserv on a GPU machine, one script: set-up, the GPU test suite on each kernel path, and the benchmarks behind
# docs/performance.md, each measuring its peers and the device's ceilings in the same run. Stages run in the order
# given; the device is named first, every step's whole log is $OUT/STEP.log (JSON results beside it).
#
#   bash tools/gpu.sh wheels                   on a machine with network: the wheels the GPU image lacks, into .whl/
#   bash tools/gpu.sh STAGE[:ARG,...] ...      on the GPU machine, in a copy of the repository (.whl/ with it)
#   bash tools/gpu.sh env -- COMMAND ...       any command in the same set-up
#
# Stages (ARGs after a colon, comma-separated; the default in brackets):
#   env                    the device, its driver and the libraries xserv runs on (every run sets up; env prints it)
#   compile                the kernel harness compiles every family for this GPU
#   check                  the kernel harness checks every op against its NumPy reference
#   ceilings               copy bandwidth and a large cuBLAS GEMM
#   bench-ops              the kernel harness times every op against PyTorch
#   bench-runtime          tools/bench_runtime.py: cuBLASLt against torch.matmul, launch cost, kernel loading
#   suite[:GROUP,...]      `pytest -m gpu` on each kernel path of $PATHS side by side, each path with its own kernel
#                          cache; GROUP: attention, attention-fp8, ops, models, or a test file [all four groups]
#   engine[:MODEL,...]     the standard offline workload greedy and sampled, batch-1 latency at context 512, time to
#                          first token of 16 tokens, a 2,000-token shared prefix [0.6b]
#   batch1[:PRESET,...]    the GEMV table at one row, decode at batch 1 and 64 (fused and unfused ops) and at 32,000
#                          tokens of context, time to first token of 16 tokens [0.6b]
#   hf[:MODEL,...]         the transformers peer of batch1: a static KV cache compiled by generate() [0.6b]
#   paths[:MODEL,...]      each kernel path of $PATHS on the offline workload and batch-1 decode, then prefill
#                          attention (portable v3 and its 99 KB form, Hopper v5) against PyTorch SDPA [0.6b]
#   moe[:STEP,...]         Qwen3-30B-A3B-shaped (MOE_LAYERS of its 48 layers, default all), each figure against its
#                          limit: read (the folder's page-cache read time, the bar for loading) latency ttft
#                          throughput hf (transformers bf16) [all five]; make: the checkpoint only
#   fp8[:STEP,...]         an FP8 checkpoint of FP8_PRESET [8b] and its bf16 twin (same seed): latency ttft
#                          throughput (the offline workload for weights x KV cache, bf16 and FP8 each) [all three]
#   tp[:STEP,...]          two GPUs: tests ipc (the one-shot all-reduce checked and timed against NCCL) 8b 32b
#                          (batch-1 decode at TP=1 and 2) throughput (32B-shaped at TP=2) [all five]
#   serve[:MODEL]          `xserv serve` + `xserv bench serve` (256 streams) against `xserv bench throughput` [0.6b]
#   structured[:MODEL]     `xserv bench serve`, every request constrained by one JSON schema, against none [0.6b]
#   parity[:MODEL,...]     tools/check_parity.py: logits against transformers float32, greedy tokens against bf16 [0.6b]
#   profile[:MODEL,...]    batch-1 decode at context 512 against its roofline, and where its step's time goes
#                          (tools/profile_engine.py --timeline) [8b-fp8,30b-a3b-l12]
#
# MODEL: a folder, or a preset's random-weight checkpoint PRESET[-fp8][-lLAYERS] (8b, 8b-fp8, 30b-a3b-l12) made once
# in $MODELS. Environment: OUT [/tmp/xserv-out]; MODELS [/dev/shm/xserv-models: host memory, so a warm machine keeps
# them]; PATHS [native sm_80] (sm_89: the 99 KB shared-memory limits of an RTX 4090 / L40S); DEADLINE [570 s after
# the start: no step starts later, so that a call limited to 600 s ends with its summary]; MOE_LAYERS, FP8_PRESET,
# HF_MODES (tools/bench_hf_moe.py --modes), SUITE_LIMIT [480 s a suite group].
#
# A lent machine's call runs at most 600 s: the suite takes two calls (suite:attention,attention-fp8 and
# suite:ops,models), moe one, fp8 two (fp8:latency,ttft and fp8:throughput); the checkpoints stay for the next call.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/xserv-out}
MODELS=${MODELS:-/dev/shm/xserv-models}
PATHS=${PATHS:-native sm_80}
DEADLINE=${DEADLINE:-570}
mkdir -p "$OUT"

wheels() {  # nvmath-python (cuBLASLt), a cuda-core with the 1.x launch API, the server's stack, structured output,
  # nccl4py, the tests' time-limit plugin: the versions the CPU tests run with, for the GPU image's CPython 3.12
  local platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64"
  set -e
  python3 -m pip download --no-deps $platform -d .whl nvmath-python==1.0.0 cuda-core==1.2.2
  # the image has no network: `xserv serve` and its tests need every dependency here. httptools + uvloop: uvicorn
  # takes them when present, and an SSE chunk costs ~26 us with them against ~160 us with h11
  python3 -m pip download $platform -d .whl fastapi==0.165.0 uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0 \
    openai==3.54.0 httpx==0.28.1
  python3 -m pip download $platform -d .whl llguidance==1.9.1 jsonschema==4.26.0 pytest-timeout==2.4.0
  # tensor parallelism; the image's PyTorch brings libnccl.so.2
  python3 -m pip download --no-deps $platform -d .whl nccl4py==0.6.0 cuda-pathfinder==1.9.1
  set +e
  ls -la .whl
}

setup() {
  export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 XSERV_CACHE_DIR=${XSERV_CACHE_DIR:-/tmp/xserv-cache-native}
  if ls .whl/*.whl >/dev/null 2>&1; then
    # beside the image's own packages, without their dependencies (the image has the rest and no network);
    # installed once a machine
    if [ "$(ls .whl)" != "$(cat /tmp/site/.xserv-wheels 2>/dev/null)" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
      ls .whl > /tmp/site/.xserv-wheels
    fi
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no NVIDIA driver here"
}

# step NAME LIMIT TAIL CMD...: CMD with its output in $OUT/NAME.log, at most LIMIT seconds and never past DEADLINE;
# prints the log's last TAIL lines (progress bars dropped) and how the step ended
step() {
  local name=$1 limit=$2 tail_n=$3 rc t left=$((DEADLINE - SECONDS))
  shift 3
  if ((left < 15)); then echo "=== $name: SKIPPED, ${left} s left before the ${DEADLINE}-s deadline"; return 1; fi
  ((limit > left)) && limit=$left
  echo "=== $name ($SECONDS s in, limit $limit s)"
  t=$SECONDS
  # SIGABRT at the limit: Python (PYTHONFAULTHANDLER) writes every thread's stack into the log first
  timeout -s ABRT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  grep -av 'it/s]\|tok/s]\|tensor/s]' "$OUT/$name.log" | tail -n "$tail_n"
  case $rc in
    0) ;;
    124 | 134 | 137) echo "--- $name: TIMED OUT after $limit s" ;;
    *) echo "--- $name: FAILED (exit $rc; $OUT/$name.log)" ;;
  esac
  echo "--- $name: $((SECONDS - t)) s"
  return $rc
}

# path_env PATH: `env` arguments for a kernel path (native: XSERV_ARCH unset), each path with its own kernel cache
path_env() {
  if [ "$1" = native ]; then echo "-u XSERV_ARCH XSERV_CACHE_DIR=/tmp/xserv-cache-native"
  else echo "XSERV_ARCH=$1 XSERV_CACHE_DIR=/tmp/xserv-cache-$1"; fi
}

dir_of() { case $1 in */*) echo "$1" ;; *) echo "$MODELS/$1" ;; esac; }

# make_model MODEL: a preset's checkpoint PRESET[-fp8][-lLAYERS], unless it is there already (or MODEL is a folder)
make_model() {
  local spec=$1 dir preset layers="" fp8=""
  dir=$(dir_of "$spec")
  [ -f "$dir/config.json" ] && return 0
  [[ $spec == */* ]] && { echo "no checkpoint at $spec"; return 1; }
  preset=$spec
  [[ $preset =~ ^(.+)-l([0-9]+)$ ]] && preset=${BASH_REMATCH[1]} layers=${BASH_REMATCH[2]}
  [[ $preset == *-fp8 ]] && preset=${preset%-fp8} fp8=--fp8
  mkdir -p "$MODELS"
  if [[ $preset == 30b-a3b ]]; then  # 61 GB whole: host memory holds one such folder at a time
    for other in "$MODELS"/30b-a3b*; do [ -d "$other" ] && rm -rf "$other" && echo "removed $other"; done
  fi
  step "make-$spec" 300 1 python3 -m xserv make-test-model --preset "$preset" --out "$dir" $fp8 \
    ${layers:+--layers "$layers"} --workers 16 --no-progress || return 1
  echo "    $(du -sh "$dir" | cut -f1) in $dir"
}

# summary SCRIPT ARGS...: a Python summary of the stage's JSON results, run whatever the steps did
summary() { echo "=== summary ($SECONDS s in)"; python3 - "$@"; }

stage_suite() {
  local alone=tests/engine/test_llm_threads.py::test_cuda_memory_comes_back_after_close group path files limit
  [ $# -gt 0 ] || set -- attention attention-fp8 ops models
  files() {
    case $1 in
      attention) echo tests/ops/test_attention.py ;;
      attention-fp8) echo tests/ops/test_attention_fp8_kv.py ;;
      ops) echo tests/ops --ignore=tests/ops/test_attention.py --ignore=tests/ops/test_attention_fp8_kv.py ;;
      # the one test that measures the whole GPU's free memory runs alone afterwards: another process allocating
      # beside it fails it
      models) echo tests --ignore=tests/ops --deselect=$alone ;;
      */*) echo "$1 --deselect=$alone" ;;
      *) echo "suite: unknown group $1 (attention, attention-fp8, ops, models or a test file)" >&2; return 1 ;;
    esac
  }
  for group; do files "$group" >/dev/null || return 2; done
  limit=$((DEADLINE - SECONDS - 30))
  ((limit > ${SUITE_LIMIT:-480})) && limit=${SUITE_LIMIT:-480}
  echo "=== suite: $* on $PATHS, side by side, at most $limit s"
  for group; do for path in $PATHS; do (
    log=$OUT/suite-${group//\//_}-$path
    timeout -s ABRT -k 10 $limit env $(path_env $path) python3 -m pytest -m gpu -q -p no:cacheprovider \
      --durations=5 --junitxml=$log.xml $(files "$group") > $log.log 2>&1
    echo "rc=$?" >> $log.log ) &
  done; done
  wait
  if [[ " $* " == *" models "* || " $* " == *" ${alone%%::*} "* ]]; then for path in $PATHS; do
    step "suite-alone-$path" 120 1 env $(path_env $path) python3 -m pytest -m gpu -q -p no:cacheprovider $alone
  done; fi
  for group; do for path in $PATHS; do
    log=$OUT/suite-${group//\//_}-$path.log
    echo "=== $group, $path path"
    grep -E "^(FAILED|ERROR)" $log | cut -c1-240 | head -15
    grep -A6 "slowest 5" $log | tail -5
    tail -2 $log
  done; done
}

stage_engine() {
  local spec m
  [ $# -gt 0 ] || set -- 0.6b
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  for spec; do
    make_model $spec || continue
    m=$(dir_of $spec); spec=${spec##*/}
    step "engine-$spec-greedy" 200 5 python3 -m xserv bench throughput --model $m --temperature 0 --profile \
      --json $OUT/engine-$spec-greedy.json
    step "engine-$spec-sampled" 200 5 python3 -m xserv bench throughput --model $m --temperature 0.6 --top-p 0.95 \
      --top-k 20 --json $OUT/engine-$spec-sampled.json
    step "engine-$spec-latency" 120 1 python3 -m xserv bench latency --model $m --input-len 512 --output-len 256 \
      --json $OUT/engine-$spec-latency.json
    step "engine-$spec-ttft" 60 1 python3 -m xserv bench latency --model $m --input-len 16 --output-len 8 --iters 20
    step "engine-$spec-prefix" 120 2 python3 -m xserv bench latency --model $m --shared-prefix 2000 --input-len 64 \
      --output-len 16 --iters 64 --json $OUT/engine-$spec-prefix.json
  done
}

stage_batch1() {
  local spec m
  [ $# -gt 0 ] || set -- 0.6b
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  step gemv 150 12 python3 -m tools.bench_gemv --m 1 --models "$(IFS=,; echo "$*")" --skip-torch
  for spec; do
    make_model $spec || continue
    m=$(dir_of $spec)
    step "batch1-$spec" 150 3 python3 -m tools.bench_decode --model $m --batch-sizes 1,64
    step "batch1-$spec-unfused" 100 1 python3 -m tools.bench_decode --model $m --batch-sizes 1 --unfused
    step "batch1-$spec-32k" 150 1 python3 -m tools.bench_decode --model $m --batch-sizes 1 --context 32000 --steps 64
    step "batch1-$spec-ttft" 60 1 python3 -m xserv bench latency --model $m --input-len 16 --output-len 8 --iters 20
  done
}

stage_hf() {
  local spec
  [ $# -gt 0 ] || set -- 0.6b
  for spec; do
    make_model $spec || continue
    step "hf-${spec##*/}" 300 3 python3 -m tools.bench_hf_decode --model "$(dir_of $spec)" --batch-sizes 1,64 \
      --steps 32
  done
}

stage_paths() {
  local spec m path
  [ $# -gt 0 ] || set -- 0.6b
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  for spec; do
    make_model $spec || continue
    m=$(dir_of $spec); spec=${spec##*/}
    for path in $PATHS; do
      step "paths-$spec-$path-throughput" 200 3 env $(path_env $path) python3 -m xserv bench throughput --model $m \
        --temperature 0 --json $OUT/paths-$spec-$path-throughput.json
      step "paths-$spec-$path-latency" 120 1 env $(path_env $path) python3 -m xserv bench latency --model $m \
        --input-len 512 --output-len 256 --json $OUT/paths-$spec-$path-latency.json
    done
  done
  step paths-prefill 150 16 python3 -m tools.bench_attention --prefill v3,v3_m2w8_b3_k32,v5 --prefill-only --quick
}

stage_moe() {
  local spec=30b-a3b${MOE_LAYERS:+-l$MOE_LAYERS} m steps
  steps=" ${*:-read latency ttft throughput hf} "
  want() { [[ "$steps" == *" $1 "* ]]; }
  m=$(dir_of $spec)
  echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2 " GB RAM, " $7 " GB available"}'); model $m"
  make_model $spec || return 1
  [ "$steps" = " make " ] && return 0
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  # the folder's page-cache read time (it lives in host memory: reading it is a memory copy), the bar for the load
  want read && step moe-read 120 3 python3 - "$m" "$OUT/moe-read.json" <<'EOF'
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
  # the latency JSON also carries the load times
  want latency && step moe-latency 240 5 python3 -m xserv bench latency --model $m --input-len 512 --output-len 128 \
    --iters 5 --roofline --gpu-memory-fraction 0.5 --json $OUT/moe-latency.json
  want ttft && step moe-ttft 150 4 python3 -m xserv bench latency --model $m --input-len 2048 --output-len 2 \
    --iters 10 --roofline --gpu-memory-fraction 0.5 --json $OUT/moe-ttft.json
  # 0.75 of free memory for the KV cache leaves room for the ceilings measured after the run
  want throughput && step moe-throughput 300 6 python3 -m xserv bench throughput --model $m \
    --gpu-memory-fraction 0.75 --json $OUT/moe-throughput.json
  # transformers after xserv's processes have exited: the bf16 weights fill the GPU alone; compiling comes last
  want hf && step moe-hf 300 8 python3 -m tools.bench_hf_moe --model $m --context 512 --steps 32 --ttft 2048 \
    --modes "${HF_MODES:-eager,static,ttft,compiled}"
  summary "$OUT" <<'EOF'
import json, os, re, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
lat, ttft, tp, rd = (load(f"moe-{n}.json") for n in ("latency", "ttft", "throughput", "read"))
ce = (lat or ttft or tp or {}).get("ceilings")
if ce:
    print(f"ceilings: copy {ce['copy_bytes_per_s'] / 1e9:,.0f} GB/s, GEMM {ce['gemm_flops_per_s'] / 1e12:.0f} TFLOP/s")
if rd and lat and lat.get("load_s"):
    ld = lat["load_s"]
    w = ld.get("weights_s")
    print(f"load: {rd['bytes'] / 1e9:.1f} GB read by cat in {rd['cat_s']:.2f} s ({rd['parallel_cat_s']:.2f} s by 16 "
          f"cats); xserv weights {w:.2f} s = {w / rd['cat_s']:.2f}x the cat, engine {ld.get('engine_s', 0):.2f} s, "
          f"kernel check/compile {ld.get('kernel_compile_s') or 0:.2f} s")
if lat and lat.get("roofline"):
    r, rate = lat["roofline"], lat["decode_tokens_per_s"] or 0
    roof, other = r["decode_limit_tokens_per_s"], r.get("decode_limit_tokens_per_s_with_embedding")
    print(f"batch-1 decode, context 512: {rate:,.1f} tok/s; roofline {roof:,.1f} tok/s ({r['decode_step_bytes'] / 1e9:.2f}"
          f" GB a step: attention + router weights, the routed experts, lm_head, K/V) -> {rate / roof:.1%}"
          + (f"; counting the embedding table as the dense rooflines do {other:,.1f} -> {rate / other:.1%}"
             if other else ""))
if ttft and ttft.get("roofline"):
    r, ms = ttft["roofline"], ttft["ttft_ms"]
    flop_ms, read_ms = r["ttft_flop_limit_s"] * 1e3, r["ttft_weight_read_s"] * 1e3
    print(f"TTFT, 2048-token prompt: {ms:.1f} ms; FLOP limit (active parameters) {flop_ms:.1f} ms -> "
          f"{flop_ms / ms:.1%}; the weights its tokens touch read at copy bandwidth {read_ms:.1f} ms")
if tp and tp.get("limit"):
    lim = tp["limit"]
    print(f"standard workload: {tp['output_tokens_per_s']:,.0f} output tok/s ({tp['elapsed_s']:.1f} s, "
          f"{tp['num_preemptions']} preemptions); limit {lim['limit_output_tokens_per_s']:,.0f} tok/s (touched "
          f"experts, uniform routing) -> {lim['limit_s'] / tp['elapsed_s']:.1%}")
try:
    for line in open(os.path.join(out, "moe-hf.log")):
        if re.match(r"(transformers bf16|transformers peer|device:|peak GPU)", line):
            print("peer: " + line.rstrip()[:200])
except OSError:
    pass
EOF
}

stage_fp8() {
  local preset=${FP8_PRESET:-8b} steps m kv
  steps=" ${*:-latency ttft throughput} "
  want() { [[ "$steps" == *" $1 "* ]]; }
  make_model $preset || return 1
  make_model $preset-fp8 || return 1
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  for m in $preset $preset-fp8; do
    want latency && step "fp8-latency-$m" 150 3 python3 -m xserv bench latency --model $(dir_of $m) --input-len 512 \
      --output-len 128 --iters 5 --roofline --gpu-memory-fraction 0.5 --json $OUT/fp8-latency-$m.json
    want ttft && step "fp8-ttft-$m" 100 3 python3 -m xserv bench latency --model $(dir_of $m) --input-len 2048 \
      --output-len 2 --iters 10 --roofline --gpu-memory-fraction 0.5 --json $OUT/fp8-ttft-$m.json
  done
  if want throughput; then for m in $preset $preset-fp8; do for kv in bfloat16 fp8_e4m3; do
    step "fp8-throughput-$m-$kv" 150 2 python3 -m xserv bench throughput --model $(dir_of $m) --kv-cache-dtype $kv \
      --gpu-memory-fraction 0.75 --json $OUT/fp8-throughput-$m-$kv.json
  done; done; fi
  summary "$OUT" $preset $preset-fp8 <<'EOF'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        return json.load(open(os.path.join(out, f"fp8-{name}.json")))
    except (OSError, ValueError):
        return None
for name in names:
    lat, ttft = load(f"latency-{name}"), load(f"ttft-{name}")
    if lat and lat.get("roofline"):
        rate, roof = lat["decode_tokens_per_s"] or 0, lat["roofline"]["decode_limit_tokens_per_s"]
        print(f"{name}: batch-1 decode ctx 512 {rate:,.1f} tok/s, roofline {roof:,.1f} "
              f"({lat['roofline']['decode_step_bytes'] / 1e9:.2f} GB a step) -> {rate / roof:.1%}")
    if ttft:
        t, lim = ttft["ttft_ms"] / 1e3, (ttft.get("roofline") or {}).get("ttft_flop_limit_s")
        print(f"{name}: TTFT 2,048 tokens {t * 1e3:.1f} ms"
              + (f", FLOP limit at the bf16 GEMM rate {lim * 1e3:.1f} ms -> {lim / t:.1%}" if lim else ""))
base = (load(f"throughput-{names[0]}-bfloat16") or {}).get("output_tokens_per_s")
for name in names:
    for kv in ("bfloat16", "fp8_e4m3"):
        r = load(f"throughput-{name}-{kv}")
        if not r:
            continue
        rate, lim = r["output_tokens_per_s"], (r.get("limit") or {}).get("limit_output_tokens_per_s")
        print(f"offline, {name} weights, {kv} KV cache: {rate:,.0f} output tok/s"
              + (f", {rate / lim:.0%} of its limit {lim:,.0f}" if lim else "")
              + (f", {rate / base:.3f}x bf16 / bf16" if base else ""))
EOF
}

stage_tp() {
  local steps bench=()
  steps=" ${*:-tests ipc 8b 32b throughput} "
  want() { [[ "$steps" == *" $1 "* ]]; }
  nvidia-smi topo -m 2>&1 | head -3
  want tests && step tp-tests 240 15 python3 -m pytest -m gpu -q -p no:cacheprovider tests/parallel/test_ipc_allreduce.py \
    tests/parallel/test_tp_engine.py tests/parallel/test_tp_fused.py
  want ipc && step tp-ipc-check 150 10 python3 -m tools.check_ipc_allreduce check
  want ipc && step tp-ipc-latency 150 10 python3 -m tools.check_ipc_allreduce bench
  want 8b && make_model 8b && bench+=(8b)
  want 32b && make_model 32b && bench+=(32b)
  ((${#bench[@]})) && step tp-decode 300 12 python3 -m tools.bench_tp --models "$MODELS" "${bench[@]}"
  want throughput && make_model 32b && step tp-throughput 200 12 python3 -m xserv bench throughput \
    --model $(dir_of 32b) --tensor-parallel-size 2 --max-model-len 2048
}

# serving MODEL PORT: `xserv serve` in the background, ready when this returns; SERVER holds its process id
serving() {
  python3 -m xserv serve --model "$1" --port $2 --max-model-len 2048 --log-level warning > $OUT/serve-$2.log 2>&1 &
  SERVER=$!
  python3 - $2 $SERVER <<'EOF'
import os, sys, time, httpx
for _ in range(300):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health").status_code == 200:
            break
    except Exception:
        pass
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit("the server exited before it was ready")
    time.sleep(1)
EOF
}

stage_serve() {
  local spec=${1:-0.6b} m
  make_model $spec || return 1
  m=$(dir_of $spec)
  step serve-offline 200 4 python3 -m xserv bench throughput --model $m --json $OUT/serve-offline.json
  serving $m 8011
  step serve 250 12 python3 -m xserv bench serve --url http://127.0.0.1:8011 --json $OUT/serve.json
  kill -TERM $SERVER; wait $SERVER; echo "server exit status $?"
  summary "$OUT" <<'EOF'
import json, sys
o, s = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("serve-offline", "serve"))
print(f"serve / offline output tok/s: {s['output_tokens_per_s']:,.0f} / {o['output_tokens_per_s']:,.0f} = "
      f"{s['output_tokens_per_s'] / o['output_tokens_per_s']:.0%}")
EOF
}

stage_structured() {
  local spec=${1:-0.6b} m schema=$OUT/schema.json
  make_model $spec || return 1
  m=$(dir_of $spec)
  # an answer string the random model never closes: every request runs to its max_tokens, as unconstrained ones do
  echo '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}' > $schema
  serving $m 8012
  step structured-free 250 4 python3 -m xserv bench serve --url http://127.0.0.1:8012 --json $OUT/structured-free.json
  step structured-schema 250 5 python3 -m xserv bench serve --url http://127.0.0.1:8012 --json-schema $schema \
    --json $OUT/structured-schema.json
  kill -TERM $SERVER; wait $SERVER
  summary "$OUT" <<'EOF'
import json, sys
f, c = (json.load(open(f"{sys.argv[1]}/structured-{n}.json")) for n in ("free", "schema"))
print(f"constrained / unconstrained output tok/s: {c['output_tokens_per_s']:,.0f} / {f['output_tokens_per_s']:,.0f}"
      f" = {c['output_tokens_per_s'] / f['output_tokens_per_s']:.0%}")
EOF
}

stage_parity() {
  local spec
  [ $# -gt 0 ] || set -- 0.6b
  for spec; do
    make_model $spec || continue
    step "parity-${spec##*/}" 300 20 python3 -m tools.check_parity --model "$(dir_of $spec)"
  done
}

stage_profile() {
  local spec m
  [ $# -gt 0 ] || set -- 8b-fp8 30b-a3b-l12
  step ceilings 120 3 python3 -m tools.kernel_harness ceilings
  for spec; do
    make_model $spec || continue
    m=$(dir_of $spec); spec=${spec##*/}
    step "profile-$spec-latency" 150 3 python3 -m xserv bench latency --model $m --input-len 512 --output-len 128 \
      --iters 5 --roofline --gpu-memory-fraction 0.5
    step "profile-$spec" 150 44 python3 -m tools.profile_engine --model $m --single-context 512 --warm 32 --steps 20 \
      --top 16 --timeline 24
  done
}

[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
if [ "$*" = wheels ]; then wheels; exit; fi
setup
while [ $# -gt 0 ]; do
  stage=$1; shift
  name=${stage%%:*} args=()
  [[ $stage == *:* ]] && IFS=, read -ra args <<< "${stage#*:}"
  case $name in
    --) exec "$@" ;;
    env) python3 -c "import cuda.bindings, cuda.core, numpy; from cuda.bindings import nvrtc
print('cuda-bindings', cuda.bindings.__version__, 'cuda-core', cuda.core.__version__, 'nvrtc', nvrtc.nvrtcVersion()[1:],
      'numpy', numpy.__version__)"
         python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
           2>/dev/null || echo "torch / transformers: not importable (the peers are skipped)" ;;
    compile) step compile 500 5 python3 -m tools.kernel_harness compile ;;
    check) step check 500 30 python3 -m tools.kernel_harness check all ;;
    ceilings) step ceilings 120 3 python3 -m tools.kernel_harness ceilings ;;
    bench-ops) step bench-ops 500 80 python3 -m tools.kernel_harness bench all --vs torch ;;
    bench-runtime) step bench-runtime 300 60 python3 -m tools.bench_runtime ;;
    wheels) echo "wheels: run it alone, on a machine with network" ;;
    suite | engine | batch1 | hf | paths | moe | fp8 | tp | serve | structured | parity | profile)
      stage_$name ${args[@]+"${args[@]}"} ;;
    *) echo "unknown stage $name (bash tools/gpu.sh: the list)"; exit 2 ;;
  esac
done
