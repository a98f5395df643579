// SwiGLU activation on the fused [gate; up] projection: out[t, i] = silu(x[t, i]) * x[t, I + i], i < I.
// silu in fp32 as g / (1 + exp(-g)). Rounding matches HF's bf16 `act_fn(gate) * up`: the silu output is rounded
// to bf16, then the bf16 x bf16 product is computed in fp32 and rounded to bf16 again.
#include "norm.cuh"

namespace {
__device__ __forceinline__ float silu_mul(float g, float u) { return xserv::round_bf16(g / (1.f + expf(-g))) * u; }
}  // namespace

// x: [num_tokens, 2 * inter] bf16; out: [num_tokens, inter] bf16. One thread per 8 outputs (16-byte loads and
// stores): needs inter % 8 == 0 and 16-byte aligned x and out (launcher checks).
// grid = ceil(num_tokens * inter / 8 / blockDim.x).
extern "C" __global__ void silu_and_mul_bf16_vec(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                                 long long num_tokens, int inter) {
    const int chunks = inter / 8;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= num_tokens * chunks) return;
    const long long t = idx / chunks;
    const int c = (int)(idx - t * chunks);
    const __nv_bfloat16* row = x + t * 2 * inter;
    float g[8], u[8];
    xserv::load8(row + c * 8, g);
    xserv::load8(row + inter + c * 8, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = silu_mul(g[j], u[j]);
    xserv::store8(out + t * inter + c * 8, g);
}

// Same shapes, any inter and alignment: one thread per output. grid = ceil(num_tokens * inter / blockDim.x).
extern "C" __global__ void silu_and_mul_bf16_scalar(const __nv_bfloat16* __restrict__ x,
                                                    __nv_bfloat16* __restrict__ out, long long num_tokens, int inter) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= num_tokens * inter) return;
    const long long t = idx / inter;
    const int i = (int)(idx - t * inter);
    const float g = __bfloat162float(x[t * 2 * inter + i]), u = __bfloat162float(x[t * 2 * inter + inter + i]);
    out[idx] = __float2bfloat16_rn(silu_mul(g, u));
}
