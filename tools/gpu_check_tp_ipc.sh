#!/usr/bin/env bash
# The one-shot IPC all-reduce on the lent 2-GPU machine (nvidia-h100-x2), one call:
#   1. peer access between the GPUs (nvidia-smi topo), then the GPU tests: tests/test_ipc_allreduce.py (the kernel
#      against NumPy and NCCL, eager and graph-captured, many epochs, the same bits on both ranks) and the TP=2
#      model tests of tests/test_tp_engine.py (IPC vs NCCL-only logits and greedy tokens; TP=2 vs TP=1);
#   2. all-reduce latency, IPC vs NCCL, eager and inside a CUDA graph: [1, 4096], [1, 5120] bf16 and larger;
#   3. `bash tools/gpu_bench_tp.sh 8b`: 8B-shaped batch-1 decode TP=2 vs TP=1 (goal 1.5x), then the same with
#      XSERV_TP_ALLREDUCE=nccl for the before/after in one session.
#   bash tools/gpu_check_tp_ipc.sh [tests] [latency] [bench]      (default: all three)
set -u
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
stages=("${@:-tests latency bench}"); stages=(${stages[@]})
want() { [[ " ${stages[*]} " == *" $1 "* ]]; }
log="$OUT/check_tp_ipc.txt"
nvidia-smi topo -m 2>&1 | head -5 | tee -a "$log"
if want tests; then
  echo "=== GPU tests: IPC all-reduce, TP=2 model" | tee -a "$log"
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_ipc_allreduce.py tests/test_tp_engine.py \
    -p no:cacheprovider 2>&1 | tail -20 | tee -a "$log"
  echo "=== tools/check_ipc_allreduce.py check" | tee -a "$log"
  timeout 300 python3 -m tools.check_ipc_allreduce check 2>&1 | tail -25 | tee -a "$log"
fi
if want latency; then
  echo "=== all-reduce latency (us per call; 2 ranks): IPC one-shot vs NCCL" | tee -a "$log"
  timeout 300 python3 -m tools.check_ipc_allreduce bench 2>&1 | tail -20 | tee -a "$log"
fi
if want bench; then
  echo "=== 8B-shaped batch-1 decode, TP=2 (IPC for small all-reduces) vs TP=1" | tee -a "$log"
  timeout 420 bash tools/gpu_bench_tp.sh 8b 2>&1 | tail -25 | tee -a "$log"
  echo "=== the same with XSERV_TP_ALLREDUCE=nccl (NCCL for every all-reduce)" | tee -a "$log"
  XSERV_TP_ALLREDUCE=nccl timeout 420 bash tools/gpu_bench_tp.sh 8b 2>&1 | tail -25 | tee -a "$log"
fi
