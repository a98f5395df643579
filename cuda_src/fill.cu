// Fill and copy helpers used by the runtime's own tests and benchmarks.
#include "common.cuh"

// out[i] = value for i < n.   out: [n] float32
extern "C" __global__ void fill_f32(float* out, float value, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

// Device-to-device copy with 16-byte accesses, grid-stride; the copy-bandwidth ceiling for benchmarks.
// dst, src: [n16] uint4
extern "C" __global__ void copy_u128(uint4* __restrict__ dst, const uint4* __restrict__ src, long long n16) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
