#!/usr/bin/env bash
# Tensor-parallel benchmarks on the lent 2-GPU machine (nvidia-h100-x2), one call:
#   1. the NCCL all-reduce of one decode row ([1, hidden] bf16) per call, eager and inside a CUDA graph (2 ranks);
#   2. Qwen3-8B-shaped batch-1 decode at context 512: TP=1 and TP=2 (goal: TP=2 >= 1.5x TP=1);
#   3. Qwen3-32B-shaped batch-1 decode at TP=2 against its TP=2 roofline (per-GPU weight + KV bytes at the copy
#      bandwidth), with the all-reduce time per step (2 x layers + 1 all-reduces x the graph figure of 1.);
#   4. the standard offline workload (`xserv bench throughput`) on 32B at TP=2.
#   bash tools/gpu_bench_tp.sh [tests] [8b] [32b] [throughput]      (default: all four; tests: the GPU tests of
#   tests/test_tp_engine.py while the checkpoints are written)
# Checkpoints (random weights, the presets' shapes) go to /dev/shm. Prints the device name first.
set -u
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
stages=("${@:-tests 8b 32b throughput}"); stages=(${stages[@]})
want() { [[ " ${stages[*]} " == *" $1 "* ]]; }
for p in 8b 32b; do
  want $p || continue
  [ -d /dev/shm/model-$p ] || python3 -m tools.make_test_model --preset $p --out /dev/shm/model-$p --no-progress >/dev/null 2>&1 &
done
if want tests; then  # the multi-GPU tests, while the checkpoints are written
  echo "=== GPU tests (tests/test_tp_engine.py -m gpu)"
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_tp_engine.py -p no:cacheprovider 2>&1 | tail -15 \
    | tee -a "$OUT/bench_tp.txt"
fi
bench=(); want 8b && bench+=(8b); want 32b && bench+=(32b)
timeout ${BENCH_TIMEOUT:-240} python3 -m tools.bench_tp "${bench[@]}" 2>&1 | grep -v Warning | tee -a "$OUT/bench_tp.txt"
wait
if want throughput; then
  echo "=== 32B TP=2, standard offline workload"
  timeout ${THROUGHPUT_TIMEOUT:-150} python3 -m xserv bench throughput --model /dev/shm/model-32b --tensor-parallel-size 2 --max-model-len 2048 2>&1 \
    | grep -v Warning | tail -12 | tee -a "$OUT/bench_tp.txt"
fi
