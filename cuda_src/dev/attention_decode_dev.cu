// Development kernels of the decode family (not shipped: compiled only on request by the tests marked `dev`,
// tools/bench_attention.py and the kernel harness, which name them through tools/dev/kernels.py). Built on the
// production file, whose helpers and kernel templates it includes rather than copies; measured in
// docs/kernels/history/attention.md ("v3 decode", "v4 decode").
//   v3: tensor-core decode (mma.sync), per-lane cp.async staging; never the default (v4 is faster everywhere).
//   v4 experiments: the production template with 3 / 4 ring stages and with 16-warp CTAs.
#include "../attention_decode.cu"

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
// register budget never becomes the tighter limit (tools/dev/kernels.py v3_min_blocks mirrors these).
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
// v4 experiments, the production templates of attention_decode.cu at other shapes, for the benchmark's (head_dim,
// group) shapes only: 3 and 4 ring stages (XSERV_DECODE_V4_KERNEL; 2 ship), and 16-warp CTAs
// (XSERV_DECODE_V4_WIDE_KERNEL; the 8-warp ones ship): one split per kv head of a short context with no split combine
// lost (docs/kernels/history/attention.md, "Wide CTAs for short contexts").
// =================================================================================================================
#define XSERV_DECODE_V4_EXPERIMENTS(D, G)          \
    XSERV_DECODE_V4_KERNEL(D, G, 3)                \
    XSERV_DECODE_V4_KERNEL(D, G, 4)                \
    XSERV_DECODE_V4_WIDE_KERNEL(D, G, 2, 16)
XSERV_DECODE_V4_EXPERIMENTS(128, 4)
XSERV_DECODE_V4_EXPERIMENTS(128, 2)
XSERV_DECODE_V4_EXPERIMENTS(64, 2)
