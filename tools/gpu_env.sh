# Sourced by the one-call GPU scripts: the repository root as the working folder, $OUT, the carried wheels installed
# (tools/gpu_session.sh env), the environment xserv runs in there, and the device named first in the log.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/xserv-out}; mkdir -p "$OUT"
bash tools/gpu_session.sh env >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 XSERV_CACHE_DIR=${XSERV_CACHE_DIR:-/tmp/xserv-cache}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# run_test_paths "TESTS" TIMEOUT PATH...: `pytest -m gpu` over TESTS on each kernel path side by side (native, or an
# XSERV_ARCH such as sm_80 / sm_89), each with its own kernel cache, logs in $OUT/tests-PATH.log; then each path's
# failures and summary. Leaves XSERV_ARCH unset and the native cache selected.
run_test_paths() {
  local tests=$1 limit=$2 path; shift 2
  for path in "$@"; do (
    if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
    export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
    timeout -s ABRT -k 10 $limit python3 -m pytest -m gpu -q -p no:cacheprovider $tests > $OUT/tests-$path.log 2>&1
    echo "rc=$?" >> $OUT/tests-$path.log ) &
  done
  wait
  for path in "$@"; do
    echo "=== tests, $path path"; grep -E "^(FAILED|ERROR|E  )" $OUT/tests-$path.log | cut -c1-300 | head -12
    tail -2 $OUT/tests-$path.log
  done
  unset XSERV_ARCH
  export XSERV_CACHE_DIR=/tmp/xserv-cache-native
}
