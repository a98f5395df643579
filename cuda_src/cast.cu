// Dtype conversion between bf16, fp16 and fp32 over n elements (flattened): through fp32 (exact for bf16/fp16
// inputs), one round-to-nearest-even to the target type (NaN stays NaN, overflow goes to inf).
// One element per thread, grid-stride. grid = min(ceil(n / blockDim.x), launcher's cap).
#include "common.cuh"

namespace {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

template <typename In, typename Out>
__device__ __forceinline__ void cast_n(const In* __restrict__ x, Out* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = from_f32<Out>(to_f32(x[i]));
}

}  // namespace

// x: [n] In; out: [n] Out.
#define XSERV_CAST(NAME, IN, OUT)                                                                                    \
    extern "C" __global__ void NAME(const IN* x, OUT* out, long long n) { cast_n<IN, OUT>(x, out, n); }
XSERV_CAST(cast_bf16_to_f32, __nv_bfloat16, float)
XSERV_CAST(cast_f16_to_f32, __half, float)
XSERV_CAST(cast_f32_to_bf16, float, __nv_bfloat16)
XSERV_CAST(cast_f32_to_f16, float, __half)
XSERV_CAST(cast_bf16_to_f16, __nv_bfloat16, __half)
XSERV_CAST(cast_f16_to_bf16, __half, __nv_bfloat16)
#undef XSERV_CAST
