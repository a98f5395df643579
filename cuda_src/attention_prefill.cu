// Causal prefill attention over the paged KV cache, head dims 64 and 128: the simple cross-check and the v3 kernels
// of every arch but sm_90a (templates, arguments and layout: attention_prefill.cuh; sm_90a: attention_prefill_sm90.cu).
#include "attention_prefill.cuh"

extern "C" __global__ void __launch_bounds__(128) attention_prefill_simple_d64(XSERV_PREFILL_ARGS) {
    prefill_simple<64>(XSERV_PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_prefill_simple_d128(XSERV_PREFILL_ARGS) {
    prefill_simple<128>(XSERV_PREFILL_PASS);
}

XSERV_PREFILL_V3(128, 2, 8, false, , 3, 64, )  // m2w8_b3
XSERV_PREFILL_V3(64, 1, 8, true, q, 3, 64, )    // m1w8q_b3
// d128 where a block may have at most 99 KB of shared memory (sm_86, sm_89, sm_120: m2w8_b3 asks 128 KB): 32-key
// tiles, 96 KB (ops/attention/prefill.py fit_v3 picks it from the device's limits)
XSERV_PREFILL_V3(128, 2, 8, false, , 3, 32, _k32)  // m2w8_b3_k32
