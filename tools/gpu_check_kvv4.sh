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
BF16_DECODE="tests/ops/test_attention.py::test_decode_rope_gpu_v2_fallback_and_variant"
BF16_DECODE+=" tests/ops/test_attention.py::test_decode_gpu_graph_replays"
export FP8KV_TESTS=${FP8KV_TESTS:-"tests/ops/test_attention_fp8_kv.py tests/test_fp8_kv_model.py $BF16_DECODE"}
export FP8KV_PATHS=${FP8KV_PATHS:-"native sm_80"} FP8KV_TEST_LIMIT=${FP8KV_TEST_LIMIT:-270}
export FP8KV_DEADLINE=${FP8KV_DEADLINE:-500}
exec bash "$(dirname "$0")/gpu_check_fp8_kv.sh" "$@"
