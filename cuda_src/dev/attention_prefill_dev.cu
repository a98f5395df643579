// Development kernels of the prefill family (not shipped: compiled only on request by the tests marked `dev`,
// tools/bench_attention.py and the kernel harness). Built on the production file, whose helpers and kernels it
// includes; measured in docs/kernels/history/attention.md ("v2 prefill", "v3 prefill").
//   v2 (fa2): FlashAttention-2 on mma.sync, the baseline v3 was tuned from.
//   v3: the tuning points that do not ship (the production file has the best one per head_dim).
#include "../attention_prefill.cu"

// ------------------------------------------------------------------------------------------------------------
// v2: FlashAttention-2 on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulators).
//
// A CTA owns BQ = 16 * WARPS query rows of one (sequence, head); warp w owns rows [16w, 16w + 16). The Q tile
// stays in registers (ldmatrix'd once); K/V tiles of BKV = 64 keys stream through shared memory with cp.async
// in a 2-stage pipeline (tile kt+1 in flight while tile kt is computed). Per tile:
//   S = Q K^T (K rows are the mma's "col" B operand as stored), online softmax in the exp2 domain, O += P V
//   (P re-packed from the S accumulators into A fragments in registers; V through ldmatrix.trans).
// Causal: only tiles holding keys <= the tile's last query position are visited, and only tiles that reach past
// the tile's first query position are masked. Rows past the chunk and keys past kv_len are zero-filled by
// cp.async (never loaded), so NaN in unused cache slots cannot leak.
// grid (ceil(max_q_len / BQ), Hq, num_seqs) with x reversed (the longest causal rows start first), block 32*WARPS,
// dynamic smem (BQ + 4 * BKV) * D * 2 bytes.
template <int D, int WARPS>
__device__ void prefill_fa2(XSERV_PREFILL_ARGS) {
    constexpr int BQ = 16 * WARPS, BKV = 64;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    constexpr int THREADS = 32 * WARPS;
    static_assert(THREADS % CH == 0, "each thread copies a fixed chunk column");
    constexpr int KV_ROWS_PER_PASS = THREADS / CH;

    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [BQ][D], swizzled chunks
    __nv_bfloat16* sK = sQ + BQ * D;                                  // [2][BKV][D]
    __nv_bfloat16* sV = sK + 2 * BKV * D;                             // [2][BKV][D]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    PrefillTile T;
    if (!prefill_tile(T, blockIdx.y, blockIdx.z, (gridDim.x - 1 - blockIdx.x) * BQ, BQ, BKV, XSERV_PREFILL_TABLES)) return;
    const int h = T.h, q_start = T.q_start, q_len = T.q_len, i0 = T.i0, kv_len = T.kv_len, offset = T.offset;
    const int kv_head = T.kv_head, kv_end = T.kv_end, n_tiles = T.n_tiles;
    const int* table = T.table;

    // ---- Q tile -> shared (rows past the chunk zero-filled)
    load_q_rows<D>(q, q_row_stride, T, 0, BQ, tid, THREADS,
                   [&](int row, int ch) { return smem_u32(sQ + row * D + swizzled_chunk(row, ch) * 8); });

    // ---- K/V tile kt -> stage: each thread copies chunk column (tid % CH) of rows tid / CH + pass * KV_ROWS_PER_PASS
    const int my_ch = tid % CH, my_row0 = tid / CH;
    auto load_kv = [&](int kt, int stage) {
        __nv_bfloat16* dK = sK + stage * BKV * D;
        __nv_bfloat16* dV = sV + stage * BKV * D;
#pragma unroll
        for (int pass = 0; pass < BKV / KV_ROWS_PER_PASS; ++pass) {
            const int row = my_row0 + pass * KV_ROWS_PER_PASS;
            const int j = kt * BKV + row;
            const bool valid = j < kv_end;
            long long off = 0;
            if (valid) off = paged_row_offset(table, j, block_size, num_kv_heads, D, kv_head) + my_ch * 8;
            const int sm = row * D + swizzled_chunk(row, my_ch) * 8;
            cp_async16(smem_u32(dK + sm), k_cache + off, valid);
            cp_async16(smem_u32(dV + sm), v_cache + off, valid);
        }
    };
    load_kv(0, 0);
    cp_async_commit();  // group 0: Q and tile 0

    unsigned qf[D / 16][4];          // this warp's 16 query rows as A fragments, one per 16-wide slice of D
    float o[D / 8][4];               // O accumulators: 16 rows x D, n-tiles of 8 columns
    float m_row[2] = {neg_inf(), neg_inf()};  // running max (log2 domain) of rows lane/4 and lane/4 + 8
    float l_row[2] = {0.f, 0.f};              // running sum of this thread's columns (quad-reduced at the end)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    const int r_lo = warp * 16 + (lane >> 2);  // tile rows of this thread's C fragments: r_lo, r_lo + 8
    // last key position each of this thread's two rows sees, and the smallest over the CTA's rows
    const int pos_lo = causal ? offset + i0 + r_lo : kv_len - 1, pos_hi = causal ? pos_lo + 8 : kv_len - 1;
    const int first_pos = causal ? offset + i0 : kv_len - 1;

    for (int kt = 0; kt < n_tiles; ++kt) {
        // Prefetch tile kt+1 into the other stage; that stage was last read in iteration kt-1, which every warp
        // finished before the trailing barrier of kt-1.
        if (kt + 1 < n_tiles) load_kv(kt + 1, (kt + 1) & 1);
        cp_async_commit();   // (possibly empty) group, so that "all but the newest group" always means tile kt
        cp_async_wait<1>();
        __syncthreads();     // tile kt (and, at kt == 0, Q) written by every thread's cp.async is now visible

        if (kt == 0) {
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int ch = kk * 2 + (lane >> 4);
                ldmatrix_x4(qf[kk], smem_u32(sQ + row * D + swizzled_chunk(row, ch) * 8));
            }
        }
        const __nv_bfloat16* tK = sK + (kt & 1) * BKV * D;
        const __nv_bfloat16* tV = sV + (kt & 1) * BKV * D;

        // ---- S = Q K^T  (16 x 64 per warp)
        float sacc[BKV / 8][4];
#pragma unroll
        for (int nt = 0; nt < BKV / 8; ++nt) {
            sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
#pragma unroll
            for (int kk2 = 0; kk2 < D / 32; ++kk2) {
                // matrices i = 0..3: K rows nt*8..+7, columns (kk2*4 + i)*8..+7 -> B fragments of two k-steps
                unsigned b[4];
                const int row = nt * 8 + (lane & 7);
                const int ch = kk2 * 4 + (lane >> 3);
                ldmatrix_x4(b, smem_u32(tK + row * D + swizzled_chunk(row, ch) * 8));
                mma_bf16_16816(sacc[nt], qf[2 * kk2], b[0], b[1]);
                mma_bf16_16816(sacc[nt], qf[2 * kk2 + 1], b[2], b[3]);
            }
        }

        // ---- online softmax (log2 domain); mask only tiles that reach past the CTA's first query position
        const bool need_mask = kt * BKV + BKV - 1 > first_pos;
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int nt = 0; nt < BKV / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = sacc[nt][e] * scale_log2;
                if (need_mask) {
                    const int j = kt * BKV + nt * 8 + 2 * (lane & 3) + (e & 1);
                    if (j > (e < 2 ? pos_lo : pos_hi)) x = neg_inf();
                }
                sacc[nt][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // the 4 lanes of a quad share a row
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m_row[r], mx[r]);
            m_use[r] = m_new == neg_inf() ? 0.f : m_new;  // a fully masked row so far: keep exp2 away from inf - inf
            alpha[r] = exp2f(m_row[r] - m_use[r]);
            m_row[r] = m_new;
            l_row[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
            o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        unsigned pa[BKV / 16][4];  // P as A fragments of the PV product, one per 16 keys
#pragma unroll
        for (int nt = 0; nt < BKV / 8; ++nt) {
            const float p0 = exp2f(sacc[nt][0] - m_use[0]), p1 = exp2f(sacc[nt][1] - m_use[0]);
            const float p2 = exp2f(sacc[nt][2] - m_use[1]), p3 = exp2f(sacc[nt][3] - m_use[1]);
            l_row[0] += p0 + p1;
            l_row[1] += p2 + p3;
            // S n-tile 2k -> a[0] (row g), a[1] (row g+8); n-tile 2k+1 -> a[2], a[3] (columns +8)
            pa[nt >> 1][(nt & 1) * 2 + 0] = pack_bf16x2(p0, p1);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16x2(p2, p3);
        }

        // ---- O += P V  (16 x D per warp); V's B fragments through ldmatrix.trans
#pragma unroll
        for (int ks = 0; ks < BKV / 16; ++ks) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                // matrices: (keys ks*16+0..7, d dp*16+0..7), (keys +8, same d), (keys +0, d +8), (keys +8, d +8)
                unsigned b[4];
                const int row = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int ch = dp * 2 + (lane >> 4);
                ldmatrix_x4_trans(b, smem_u32(tV + row * D + swizzled_chunk(row, ch) * 8));
                mma_bf16_16816(o[2 * dp], pa[ks], b[0], b[1]);
                mma_bf16_16816(o[2 * dp + 1], pa[ks], b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with stage kt&1 before iteration kt+1 refills it with tile kt+2
    }

    // ---- epilogue: O / l, rows past the chunk dropped
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 1);
        l_row[r] += __shfl_xor_sync(0xffffffffu, l_row[r], 2);
    }
    const float inv[2] = {l_row[0] > 0.f ? 1.f / l_row[0] : 0.f, l_row[1] > 0.f ? 1.f / l_row[1] : 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = i0 + r_lo + r * 8;
        if (i >= q_len) continue;
        __nv_bfloat16* orow = out + ((long long)(q_start + i) * num_q_heads + h) * D + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<unsigned*>(orow + n * 8) = pack_bf16x2(o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r]);
    }
}

extern "C" __global__ void __launch_bounds__(128) attention_prefill_fa2_d64_w4(XSERV_PREFILL_ARGS) {
    prefill_fa2<64, 4>(XSERV_PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(128) attention_prefill_fa2_d128_w4(XSERV_PREFILL_ARGS) {
    prefill_fa2<128, 4>(XSERV_PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(256) attention_prefill_fa2_d64_w8(XSERV_PREFILL_ARGS) {
    prefill_fa2<64, 8>(XSERV_PREFILL_PASS);
}
extern "C" __global__ void __launch_bounds__(256) attention_prefill_fa2_d128_w8(XSERV_PREFILL_ARGS) {
    prefill_fa2<128, 8>(XSERV_PREFILL_PASS);
}


// v3 tuning points
XSERV_PREFILL_V3(128, 2, 4, false, , 2, 64, )
XSERV_PREFILL_V3(128, 2, 4, false, , 3, 64, )
XSERV_PREFILL_V3(128, 2, 4, false, , 3, 32, _k32)
XSERV_PREFILL_V3(128, 1, 4, true, q, 3, 64, )
XSERV_PREFILL_V3(128, 1, 8, true, q, 3, 64, )
XSERV_PREFILL_V3(64, 2, 4, true, q, 3, 64, )
XSERV_PREFILL_V3(64, 1, 4, true, q, 3, 64, )
XSERV_PREFILL_V3(64, 1, 8, true, q, 3, 32, _k32)
