// The output gate of Qwen3.5's gated attention: out = attn * sigmoid(gate), element-wise, with gate the trailing
// Hq heads of the packed qkvg projection (columns [q | k | v | gate]). fp32 math, one rounding to bf16 at the store
// (transformers in bf16 rounds sigmoid(gate) to bf16 first; rounding once is closer to the fp32 result).
// Memory-bound: each thread moves one 16-byte chunk (8 values) of attn, gate and out.
#include "common.cuh"

// attn, out: [T, Hq, D] bf16 (out may be attn); qkvg: [T, gate_row_stride] bf16, token t's gate for attn's row at
// qkvg + t * gate_row_stride + gate_offset; row = Hq * D values (a multiple of 8), all 16-byte aligned.
// grid = ceil(T * row / 8 / blockDim.x).
extern "C" __global__ void attention_output_gate_bf16(const __nv_bfloat16* attn, const __nv_bfloat16* __restrict__ qkvg,
                                                      __nv_bfloat16* out, long long num_tokens, int row,
                                                      long long gate_row_stride, long long gate_offset) {
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = row / 8;
    if (chunk >= num_tokens * per_row) return;
    const long long t = chunk / per_row;
    const int c = (int)(chunk - t * per_row);
    float a[8], g[8];
    xserv::load8(attn + chunk * 8, a);
    xserv::load8(qkvg + t * gate_row_stride + gate_offset + 8 * c, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = a[e] / (1.f + __expf(-g[e]));
    xserv::store8(out + chunk * 8, a);
}
