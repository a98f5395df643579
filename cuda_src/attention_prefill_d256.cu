// Causal prefill attention at head_dim 256 (Qwen3.5's gated attention layers), on every arch (sm_90a too: the wgmma
// kernels of attention_prefill_sm90.cu are sized for head dims up to 128): the simple cross-check and v3
// (attention_prefill.cuh) with one 16-row m-tile a warp (its O accumulators alone are 128 registers), Q re-read from
// shared memory, 32-key tiles: 96 KB of shared memory, within the 99 KB arches (sm_86, sm_89, sm_120). Its own
// family: compiled at start-up for a model of head dim 256 only (the piece of the shapes line), never for Qwen3.
// xserv-shapes: head_dim=256 (a start-up of a head-dim-256 model compiles it; the portable and the hopper path)
#include "attention_prefill.cuh"

extern "C" __global__ void __launch_bounds__(128) attention_prefill_simple_d256(XSERV_PREFILL_ARGS) {
    prefill_simple<256>(XSERV_PREFILL_PASS);
}

XSERV_PREFILL_V3(256, 1, 4, false, , 3, 32, _k32)  // m1w4_b3_k32
