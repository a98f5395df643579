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

// The end of every split kernel: merge the WARPS per-warp online-softmax states of the CTA's G heads (shared
// memory, flat: m, l [WARPS][G], acc [WARPS][G][D]) and write the normalised bf16 output (num_splits == 1) or the
// fp32 partial and the log2-sum-exp2 of this split. row0 = s * num_q_heads + first head of the group.
template <int D, int G, int WARPS>
__device__ __forceinline__ void write_split_result(const float* sm_m, const float* sm_l, const float* sm_acc,
                                                   long long row0, int split, int num_splits,
                                                   __nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
                                                   float* __restrict__ part_lse) {
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, d = idx % D;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w * G + g]);  // finite: warp 0 saw key `start`
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wgt = exp2f(sm_m[w * G + g] - mm);  // 0 for a warp that saw no key
            ll += sm_l[w * G + g] * wgt;
            aa += sm_acc[(w * G + g) * D + d] * wgt;
        }
        const long long row = row0 + g;
        if (num_splits == 1) {
            out[row * D + d] = __float2bfloat16(aa / ll);
        } else {
            part_o[(row * num_splits + split) * D + d] = aa / ll;
            if (d == 0) part_lse[row * num_splits + split] = mm + log2f(ll);
        }
    }
}

// Split-KV combine folded into the split kernel (threadfence-reduction pattern): after write_split_result, the last
// CTA of a (sequence, kv head) to finish merges the `active` splits' partials of its G heads into `out` and resets
// the counter (graph replays reuse it). sm_w: shared scratch of G * active floats; sm_last: a shared int.
template <int D, int G, int WARPS>
__device__ __forceinline__ void combine_splits_if_last(int* counter, int active, long long row0, int num_splits,
                                                       const float* __restrict__ part_o,
                                                       const float* __restrict__ part_lse,
                                                       __nv_bfloat16* __restrict__ out, float* sm_w, int& sm_last) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __threadfence();  // this thread's partial writes are visible device-wide before the CTA counts itself done
    __syncthreads();
    if (threadIdx.x == 0) sm_last = atomicAdd(counter, 1) == active - 1;
    __syncthreads();
    if (!sm_last) return;
    __threadfence();  // the other CTAs' partials (counted before our atomic) are visible from here on
    // split weights 2^(lse_i - M) / sum per head, one warp per head
    for (int g = warp; g < G; g += WARPS) {
        const float* lse = part_lse + (row0 + g) * num_splits;
        float mm = neg_inf();
        for (int i = lane; i < active; i += 32) mm = fmaxf(mm, __ldcg(lse + i));
        mm = warp_max(mm);  // finite: split 0 holds keys
        float den = 0.f;
        for (int i = lane; i < active; i += 32) {
            const float w = exp2f(__ldcg(lse + i) - mm);
            sm_w[g * active + i] = w;
            den += w;
        }
        den = warp_sum(den);
        __syncwarp();  // the lanes' weights are written before they are rescaled by other lanes
        for (int i = lane; i < active; i += 32) sm_w[g * active + i] /= den;
    }
    __syncthreads();  // all heads' weights are in shared memory
    for (int idx = threadIdx.x; idx < G * D / 4; idx += WARPS * 32) {
        const int g = idx / (D / 4), d4 = idx % (D / 4);
        const long long row = row0 + g;
        const float4* src = reinterpret_cast<const float4*>(part_o + row * num_splits * D) + d4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int i = 0; i < active; ++i) {
            const float w = sm_w[g * active + i];
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
    if (threadIdx.x == 0) *counter = 0;
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
    write_split_result<D, G, kWarps>(&sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0], (long long)s * num_q_heads + h0, split,
                                     num_splits, out, part_o, part_lse);
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
    const long long row0 = (long long)s * num_q_heads + h0;
    write_split_result<D, G, kV3Warps>(sm_m, sm_l, sm_o, row0, split, num_splits, out, part_o, part_lse);
    if (num_splits == 1) return;
    // the merge area is no longer read: it holds the split weights now
    combine_splits_if_last<D, G, kV3Warps>(counters + (long long)s * num_kv_heads + kv_head,
                                           min(num_splits, (kv_len + chunk_len - 1) / chunk_len), row0, num_splits,
                                           part_o, part_lse, out, reinterpret_cast<float*>(smem_raw), sm_last);
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

// =================================================================================================================
// v4: v2's CUDA-core math, fed by a per-lane cp.async ring and a per-CTA page table in shared memory, with the
// split combine folded into the kernel.
//
// attention_decode_v4_d{D}_g{G}_s{STAGES}[_n|_p]: grid (num_splits, Hkv, num_seqs), block 128 (4 warps), dynamic
// shared memory STAGES * 16 KB (the ring) + kV4TabCap * 4 (page table) + 16 bytes. STAGES = 2 is the default
// (measured best on an H200: docs/kernels/attention.md, "v4 decode"); 3, 4, _n and _p are experiments.
//   Key layout as v2: D/8 lanes share a key (one 16-byte chunk of its K and V row each), 32/(D/8) keys side by side,
//   kV4Unroll such steps per stage, warps interleaved over the split's keys. Each lane cp.asyncs exactly the chunks
//   it later reads ([warp][stage][chunk][lane], conflict-free), so the STAGES-deep ring needs no barrier: while one
//   stage is computed, STAGES - 1 are in flight, and the registers hold no loads.
//   At CTA start the split's block-table entries (pre-multiplied by block_size) are copied into shared memory, so a
//   refill is a shared load, a multiply-add and two cp.async per key: no global round trip before the K/V loads.
//   The launcher guarantees they fit (ceil(chunk_len / block_size) + 1 <= kV4TabCap), else it runs v2.
//   t / block_size is a multiply-high by a host-computed magic number (bs_magic, bs_shift), not a division.
//   Softmax: ex2.approx; the running max is raised only when a score exceeds it by more than 8 (log2 domain), and
//   the warp rescales only when some lane raised it (p <= 2^8 in between: the same result, fewer multiplies).
//   TR (default): the U x G partial dot products of a lane are reduced over the key's D/8 lanes by a transpose-
//   reduce (each step halves the values a lane holds: 15 shuffles for 16 values instead of 64) and gathered back
//   with one indexed shuffle per score. _n: v2's butterfly per score. _p: a probe that only streams K and V through
//   the ring (no math, output zeros): the memory ceiling of this loading scheme, for the benchmark only.
//   num_splits == 1: bf16 out directly; otherwise fp32 partials, and the last CTA of each (sequence, kv head) to
//   finish (counters, reset by that CTA: graph-replay safe) merges them. kv_len == 0: split 0 writes zeros.
// =================================================================================================================
namespace {

constexpr int kV4Warps = 4;
constexpr int kV4Unroll = 4;
constexpr int kV4TabCap = 512;
constexpr float kV4Thresh = 8.f;

// n / d for 0 <= n < 2^31 with (magic, shift) from the host (_fast_div in xserv/ops/attention.py).
__device__ __forceinline__ int fast_div(int n, unsigned magic, int shift) {
    return (int)((__umulhi((unsigned)n, magic) + (unsigned)n) >> shift);
}

// bf16 -> fp32 is a shift or a mask (one instruction per value; the generic conversion takes 1.5).
__device__ __forceinline__ void bf16x8_to_float_fast(const uint4& v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

template <int D, int G, int STAGES, bool TR, bool PROBE>
__device__ void decode_split_v4(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                                const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
                                const int* __restrict__ kv_lens, const int* __restrict__ block_tables,
                                int max_blocks_per_seq, int block_size, int num_q_heads, int num_kv_heads,
                                float scale_log2, int chunk_len, int num_splits, __nv_bfloat16* __restrict__ out,
                                float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ counters,
                                unsigned bs_magic, int bs_shift) {
    constexpr int U = kV4Unroll;
    constexpr int LPK = D / 8;         // lanes per key
    constexpr int KPS = 32 / LPK;      // keys side by side in a warp
    constexpr int KPI = KPS * U;       // keys per warp and stage
    constexpr int NCH = 2 * U;         // 16-byte chunks per lane and stage (K then V)
    constexpr int RING = kV4Warps * STAGES * NCH * 32 * 16;
    static_assert(kV4Warps * G * D * 4 + 2 * kV4Warps * G * 4 <= RING, "merge area fits in the ring");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    int* tab = reinterpret_cast<int*>(smem_raw + RING);
    int& sm_last = *reinterpret_cast<int*>(smem_raw + RING + kV4TabCap * 4);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane % LPK, sub = lane / LPK;
    const int s = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
    const int kv_len = kv_lens[s];
    const int start = split * chunk_len;
    const int h0 = kv_head * G;
    if (start >= kv_len) {
        if (kv_len == 0 && split == 0)  // a padding row of a captured batch: a defined zero row
            for (int idx = threadIdx.x; idx < G * D; idx += kV4Warps * 32)
                out[((long long)s * num_q_heads + h0) * D + idx] = __float2bfloat16(0.f);
        return;
    }
    const int end = min(start + chunk_len, kv_len);
    const int* table = block_tables + (long long)s * max_blocks_per_seq;
    // The split's pages, as first slots (page * block_size). The launcher guarantees they fit in kV4TabCap.
    const int p0 = fast_div(start, bs_magic, bs_shift);
    const int n_tab = fast_div(end - 1, bs_magic, bs_shift) - p0 + 1;
    for (int i = threadIdx.x; i < n_tab; i += kV4Warps * 32) tab[i] = __ldg(table + p0 + i) * block_size;

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

    const int first = start + warp * KPI;
    const int n_it = end > first ? (end - first + kV4Warps * KPI - 1) / (kV4Warps * KPI) : 0;
    const unsigned row_bytes = (unsigned)(num_kv_heads * D * 2);  // bytes between consecutive slots
    const unsigned long long kbase = reinterpret_cast<unsigned long long>(k_cache + (long long)kv_head * D + c * 8);
    const unsigned long long vbase = reinterpret_cast<unsigned long long>(v_cache + (long long)kv_head * D + c * 8);
    const unsigned ring = smem_u32(smem_raw) + (unsigned)(warp * STAGES * NCH * 32 + lane) * 16u;
    __syncthreads();  // the page table is in shared memory

    auto issue = [&](int it, int stage) {
        const int j0 = first + it * (kV4Warps * KPI) + sub;
        const unsigned st = ring + (unsigned)(stage * NCH * 32) * 16u;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * KPS;
            const bool valid = j < end;
            const int jj = valid ? j : start;  // an address inside the sequence either way
            const int pidx = fast_div(jj, bs_magic, bs_shift);
            const unsigned slot = (unsigned)(tab[pidx - p0] + (jj - pidx * block_size));
            // one IMAD.WIDE.U32 each: base + slot * row_bytes
            const unsigned long long koff = kbase + (unsigned long long)slot * row_bytes;
            const unsigned long long voff = vbase + (unsigned long long)slot * row_bytes;
            cp_async16_m(st + u * 512u, reinterpret_cast<const void*>(koff), valid);
            cp_async16_m(st + (U + u) * 512u, reinterpret_cast<const void*>(voff), valid);
        }
    };

#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) {
        if (b < n_it) issue(b, b);
        cp_async_commit_m();
    }
    unsigned probe = 0u;
    int rd = 0, wr = STAGES - 1;
    for (int it = 0; it < n_it; ++it) {
        if (it + STAGES - 1 < n_it) issue(it + STAGES - 1, wr);
        cp_async_commit_m();
        cp_async_wait_m<STAGES - 1>();  // this lane's copies of stage `rd` have landed
        const unsigned st = ring + (unsigned)(rd * NCH * 32) * 16u;
        rd = rd + 1 == STAGES ? 0 : rd + 1;
        wr = wr + 1 == STAGES ? 0 : wr + 1;
        if constexpr (PROBE) {
            probe ^= (unsigned)it;
        } else {
        const int jb = first + it * (kV4Warps * KPI) + sub;
        float sc[U][G];
        if constexpr (TR) {
            constexpr int GP = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;  // G padded to a power of two
            constexpr int NP = U * GP;
            constexpr int NF = NP >= LPK ? NP / LPK : 1;  // full scores a lane holds after the reduce
            constexpr int R = NP >= LPK ? 1 : LPK / NP;   // lanes holding the same score
            float v[NP];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float kf[8];
                bf16x8_to_float_fast(lds128(st + u * 512u), kf);
#pragma unroll
                for (int g = 0; g < GP; ++g) {
                    float d = 0.f;
                    if (g < G) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                    }
                    v[u * GP + g] = d;
                }
            }
            // transpose-reduce over the key's lanes: at lane bit `bit`, the lane with the bit set keeps the upper
            // half of its values and sends the lower half, its partner the reverse
#pragma unroll
            for (int bit = LPK / 2, n = NP; bit >= 1; bit >>= 1) {
                if (n > 1) {
                    const bool hi = (c & bit) != 0;
                    const int half = n / 2;
#pragma unroll
                    for (int i = 0; i < NP / 2; ++i) {
                        if (i < half) {
                            const float a = v[i], b = v[i + half];
                            const float send = hi ? a : b, keep = hi ? b : a;
                            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
                        }
                    }
                    n = half;
                } else {
                    v[0] += __shfl_xor_sync(0xffffffffu, v[0], bit);
                }
            }
            // lane c now holds the full scores ((c / R) * NF + k), k < NF; gather them all into every lane
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const int i = u * GP + g;
                    sc[u][g] = __shfl_sync(0xffffffffu, v[i % NF], sub * LPK + (i / NF) * R);
                }
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float kf[8];
                bf16x8_to_float_fast(lds128(st + u * 512u), kf);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    float d = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
#pragma unroll
                    for (int off = LPK / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                    sc[u][g] = d;
                }
            }
        }
        if (first + it * (kV4Warps * KPI) + KPI > end) {  // the last stage of the warp: mask keys past the end
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int g = 0; g < G; ++g)
                    if (jb + u * KPS >= end) sc[u][g] = neg_inf();
        }
        // online softmax with a lazily raised max (see the header)
        float mx[G];
        bool grow = false;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            mx[g] = sc[0][g];
#pragma unroll
            for (int u = 1; u < U; ++u) mx[g] = fmaxf(mx[g], sc[u][g]);
            grow |= mx[g] > m[g] + kV4Thresh;  // m = -inf: any valid key raises it
        }
        if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float m_new = fmaxf(m[g], mx[g]);
                const float alpha = exp2_approx(m[g] - (m_new == neg_inf() ? 0.f : m_new));  // m = -inf: 0
                l[g] *= alpha;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
                m[g] = m_new;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_use = m[g] == neg_inf() ? 0.f : m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) sc[u][g] = exp2_approx(sc[u][g] - m_use);  // now p (0 for masked keys)
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            bf16x8_to_float_fast(lds128(st + (U + u) * 512u), vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                l[g] += sc[u][g];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(sc[u][g], vf[e], acc[g][e]);
            }
        }
        }  // !PROBE
    }
    cp_async_wait_m<0>();

    if constexpr (PROBE) {
        // no result: zeros (and the ring's last word, which keeps nothing from being optimised away)
        if (split == 0)
            for (int idx = threadIdx.x; idx < G * D; idx += kV4Warps * 32)
                out[((long long)s * num_q_heads + h0) * D + idx] = __float2bfloat16(probe == 0xffffffffu ? 1.f : 0.f);
        return;
    }

    // Merge the KPS key groups of this warp (lanes c, c + LPK, ... hold the same columns).
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
    __syncthreads();  // every warp is past its last ring read: the ring becomes the merge area
    float* sm_acc = reinterpret_cast<float*>(smem_raw);  // [kV4Warps][G][D]
    float* sm_m = sm_acc + kV4Warps * G * D;             // [kV4Warps][G]
    float* sm_l = sm_m + kV4Warps * G;                   // [kV4Warps][G]
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sm_acc[(warp * G + g) * D + c * 8 + e] = acc[g][e];
            if (c == 0) {
                sm_m[warp * G + g] = m[g];
                sm_l[warp * G + g] = l[g];
            }
        }
    }
    __syncthreads();
    const long long row0 = (long long)s * num_q_heads + h0;
    write_split_result<D, G, kV4Warps>(sm_m, sm_l, sm_acc, row0, split, num_splits, out, part_o, part_lse);
    if (num_splits == 1) return;
    // the merge area is no longer read: it holds the split weights now
    combine_splits_if_last<D, G, kV4Warps>(counters + (long long)s * num_kv_heads + kv_head,
                                           min(num_splits, (kv_len + chunk_len - 1) / chunk_len), row0, num_splits,
                                           part_o, part_lse, out, reinterpret_cast<float*>(smem_raw), sm_last);
}

}  // namespace

// 4 CTAs per SM for G <= 4 (<= 128 registers; the ring of 2 stages is 32 KB), 2 above (q and acc alone are 16 G
// registers).
#define XSERV_V4_MINB(G) ((G) <= 4 ? 4 : 2)
#define XSERV_DECODE_V4_KERNEL(D, G, S, SUFFIX, TR, PROBE)                                                       \
    extern "C" __global__ void __launch_bounds__(128, XSERV_V4_MINB(G))                                          \
        attention_decode_v4_d##D##_g##G##_s##S##SUFFIX(XSERV_DECODE_ARGS, int* __restrict__ counters,           \
                                                       unsigned bs_magic, int bs_shift) {                         \
        decode_split_v4<D, G, S, TR, PROBE>(XSERV_DECODE_PASS, counters, bs_magic, bs_shift);                    \
    }

// The default (2 stages, transpose-reduce) for every head_dim and group size.
XSERV_DECODE_V4_KERNEL(64, 1, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 2, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 3, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 4, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 5, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 6, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 7, 2, , true, false)
XSERV_DECODE_V4_KERNEL(64, 8, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 1, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 2, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 3, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 4, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 5, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 6, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 7, 2, , true, false)
XSERV_DECODE_V4_KERNEL(128, 8, 2, , true, false)
// Experiments (the benchmark's shapes only): 3 / 4 stages, v2's butterfly (_n), the load-only probe (_p).
#define XSERV_DECODE_V4_EXPERIMENTS(D, G)                \
    XSERV_DECODE_V4_KERNEL(D, G, 3, , true, false)       \
    XSERV_DECODE_V4_KERNEL(D, G, 4, , true, false)       \
    XSERV_DECODE_V4_KERNEL(D, G, 2, _n, false, false)    \
    XSERV_DECODE_V4_KERNEL(D, G, 2, _p, false, true)
XSERV_DECODE_V4_EXPERIMENTS(128, 4)
XSERV_DECODE_V4_EXPERIMENTS(128, 2)
XSERV_DECODE_V4_EXPERIMENTS(64, 2)
