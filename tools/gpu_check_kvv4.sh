#!/usr/bin/env bash
# Issue 31: decode attention on v4's structure over an FP8 KV cache (branch pending/kvv4; docs/kernels/attention.md,
# "v4 on an FP8 cache": the expectation), one call. tools/gpu_check_fp8_kv.sh with
#   tests: the FP8-KV GPU tests (tests/ops/test_attention_fp8_kv.py: the e4m3 v4 / v4w8 / subgroup / v2 kernels against
#          NumPy at 512 and 8,192 keys, G = 2, 4, 5, 8, d64/d128, batch 1 and 5, NaN-poisoned outputs; the fused
#          one-launch entry bit-identical to the quantizing rope kernel + attention_decode, caches byte for byte;
#          tests/test_fp8_kv_model.py), and two bf16 decode GPU tests for the launcher changes (the v2 fallback's
#          combine, graph replays), natively and with XSERV_ARCH=sm_80 (the soft e4m3 conversions) side by side;
#   bench: the 0.6B-shaped checkpoint, bf16 KV against --kv-cache-dtype fp8_e4m3 in the same call: `xserv bench
#          latency` at context 512 (batch 1; expected fp8 ~1,360-1,420 tok/s, ~bf16) and `xserv bench throughput`
#          (the offline workload; expected ~1.25-1.45x bf16). Summary last; logs under $OUT.
#   bash tools/gpu_check_kvv4.sh [STEP ...]     steps: tests make bench (default all)
cd "$(dirname "$0")/.." || exit 1
BF16_DECODE="tests/ops/test_attention.py::test_decode_rope_gpu_v2_fallback_and_variant"
BF16_DECODE+=" tests/ops/test_attention.py::test_decode_gpu_graph_replays"
export FP8KV_TESTS=${FP8KV_TESTS:-"tests/ops/test_attention_fp8_kv.py tests/test_fp8_kv_model.py $BF16_DECODE"}
export FP8KV_PATHS=${FP8KV_PATHS:-"native sm_80"} FP8KV_TEST_LIMIT=${FP8KV_TEST_LIMIT:-240}
export FP8KV_DEADLINE=${FP8KV_DEADLINE:-460}  # s after the precompile (~1-1.5 min): ~8-9 min in all
# The FP8 pieces the tests load (and the v2 pieces of their combine, the bf16 tests' pieces) compiled first, on 8
# threads per path, both paths at once (in the tests they would compile one after another: minutes).
if [[ " ${*:-tests} " == *" tests "* ]]; then
  source tools/gpu_env.sh
  for path in $FP8KV_PATHS; do (
    if [ $path = native ]; then unset XSERV_ARCH; else export XSERV_ARCH=$path; fi
    export XSERV_CACHE_DIR=/tmp/xserv-cache-$path
    python3 - <<'PY' 2>&1 | tail -2
import time
from xserv.runtime import get_device
from xserv.runtime.compiler import compile_families, piece
shapes = [(128, 2), (128, 4), (128, 8), (128, 5), (64, 2), (64, 4)]
names = [piece(f, head_dim=d, group=g, kvfp8=1) for d, g in shapes
         for f in ("attention_decode_fp8", "attention_decode_v2", "attention_decode")]
t = time.time()
compile_families(names, get_device().arch, workers=8)
print(f"precompiled {len(names)} decode pieces for {get_device().arch} in {time.time() - t:.0f} s")
PY
  ) & done
  wait
fi
exec bash tools/gpu_check_fp8_kv.sh "$@"  # (gpu_env.sh: the repository root is the working folder)
