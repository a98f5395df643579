// Elementwise add: out[i] = a[i] + b[i] over n elements (flattened), fp32 math, one rounding at the store (what
// torch does for bf16 + bf16). `out` may alias `a` or `b` (each element is read then written by one thread).
#include "common.cuh"

// a, b, out: [n] bf16; 8 elements per thread with 16-byte accesses: needs n % 8 == 0 and 16-byte aligned pointers
// (launcher checks). n8 = n / 8; grid = ceil(n8 / blockDim.x).
extern "C" __global__ void add_bf16_vec(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out,
                                        long long n8) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float x[8], y[8];
    xserv::load8(a + i * 8, x);
    xserv::load8(b + i * 8, y);
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] += y[j];
    xserv::store8(out + i * 8, x);
}

// a, b, out: [n4] float4 (n = 4 * n4 fp32): needs n % 4 == 0 and 16-byte aligned pointers.
extern "C" __global__ void add_f32_vec(const float4* a, const float4* b, float4* out, long long n4) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 x = a[i], y = b[i];
    out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
}

// a, b, out: [n] bf16, any alignment.
extern "C" __global__ void add_bf16_scalar(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out,
                                           long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// a, b, out: [n] fp32, any alignment.
extern "C" __global__ void add_f32_scalar(const float* a, const float* b, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
