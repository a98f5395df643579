// Decode attention v2, the fallback of v4 (attention_decode_v4.cuh) where a split's pages would overflow v4's shared
// page table (a block size below 8 with a very long context): the body, templated on the cache's KV format
// (KvChunksBf16 / KvChunksE4m3 in attention_decode.cuh), and the entries of each shape piece for the format XSERV_KV_FMT
// (BF16 or FP8) that the including file defines: attention_decode_v2.cu (bf16 cache, with the combine kernel both
// formats' split grids finish with), attention_decode_fp8.cu (e4m3 cache). The including file has included
// attention_decode.cuh and said `using namespace xserv; using namespace xserv::decode;` first.
//
// attention_decode_d{D}_g{G} (FP8: attention_decode_fp8_d{D}_g{G}): grid (num_splits, Hkv, num_seqs), block 128 (4 warps).
//   A CTA takes the G = Hq / Hkv query heads that share kv head blockIdx.y, and keys
//   [split * chunk_len, min((split + 1) * chunk_len, kv_len)) of its sequence, so each K/V byte is read once.
//   Within a warp, D/8 lanes share one key (each lane one chunk of 8 elements of its K and V row: 16 bytes in bf16,
//   8 in e4m3) and 32/(D/8) keys are handled side by side; UNROLL such steps are loaded before the first use (bf16:
//   4, 8 16-byte loads in flight per lane; e4m3: 8 for G <= 4, the same bytes at half the load width). Each key group
//   keeps its own online-softmax state (m, l, acc) for the G heads; the groups are merged by shuffles, the 4 warps
//   through shared memory. No barrier in the main loop.
//   num_splits == 1: the CTA writes the normalised output (bf16) itself; otherwise it writes fp32 partials and the
//   log2-sum-exp2 of its scores, and attention_decode_combine (attention_decode_v2.cu) merges them.
//
// Arguments: XSERV_DECODE_ARGS_OF(the cache element) (attention_decode.cuh); FP8: then k_scale, v_scale.
#pragma once
#ifndef XSERV_KV_FMT
#error "define XSERV_KV_FMT (BF16 or FP8) before including attention_decode_v2.cuh"
#endif

namespace {

constexpr int kWarps = 4;

// KV: the cache's format (KvChunksBf16, KvChunksE4m3: attention_decode.cuh), kv its scales. R: query-head subgroups
// (head_dim 256, whose G * 16 registers of query and accumulator allow at most 8 heads a CTA): grid row blockIdx.y =
// kv_head * R + r runs the G heads [kv_head * G * R + r * G, + G); R CTAs read the same K/V (the second from L2).
template <int D, int G, class KV = KvChunksBf16, int R = 1>
__device__ void decode_split(XSERV_DECODE_ARGS_OF(typename KV::T), KV kv = KV()) {
    using Chunk = typename KV::Chunk;
    constexpr int kUnroll = KV::template kUnrollV2<G>;  // keys per lane and step, all loaded before the first use
    constexpr int LPK = D / 8;        // lanes per key
    constexpr int KPS = 32 / LPK;     // keys side by side in a warp
    constexpr int KPI = KPS * kUnroll;  // keys per warp iteration
    __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];
    __shared__ __align__(16) float sm_acc[kWarps][G][D];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane % LPK, sub = lane / LPK;
    const int s = blockIdx.z, kv_head = blockIdx.y / R, split = blockIdx.x;
    const int kv_len = kv_lens[s];
    const int start = split * chunk_len;
    if (start >= kv_len) {
        // kv_len == 0 (a padding row of a captured batch): a defined zero output instead of garbage
        if (kv_len == 0 && num_splits == 1)
            for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32)
                out[((long long)s * num_q_heads + kv_head * (G * R) + (blockIdx.y % R) * G) * D + idx] =
                    __float2bfloat16(0.f);
        return;
    }
    const int end = min(start + chunk_len, kv_len);
    const int h0 = kv_head * (G * R) + (blockIdx.y % R) * G;
    const int* table = block_tables + (long long)s * max_blocks_per_seq;
    kv.load(kv_head);  // the kv head's scales (e4m3; bf16: nothing)
    const float q_mul = kv.q_scale(scale_log2);

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
        Chunk kr[kUnroll], vr[kUnroll];
        bool valid[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int j = base + u * KPS + sub;
            valid[u] = j < end;
            kr[u] = vr[u] = Chunk{};
            if (valid[u]) {
                const long long off = paged_row_offset(table, j, block_size, num_kv_heads, D, kv_head) + c * 8;
                kr[u] = __ldg(reinterpret_cast<const Chunk*>(k_cache + off));
                vr[u] = __ldg(reinterpret_cast<const Chunk*>(v_cache + off));
            }
        }
        float sc[kUnroll][G];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float kf[8];
            KV::to_float(kr[u], kf);
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
            KV::to_float(vr[u], vf);
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
            for (int e = 0; e < 8; ++e) sm_acc[warp][g][c * 8 + e] = kv.out_v(acc[g][e]);
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

// attention_decode[_fp8]_d{D}_g{G} of R subgroups of G / R heads (grid rows Hkv * R): attention_decode_d256.cu.
#define XSERV_V2_SUBGROUPS_ENTRY(FMT, D, G, R) XSERV_V2_SUBGROUPS_ENTRY_(FMT, D, G, R)
#define XSERV_V2_SUBGROUPS_ENTRY_(FMT, D, G, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) XSERV_PASTE(XSERV_KV_PREFIX_##FMT, d##D##_g##G)(          \
        XSERV_DECODE_ARGS_OF(XSERV_KV_T_##FMT) XSERV_KV_SCALE_ARGS_##FMT) {                                     \
        decode_split<D, G / R, decltype(XSERV_KV_POLICY_##FMT), R>(XSERV_DECODE_PASS, XSERV_KV_POLICY_##FMT);   \
    }

// The entries of the shapes of head dim 64 and 128 (attention_decode_d256.cu, which defines XSERV_V2_BODY_ONLY,
// has its own).
#ifndef XSERV_V2_BODY_ONLY
#define XSERV_V2_ENTRY(FMT, D, G) XSERV_V2_ENTRY_(FMT, D, G)
#define XSERV_V2_ENTRY_(FMT, D, G)                                                                               \
    extern "C" __global__ void __launch_bounds__(128) XSERV_PASTE(XSERV_KV_PREFIX_##FMT, d##D##_g##G)(          \
        XSERV_DECODE_ARGS_OF(XSERV_KV_T_##FMT) XSERV_KV_SCALE_ARGS_##FMT) {                                     \
        decode_split<D, G>(XSERV_DECODE_PASS, XSERV_KV_POLICY_##FMT);                                            \
    }

#if XSERV_PIECE(64, 1)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 1)
#endif
#if XSERV_PIECE(64, 2)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 2)
#endif
#if XSERV_PIECE(64, 3)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 3)
#endif
#if XSERV_PIECE(64, 4)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 4)
#endif
#if XSERV_PIECE(64, 5)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 5)
#endif
#if XSERV_PIECE(64, 6)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 6)
#endif
#if XSERV_PIECE(64, 7)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 7)
#endif
#if XSERV_PIECE(64, 8)
XSERV_V2_ENTRY(XSERV_KV_FMT, 64, 8)
#endif
#if XSERV_PIECE(128, 1)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 1)
#endif
#if XSERV_PIECE(128, 2)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 2)
#endif
#if XSERV_PIECE(128, 3)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 3)
#endif
#if XSERV_PIECE(128, 4)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 4)
#endif
#if XSERV_PIECE(128, 5)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 5)
#endif
#if XSERV_PIECE(128, 6)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 6)
#endif
#if XSERV_PIECE(128, 7)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 7)
#endif
#if XSERV_PIECE(128, 8)
XSERV_V2_ENTRY(XSERV_KV_FMT, 128, 8)
#endif
#endif  // XSERV_V2_BODY_ONLY
