// Shared device helpers for xserv kernels: 16-byte bf16 vectors, warp/block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>


namespace xserv {

// Eight bf16 values moved as one 16-byte access (LDG.128 / STG.128). Callers guarantee 16-byte alignment.
struct __align__(16) bf16x8 {
    __nv_bfloat162 h[4];
};

// Eight bf16 values held as one 16-byte register quad, widened to fp32 in order.
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&out)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&out)[8]) {
    bf16x8 v = *reinterpret_cast<const bf16x8*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(v.h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&in)[8]) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<bf16x8*>(p) = v;
}

// Eight fp32 values moved as two 16-byte accesses (the fp32 residual stream). Callers guarantee alignment.
__device__ __forceinline__ void load8(const float* p, float (&out)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void store8(float* p, const float (&in)[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds one float per warp (<= 32 warps).
// The first barrier makes the per-warp partials visible; the second keeps a following call from overwriting
// `scratch` before every warp has read it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = lane < nwarps ? scratch[lane] : 0.f;
    total = warp_sum(total);
    __syncthreads();
    return total;
}

// The threadfence-reduction hand-off: each CTA of a group counts itself done on `counter`, and the one that arrives
// last (true in all of its threads) sees every other CTA's global writes made before they arrived. Every thread
// of the CTA calls it; `last` is a shared int. The caller of the last CTA resets the counter if it is reused.
// The ordering comes from one acquire-release atomic of thread 0 between two CTA barriers (the pattern of
// cooperative groups' grid sync), not from a __threadfence in every thread: the first barrier orders the CTA's
// writes before thread 0's release (release is cumulative), the second orders thread 0's acquire of the other
// CTAs' writes before every thread's reads (docs/kernels/history/attention.md, "Short-context tail").
__device__ __forceinline__ bool last_to_arrive(int* counter, int total, int& last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int before;
        asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
        last = before == total - 1;
    }
    __syncthreads();
    return last;
}

// Programmatic dependent launch (Hopper). A kernel launched with the programmatic-stream-serialization attribute
// (Kernel(..., pdl=True)) may start while the kernel before it in the stream is still running. It must call
// pdl_wait() before its first read of anything an earlier kernel wrote (work that depends only on weights may come
// first: that is the point), and may call pdl_launch_dependents() once its own dependents may start their prologue.
// Both are no-ops when the kernel was launched without the attribute, and compile to nothing before sm_90.
// That is the one arch guard in xserv's kernels that compiles code away, and it is exact, not a stub: PDL launches
// exist from sm_90 on, the runtime never launches with the attribute for code compiled below sm_90
// (runtime/arch.pdl_enabled, checked in Kernel), and a kernel launched without it starts only after every earlier
// kernel in the stream has finished, which is all pdl_wait() would wait for; with no dependents waiting on it,
// pdl_launch_dependents() has nothing to release. (activation.ptx drops its griddepcontrol lines the same way.)
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace xserv
