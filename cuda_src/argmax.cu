// Row argmax: out[b] = the index of the largest x[b, :]; ties go to the lowest index. NaN counts as larger than
// every number, so a row holding NaN returns the index of its first NaN (NumPy's np.argmax behaves the same).
// One CTA per row: each thread scans a strided slice in increasing index order, then a warp-shuffle and a
// shared-memory reduction over (value, index) pairs. grid = batch, block = launcher's thread count (<= 1024,
// a multiple of 32). Few rows (greedy decode at batch 1: one CTA reading a 600 KB row took 17 us): the
// argmax_*_split kernels spread each row over several CTAs and the last one to finish reduces their candidates.
#include "common.cuh"

namespace {

// Is candidate (v, i) preferred over the current best (bv, bi)?
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    const bool vn = isnan(v), bn = isnan(bv);
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

// Block-wide reduction of each thread's (best, index); thread 0 gets the block's and writes *out (and *out_val).
__device__ __forceinline__ void reduce_and_store(float best, int index, int* out, float* out_val = nullptr) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, off);
        const int i = __shfl_xor_sync(0xffffffffu, index, off);
        if (better(v, i, best, index)) { best = v; index = i; }
    }
    if (lane == 0) { s_val[warp] = best; s_idx[warp] = index; }
    // Every warp's candidate is in shared memory before warp 0 reduces them.
    __syncthreads();
    if (warp == 0) {
        best = lane < nwarps ? s_val[lane] : __int_as_float(0xff800000);
        index = lane < nwarps ? s_idx[lane] : 0x7fffffff;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, best, off);
            const int i = __shfl_xor_sync(0xffffffffu, index, off);
            if (better(v, i, best, index)) { best = v; index = i; }
        }
        if (lane == 0) {
            *out = index;
            if (out_val) *out_val = best;
        }
    }
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// Start from (-inf, INT_MAX): any element beats it (a -inf element by its lower index), so V >= 1 always yields
// a real index.
template <typename T>
__device__ __forceinline__ void argmax_scalar(const T* __restrict__ x, int* __restrict__ out, int vocab) {
    const T* row = x + (long long)blockIdx.x * vocab;
    float best = __int_as_float(0xff800000);
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = to_f32(row[i]);
        if (better(v, i, best, index)) { best = v; index = i; }
    }
    reduce_and_store(best, index, out + blockIdx.x);
}

// This thread's best of the float4s [first, end) of a row (stride blockDim.x), in increasing index order.
__device__ __forceinline__ void scan_f32_vec(const float4* row, int first, int end, float& best, int& index) {
    best = __int_as_float(0xff800000);
    index = 0x7fffffff;
    for (int c = first + threadIdx.x; c < end; c += blockDim.x) {
        const float4 q = row[c];
        const float v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (better(v[j], c * 4 + j, best, index)) { best = v[j]; index = c * 4 + j; }
    }
}

}  // namespace

// x: [batch, vocab] fp32; out: [batch] int32.
extern "C" __global__ void argmax_f32(const float* x, int* out, int vocab) { argmax_scalar<float>(x, out, vocab); }

// x: [batch, vocab] bf16; out: [batch] int32.
extern "C" __global__ void argmax_bf16(const __nv_bfloat16* x, int* out, int vocab) {
    argmax_scalar<__nv_bfloat16>(x, out, vocab);
}

// x: [batch, vocab] bf16; out: [batch] int32. 16-byte loads: needs vocab % 8 == 0 and x 16-byte aligned.
extern "C" __global__ void argmax_bf16_vec(const __nv_bfloat16* __restrict__ x, int* __restrict__ out, int vocab) {
    const __nv_bfloat16* row = x + (long long)blockIdx.x * vocab;
    float best = __int_as_float(0xff800000);
    int index = 0x7fffffff;
    for (int c = threadIdx.x; c < vocab / 8; c += blockDim.x) {
        float v[8];
        xserv::load8(row + c * 8, v);
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (better(v[j], c * 8 + j, best, index)) { best = v[j]; index = c * 8 + j; }
    }
    reduce_and_store(best, index, out + blockIdx.x);
}

// x: [batch, vocab] fp32; out: [batch] int32. 16-byte loads: needs vocab % 4 == 0 and x 16-byte aligned.
extern "C" __global__ void argmax_f32_vec(const float* __restrict__ x, int* __restrict__ out, int vocab) {
    float best;
    int index;
    scan_f32_vec(reinterpret_cast<const float4*>(x + (long long)blockIdx.x * vocab), 0, vocab / 4, best, index);
    reduce_and_store(best, index, out + blockIdx.x);
}

// As argmax_f32_vec, a row split over gridDim.x CTAs: grid (splits, batch), split s scans the float4s
// [s * chunk4, (s + 1) * chunk4) and stores its candidate in part_val / part_idx [batch, splits]; the last CTA of
// the row to finish (a counter per row, which that CTA resets: graph replays reuse it) reduces the candidates.
// `better` is a total order (value, then lowest index; NaN first), so the reduction order cannot change the answer.
extern "C" __global__ void argmax_f32_vec_split(const float* __restrict__ x, int* __restrict__ out, int vocab,
                                                int chunk4, float* part_val, int* part_idx, int* counters) {
    const int b = blockIdx.y, splits = gridDim.x;
    const int first = blockIdx.x * chunk4, end = min(vocab / 4, first + chunk4);
    float best;
    int index;
    scan_f32_vec(reinterpret_cast<const float4*>(x + (long long)b * vocab), first, end, best, index);
    reduce_and_store(best, index, part_idx + b * splits + blockIdx.x, part_val + b * splits + blockIdx.x);
    __shared__ int last;
    if (!xserv::last_to_arrive(counters + b, splits, last)) return;
    best = __int_as_float(0xff800000);
    index = 0x7fffffff;
    for (int i = threadIdx.x; i < splits; i += blockDim.x) {
        const float v = __ldcg(part_val + b * splits + i);
        const int j = __ldcg(part_idx + b * splits + i);
        if (better(v, j, best, index)) { best = v; index = j; }
    }
    reduce_and_store(best, index, out + b);
    if (threadIdx.x == 0) counters[b] = 0;
}
