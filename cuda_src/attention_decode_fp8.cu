// Decode attention over an FP8 (e4m3) paged KV cache: one query token per sequence, split-KV with GQA grouping,
// K and V dequantized in registers (xserv/ops/attention/decode.py's attention_decode on a float8_e4m3fn cache;
// docs/kernels/attention.md, "FP8 KV cache"). v2's structure (attention_decode_v2.cu), with half the bytes a key:
//
// attention_decode_fp8_d{D}_g{G}: grid (num_splits, Hkv, num_seqs), block 128 (4 warps).
//   A CTA takes the G = Hq / Hkv query heads of kv head blockIdx.y and keys [split * chunk_len, min(.. + chunk_len,
//   kv_len)) of its sequence. D/8 lanes share one key, each lane one 8-byte chunk (8 codes) of its K and V row; 32/(D/8)
//   keys side by side; UNROLL steps loaded before the first use. UNROLL = 8 for G <= 4 keeps v2's 128 bytes in flight
//   per lane with half-size loads (4 above: registers, q and acc alone are 16 G).
//   Scales: score = q . (code_k * k_scale) = (q * k_scale) . code_k, so k_scale[kv_head] is folded into the query
//   once (with softmax's scale * log2 e); out = sum p (code_v * v_scale) / l = v_scale * (sum p code_v) / l, so the
//   accumulators are multiplied by v_scale once before the merge (the merge and the combine are linear in them).
//   The rest (online softmax per key group, shuffle merge, cross-warp merge, partials) is v2's, from
//   attention_decode.cuh; num_splits > 1 is finished by attention_decode_v2.cu's attention_decode_combine.
//
// Arguments: XSERV_DECODE_ARGS with the caches as e4m3 bytes, then k_scale, v_scale [num_kv_heads] float32.
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 kvfp8=1 (compiled per model shape, for an FP8 KV cache only)
#include "attention_decode.cuh"
#include "e4m3.cuh"

using namespace xserv;
using namespace xserv::decode;

namespace {

constexpr int kWarps = 4;

template <int D, int G>
__device__ void decode_split_fp8(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                                 const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
                                 const int* __restrict__ kv_lens, const int* __restrict__ block_tables,
                                 int max_blocks_per_seq, int block_size, int num_q_heads, int num_kv_heads,
                                 float scale_log2, int chunk_len, int num_splits, __nv_bfloat16* __restrict__ out,
                                 float* __restrict__ part_o, float* __restrict__ part_lse,
                                 const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
    constexpr int UNROLL = G <= 4 ? 8 : 4;
    constexpr int LPK = D / 8;          // lanes per key
    constexpr int KPS = 32 / LPK;       // keys side by side in a warp
    constexpr int KPI = KPS * UNROLL;   // keys per warp iteration
    __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];
    __shared__ __align__(16) float sm_acc[kWarps][G][D];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane % LPK, sub = lane / LPK;
    const int s = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
    const int kv_len = kv_lens[s];
    const int start = split * chunk_len;
    if (start >= kv_len) {
        // kv_len == 0 (a padding row of a captured batch): a defined zero output instead of garbage
        if (kv_len == 0 && num_splits == 1)
            for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32)
                out[((long long)s * num_q_heads + kv_head * G) * D + idx] = __float2bfloat16(0.f);
        return;
    }
    const int end = min(start + chunk_len, kv_len);
    const int h0 = kv_head * G;
    const int* table = block_tables + (long long)s * max_blocks_per_seq;
    const float q_mul = scale_log2 * k_scale[kv_head];

    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        uint4 raw = *reinterpret_cast<const uint4*>(q + s * q_row_stride + (long long)(h0 + g) * D + c * 8);
        bf16x8_to_float(raw, qf[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][e] *= q_mul;
    }
    float m[G], l[G], acc[G][8];
    empty_states(m, l, acc);

    for (int base = start + warp * KPI; base < end; base += kWarps * KPI) {
        // Issue all loads of this iteration before using any (a table lookup, then K and V, per key).
        uint2 kr[UNROLL], vr[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = base + u * KPS + sub;
            valid[u] = j < end;
            kr[u] = vr[u] = make_uint2(0u, 0u);
            if (valid[u]) {
                const long long off = paged_row_offset(table, j, block_size, num_kv_heads, D, kv_head) + c * 8;
                kr[u] = __ldg(reinterpret_cast<const uint2*>(k_cache + off));
                vr[u] = __ldg(reinterpret_cast<const uint2*>(v_cache + off));
            }
        }
        float sc[UNROLL][G];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[8];
            e4m3::e4m3x8_to_float(kr[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                // sum over the LPK lanes of this key (contiguous lanes: xor offsets < LPK stay inside the group)
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                sc[u][g] = valid[u] ? d : neg_inf();
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = sc[0][g];
#pragma unroll
            for (int u = 1; u < UNROLL; ++u) mx = fmaxf(mx, sc[u][g]);
            const float m_new = fmaxf(m[g], mx);
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2f(m[g] - m_use);
            l[g] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
            m[g] = m_new;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) sc[u][g] = exp2f(sc[u][g] - m_use);  // now p
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[8];
            e4m3::e4m3x8_to_float(vr[u], vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                l[g] += sc[u][g];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(sc[u][g], vf[e], acc[g][e]);
            }
        }
    }

    // Merge the KPS key groups of this warp (lanes c, c + LPK, c + 2 LPK, ... hold the same columns).
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float acc_o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc_o[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
            const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
            const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
            merge_state(m[g], l[g], acc[g], m_o, l_o, acc_o);
        }
    }
    const float vs = v_scale[kv_head];
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm_acc[warp][g][c * 8 + e] = acc[g][e] * vs;
            if (c == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();  // every warp's (m, l, acc) is in shared memory before the cross-warp merge reads it
    write_split_result<D, G, kWarps>(&sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0], (long long)s * num_q_heads + h0, split,
                                     num_splits, out, part_o, part_lse);
}

}  // namespace

#define XSERV_DECODE_FP8_KERNEL(D, G)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_fp8_d##D##_g##G(                         \
        const __nv_bfloat16* __restrict__ q, long long q_row_stride, const unsigned char* __restrict__ k_cache,  \
        const unsigned char* __restrict__ v_cache, const int* __restrict__ kv_lens,                             \
        const int* __restrict__ block_tables, int max_blocks_per_seq, int block_size, int num_q_heads,           \
        int num_kv_heads, float scale_log2, int chunk_len, int num_splits, __nv_bfloat16* __restrict__ out,      \
        float* __restrict__ part_o, float* __restrict__ part_lse, const float* __restrict__ k_scale,             \
        const float* __restrict__ v_scale) {                                                                     \
        decode_split_fp8<D, G>(q, q_row_stride, k_cache, v_cache, kv_lens, block_tables, max_blocks_per_seq,     \
                               block_size, num_q_heads, num_kv_heads, scale_log2, chunk_len, num_splits, out,    \
                               part_o, part_lse, k_scale, v_scale);                                              \
    }

#if XSERV_PIECE(64, 1)
XSERV_DECODE_FP8_KERNEL(64, 1)
#endif
#if XSERV_PIECE(64, 2)
XSERV_DECODE_FP8_KERNEL(64, 2)
#endif
#if XSERV_PIECE(64, 3)
XSERV_DECODE_FP8_KERNEL(64, 3)
#endif
#if XSERV_PIECE(64, 4)
XSERV_DECODE_FP8_KERNEL(64, 4)
#endif
#if XSERV_PIECE(64, 5)
XSERV_DECODE_FP8_KERNEL(64, 5)
#endif
#if XSERV_PIECE(64, 6)
XSERV_DECODE_FP8_KERNEL(64, 6)
#endif
#if XSERV_PIECE(64, 7)
XSERV_DECODE_FP8_KERNEL(64, 7)
#endif
#if XSERV_PIECE(64, 8)
XSERV_DECODE_FP8_KERNEL(64, 8)
#endif
#if XSERV_PIECE(128, 1)
XSERV_DECODE_FP8_KERNEL(128, 1)
#endif
#if XSERV_PIECE(128, 2)
XSERV_DECODE_FP8_KERNEL(128, 2)
#endif
#if XSERV_PIECE(128, 3)
XSERV_DECODE_FP8_KERNEL(128, 3)
#endif
#if XSERV_PIECE(128, 4)
XSERV_DECODE_FP8_KERNEL(128, 4)
#endif
#if XSERV_PIECE(128, 5)
XSERV_DECODE_FP8_KERNEL(128, 5)
#endif
#if XSERV_PIECE(128, 6)
XSERV_DECODE_FP8_KERNEL(128, 6)
#endif
#if XSERV_PIECE(128, 7)
XSERV_DECODE_FP8_KERNEL(128, 7)
#endif
#if XSERV_PIECE(128, 8)
XSERV_DECODE_FP8_KERNEL(128, 8)
#endif
