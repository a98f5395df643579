// RMSNorm family (Qwen3RMSNorm rounding, see norm.cuh):
//   rmsnorm:            out = weight * bf16(x * rsqrt(mean(x^2) + eps))                      per row of `hidden`
//   fused_add_rmsnorm:  residual <- bf16(x + residual) (in place); out = rmsnorm(residual)  (vLLM's convention)
//                       *_f32res: the residual stream kept in fp32: residual <- x + residual, unrounded, and
//                       out = bf16(weight * residual * rsqrt(...)) with no intermediate bf16 rounding (HF's
//                       RMSNorm on an fp32 input). Keeping the stream in fp32 stops 2 roundings per layer from
//                       accumulating over 36+ layers.
//   head_rmsnorm:       the same over the last dim D (64 or 128) of [rows, D] head vectors (Qwen3 q_norm / k_norm)
// bf16 storage, fp32 math. `out` may alias `x` (every element is read and then written by the same thread).
//
// Full rows: one CTA per row, the row held in registers (VPT 16-byte vectors per thread), one block reduction.
// The *_vpt* kernels assume hidden % 8 == 0, 16-byte aligned x/residual/weight/out (the launcher checks) and
// hidden <= 8 * VPT * blockDim.x; the *_scalar kernels take any hidden and alignment (two passes over the row).
//
// Programmatic dependent launch (the row kernels): every CTA waits for the kernel before (pdl_wait) before it reads
// anything, then lets the next kernel launch (pdl_launch_dependents): for the few rows of a decode step, the GEMV
// that projects the normalised rows starts its CTAs and loads its first weights while this kernel runs (it waits
// for this grid before it reads `out`). Both are no-ops when the launcher does not set the attribute.
#include "norm.cuh"

using xserv::bf16x8;

namespace {

constexpr int kRowsPerWarp = 2;  // head rows per warp: two rows' loads in flight before the first reduction

// Eight residual values moved as 16-byte accesses (common.cuh: one bf16x8, or two float4), and whether the
// stream is rounded to bf16 (Qwen3RMSNorm's rounding of the normalised value applies to bf16 streams only).
using xserv::load8;
using xserv::store8;
template <typename Res> constexpr bool kRoundedStream = true;
template <> constexpr bool kRoundedStream<float> = false;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ void assign(__nv_bfloat16& dst, float v) { dst = __float2bfloat16_rn(v); }
__device__ __forceinline__ void assign(float& dst, float v) { dst = v; }

// weight * normalised value: HF rounds the normalised value to the stream's dtype before the weight multiply.
template <typename Res>
__device__ __forceinline__ float apply(float v, float inv, float w) {
    if constexpr (kRoundedStream<Res>) return xserv::rms_apply(v, inv, w);
    else return w * (v * inv);
}

template <int VPT, bool ADD, typename Res = __nv_bfloat16>
__device__ __forceinline__ void rmsnorm_row_vec(const __nv_bfloat16* __restrict__ x, Res* residual,
                                                const __nv_bfloat16* __restrict__ weight, __nv_bfloat16* out,
                                                int hidden, float eps) {
    __shared__ float scratch[32];
    xserv::pdl_wait();                // see "Programmatic dependent launch" above
    xserv::pdl_launch_dependents();
    const int nchunks = hidden / 8;
    const long long base = (long long)blockIdx.x * hidden;
    float v[VPT][8];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nchunks) {
            xserv::load8(x + base + c * 8, v[k]);
            if constexpr (ADD) {
                float r[8];
                load8(residual + base + c * 8, r);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    v[k][j] += r[j];
                    if constexpr (kRoundedStream<Res>) v[k][j] = xserv::round_bf16(v[k][j]);
                }
                store8(residual + base + c * 8, v[k]);  // exact: v already holds the stream's representable value
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) ss += v[k][j] * v[k][j];
        }
    }
    // block_sum's barrier: every thread's partial sum of squares is in before the row's 1/rms is formed.
    const float inv = xserv::rms_inv(xserv::block_sum(ss, scratch), hidden, eps);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nchunks) {
            float w[8];
            xserv::load8(weight + c * 8, w);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[k][j] = apply<Res>(v[k][j], inv, w[j]);
            xserv::store8(out + base + c * 8, v[k]);
        }
    }
}

template <bool ADD, typename Res = __nv_bfloat16>
__device__ __forceinline__ void rmsnorm_row_scalar(const __nv_bfloat16* x, Res* residual,
                                                   const __nv_bfloat16* __restrict__ weight, __nv_bfloat16* out,
                                                   int hidden, float eps) {
    __shared__ float scratch[32];
    xserv::pdl_wait();
    xserv::pdl_launch_dependents();
    const long long base = (long long)blockIdx.x * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = __bfloat162float(x[base + i]);
        if constexpr (ADD) {
            v += to_float(residual[base + i]);
            if constexpr (kRoundedStream<Res>) v = xserv::round_bf16(v);
            assign(residual[base + i], v);
        }
        ss += v * v;
    }
    // block_sum's barrier: all partial sums are in (and, for ADD, the block's residual writes are visible).
    const float inv = xserv::rms_inv(xserv::block_sum(ss, scratch), hidden, eps);
    // Second pass: the same thread touches the same elements as in the first pass, so `out` may alias `x`.
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = ADD ? to_float(residual[base + i]) : __bfloat162float(x[base + i]);
        out[base + i] = __float2bfloat16_rn(apply<Res>(v, inv, __bfloat162float(weight[i])));
    }
}

// One warp per head row (kRowsPerWarp rows per warp; a row index is warp-uniform, so the bounds check keeps
// whole warps together, as warp_sum requires).
template <int D, bool PAIRED>
__device__ __forceinline__ void head_rmsnorm_rows(const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ weight,
                                                  __nv_bfloat16* out, long long rows, float eps) {
    const int lane = threadIdx.x & 31;
    const long long first = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kRowsPerWarp;
    xserv::HeadRow<D> r[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k)
        if (first + k < rows) xserv::head_load<D, PAIRED>(x + (first + k) * D, r[k], lane);
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
        if (first + k < rows) {
            xserv::head_rmsnorm_regs<D>(r[k], weight, eps, lane);
            xserv::head_store<D, PAIRED>(out + (first + k) * D, r[k], lane);
        }
    }
}

}  // namespace

// x, out: [num_rows, hidden] bf16; weight: [hidden] bf16. grid = num_rows, block = launcher's thread count.
#define XSERV_RMSNORM_VPT(VPT)                                                                                        \
    extern "C" __global__ void rmsnorm_bf16_vpt##VPT(const __nv_bfloat16* x, const __nv_bfloat16* weight,            \
                                                     __nv_bfloat16* out, int hidden, float eps) {                    \
        rmsnorm_row_vec<VPT, false, __nv_bfloat16>(x, nullptr, weight, out, hidden, eps);                                           \
    }                                                                                                                \
    extern "C" __global__ void fused_add_rmsnorm_bf16_vpt##VPT(const __nv_bfloat16* x, __nv_bfloat16* residual,      \
                                                               const __nv_bfloat16* weight, __nv_bfloat16* out,      \
                                                               int hidden, float eps) {                              \
        rmsnorm_row_vec<VPT, true>(x, residual, weight, out, hidden, eps);                                           \
    }                                                                                                                \
    extern "C" __global__ void fused_add_rmsnorm_f32res_vpt##VPT(const __nv_bfloat16* x, float* residual,             \
                                                                 const __nv_bfloat16* weight, __nv_bfloat16* out,    \
                                                                 int hidden, float eps) {                            \
        rmsnorm_row_vec<VPT, true, float>(x, residual, weight, out, hidden, eps);                                    \
    }
XSERV_RMSNORM_VPT(1)
XSERV_RMSNORM_VPT(2)
XSERV_RMSNORM_VPT(4)
XSERV_RMSNORM_VPT(8)
#undef XSERV_RMSNORM_VPT

// x, out: [num_rows, hidden] bf16; weight: [hidden] bf16. grid = num_rows.
extern "C" __global__ void rmsnorm_bf16_scalar(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                               __nv_bfloat16* out, int hidden, float eps) {
    rmsnorm_row_scalar<false, __nv_bfloat16>(x, nullptr, weight, out, hidden, eps);
}

// x, residual, out: [num_rows, hidden] bf16; weight: [hidden] bf16. grid = num_rows.
extern "C" __global__ void fused_add_rmsnorm_bf16_scalar(const __nv_bfloat16* x, __nv_bfloat16* residual,
                                                         const __nv_bfloat16* weight, __nv_bfloat16* out,
                                                         int hidden, float eps) {
    rmsnorm_row_scalar<true>(x, residual, weight, out, hidden, eps);
}

// x, out: [num_rows, hidden] bf16; residual: [num_rows, hidden] fp32; weight: [hidden] bf16. grid = num_rows.
extern "C" __global__ void fused_add_rmsnorm_f32res_scalar(const __nv_bfloat16* x, float* residual,
                                                           const __nv_bfloat16* weight, __nv_bfloat16* out,
                                                           int hidden, float eps) {
    rmsnorm_row_scalar<true, float>(x, residual, weight, out, hidden, eps);
}

// x, out: [rows, D] bf16 (rows = tokens * heads); weight: [D] bf16. One warp per row, kRowsPerWarp rows per
// warp: grid = ceil(rows / (kRowsPerWarp * blockDim.x / 32)). The non-_scalar D=128 kernel needs x and out
// 4-byte aligned.
extern "C" __global__ void head_rmsnorm_d64_bf16(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                 __nv_bfloat16* out, long long rows, float eps) {
    head_rmsnorm_rows<64, false>(x, weight, out, rows, eps);
}
extern "C" __global__ void head_rmsnorm_d128_bf16(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                  __nv_bfloat16* out, long long rows, float eps) {
    head_rmsnorm_rows<128, true>(x, weight, out, rows, eps);
}
extern "C" __global__ void head_rmsnorm_d128_bf16_scalar(const __nv_bfloat16* x, const __nv_bfloat16* weight,
                                                         __nv_bfloat16* out, long long rows, float eps) {
    head_rmsnorm_rows<128, false>(x, weight, out, rows, eps);
}
