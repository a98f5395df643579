// Device pieces of qk_norm_rope_write_kv (rope.cu) that the fused decode-attention entry (attention_decode.cu)
// reuses, so that both round at the same points and give the same bits: Qwen3's q/k head RMSNorm and rotate-half
// RoPE of one head row held in the "16-byte" layout below.
//
// Layout: a head row of D values (D = 64, 128 or 256) is held by LPR = D/16 lanes; lane t (t = lane % LPR) holds
// lo = elements [8t, 8t+8) and hi = [D/2 + 8t, D/2 + 8t + 8), so each rotate-half pair (i, i + D/2) stays in one lane.
// The LPR lanes of a row must be consecutive and start at a multiple of LPR (the norm's shuffles are xor's of
// distance < LPR); several lanes may hold the same row (attention_decode.cu: the key's D/8 lanes hold it twice).
//
// Bit-identity with qk_norm_rope's warp-per-row layout (HeadRow, norm.cuh): each value gets the same arithmetic
// (rms_apply, round_bf16, the same RoPE expressions, the same bf16 rounding at the store), and the row's sum of
// squares is added up in the same tree: HeadRow lane l's partial (its EH values of each half, in its order) is formed
// here for each of the VPL = 32/LPR HeadRow lanes a lane covers (l = t * VPL + j), and warp_sum's butterfly
// (xor 16, 8, 4, 2, 1) is replayed on them: a distance >= VPL is a shuffle by distance / VPL between the row's lanes,
// a smaller one adds the lane's own partials j and j ^ distance. Float addition is commutative, so every HeadRow
// lane of warp_sum ends with the same bits, and so does every partial here.
#pragma once
#include "norm.cuh"

namespace xserv {
namespace rope16 {

__device__ __forceinline__ uint4 float8_to_bf16_bits(const float (&f)[8]) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // head_store's rounding
    return v;
}

// The q and k norm weights of lane t's 16 elements. They stay packed bf16 pairs in registers (16 registers for q's
// and k's, not 32) and are picked value by value (a select: a reference to one of two arrays would put both in
// local memory).
struct NormWeights {
    __nv_bfloat162 q_lo[4], q_hi[4], k_lo[4], k_hi[4];  // elements [8t, 8t+8) and [D/2 + 8t, D/2 + 8t + 8)
};

template <int D>
__device__ __forceinline__ void load_norm_weights(NormWeights& w, const __nv_bfloat16* __restrict__ q_weight,
                                                  const __nv_bfloat16* __restrict__ k_weight, int t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // scalar loads: the weights need no alignment
        w.q_lo[e] = __halves2bfloat162(q_weight[8 * t + 2 * e], q_weight[8 * t + 2 * e + 1]);
        w.q_hi[e] = __halves2bfloat162(q_weight[D / 2 + 8 * t + 2 * e], q_weight[D / 2 + 8 * t + 2 * e + 1]);
        w.k_lo[e] = __halves2bfloat162(k_weight[8 * t + 2 * e], k_weight[8 * t + 2 * e + 1]);
        w.k_hi[e] = __halves2bfloat162(k_weight[D / 2 + 8 * t + 2 * e], k_weight[D / 2 + 8 * t + 2 * e + 1]);
    }
}

__device__ __forceinline__ float weight_at(const __nv_bfloat162 (&w)[4], int i) {
    return __bfloat162float(i % 2 ? w[i / 2].y : w[i / 2].x);
}

// The head RMSNorm of one row held by LPR lanes (see the header): inv_rms from warp_sum's tree, then
// round_bf16(rms_apply(x, inv, w)) per value. Every lane of the warp must call it (full-mask shuffles).
template <int D>
__device__ __forceinline__ void row_rmsnorm16(float (&lo)[8], float (&hi)[8], bool is_q, const NormWeights& w,
                                              float eps) {
    constexpr int EH = D / 64;     // values per half of a HeadRow lane
    constexpr int VPL = 8 / EH;    // HeadRow lanes per lane here (= 32 / LPR)
    float part[VPL];
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        float ss = 0.f;  // head_rmsnorm_regs' partial of HeadRow lane t * VPL + j, in its order
#pragma unroll
        for (int e = 0; e < EH; ++e) {
            const int i = j * EH + e;
            ss += lo[i] * lo[i] + hi[i] * hi[i];
        }
        part[j] = ss;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {  // warp_sum's butterfly over the 32 HeadRow lanes
        if (offset >= VPL) {
#pragma unroll
            for (int j = 0; j < VPL; ++j) part[j] += __shfl_xor_sync(0xffffffffu, part[j], offset / VPL);
        } else {
            float next[VPL];
#pragma unroll
            for (int j = 0; j < VPL; ++j) next[j] = part[j] + part[j ^ offset];
#pragma unroll
            for (int j = 0; j < VPL; ++j) part[j] = next[j];
        }
    }
    const float inv = xserv::rms_inv(part[0], D, eps);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float wl = is_q ? weight_at(w.q_lo, i) : weight_at(w.k_lo, i);
        const float wh = is_q ? weight_at(w.q_hi, i) : weight_at(w.k_hi, i);
        lo[i] = xserv::round_bf16(xserv::rms_apply(lo[i], inv, wl));
        hi[i] = xserv::round_bf16(xserv::rms_apply(hi[i], inv, wh));
    }
}

// cos and sin of lane t's 8 rotate-half pairs at position pos (cos_sin: [max_pos, D] fp32, 16-byte aligned), or
// false (nothing read) for a position outside the table.
template <int D>
__device__ __forceinline__ bool load_cos_sin(const float* __restrict__ cos_sin, int pos, int max_pos, int t,
                                             float (&cv)[8], float (&sv)[8]) {
    if (pos < 0 || pos >= max_pos) return false;
    const float4* cs = reinterpret_cast<const float4*>(cos_sin + (long long)pos * D);
    const float4 c0 = __ldg(cs + 2 * t), c1 = __ldg(cs + 2 * t + 1);
    const float4 s0 = __ldg(cs + D / 8 + 2 * t), s1 = __ldg(cs + D / 8 + 2 * t + 1);
    cv[0] = c0.x; cv[1] = c0.y; cv[2] = c0.z; cv[3] = c0.w; cv[4] = c1.x; cv[5] = c1.y; cv[6] = c1.z; cv[7] = c1.w;
    sv[0] = s0.x; sv[1] = s0.y; sv[2] = s0.z; sv[3] = s0.w; sv[4] = s1.x; sv[5] = s1.y; sv[6] = s1.z; sv[7] = s1.w;
    return true;
}

// RoPE of lane t's 8 pairs (rope_regs' expressions), or NaN in all 16 values where the position was outside the
// table (in_range false), so that the bug shows.
__device__ __forceinline__ void rope_apply(float (&lo)[8], float (&hi)[8], bool in_range, const float (&cv)[8],
                                           const float (&sv)[8]) {
    if (in_range) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float c = cv[e], s = sv[e];
            const float l = lo[e], h = hi[e];
            lo[e] = l * c - h * s;
            hi[e] = h * c + l * s;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = hi[e] = xserv::quiet_nan();
    }
}

// Partial RoPE (Qwen3.5's gated attention: D = 256, ROT = 64): only elements [0, ROT) rotate, rotate-half within that
// slice, pairs (i, i + ROT/2) with cos_sin [max_pos, ROT] (cos of the ROT/2 frequencies, then their sin). In the layout
// above those elements are the lo chunks of lanes t < ROT/8, and pair partners sit in lanes t and t ^ (ROT/16) (the
// same row's lanes). load_cos_sin_partial gives lane t's 8 cos / sin values (frequencies 8 (t % (ROT/16)) + e; lanes
// t >= ROT/8 read nothing), false for a position outside the table (nothing read).
template <int D, int ROT>
__device__ __forceinline__ bool load_cos_sin_partial(const float* __restrict__ cos_sin, int pos, int max_pos, int t,
                                                     float (&cv)[8], float (&sv)[8]) {
    static_assert(ROT % 16 == 0 && ROT < D && ROT / 2 <= D / 2, "the rotary slice lies in the lo chunks");
    if (pos < 0 || pos >= max_pos) return false;
    if (t < ROT / 8) {
        const float4* cs = reinterpret_cast<const float4*>(cos_sin + (long long)pos * ROT);
        const int f = t % (ROT / 16);
        const float4 c0 = __ldg(cs + 2 * f), c1 = __ldg(cs + 2 * f + 1);
        const float4 s0 = __ldg(cs + ROT / 8 + 2 * f), s1 = __ldg(cs + ROT / 8 + 2 * f + 1);
        cv[0] = c0.x; cv[1] = c0.y; cv[2] = c0.z; cv[3] = c0.w; cv[4] = c1.x; cv[5] = c1.y; cv[6] = c1.z; cv[7] = c1.w;
        sv[0] = s0.x; sv[1] = s0.y; sv[2] = s0.z; sv[3] = s0.w; sv[4] = s1.x; sv[5] = s1.y; sv[6] = s1.z; sv[7] = s1.w;
    }
    return true;
}

// The rotation of lane t's part of the slice (rope_apply's expressions: first half x c - partner s, second half
// x c + partner s), or NaN in all of the row's values where the position was outside the table. Every lane of the
// warp must call it (a full-mask shuffle fetches the partner's lo chunk).
template <int D, int ROT>
__device__ __forceinline__ void rope_partial(float (&lo)[8], float (&hi)[8], bool in_range, int t,
                                             const float (&cv)[8], const float (&sv)[8]) {
    float partner[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) partner[e] = __shfl_xor_sync(0xffffffffu, lo[e], ROT / 16);
    if (!in_range) {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = hi[e] = xserv::quiet_nan();
    } else if (t < ROT / 16) {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = lo[e] * cv[e] - partner[e] * sv[e];
    } else if (t < ROT / 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = lo[e] * cv[e] + partner[e] * sv[e];
    }
}

}  // namespace rope16
}  // namespace xserv
