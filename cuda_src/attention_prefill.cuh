// Causal attention for variable-length query chunks packed along tokens, K/V read from the paged KV cache
// (layout in attention.cuh). Query i (0-based within sequence s's chunk) sits at absolute position
// kv_lens[s] - q_len_s + i and attends to key positions <= that. GQA: q head h reads kv head h / (Hq / Hkv).
//
// Common arguments:
//   q:             token t's head h at q + t * q_row_stride + h * D   (q_row_stride = Hq*D, or (Hq+2Hkv)*D when
//                  q is the packed qkv tensor)
//   k_cache/v_cache: [num_blocks, block_size, num_kv_heads, D]
//   cu_seqlens_q:  [num_seqs + 1] int32, query chunk of sequence s = tokens [cu[s], cu[s+1])
//   kv_lens:       [num_seqs] int32, keys of sequence s = positions [0, kv_lens[s]) (kv_lens[s] >= q_len_s)
//   block_tables:  [num_seqs, max_blocks_per_seq] int32
//   out:           [num_tokens, num_q_heads, D] bf16
//   scale_log2:    softmax scale * log2(e)
//   causal:        0 lets every query see all kv_len keys (benchmarks against non-causal peers; the simple kernel
//                  ignores it)
//
// This header holds the kernel templates (simple = v1, v3) and v3's entry macro; the entries are instantiated in
// attention_prefill.cu (head dims 64 and 128) and attention_prefill_d256.cu (256, Qwen3.5's gated attention: its own
// family, compiled at start-up for a model of that head dim only); cuda_src/dev/attention_prefill_dev.cu adds the
// tuning points.
#pragma once
#include "attention.cuh"

using namespace xserv;

// ------------------------------------------------------------------------------------------------------------
// v1: one warp per (query token, head), scalar online softmax over every visible key. Slow (a warp reduction per
// key) but simple; kept as an independent GPU cross-check of the tensor-core kernel.
// grid (ceil(max_q_len / 4), Hq, num_seqs), block 128 (warp w handles query blockIdx.x * 4 + w).
template <int D>
__device__ void prefill_simple(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                               const __nv_bfloat16* __restrict__ k_cache, const __nv_bfloat16* __restrict__ v_cache,
                               const int* __restrict__ cu_seqlens_q, const int* __restrict__ kv_lens,
                               const int* __restrict__ block_tables, int max_blocks_per_seq, int block_size,
                               int num_q_heads, int num_kv_heads, float scale_log2, __nv_bfloat16* __restrict__ out,
                               int /*causal: always*/) {
    constexpr int E = D / 32;  // elements per lane
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int s = blockIdx.z, h = blockIdx.y;
    const int q_start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - q_start;
    const int i = blockIdx.x * 4 + warp;
    if (i >= q_len) return;
    const int kv_len = kv_lens[s];
    const int pos = kv_len - q_len + i;
    const int kv_head = h / (num_q_heads / num_kv_heads);
    const int* table = block_tables + (long long)s * max_blocks_per_seq;

    float qv[E], acc[E];
    const __nv_bfloat16* qrow = q + (long long)(q_start + i) * q_row_stride + (long long)h * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qv[e] = __bfloat162float(qrow[e]) * scale_log2;
        acc[e] = 0.f;
    }
    float m = neg_inf(), l = 0.f;
    for (int j = 0; j <= pos; ++j) {
        const long long off = paged_row_offset(table, j, block_size, num_kv_heads, D, kv_head) + lane * E;
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot += qv[e] * __bfloat162float(k_cache[off + e]);
        dot = warp_sum(dot);
        const float m_new = fmaxf(m, dot);
        const float alpha = exp2f(m - m_new), p = exp2f(dot - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * alpha + p * __bfloat162float(v_cache[off + e]);
        m = m_new;
    }
    __nv_bfloat16* orow = out + ((long long)(q_start + i) * num_q_heads + h) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) orow[e] = __float2bfloat16(acc[e] / l);
}

// ------------------------------------------------------------------------------------------------------------
// v3: FlashAttention-2 on mma.sync, tuned for latency (docs/kernels/history/attention.md, "v3 prefill"); the prefill of
// every architecture but sm_90a. (v2, the plain FlashAttention-2 it was tuned from, is in cuda_src/dev/.)
//
// What differs from v2:
//  - MT m-tiles (16 query rows each) per warp: with MT = 2 every K/V fragment loaded by ldmatrix feeds 4 mma
//    instead of 2 (half the shared-memory traffic per mma, twice the independent accumulators per load).
//  - Q fragments either stay in registers (QREG) or are re-read from shared memory each tile (MT = 2, D = 128,
//    where 64 more registers would not fit beside the 128 O accumulators).
//  - Every ldmatrix is issued PF steps ahead of the mma that consumes it (NBUF-deep register ring).
//  - K and V are separate cp.async groups in 2 stages each: K is fetched two tiles ahead, V one tile ahead, so a
//    warp only waits for the operand of the product it is about to run (two barriers per tile).
//  - One page-table lookup per thread per tile: a thread copies RPT consecutive key rows (one page when
//    block_size % RPT == 0), looked up one tile before it is needed.
//  - Softmax: the scale is folded into the exp2 argument (one FFMA + ex2.approx per score); P is computed 16 keys
//    at a time right before its PV mma so the exp2s interleave with tensor-core work.
//  - Causal: a warp skips tiles that lie wholly past its last query row and masks only tiles that reach past its
//    first row; grid (Hq, num_seqs, q tiles) with the heaviest q tiles launched first.
// Same arguments as the simple kernel; grid (Hq, num_seqs, ceil(max_q_len / BQ)), block 32 * WARPS,
// dynamic smem (BQ + 4 * 64) * D * 2 bytes.

namespace prefill3 {

// mma without `volatile`: pure register arithmetic, so the compiler may schedule it freely.
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace prefill3

template <int D, int MT, int WARPS, bool QREG, int NBUF, int BKV>
__device__ __forceinline__ void prefill_v3(XSERV_PREFILL_ARGS) {
    using namespace prefill3;
    constexpr int ROWS_W = 16 * MT, BQ = ROWS_W * WARPS;
    constexpr int CH = D / 8;                      // 16-byte chunks per row
    constexpr int THREADS = 32 * WARPS;
    constexpr int RPT = BKV * CH / THREADS;        // K (and V) rows a thread copies per tile
    static_assert(THREADS % CH == 0 && (THREADS / CH) * RPT == BKV, "copy layout");
    constexpr int TILE = BKV * D;                  // elements of one K or V stage
    constexpr int ROW_B = D * 2;                   // bytes per shared row
    constexpr int PF = NBUF - 1;                   // ldmatrix prefetch distance (steps)

    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [BQ][D]
    __nv_bfloat16* sK = sQ + BQ * D;                                  // [2][BKV][D]
    __nv_bfloat16* sV = sK + 2 * TILE;                                // [2][BKV][D]
    require_dynamic_smem((BQ + 4 * BKV) * D * 2);
    static_assert(BKV % 16 == 0, "key tile is a whole number of mma k-steps");
    // All shared tiles: 16-byte chunk c of row r stored at chunk c ^ (r & 7) (conflict-free ldmatrix phases).

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    PrefillTile T;  // heaviest (last) q tiles first
    if (!prefill_tile(T, blockIdx.x, blockIdx.y, (gridDim.z - 1 - blockIdx.z) * BQ, BQ, BKV, XSERV_PREFILL_TABLES)) return;
    const int h = T.h, q_start = T.q_start, q_len = T.q_len, i0 = T.i0, kv_len = T.kv_len, offset = T.offset;
    const int kv_head = T.kv_head, kv_end = T.kv_end, n_tiles = T.n_tiles;
    const int* table = T.table;

    // ---- Q tile -> shared (rows past the chunk zero-filled); joins the group of K tile 0
    load_q_rows<D>(q, q_row_stride, T, 0, BQ, tid, THREADS,
                   [&](int row, int ch) { return smem_u32(sQ + row * D + swizzled_chunk(row, ch) * 8); });

    // ---- K/V copy layout: thread copies chunk column my_ch of rows my_g * RPT + r, r = 0..RPT-1 (issued in the
    // order r = (p + my_g) % RPT so that the threads of one warp write rows with different swizzles).
    const int my_ch = tid % CH, my_g = tid / CH;
    const long long slot_stride = (long long)num_kv_heads * D;  // elements between consecutive cache slots
    const __nv_bfloat16* k_head = k_cache + (long long)kv_head * D + my_ch * 8;
    const __nv_bfloat16* v_head = v_cache + (long long)kv_head * D + my_ch * 8;
    const bool grouped = block_size % RPT == 0;  // a thread's RPT rows of a tile then lie in one page
    // block of this thread's first row of tile kt (0 when that row is past kv_end: never dereferenced)
    auto page_of = [&](int kt) -> int {
        const int j = kt * BKV + my_g * RPT;
        return (grouped && j < kv_end) ? __ldg(table + j / block_size) : 0;
    };
    auto load_tile = [&](const __nv_bfloat16* head, __nv_bfloat16* dst, int kt, int page) {
        const int j0 = kt * BKV + my_g * RPT;
        const __nv_bfloat16* src0 = head + ((long long)page * block_size + j0 % block_size) * slot_stride;
#pragma unroll
        for (int p = 0; p < RPT; ++p) {
            const int r = (p + my_g) % RPT;
            const int row = my_g * RPT + r, j = j0 + r;
            const bool valid = j < kv_end;
            const __nv_bfloat16* src = head;
            if (valid) {
                if (grouped) {
                    src = src0 + r * slot_stride;
                } else {
                    const long long slot = (long long)__ldg(table + j / block_size) * block_size + j % block_size;
                    src = head + slot * slot_stride;
                }
            }
            cp_async16(smem_u32(dst + row * D + swizzled_chunk(row, my_ch) * 8), src, valid);
        }
    };

    // Prologue. Groups are committed in the order Q+K0, V0, K1 and then, per tile kt, V(kt+1) and K(kt+2)
    // (empty groups past the end keep the count uniform), so "at most 2 groups pending" means: before S(kt),
    // K(kt) has landed; before PV(kt), V(kt) has landed.
    {
        const int p0 = page_of(0);
        load_tile(k_head, sK, 0, p0);
        cp_async_commit();
        load_tile(v_head, sV, 0, p0);
        cp_async_commit();
    }
    int page1 = n_tiles > 1 ? page_of(1) : 0;  // page of tile kt+1 (for V(kt+1))
    if (n_tiles > 1) load_tile(k_head, sK + TILE, 1, page1);
    cp_async_commit();
    int page2 = n_tiles > 2 ? page_of(2) : 0;  // page of tile kt+2 (for K(kt+2))

    // ---- per-lane ldmatrix byte addresses (chunk XOR terms are per lane; the row part of the swizzle is lane & 7
    // because every fragment's rows start at a multiple of 8)
    const unsigned sQa = smem_u32(sQ), sKa = smem_u32(sK), sVa = smem_u32(sV);
    const int xq = (lane >> 4) ^ (lane & 7);           // Q (A operand) and V (.trans): chunk 2k + (lane >> 4)
    const int xk = ((lane >> 3) & 1) ^ (lane & 7);     // K (B operand): chunk 2k + ((lane >> 3) & 1)
    const unsigned q_lane = sQa + (warp * ROWS_W + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW_B;
    const unsigned k_lane = sKa + ((lane & 7) + ((lane >> 4) << 3)) * ROW_B;
    const unsigned v_lane = sVa + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROW_B;

    unsigned qf[QREG ? MT : 1][QREG ? D / 16 : 1][4];  // resident Q fragments (QREG)
    float o[MT][D / 8][4];
    float m_row[MT][2], l_row[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m_row[mt][0] = m_row[mt][1] = neg_inf();
        l_row[mt][0] = l_row[mt][1] = 0.f;
    }
    // key position limit of (mt, r): pos_base + pos_step * (16 mt + 8 r)
    const int warp_row0 = i0 + warp * ROWS_W;
    const int pos_base = causal ? offset + warp_row0 + (lane >> 2) : kv_len - 1;
    const int pos_step = causal ? 1 : 0;
    const int warp_first = causal ? offset + warp_row0 : kv_len - 1;
    const int warp_last = causal ? offset + warp_row0 + ROWS_W - 1 : kv_len - 1;

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int st = kt & 1;
        cp_async_wait<2>();
        __syncthreads();  // K(kt) (and Q) visible to all; every warp is past PV(kt-1), so V stage st^1 is free
        if (kt + 1 < n_tiles) load_tile(v_head, sV + (st ^ 1) * TILE, kt + 1, page1);
        cp_async_commit();

        if constexpr (QREG) {
            if (kt == 0) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int kk = 0; kk < D / 16; ++kk)
                        ldmatrix_x4(qf[mt][kk], q_lane + mt * 16 * ROW_B + (((2 * kk) ^ xq) << 4));
            }
        }
        const bool active = kt * BKV <= warp_last;  // warp-uniform: some key of the tile is visible to the warp

        // ---- S = Q K^T: MT x 16 rows x 64 keys per warp. Step (kk, np): one ldmatrix.x4 of K = B fragments of
        // n-tiles 2np, 2np+1 at k-step kk, used by 2 * MT mma; loaded PF steps ahead.
        float sacc[MT][BKV / 8][4];
        if (active) {
            constexpr int NP = BKV / 16, STEPS = (D / 16) * NP;
            const unsigned k_st = k_lane + st * TILE * 2;
            auto k_addr = [&](int step) {
                const int kk = step / NP, np = step % NP;
                return k_st + np * 16 * ROW_B + (((2 * kk) ^ xk) << 4);
            };
            unsigned kb[NBUF][4];
            unsigned qa[QREG ? 1 : 2][MT][4];
#pragma unroll
            for (int p = 0; p < PF; ++p) ldmatrix_x4(kb[p], k_addr(p));
            if constexpr (!QREG) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(qa[0][mt], q_lane + mt * 16 * ROW_B + ((0 ^ xq) << 4));
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < BKV / 8; ++nt) sacc[mt][nt][0] = sacc[mt][nt][1] = sacc[mt][nt][2] = sacc[mt][nt][3] = 0.f;
#pragma unroll
            for (int step = 0; step < STEPS; ++step) {
                const int kk = step / NP, np = step % NP;
                if (step + PF < STEPS) ldmatrix_x4(kb[(step + PF) % NBUF], k_addr(step + PF));
                if constexpr (!QREG) {
                    if (np == 0 && kk + 1 < D / 16) {
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
                            ldmatrix_x4(qa[(kk + 1) & 1][mt], q_lane + mt * 16 * ROW_B + (((2 * (kk + 1)) ^ xq) << 4));
                    }
                }
                const unsigned(&b)[4] = kb[step % NBUF];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (QREG) {
                        mma16816(sacc[mt][2 * np], qf[mt][kk], b[0], b[1]);
                        mma16816(sacc[mt][2 * np + 1], qf[mt][kk], b[2], b[3]);
                    } else {
                        mma16816(sacc[mt][2 * np], qa[kk & 1][mt], b[0], b[1]);
                        mma16816(sacc[mt][2 * np + 1], qa[kk & 1][mt], b[2], b[3]);
                    }
                }
            }
        }

        cp_async_wait<2>();
        __syncthreads();  // V(kt) visible; every warp is past S(kt), so K stage st is free for K(kt+2)
        if (kt + 2 < n_tiles) load_tile(k_head, sK + st * TILE, kt + 2, page2);
        cp_async_commit();
        page1 = page2;
        page2 = kt + 3 < n_tiles ? page_of(kt + 3) : 0;  // consumed one tile later: the lookup's latency is hidden

        if (!active) continue;

        // ---- online softmax on raw scores (scale folded into exp2's argument); mask only where some key of
        // the tile lies past the warp's first row
        if (kt * BKV + BKV - 1 > warp_first) {
            // key kt*BKV + 2*(lane&3) + c (c = nt*8 + (e&1), compile-time) is visible to row (mt, r) iff c <= lim
            const int base = pos_base - kt * BKV - 2 * (lane & 3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int lim = base + pos_step * (16 * mt + 8 * r);
#pragma unroll
                    for (int nt = 0; nt < BKV / 8; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (nt * 8 + e > lim) sacc[mt][nt][2 * r + e] = neg_inf();
                }
        }
        float m_use[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = neg_inf();
#pragma unroll
                for (int nt = 0; nt < BKV / 8; ++nt) mx = fmaxf(mx, fmaxf(sacc[mt][nt][2 * r], sacc[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 lanes of a quad share a row
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_row[mt][r], mx * scale_log2);
                m_use[mt][r] = m_new == neg_inf() ? 0.f : m_new;  // fully masked so far: no inf - inf
                const float alpha = exp2_approx(m_row[mt][r] - m_use[mt][r]);
                m_row[mt][r] = m_new;
                l_row[mt][r] *= alpha;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[mt][n][2 * r] *= alpha;
                    o[mt][n][2 * r + 1] *= alpha;
                }
            }
        }

        // ---- O += P V, 16 keys (ks) at a time: P(ks) is exponentiated right before its mma. Step (ks, dp): one
        // ldmatrix.x4.trans of V = B fragments of O n-tiles 2dp, 2dp+1, used by 2 * MT mma; loaded PF steps ahead.
        {
            constexpr int DP = D / 16, STEPS = (BKV / 16) * DP;
            const unsigned v_st = v_lane + st * TILE * 2;
            auto v_addr = [&](int step) {
                const int ks = step / DP, dp = step % DP;
                return v_st + ks * 16 * ROW_B + (((2 * dp) ^ xq) << 4);
            };
            unsigned vb[NBUF][4];
#pragma unroll
            for (int p = 0; p < PF; ++p) ldmatrix_x4_trans(vb[p], v_addr(p));
            unsigned pa[MT][4];
#pragma unroll
            for (int step = 0; step < STEPS; ++step) {
                const int ks = step / DP, dp = step % DP;
                if (step + PF < STEPS) ldmatrix_x4_trans(vb[(step + PF) % NBUF], v_addr(step + PF));
                if (dp == 0) {
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            const float* sv = sacc[mt][2 * ks + hh];
                            const float p0 = exp2_approx(fmaf(sv[0], scale_log2, -m_use[mt][0]));
                            const float p1 = exp2_approx(fmaf(sv[1], scale_log2, -m_use[mt][0]));
                            const float p2 = exp2_approx(fmaf(sv[2], scale_log2, -m_use[mt][1]));
                            const float p3 = exp2_approx(fmaf(sv[3], scale_log2, -m_use[mt][1]));
                            l_row[mt][0] += p0 + p1;
                            l_row[mt][1] += p2 + p3;
                            pa[mt][2 * hh] = pack_bf16x2(p0, p1);
                            pa[mt][2 * hh + 1] = pack_bf16x2(p2, p3);
                        }
                    }
                }
                const unsigned(&b)[4] = vb[step % NBUF];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816(o[mt][2 * dp], pa[mt], b[0], b[1]);
                    mma16816(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

    // ---- epilogue: O / l, rows past the chunk dropped
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_row[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int i = warp_row0 + mt * 16 + (lane >> 2) + r * 8;
            if (i >= q_len) continue;
            __nv_bfloat16* orow = out + ((long long)(q_start + i) * num_q_heads + h) * D + 2 * (lane & 3);
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                *reinterpret_cast<unsigned*>(orow + n * 8) = pack_bf16x2(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
        }
    }
}

// attention_prefill_v3_d{D}_m{MT}w{WARPS}[q]_b{NBUF}[_k32]: MT m-tiles per warp, WARPS warps, q = Q fragments
// resident in registers (else re-read from shared memory per tile), NBUF-deep ldmatrix ring, key tiles of 64 (or
// 32: _k32). Two CTAs per SM wanted for 4 warps, one for 8. The measured best per head_dim ships; the other tuning
// points are instantiated in cuda_src/dev/attention_prefill_dev.cu.
#define XSERV_PREFILL_V3(D, MT, WARPS, QREG, QS, NBUF, BKV, KS)                                                \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, 256 / (32 * WARPS))                                  \
        attention_prefill_v3_d##D##_m##MT##w##WARPS##QS##_b##NBUF##KS(XSERV_PREFILL_ARGS) {                     \
        prefill_v3<D, MT, WARPS, QREG, NBUF, BKV>(XSERV_PREFILL_PASS);                                           \
    }
