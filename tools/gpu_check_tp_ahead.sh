#!/usr/bin/env bash
# Decode steps launched ahead at tp > 1, and the IPC kernels launched with programmatic dependent launch (issue 32),
# on the lent 2-GPU machine (nvidia-h100-x2), one call of ~5 minutes:
#   1. the GPU tests: tests/test_ipc_allreduce.py (the kernel against NumPy and NCCL, eager and in a graph, the same
#      bits on both ranks), tests/test_tp_engine.py and tests/test_tp_fused.py (TP=2 vs TP=1);
#   2. 8B-shaped batch-1 decode at context 512: TP=1, then TP=2 with decode steps launched ahead (the tokens
#      broadcast in each graph) and the IPC kernels' early trigger (the default), without launch-ahead, and without
#      either (the state before: 269.7-276.6 tok/s, 1.43-1.47x);
#   3. a profile of rank 0's TP=2 step (tools/profile_engine.py --timeline): where the step's time goes.
#   bash tools/gpu_check_tp_ahead.sh
set -u
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
log="$OUT/check_tp_ahead.txt"
[ -d /dev/shm/model-8b ] || python3 -m tools.make_test_model --preset 8b --out /dev/shm/model-8b --no-progress \
  >/dev/null 2>&1 &
maker=$!
echo "=== GPU tests: IPC all-reduce, TP=2 model, fused path at TP=2" | tee -a "$log"
timeout ${TESTS_TIMEOUT:-180} python3 -m pytest -q -m gpu tests/test_ipc_allreduce.py tests/test_tp_engine.py \
  tests/test_tp_fused.py -p no:cacheprovider > "$OUT/tests.tmp" 2>&1
echo "pytest rc=$?" >> "$OUT/tests.tmp"
tail -15 "$OUT/tests.tmp" | tee -a "$log"
rm -f "$OUT/tests.tmp"
wait $maker 2>/dev/null
echo "=== 8B-shaped batch-1 decode, TP=1 and TP=2 by trigger placement" | tee -a "$log"
timeout ${BENCH_TIMEOUT:-240} python3 -m tools.bench_tp 8b variants 2>&1 | grep -v Warning | tail -12 | tee -a "$log"
echo "=== profile, rank 0 of TP=2 (trigger early), batch 1 at context 512" | tee -a "$log"
timeout ${PROFILE_TIMEOUT:-150} python3 -m tools.profile_engine --model /dev/shm/model-8b --tensor-parallel-size 2 \
  --single-context 512 --warm 32 --steps 20 --top 14 --timeline 24 2>&1 | grep -v Warning | tail -42 >> "$log"
echo "=== summary"
grep -E "passed|failed|error|pytest rc=" "$log" | tail -4
grep -E "TP=1:|TP=2:|TP=2,|speed-up|kernels per step" "$log"
