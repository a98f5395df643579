#!/usr/bin/env bash
# The fused one-token decode path at tp > 1 on the lent 2-GPU machine (nvidia-h100-x2), one call of ~400 s:
#   1. the GPU tests: tests/test_ipc_allreduce.py (tools/check_ipc_allreduce.py check: the one-shot kernel and its
#      residual-add epilogue, allreduce_oneshot_add_bf16, against NumPy, eager and inside a CUDA graph, the same bits
#      on both ranks), tests/test_tp_engine.py (TP=2 vs TP=1 logits and greedy tokens: decode steps now take the
#      fused path at TP=2; IPC vs NCCL-only, which keeps the unfused path) and tests/test_tp_fused.py;
#   2. `bash tools/gpu_bench_tp.sh 8b`: 8B-shaped batch-1 decode at context 512, TP=2 vs TP=1 (goal >= 1.5x; before
#      this change 1.42x, 267.0 tok/s at TP=2).
# The 8B checkpoint is written to /dev/shm while the tests run. Prints a short summary last; one log under $OUT.
#   bash tools/gpu_check_tp_fused.sh
set -u
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
log="$OUT/check_tp_fused.txt"
[ -d /dev/shm/model-8b ] || python3 -m tools.make_test_model --preset 8b --out /dev/shm/model-8b --no-progress \
  >/dev/null 2>&1 &
maker=$!
nvidia-smi topo -m 2>&1 | head -3 >> "$log"
echo "=== GPU tests: IPC all-reduce (+ residual-add epilogue), TP=2 model, fused path at TP=2" | tee -a "$log"
timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -m gpu tests/test_ipc_allreduce.py tests/test_tp_engine.py \
  tests/test_tp_fused.py -p no:cacheprovider > "$OUT/tests.tmp" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.tmp"
tail -25 "$OUT/tests.tmp" | tee -a "$log"
rm -f "$OUT/tests.tmp"
wait $maker 2>/dev/null
echo "=== 8B-shaped batch-1 decode, TP=2 (fused one-token path, IPC all-reduce + residual add) vs TP=1" | tee -a "$log"
BENCH_TIMEOUT=200 timeout 240 bash tools/gpu_bench_tp.sh 8b > "$OUT/bench.tmp" 2>&1
echo "bench rc=$?" >> "$OUT/bench.tmp"
tail -12 "$OUT/bench.tmp" >> "$log"
rm -f "$OUT/bench.tmp" "$OUT/bench_tp.txt"
echo "=== summary"
grep -E "passed|failed|error|pytest rc=" "$log" | tail -4
grep -E "TP=1:|TP=2:|speed-up|bench rc=" "$log"
