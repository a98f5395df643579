#!/usr/bin/env bash
# One call on the lent GPU machine: set up, then run the named stages. Logs go to $OUT when it is set.
#   bash tools/gpu_session.sh env runtime ops bench-ops model ...
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/xserv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=/tmp/xserv-cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
run() { echo "=== $*"; "$@" 2>&1 | tee -a "$OUT/log.txt"; }
for stage in "$@"; do
  case $stage in
    env) run nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
         run python3 -c "import cuda.bindings, cuda.core, numpy, torch; from cuda.bindings import nvrtc; print('cuda-bindings', cuda.bindings.__version__, 'cuda-core', cuda.core.__version__, 'nvrtc', nvrtc.nvrtcVersion()[1:], 'torch', torch.__version__)" ;;
    compile) run python3 -m tools.kernel_harness compile ;;
    runtime) run python3 -m pytest -q -x tests/test_runtime.py tests/test_tensor.py tests/test_compile_all.py ;;
    tests) run python3 -m pytest -q tests ;;
    gpu-tests) run python3 -m pytest -q -m gpu tests ;;
    check) run python3 -m tools.kernel_harness check all ;;
    bench-runtime) run python3 -m tools.bench_runtime ;;
    bench-ops) run python3 -m tools.kernel_harness bench all --vs torch ;;
    *) run bash -c "$stage" ;;
  esac
done
