#!/usr/bin/env bash
# The library's reliability on the lent GPU, one call (issue 27): the threaded LLM, memory after close(), the
# engine thread's cost, then the rest of the GPU suite outside the kernel files as far as time allows.
#   bash tools/gpu_check_library.sh [SECONDS for the broad suite, default 240]
set -u
source "$(dirname "$0")/gpu_env.sh"
bash tools/gpu_session.sh compile >/dev/null
echo "=== library GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_llm_threads.py tests/test_llm.py tests/test_server_gpu.py \
  2>&1 | grep -v "^$" | tail -15
m=/tmp/model-0.6b
[ -d $m ] || python3 -m tools.make_test_model --preset 0.6b --out $m --no-progress >/dev/null
echo "=== memory after close, 0.6B, default KV sizing"
python3 - $m <<'PY'
import gc, sys
from xserv import LLM, SamplingParams
from xserv.runtime import get_device
dev = get_device()
for i in range(3):
    before = dev.memory_info()[0]
    llm = LLM(sys.argv[1], progress=False)
    held, kv = dev.memory_info()[0], llm.kv_cache.num_tokens
    llm.generate("Hello", SamplingParams(max_tokens=8))
    (llm.close() if i < 2 else (lambda: None)()); del llm; gc.collect()
    after = dev.memory_info()[0]
    print(f"{dev.name}: LLM {i}: free {before >> 20} MiB before, {held >> 20} held, {after >> 20} after; KV {kv} tokens")
PY
echo "=== engine thread cost, 0.6B"
python3 -m tools.bench_engine_thread --model $m --rounds 2 2>&1 | tail -3
echo "=== the rest of the GPU suite (outside tests/ops), up to ${1:-240} s"
timeout "${1:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/ops \
  --deselect tests/test_llm_threads.py --deselect tests/test_llm.py 2>&1 | grep -v "^$" | tail -15
