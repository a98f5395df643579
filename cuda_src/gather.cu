// Token feedback between engine steps: out[i] = src[index[i]] where index[i] >= 0; rows with index[i] < 0 keep
// the value the host wrote. Lets a decode step be launched before the previous step's sampled tokens have come
// back to the host: its input ids are gathered on the device from the previous step's output.
#include "common.cuh"

// src: [m] int32   index: [n] int32 (-1 = keep)   out: [n] int32
extern "C" __global__ void gather_i32(const int* __restrict__ src, const int* __restrict__ index, int* __restrict__ out,
                                      int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const int j = index[i];
        if (j >= 0) out[i] = src[j];
    }
}
