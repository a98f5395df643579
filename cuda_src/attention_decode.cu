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
//   q:            sequence s's head h at q + s * q_row_stride + h * D   (q or the packed qkv tensor)
//   k_cache/v_cache: [num_blocks, block_size, num_kv_heads, D] bf16
//   kv_lens:      [num_seqs] int32 (0 gives a zero output row)
//   block_tables: [num_seqs, max_blocks_per_seq] int32
//   out:          [num_seqs, num_q_heads, D] bf16
//   part_o:       [num_seqs, num_q_heads, num_splits, D] fp32    (unused when num_splits == 1)
//   part_lse:     [num_seqs, num_q_heads, num_splits] fp32, log2 domain (scores already scaled by scale*log2 e)
// Splits that start at or past kv_len write nothing; the combine kernel reads only the ceil(kv_len / chunk_len)
// splits that hold keys.
#include "attention.cuh"

using namespace xserv;

namespace {

constexpr int kWarps = 4;
constexpr int kUnroll = 4;

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

// Merge online-softmax state (m, l, acc) with another (log2 domain); an empty state has m = -inf, l = 0.
__device__ __forceinline__ void merge_state(float& m, float& l, float (&acc)[8], float m_o, float l_o,
                                            const float (&acc_o)[8]) {
    const float m_new = fmaxf(m, m_o);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    const float a = exp2f(m - m_use), b = exp2f(m_o - m_use);
    l = l * a + l_o * b;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + acc_o[e] * b;
    m = m_new;
}

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
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }

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

    for (int idx = threadIdx.x; idx < G * D; idx += kWarps * 32) {
        const int g = idx / D, d = idx % D;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sm_m[w][g]);  // finite: warp 0 saw key `start`
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float wgt = exp2f(sm_m[w][g] - mm);  // 0 for a warp that saw no key
            ll += sm_l[w][g] * wgt;
            aa += sm_acc[w][g][d] * wgt;
        }
        const long long row = (long long)s * num_q_heads + h0 + g;
        if (num_splits == 1) {
            out[row * D + d] = __float2bfloat16(aa / ll);
        } else {
            part_o[(row * num_splits + split) * D + d] = aa / ll;
            if (d == 0) part_lse[row * num_splits + split] = mm + log2f(ll);
        }
    }
}

}  // namespace

#define XSERV_DECODE_ARGS                                                                                        \
    const __nv_bfloat16 *__restrict__ q, long long q_row_stride, const __nv_bfloat16 *__restrict__ k_cache,     \
        const __nv_bfloat16 *__restrict__ v_cache, const int *__restrict__ kv_lens,                             \
        const int *__restrict__ block_tables, int max_blocks_per_seq, int block_size, int num_q_heads,           \
        int num_kv_heads, float scale_log2, int chunk_len, int num_splits, __nv_bfloat16 *__restrict__ out,      \
        float *__restrict__ part_o, float *__restrict__ part_lse
#define XSERV_DECODE_PASS                                                                                        \
    q, q_row_stride, k_cache, v_cache, kv_lens, block_tables, max_blocks_per_seq, block_size, num_q_heads,       \
        num_kv_heads, scale_log2, chunk_len, num_splits, out, part_o, part_lse
#define XSERV_DECODE_KERNEL(D, G)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_d##D##_g##G(XSERV_DECODE_ARGS) {         \
        decode_split<D, G>(XSERV_DECODE_PASS);                                                                   \
    }

XSERV_DECODE_KERNEL(64, 1)
XSERV_DECODE_KERNEL(64, 2)
XSERV_DECODE_KERNEL(64, 3)
XSERV_DECODE_KERNEL(64, 4)
XSERV_DECODE_KERNEL(64, 5)
XSERV_DECODE_KERNEL(64, 6)
XSERV_DECODE_KERNEL(64, 7)
XSERV_DECODE_KERNEL(64, 8)
XSERV_DECODE_KERNEL(128, 1)
XSERV_DECODE_KERNEL(128, 2)
XSERV_DECODE_KERNEL(128, 3)
XSERV_DECODE_KERNEL(128, 4)
XSERV_DECODE_KERNEL(128, 5)
XSERV_DECODE_KERNEL(128, 6)
XSERV_DECODE_KERNEL(128, 7)
XSERV_DECODE_KERNEL(128, 8)

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

// =================================================================================================================
// v3: the G query heads on tensor cores, K/V staged per lane through shared memory by cp.async.
//
// attention_decode_v3_d{D}_g{G}_s{STAGES}: grid (num_splits, Hkv, num_seqs), block 128 (4 warps), dynamic shared
// memory 4 * STAGES * D * 64 + 16 bytes. Requires block_size % 16 == 0 and chunk_len % 64 == 0, so that
// a 16-key block never straddles a page (one block-table lookup per 16 keys).
//   Warp w takes the 16-key blocks w, w + 4, w + 8, ... of its split. Per block:
//   S = Q K^T   as mma.sync m16n8k16: M = query heads (G rows used of 16, rows >= G are zero), N = 8 keys, K = 16
//               dims; two n-blocks (keys 0-7, 8-15) x D/16 k-steps. The dims are permuted consistently in Q and K
//               (a dot product does not care about order), so lane (g = lane/4, t = lane%4) needs whole 16-byte
//               chunks t, t+4, t+8, ... of K rows g and g+8: plain 16-byte copies, no ldmatrix.
//   softmax     row g lives in the 4 lanes of quad g (keys 2t, 2t+1 of each n-block): two shuffles for the row max.
//   O += P V    M = heads, N = 8 dims, K = 16 keys. The S accumulators are the P operand as they stand (FA2), so
//               lane (g, t) needs V of keys 2t, 2t+1, 2t+8, 2t+9 at one dim per n-block: with the output dims
//               permuted, those are 16-byte chunks g, g+8 of the four V rows, and each B register is one byte_perm
//               of two of them.
//   Every lane copies exactly the 16-byte chunks it will read back itself (layout [warp][stage][chunk][lane],
//   conflict-free), so the pipeline needs no barrier: cp.async.wait_group alone orders a lane's copies before its
//   own reads. Keys past the end are zero-filled (NaN in unused slots never reaches a register) and masked to -inf.
//   Rows g+8 of both A operands are zero: their accumulators are not kept (mma_rows_lo).
//   num_splits == 1: the CTA writes bf16 itself. Otherwise it writes fp32 partials as v2 does, and the last CTA of
//   each (sequence, kv head) to finish (counted in `counters`, which it resets to 0) merges them: no combine launch.
//   counters: [num_seqs * Hkv] int32, zero before the first launch.
// =================================================================================================================
namespace {

// cp.async with a "memory" clobber: the per-lane pipeline has no __syncthreads, so the compiler must not move a
// shared-memory read of a stage above the wait for it, nor a write into a stage above the reads of its last use.
__device__ __forceinline__ void cp_async16_m(unsigned smem_addr, const void* gptr, bool valid) {
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gptr), "r"(src_size)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit_m() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_m() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// m16n8k16 with A rows 8..15 zero: d0, d1 (row g, cols 2t, 2t+1) += A[g][..] * B; the row g+8 results are dropped.
__device__ __forceinline__ void mma_rows_lo(float& d0, float& d1, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    float x2, x3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d0), "=f"(d1), "=f"(x2), "=f"(x3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.f), "f"(0.f));
}

constexpr int kV3Warps = 4;

template <int D, int G, int STAGES>
__device__ void decode_split_v3(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                                const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
                                const int* __restrict__ kv_lens, const int* __restrict__ block_tables,
                                int max_blocks_per_seq, int block_size, int num_q_heads, int num_kv_heads,
                                float scale_log2, int chunk_len, int num_splits, __nv_bfloat16* __restrict__ out,
                                float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ counters) {
    constexpr int KCH = D / 32;     // K chunks per lane per key (2 keys per lane and block)
    constexpr int VCH = D / 64;     // V chunks per lane per key (4 keys per lane and block)
    constexpr int NCH = D / 8;      // 16-byte chunks per lane per block: 2 KCH + 4 VCH
    constexpr int NB = D / 8;       // n-blocks of the P V product
    static_assert(2 * KCH + 4 * VCH == NCH, "chunk count");
    // Dynamic shared memory only (a static byte beside 48 KB of dynamic ones fails to launch without the opt-in):
    // 4 * STAGES * D * 64 bytes of staging, then one int (the "last CTA" flag).
    extern __shared__ __align__(16) unsigned char smem_raw[];
    int& sm_last = *reinterpret_cast<int*>(smem_raw + kV3Warps * STAGES * NCH * 32 * 16);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int s = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
    const int kv_len = kv_lens[s];
    const int start = split * chunk_len;
    const int h0 = kv_head * G;
    if (start >= kv_len) {
        // kv_len == 0 (a padding row of a captured batch): split 0 writes a defined zero row (no CTA of this
        // (sequence, kv head) reaches the combine, whatever num_splits is)
        if (kv_len == 0 && split == 0)
            for (int idx = threadIdx.x; idx < G * D; idx += kV3Warps * 32)
                out[((long long)s * num_q_heads + h0) * D + idx] = __float2bfloat16(0.f);
        return;
    }
    const int end = min(start + chunk_len, kv_len);
    const int nblocks = (end - start + 15) >> 4;
    const int my_blocks = nblocks > warp ? (nblocks - warp + kV3Warps - 1) / kV3Warps : 0;
    const int* table = block_tables + (long long)s * max_blocks_per_seq;
    const long long key_stride = (long long)num_kv_heads * D;  // elements between consecutive slots

    // Q as A fragments, dims permuted: k-step kk uses chunk t + 4 (kk / 2), words 2 (kk % 2) and 2 (kk % 2) + 1.
    unsigned qa[D / 16][2];
    {
        const __nv_bfloat16* qrow = q + s * q_row_stride + (long long)(h0 + (g < G ? g : 0)) * D;
#pragma unroll
        for (int i = 0; i < KCH; ++i) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (g < G) v = *reinterpret_cast<const uint4*>(qrow + (t + 4 * i) * 8);
            qa[2 * i][0] = v.x;
            qa[2 * i][1] = v.y;
            qa[2 * i + 1][0] = v.z;
            qa[2 * i + 1][1] = v.w;
        }
    }

    const unsigned smem_base = smem_u32(smem_raw) + (unsigned)(warp * STAGES * NCH * 32 + lane) * 16u;
    // stage st, chunk c of this lane: smem_base + ((st * NCH + c) * 32) * 16

    auto issue = [&](int b, int stage) {
        const int j0 = start + 16 * (warp + kV3Warps * b);
        const int page = __ldg(table + j0 / block_size);
        const long long row0 = ((long long)page * block_size + (j0 % block_size)) * key_stride + (long long)kv_head * D;
        const unsigned st = smem_base + (unsigned)(stage * NCH * 32) * 16u;
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {  // K rows g (n-block 0) and g + 8 (n-block 1)
            const int r = g + 8 * kk;
            const bool valid = j0 + r < end;  // the address stays inside the page either way
            const __nv_bfloat16* src = k_cache + row0 + r * key_stride;
#pragma unroll
            for (int i = 0; i < KCH; ++i) cp_async16_m(st + (kk * KCH + i) * 512u, src + (t + 4 * i) * 8, valid);
        }
#pragma unroll
        for (int kv = 0; kv < 4; ++kv) {  // V rows 2t, 2t+1, 2t+8, 2t+9
            const int r = 2 * t + (kv & 1) + 8 * (kv >> 1);
            const bool valid = j0 + r < end;
            const __nv_bfloat16* src = v_cache + row0 + r * key_stride;
#pragma unroll
            for (int i = 0; i < VCH; ++i)
                cp_async16_m(st + (2 * KCH + kv * VCH + i) * 512u, src + (g + 8 * i) * 8, valid);
        }
    };

    // Prologue: STAGES - 1 blocks in flight (empty groups keep the wait counts uniform).
#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) {
        if (b < my_blocks) issue(b, b);
        cp_async_commit_m();
    }

    float m_run = neg_inf(), l_run = 0.f;
    float o[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) o[nb][0] = o[nb][1] = 0.f;

    for (int b = 0; b < my_blocks; ++b) {
        // the stage refilled here was last read in iteration b - 1, whose reads are complete (their values fed mma)
        if (b + STAGES - 1 < my_blocks) issue(b + STAGES - 1, (b + STAGES - 1) % STAGES);
        cp_async_commit_m();
        cp_async_wait_m<STAGES - 1>();  // this lane's copies of block b have landed
        const unsigned st = smem_base + (unsigned)((b % STAGES) * NCH * 32) * 16u;
        const int j0 = start + 16 * (warp + kV3Warps * b);

        float sc[2][2];
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int i = 0; i < KCH; ++i) {
                const uint4 kc = lds128(st + (kk * KCH + i) * 512u);
                mma_rows_lo(s0, s1, qa[2 * i][0], qa[2 * i][1], kc.x, kc.y);
                mma_rows_lo(s0, s1, qa[2 * i + 1][0], qa[2 * i + 1][1], kc.z, kc.w);
            }
            // (row g, key j0 + 8 kk + 2t + c)
            const int jk = j0 + 8 * kk + 2 * t;
            sc[kk][0] = jk < end ? s0 * scale_log2 : neg_inf();
            sc[kk][1] = jk + 1 < end ? s1 * scale_log2 : neg_inf();
        }
        float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run, mx);  // finite: key j0 is valid
        const float alpha = exp2f(m_run - m_new);
        m_run = m_new;
        float p[2][2];
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
#pragma unroll
            for (int c = 0; c < 2; ++c) p[kk][c] = exp2f(sc[kk][c] - m_new);
        l_run = l_run * alpha + ((p[0][0] + p[0][1]) + (p[1][0] + p[1][1]));
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            o[nb][0] *= alpha;
            o[nb][1] *= alpha;
        }
        const unsigned pa0 = pack_bf16x2(p[0][0], p[0][1]);  // P[g][2t, 2t+1]
        const unsigned pa2 = pack_bf16x2(p[1][0], p[1][1]);  // P[g][2t+8, 2t+9]
#pragma unroll
        for (int i = 0; i < VCH; ++i) {
            const uint4 v0 = lds128(st + (2 * KCH + 0 * VCH + i) * 512u);  // key 2t
            const uint4 v1 = lds128(st + (2 * KCH + 1 * VCH + i) * 512u);  // key 2t + 1
            const uint4 v2 = lds128(st + (2 * KCH + 2 * VCH + i) * 512u);  // key 2t + 8
            const uint4 v3 = lds128(st + (2 * KCH + 3 * VCH + i) * 512u);  // key 2t + 9
            const unsigned w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
            const unsigned w2[4] = {v2.x, v2.y, v2.z, v2.w}, w3[4] = {v3.x, v3.y, v3.z, v3.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                // n-block 8i + e, column g: dim 8 (g + 8i) + e; B rows (keys) 2t, 2t+1 | 2t+8, 2t+9
                const unsigned sel = (e & 1) ? 0x7632u : 0x5410u;
                const unsigned b0 = __byte_perm(w0[e >> 1], w1[e >> 1], sel);
                const unsigned b1 = __byte_perm(w2[e >> 1], w3[e >> 1], sel);
                mma_rows_lo(o[8 * i + e][0], o[8 * i + e][1], pa0, pa2, b0, b1);
            }
        }
    }
    cp_async_wait_m<0>();
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);

    // Cross-warp merge through shared memory (the staging area is reused: every warp must be past its last read).
    __syncthreads();
    float* sm_o = reinterpret_cast<float*>(smem_raw);  // [kV3Warps][G][D]
    float* sm_m = sm_o + kV3Warps * G * D;             // [kV3Warps][G]
    float* sm_l = sm_m + kV3Warps * G;                 // [kV3Warps][G]
    if (g < G) {
        float* dst = sm_o + (warp * G + g) * D;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            // o[nb][c] is O[g][dim 8 (2t + c + 8 (nb / 8)) + nb % 8]
#pragma unroll
            for (int c = 0; c < 2; ++c) dst[8 * (2 * t + c + 8 * (nb >> 3)) + (nb & 7)] = o[nb][c];
        }
        if (t == 0) {
            sm_m[warp * G + g] = m_run;
            sm_l[warp * G + g] = l_run;
        }
    }
    __syncthreads();  // every warp's state is in shared memory

    for (int idx = threadIdx.x; idx < G * D; idx += kV3Warps * 32) {
        const int gg = idx / D, d = idx % D;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < kV3Warps; ++w) mm = fmaxf(mm, sm_m[w * G + gg]);  // finite: warp 0 saw key `start`
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < kV3Warps; ++w) {
            const float wgt = exp2f(sm_m[w * G + gg] - mm);  // 0 for a warp that saw no key
            ll += sm_l[w * G + gg] * wgt;
            aa += sm_o[(w * G + gg) * D + d] * wgt;
        }
        const long long row = (long long)s * num_q_heads + h0 + gg;
        if (num_splits == 1) {
            out[row * D + d] = __float2bfloat16(aa / ll);
        } else {
            part_o[(row * num_splits + split) * D + d] = aa / ll;
            if (d == 0) part_lse[row * num_splits + split] = mm + log2f(ll);
        }
    }
    if (num_splits == 1) return;

    // Last CTA of this (sequence, kv head) merges the splits (threadfence-reduction pattern): each thread's partial
    // writes are made visible device-wide before the CTA counts itself done.
    __threadfence();
    __syncthreads();
    const int active = min(num_splits, (kv_len + chunk_len - 1) / chunk_len);
    int* counter = counters + (long long)s * num_kv_heads + kv_head;
    if (threadIdx.x == 0) sm_last = atomicAdd(counter, 1) == active - 1;
    __syncthreads();
    if (!sm_last) return;
    __threadfence();  // the other CTAs' partials (counted before our atomic) are visible from here on
    // Split weights 2^(lse_i - M) / sum per head, one warp per head (the merge area above is no longer read).
    float* sm_w = reinterpret_cast<float*>(smem_raw);  // [G][active]
    for (int gg = warp; gg < G; gg += kV3Warps) {
        const float* lse = part_lse + ((long long)s * num_q_heads + h0 + gg) * num_splits;
        float mm = neg_inf();
        for (int i = lane; i < active; i += 32) mm = fmaxf(mm, __ldcg(lse + i));
        mm = warp_max(mm);  // finite: split 0 holds keys
        float den = 0.f;
        for (int i = lane; i < active; i += 32) {
            const float w = exp2f(__ldcg(lse + i) - mm);
            sm_w[gg * active + i] = w;
            den += w;
        }
        den = warp_sum(den);
        __syncwarp();  // the lanes' weights are written before they are rescaled by other lanes
        for (int i = lane; i < active; i += 32) sm_w[gg * active + i] /= den;
    }
    __syncthreads();  // all heads' weights are in shared memory
    for (int idx = threadIdx.x; idx < G * D / 4; idx += kV3Warps * 32) {
        const int gg = idx / (D / 4), d4 = idx % (D / 4);
        const long long row = (long long)s * num_q_heads + h0 + gg;
        const float4* src = reinterpret_cast<const float4*>(part_o + row * num_splits * D) + d4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int i = 0; i < active; ++i) {
            const float w = sm_w[gg * active + i];
            const float4 x = __ldcg(src + i * (D / 4));
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + row * D + 4 * d4);
        dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
        dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
    }
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (graph replays reuse it)
}

}  // namespace

// Min CTAs per SM for __launch_bounds__: what shared memory allows (4 * S * D * 64 bytes per CTA), so that the
// register budget never becomes the tighter limit (decode_plan's _V3_RESIDENT assumes these).
#define XSERV_V3_MINB_128_2 3
#define XSERV_V3_MINB_128_3 2
#define XSERV_V3_MINB_64_2 5
#define XSERV_V3_MINB_64_3 4
#define XSERV_DECODE_V3_KERNEL(D, G, S)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, XSERV_V3_MINB_##D##_##S)                                   \
        attention_decode_v3_d##D##_g##G##_s##S(XSERV_DECODE_ARGS, int* __restrict__ counters) {                  \
        decode_split_v3<D, G, S>(XSERV_DECODE_PASS, counters);                                                   \
    }
#define XSERV_DECODE_V3_STAGES(D, G) \
    XSERV_DECODE_V3_KERNEL(D, G, 2)  \
    XSERV_DECODE_V3_KERNEL(D, G, 3)

XSERV_DECODE_V3_STAGES(64, 1)
XSERV_DECODE_V3_STAGES(64, 2)
XSERV_DECODE_V3_STAGES(64, 3)
XSERV_DECODE_V3_STAGES(64, 4)
XSERV_DECODE_V3_STAGES(64, 5)
XSERV_DECODE_V3_STAGES(64, 6)
XSERV_DECODE_V3_STAGES(64, 7)
XSERV_DECODE_V3_STAGES(64, 8)
XSERV_DECODE_V3_STAGES(128, 1)
XSERV_DECODE_V3_STAGES(128, 2)
XSERV_DECODE_V3_STAGES(128, 3)
XSERV_DECODE_V3_STAGES(128, 4)
XSERV_DECODE_V3_STAGES(128, 5)
XSERV_DECODE_V3_STAGES(128, 6)
XSERV_DECODE_V3_STAGES(128, 7)
XSERV_DECODE_V3_STAGES(128, 8)
