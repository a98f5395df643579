// Decode attention: one query token per sequence over the paged KV cache (layout in attention.cuh), split-KV
// ("flash-decoding") with GQA grouping, then a log-sum-exp combine of the splits.
//
// attention_decode_d{D}_g{G}: grid (num_splits, Hkv, num_seqs), block 128 (4 warps).
//   A CTA takes the G = Hq / Hkv query heads that share kv head blockIdx.y, and keys
//   [split * chunk_len, min((split + 1) * chunk_len, kv_len)) of its sequence, so each K/V byte is read once.
//   Within a warp, D/8 lanes share one key (each lane one 16-byte chunk of its K and V row) and 32/(D/8) keys
//   are handled side by side; UNROLL such steps are loaded before the first use (8 16-byte loads in flight per
//   lane). Each key group keeps its own online-softmax state (m, l, acc) for the G heads; the groups are merged
//   by shuffles, the 4 warps through shared memory. No barrier in the main loop.
//   num_splits == 1: the CTA writes the normalised output (bf16) itself; otherwise it writes fp32 partials and the
//   log2-sum-exp2 of its scores, and attention_decode_combine merges them.
//
// Arguments: XSERV_DECODE_ARGS (attention_decode.cuh). The fallback of v4 (attention_decode.cu) where a split's pages
// would overflow v4's shared page table (a block size below 8 with a very long context).
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 (compiled per model shape: XSERV_PIECE in attention_decode.cuh)
#include "attention_decode.cuh"

using namespace xserv;
using namespace xserv::decode;

namespace {

constexpr int kWarps = 4;
constexpr int kUnroll = 4;

template <int D, int G>
__device__ void decode_split(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                             const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
                             const int* __restrict__ kv_lens, const int* __restrict__ block_tables,
                             int max_blocks_per_seq, int block_size, int num_q_heads, int num_kv_heads,
                             float scale_log2, int chunk_len, int num_splits, __nv_bfloat16* __restrict__ out,
                             float* __restrict__ part_o, float* __restrict__ part_lse) {
    constexpr int LPK = D / 8;        // lanes per key
    constexpr int KPS = 32 / LPK;     // keys side by side in a warp
    constexpr int KPI = KPS * kUnroll;  // keys per warp iteration
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

    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        uint4 raw = *reinterpret_cast<const uint4*>(q + s * q_row_stride + (long long)(h0 + g) * D + c * 8);
        bf16x8_to_float(raw, qf[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][e] *= scale_log2;
    }
    float m[G], l[G], acc[G][8];
    empty_states(m, l, acc);

    for (int base = start + warp * KPI; base < end; base += kWarps * KPI) {
        // Issue all loads of this iteration before using any (a table lookup, then K and V, per key).
        uint4 kr[kUnroll], vr[kUnroll];
        bool valid[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int j = base + u * KPS + sub;
            valid[u] = j < end;
            kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
            if (valid[u]) {
                const long long off = paged_row_offset(table, j, block_size, num_kv_heads, D, kv_head) + c * 8;
                kr[u] = __ldg(reinterpret_cast<const uint4*>(k_cache + off));
                vr[u] = __ldg(reinterpret_cast<const uint4*>(v_cache + off));
            }
        }
        float sc[kUnroll][G];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float kf[8];
            bf16x8_to_float(kr[u], kf);
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
            for (int u = 1; u < kUnroll; ++u) mx = fmaxf(mx, sc[u][g]);
            const float m_new = fmaxf(m[g], mx);
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2f(m[g] - m_use);
            l[g] *= alpha;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
            m[g] = m_new;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) sc[u][g] = exp2f(sc[u][g] - m_use);  // now p
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float vf[8];
            bf16x8_to_float(vr[u], vf);
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
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm_acc[warp][g][c * 8 + e] = acc[g][e];
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

#define XSERV_DECODE_KERNEL(D, G)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_d##D##_g##G(XSERV_DECODE_ARGS) {         \
        decode_split<D, G>(XSERV_DECODE_PASS);                                                                   \
    }

#if XSERV_PIECE(64, 1)
XSERV_DECODE_KERNEL(64, 1)
#endif
#if XSERV_PIECE(64, 2)
XSERV_DECODE_KERNEL(64, 2)
#endif
#if XSERV_PIECE(64, 3)
XSERV_DECODE_KERNEL(64, 3)
#endif
#if XSERV_PIECE(64, 4)
XSERV_DECODE_KERNEL(64, 4)
#endif
#if XSERV_PIECE(64, 5)
XSERV_DECODE_KERNEL(64, 5)
#endif
#if XSERV_PIECE(64, 6)
XSERV_DECODE_KERNEL(64, 6)
#endif
#if XSERV_PIECE(64, 7)
XSERV_DECODE_KERNEL(64, 7)
#endif
#if XSERV_PIECE(64, 8)
XSERV_DECODE_KERNEL(64, 8)
#endif
#if XSERV_PIECE(128, 1)
XSERV_DECODE_KERNEL(128, 1)
#endif
#if XSERV_PIECE(128, 2)
XSERV_DECODE_KERNEL(128, 2)
#endif
#if XSERV_PIECE(128, 3)
XSERV_DECODE_KERNEL(128, 3)
#endif
#if XSERV_PIECE(128, 4)
XSERV_DECODE_KERNEL(128, 4)
#endif
#if XSERV_PIECE(128, 5)
XSERV_DECODE_KERNEL(128, 5)
#endif
#if XSERV_PIECE(128, 6)
XSERV_DECODE_KERNEL(128, 6)
#endif
#if XSERV_PIECE(128, 7)
XSERV_DECODE_KERNEL(128, 7)
#endif
#if XSERV_PIECE(128, 8)
XSERV_DECODE_KERNEL(128, 8)
#endif

// out[s, h, :] = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over the ceil(kv_len / chunk_len) splits holding
// keys (M = their max lse). grid (Hq, num_seqs), block D.
//   part_o: [num_seqs, Hq, num_splits, D] fp32, part_lse: [num_seqs, Hq, num_splits] fp32, out: [num_seqs, Hq, D]
extern "C" __global__ void attention_decode_combine(const float* __restrict__ part_o,
                                                    const float* __restrict__ part_lse,
                                                    const int* __restrict__ kv_lens, int chunk_len, int num_splits,
                                                    int head_dim, __nv_bfloat16* __restrict__ out) {
    const int h = blockIdx.x, s = blockIdx.y, d = threadIdx.x;
    const long long row = (long long)s * gridDim.x + h;
    const int n = min(num_splits, (kv_lens[s] + chunk_len - 1) / chunk_len);
    const float* lse = part_lse + row * num_splits;
    float mm = neg_inf();
    for (int i = 0; i < n; ++i) mm = fmaxf(mm, lse[i]);
    float den = 0.f, num = 0.f;
    for (int i = 0; i < n; ++i) {
        const float w = exp2f(lse[i] - mm);
        den += w;
        num += w * part_o[(row * num_splits + i) * head_dim + d];
    }
    out[row * head_dim + d] = __float2bfloat16(n > 0 ? num / den : 0.f);  // kv_len == 0: zeros
}
