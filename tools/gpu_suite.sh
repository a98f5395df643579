#!/usr/bin/env bash
# The whole GPU suite (`pytest -m gpu`) on the lent GPU, natively and on the portable path (XSERV_ARCH=sm_80) side by
# side, each with its own kernel cache; in two calls because one does not hold it: the attention tests (~570, the
# most compiling) and the rest. Logs and JUnit XML in $OUT; each path's failures, summary and slowest tests printed.
#   bash tools/gpu_suite.sh attention|rest [native sm_80 ...]
set -u
source "$(dirname "$0")/gpu_env.sh"
GROUP=${1:?attention or rest}; shift
ATTENTION="tests/ops/test_attention.py tests/ops/test_attention_fp8_kv.py"
case $GROUP in
  attention) TESTS=$ATTENTION ;;
  rest) TESTS="tests $(for f in $ATTENTION; do printf -- '--ignore=%s ' $f; done)" ;;
  *) echo "unknown group $GROUP: attention or rest"; exit 2 ;;
esac
LIMIT=${SUITE_LIMIT:-540}
PATHS=${*:-native sm_80}
for path in $PATHS; do (
  if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
  export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
  timeout -s ABRT -k 10 $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
    --junitxml=$OUT/$GROUP-$path.xml $TESTS > $OUT/$GROUP-$path.log 2>&1
  echo "rc=$?" >> $OUT/$GROUP-$path.log ) &
done
wait
for path in $PATHS; do
  echo "=== $GROUP, $path path"
  grep -E "^(FAILED|ERROR)" $OUT/$GROUP-$path.log | cut -c1-240 | head -15
  grep -A7 "slowest 5" $OUT/$GROUP-$path.log | tail -5
  tail -2 $OUT/$GROUP-$path.log
done
