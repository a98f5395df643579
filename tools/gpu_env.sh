# Sourced by the one-call GPU scripts: the repository root as the working folder, $OUT, the carried wheels installed
# (tools/gpu_session.sh env), the environment xserv runs in there, and the device named first in the log.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/xserv-out}; mkdir -p "$OUT"
bash tools/gpu_session.sh env >/dev/null 2>&1
export PYTHONUNBUFFERED=1 XSERV_CACHE_DIR=${XSERV_CACHE_DIR:-/tmp/xserv-cache}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
