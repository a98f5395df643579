// What the GEMV kernels (gemv.cu) share with the kernels that fold a projection in (the decode attention's
// development form that computes its own q/k/v rows, attention_decode.cu): the weight load, the prologues that stage
// the transformed x row(s) in shared memory, and the one-row dot product over 8 bf16 pairs. See gemv.cu's header for
// the prologues' rounding.
#pragma once
#include "norm.cuh"

namespace xserv {
namespace gemv {

enum Prologue : int { kBf16 = 0, kRmsNorm = 1, kSiluMul = 2 };

// A weight load that should not displace x or the staged rows in L1: W is read exactly once.
__device__ __forceinline__ uint4 load_weight(const __nv_bfloat16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// silu(g) = g / (1 + 2^(-g * log2 e)) with ex2.approx and an IEEE division, exactly as activation.ptx.
__device__ __forceinline__ float silu(float g) {
    float e;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.4426950408889634f));
    return __fdiv_rn(g, 1.f + e);
}

// Stage the m transformed x rows in shared memory (bf16 [m][K]). Every thread of the CTA takes part.
template <int M, int THREADS>
__device__ __forceinline__ void stage_x(__nv_bfloat16* xs, int KS, float* scratch, const void* x, long long x_stride,
                                        const int* x_rows, const __nv_bfloat16* norm_w, float eps, int m, int K,
                                        int prologue) {
    constexpr int kThreads = THREADS, kWarps = THREADS / 32;
    const int chunks = K / 8;
    if (prologue == kRmsNorm) {
        // Pass 1: each row's sum of squares (per-thread partials, then warp and CTA sums in a fixed order).
        float ss[M];
#pragma unroll
        for (int i = 0; i < M; ++i) ss[i] = 0.f;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
                for (int c = threadIdx.x; c < chunks; c += kThreads) {
                    float v[8];
                    xserv::load8(row + c * 8, v);
                    ss[i] += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3] + v[4] * v[4] + v[5] * v[5] +
                             v[6] * v[6] + v[7] * v[7];
                }
            }
        }
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            const float s = xserv::warp_sum(ss[i]);
            if (lane == 0) scratch[i * kWarps + warp] = s;
        }
        __syncthreads();
        // Pass 2: x = bf16(w * (r * inv)), re-reading the row (L1/L2 hits).
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                float total = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) total += scratch[i * kWarps + w];
                const float inv = xserv::rms_inv(total, K, eps);
                const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
                for (int c = threadIdx.x; c < chunks; c += kThreads) {
                    float v[8], w[8];
                    xserv::load8(row + c * 8, v);
                    xserv::load8(norm_w + c * 8, w);
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[j] = w[j] * (v[j] * inv);
                    xserv::store8(xs + (long long)i * KS + c * 8, v);
                }
            }
        }
    } else if (prologue == kSiluMul) {
        // One flat loop over (row, chunk) so that a thread's loads are independent (in flight together).
#pragma unroll 4
        for (int e = threadIdx.x; e < m * chunks; e += kThreads) {
            const int i = e / chunks, c = e - i * chunks;
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            float g[8], u[8];
            xserv::load8(row + c * 8, g);
            xserv::load8(row + K + c * 8, u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = xserv::round_bf16(silu(g[j])) * u[j];
            xserv::store8(xs + (long long)i * KS + c * 8, g);
        }
    } else {
#pragma unroll 4
        for (int e = threadIdx.x; e < m * chunks; e += kThreads) {
            const int i = e / chunks, c = e - i * chunks;
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            reinterpret_cast<uint4*>(xs + (long long)i * KS)[c] = reinterpret_cast<const uint4*>(row)[c];
        }
    }
    __syncthreads();
}

// fp32 acc + the dot product of 8 bf16 weights and 8 bf16 x values (16 bytes each), one fma at a time in order.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
    const unsigned wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // bf16 -> fp32 is a shift (low half) or a mask (high half)
        acc = fmaf(__uint_as_float(wv[j] << 16), __uint_as_float(xv[j] << 16), acc);
        acc = fmaf(__uint_as_float(wv[j] & 0xffff0000u), __uint_as_float(xv[j] & 0xffff0000u), acc);
    }
    return acc;
}

}  // namespace gemv
}  // namespace xserv
