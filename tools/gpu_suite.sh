#!/usr/bin/env bash
# The whole GPU suite (`pytest -m gpu`) on the lent GPU, natively and on the portable path (XSERV_ARCH=sm_80), in
# groups that fit a call: every (group, path) pair runs side by side, each path with its own kernel cache. Tests that
# measure the whole GPU's free memory run alone afterwards (another process allocating beside them fails them).
# Logs and JUnit XML in $OUT; each run's failures, summary and slowest tests printed.
#   bash tools/gpu_suite.sh "attention attention-fp8" native sm_80     # one call
#   bash tools/gpu_suite.sh "ops models" native sm_80                  # ops: ~570 tests; models: ~115, the slowest
set -u
source "$(dirname "$0")/gpu_env.sh"
GROUPS_=${1:?groups: attention attention-fp8 ops models}; shift
PATHS=${*:-native sm_80}
LIMIT=${SUITE_LIMIT:-480}
ALONE="tests/test_llm_threads.py::test_cuda_memory_comes_back_after_close"
files() {
  case $1 in
    attention) echo tests/ops/test_attention.py ;;
    attention-fp8) echo tests/ops/test_attention_fp8_kv.py ;;
    ops) echo tests/ops --ignore=tests/ops/test_attention.py --ignore=tests/ops/test_attention_fp8_kv.py ;;
    models) echo tests --ignore=tests/ops --deselect=$ALONE ;;
    *) echo "unknown group $1" >&2; return 1 ;;
  esac
}
with_path() {  # with_path PATH CMD...: CMD on that kernel path, with its own cache
  local path=$1; shift
  if [ $path = native ]; then (unset XSERV_ARCH; XSERV_CACHE_DIR=/tmp/xserv-cache-$path "$@")
  else (XSERV_ARCH=$path XSERV_CACHE_DIR=/tmp/xserv-cache-$path "$@"); fi
}
for group in $GROUPS_; do files $group >/dev/null || exit 2; done
for group in $GROUPS_; do for path in $PATHS; do (
  with_path $path timeout -s ABRT -k 10 $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
    --junitxml=$OUT/$group-$path.xml $(files $group) > $OUT/$group-$path.log 2>&1
  echo "rc=$?" >> $OUT/$group-$path.log ) &
done; done
wait
if [[ " $GROUPS_ " == *" models "* ]]; then for path in $PATHS; do
  with_path $path timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider $ALONE > $OUT/alone-$path.log 2>&1
  echo "=== alone, $path path: $(tail -1 $OUT/alone-$path.log)"
done; fi
for group in $GROUPS_; do for path in $PATHS; do
  echo "=== $group, $path path"
  grep -E "^(FAILED|ERROR)" $OUT/$group-$path.log | cut -c1-240 | head -15
  grep -A6 "slowest 5" $OUT/$group-$path.log | tail -5
  tail -2 $OUT/$group-$path.log
done; done
