// Test-only kernels for programmatic dependent launch (Kernel(..., pdl=True)): a slow producer that lets its
// dependents start at once, and consumers with and without the pdl_wait() they need. tests/test_runtime.py runs
// them eagerly and inside a captured CUDA graph. Not a production family (cuda_src/dev/: compiled on request).
#include "common.cuh"

namespace {

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace

// buf[i] = src[i] + 1, written only after `delay_ns` of spinning. Releases its dependents first thing, so a
// dependent launched with PDL runs its prologue during the spin; it must pdl_wait() before reading buf.
// src, buf: [n] float
extern "C" __global__ void pdl_producer(const float* __restrict__ src, float* __restrict__ buf, long long n,
                                        long long delay_ns) {
    xserv::pdl_wait();  // src may be an earlier kernel's output when this kernel is itself launched with PDL
    xserv::pdl_launch_dependents();
    const unsigned long long start = global_ns();
    while (global_ns() - start < (unsigned long long)delay_ns) {
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        buf[i] = src[i] + 1.0f;
}

// out[i] = 2 * buf[i], read after pdl_wait(): correct whether or not the producer is still running at launch.
// buf, out: [n] float
extern "C" __global__ void pdl_consumer(const float* __restrict__ buf, float* __restrict__ out, long long n) {
    xserv::pdl_wait();  // griddepcontrol.wait: returns once the previous kernel has completed and its writes are visible
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * buf[i];
}

// The same without the wait: launched with PDL after pdl_producer it reads buf before the producer wrote it (the
// stale values show that the launch attribute took effect); launched plainly it is stream-ordered and correct.
// buf, out: [n] float
extern "C" __global__ void pdl_consumer_nowait(const float* __restrict__ buf, float* __restrict__ out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.0f * buf[i];
}
