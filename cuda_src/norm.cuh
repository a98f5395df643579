// RMSNorm and head-row helpers shared by rmsnorm.cu and rope.cu (qk_norm_rope fuses the head RMSNorm).
//
// Rounding follows Hugging Face's Qwen3RMSNorm: the row statistic and the normalised value are computed in fp32,
// the normalised value is rounded to bf16 (`hidden.to(input_dtype)`), and only then multiplied by the bf16 weight
// (`weight * hidden`, a bf16 x bf16 product whose fp32 result is rounded to bf16 when stored).
#pragma once
#include "common.cuh"

namespace xserv {

// The value a bf16 tensor would hold for x (round-to-nearest-even).
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// 1 / sqrt(mean(x^2) + eps) from the row's sum of squares.
__device__ __forceinline__ float rms_inv(float sumsq, int n, float eps) { return rsqrtf(sumsq / (float)n + eps); }

// weight * bf16(x * inv_rms): HF's rounding (see the header comment); the caller rounds the product on store.
__device__ __forceinline__ float rms_apply(float x, float inv_rms, float w) { return w * round_bf16(x * inv_rms); }

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// One head row of D bf16 values (D = 64 or 128) held by one warp. Lane l holds EH = D/64 consecutive values of
// each half: lo = elements [l*EH, l*EH+EH), hi = elements [D/2 + l*EH, D/2 + l*EH + EH). This keeps each RoPE
// pair (i, i + D/2) inside one lane, so rotate-half needs no shuffles.
template <int D>
struct HeadRow {
    static_assert(D == 64 || D == 128, "head rows of 64 or 128 values");
    static constexpr int EH = D / 64;
    float lo[EH], hi[EH];
};

// PAIRED: load/store two values as one 4-byte __nv_bfloat162 (the launcher checked 4-byte alignment of the row
// base); otherwise one bf16 at a time. Both are coalesced across the warp.
template <int D, bool PAIRED>
__device__ __forceinline__ void head_load(const __nv_bfloat16* row, HeadRow<D>& r, int lane) {
    constexpr int EH = HeadRow<D>::EH;
    const int i = lane * EH;
    if constexpr (PAIRED && EH == 2) {
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + i));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + D / 2 + i));
        r.lo[0] = a.x; r.lo[1] = a.y;
        r.hi[0] = b.x; r.hi[1] = b.y;
    } else {
#pragma unroll
        for (int e = 0; e < EH; ++e) {
            r.lo[e] = __bfloat162float(row[i + e]);
            r.hi[e] = __bfloat162float(row[D / 2 + i + e]);
        }
    }
}

template <int D, bool PAIRED>
__device__ __forceinline__ void head_store(__nv_bfloat16* row, const HeadRow<D>& r, int lane) {
    constexpr int EH = HeadRow<D>::EH;
    const int i = lane * EH;
    if constexpr (PAIRED && EH == 2) {
        *reinterpret_cast<__nv_bfloat162*>(row + i) = __floats2bfloat162_rn(r.lo[0], r.lo[1]);
        *reinterpret_cast<__nv_bfloat162*>(row + D / 2 + i) = __floats2bfloat162_rn(r.hi[0], r.hi[1]);
    } else {
#pragma unroll
        for (int e = 0; e < EH; ++e) {
            row[i + e] = __float2bfloat16_rn(r.lo[e]);
            row[D / 2 + i + e] = __float2bfloat16_rn(r.hi[e]);
        }
    }
}

// RMSNorm of a warp-held head row over its D values, in registers; the result is rounded to bf16 (the value HF's
// q_norm/k_norm returns). All 32 lanes of the warp must call it (warp_sum shuffles with the full mask).
template <int D>
__device__ __forceinline__ void head_rmsnorm_regs(HeadRow<D>& r, const __nv_bfloat16* __restrict__ weight, float eps,
                                                  int lane) {
    constexpr int EH = HeadRow<D>::EH;
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < EH; ++e) ss += r.lo[e] * r.lo[e] + r.hi[e] * r.hi[e];
    const float inv = rms_inv(warp_sum(ss), D, eps);
    const int i = lane * EH;
#pragma unroll
    for (int e = 0; e < EH; ++e) {
        r.lo[e] = round_bf16(rms_apply(r.lo[e], inv, __bfloat162float(weight[i + e])));
        r.hi[e] = round_bf16(rms_apply(r.hi[e], inv, __bfloat162float(weight[D / 2 + i + e])));
    }
}

template <int D>
__device__ __forceinline__ void head_fill(HeadRow<D>& r, float value) {
#pragma unroll
    for (int e = 0; e < HeadRow<D>::EH; ++e) r.lo[e] = r.hi[e] = value;
}

}  // namespace xserv
