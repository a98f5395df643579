// v4 prefill: FlashAttention on Hopper's warpgroup MMA (wgmma.mma_async), sm_90a only. Same arguments, grid
// and semantics as the v3 kernel in attention_prefill.cu (paged K/V, packed variable-length query chunks, causal
// offset kv_len - q_len, GQA by index); notes and measurements in docs/kernels/history/attention.md ("v4 prefill").
//
// Why: mma.sync (v3) issues one 16x8x16 product per warp instruction and feeds it through registers via ldmatrix;
// on H100/H200 that path tops out near half the tensor-core rate. wgmma lets a warpgroup (4 warps, 128 threads)
// issue a 64xNx16 product that reads its B operand (and optionally A) straight from shared memory, asynchronously.
//
// Structure (one CTA = NWG warpgroups = BQ = 64 * NWG query rows of one head; every thread also copies):
//   shared: Q [BQ x D], K and V [2 stages][BKV x D], each stored as D/64 "panels" of 64 columns (128 bytes per row)
//           with the 128-byte swizzle wgmma's descriptors expect: 16-byte chunk c of row r at chunk c ^ (r % 8).
//   per K/V tile kt (cp.async, K(kt+1) and V(kt+1) in flight while tile kt is computed; one barrier per tile):
//     S = Q K^T      wgmma SS: A = Q (K-major), B = K tile (K-major), S in registers (BKV/2 fp32 per thread)
//     online softmax on S in registers (scale folded into exp2), P packed to bf16 A fragments in place
//     O += P V       wgmma RS: A = P from registers, B = V tile read MN-major (transposed by the hardware)
//   Causal: a warpgroup skips tiles wholly past its last row and masks only tiles that reach past its first row.
//
// xserv-arch: sm_90a (wgmma, setmaxnreg, TMA: the hopper path of attention_prefill; elsewhere v3 in attention_prefill.cu)
// The runtime compiles this family for sm_90a only (compiler.families_for); the #error keeps any other build honest
// instead of compiling the kernels to nothing.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_prefill_sm90 needs sm_90a (wgmma, setmaxnreg, TMA); other archs run v3 (attention_prefill.cu)"
#endif
#include "attention.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

using namespace xserv;

namespace prefill4 {

// Byte offset of 16-byte chunk `chunk` (of D/8) of row `row` in a tile of `rows` rows stored as 64-column panels
// with the 128-byte swizzle.
__device__ __forceinline__ unsigned panel_offset(int row, int chunk, int rows) {
    return (unsigned)((chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}


__device__ __forceinline__ unsigned long long desc_add(unsigned long long desc, unsigned bytes) {
    return desc + (unsigned long long)(bytes >> 4);  // start address field, 16-byte units
}

// S = Q K^T for one warpgroup: D/16 wgmma k-steps over the panels of Q (A) and of the K tile at byte offset
// `k_stage` (B), waited for. The descriptors (128-byte swizzle, stride byte offset 1024 = one 8-row swizzle atom)
// advance 32 bytes per k-step inside a panel; the next panel starts rows * 128 bytes on.
template <int D, int BQ, int BKV>
__device__ __forceinline__ void qk_issue(float (&sacc)[BKV / 2], unsigned long long q_desc, unsigned long long k_desc,
                                         unsigned k_stage) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned a_off = (kk >> 2) * BQ * 128 + (kk & 3) * 32;
        const unsigned b_off = k_stage + (kk >> 2) * BKV * 128 + (kk & 3) * 32;
        if (kk == 0)
            wgmma_ss_init<BKV>(sacc, desc_add(q_desc, a_off), desc_add(k_desc, b_off));
        else
            wgmma_ss<BKV>(sacc, desc_add(q_desc, a_off), desc_add(k_desc, b_off), 1);
    }
}
template <int D, int BQ, int BKV>
__device__ __forceinline__ void qk_product(float (&sacc)[BKV / 2], unsigned long long q_desc,
                                           unsigned long long k_desc, unsigned k_stage) {
    wgmma_fence();
    qk_issue<D, BQ, BKV>(sacc, q_desc, k_desc, k_stage);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(sacc);
}

// Online softmax of one S tile in registers, then P as bf16 A fragments. Row r (0: lane/4, 1: lane/4 + 8 of the
// warp's 16) lives in the 4 lanes of a quad. With `mask`, key key_base + 8j + e (key_base = first key of the tile +
// 2 (lane % 4)) is dropped past pos_lo (row 0) / pos_hi (row 1). O and l are rescaled by the new running max.
template <int D, int BKV>
__device__ __forceinline__ void softmax_to_p(float (&sacc)[BKV / 2], float (&o)[D / 2], float (&m_row)[2],
                                             float (&l_row)[2], unsigned (&pa)[BKV / 16][4], bool mask,
                                             int key_base, int pos_lo, int pos_hi, float scale_log2) {
    if (mask) {
#pragma unroll
        for (int j = 0; j < BKV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = key_base + 8 * j + e;
                if (key > pos_lo) sacc[4 * j + e] = neg_inf();
                if (key > pos_hi) sacc[4 * j + 2 + e] = neg_inf();
            }
    }
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < BKV / 8; ++j) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_row[r], mx * scale_log2);
        m_use[r] = m_new == neg_inf() ? 0.f : m_new;  // fully masked so far: no inf - inf
        const float alpha = exp2_approx(m_row[r] - m_use[r]);
        m_row[r] = m_new;
        l_row[r] *= alpha;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o[4 * j + 2 * r] *= alpha;
            o[4 * j + 2 * r + 1] *= alpha;
        }
    }
    // k-step ks covers keys 16ks..16ks+15 = accumulator column blocks 2ks (a[0], a[1]) and 2ks+1 (a[2], a[3])
#pragma unroll
    for (int ks = 0; ks < BKV / 16; ++ks) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float* sv = sacc + 8 * ks + 4 * half;
            const float p0 = exp2_approx(fmaf(sv[0], scale_log2, -m_use[0]));
            const float p1 = exp2_approx(fmaf(sv[1], scale_log2, -m_use[0]));
            const float p2 = exp2_approx(fmaf(sv[2], scale_log2, -m_use[1]));
            const float p3 = exp2_approx(fmaf(sv[3], scale_log2, -m_use[1]));
            l_row[0] += p0 + p1;
            l_row[1] += p2 + p3;
            pa[ks][2 * half] = pack_bf16x2(p0, p1);
            pa[ks][2 * half + 1] = pack_bf16x2(p2, p3);
        }
    }
}

// O += P V for one warpgroup (V tile at byte offset v_stage, read MN-major: its leading byte offset steps between
// 64-column panels), waited for: leaving it running into the next tile made ptxas serialise every wgmma (C7515).
template <int D, int BKV>
__device__ __forceinline__ void pv_issue(float (&o)[D / 2], const unsigned (&pa)[BKV / 16][4],
                                         unsigned long long v_desc, unsigned v_stage) {
#pragma unroll
    for (int ks = 0; ks < BKV / 16; ++ks) wgmma_rs<D, 1>(o, pa[ks], desc_add(v_desc, v_stage + ks * 16 * 128));
}
template <int D, int BKV>
__device__ __forceinline__ void pv_product(float (&o)[D / 2], const unsigned (&pa)[BKV / 16][4],
                                           unsigned long long v_desc, unsigned v_stage) {
    wgmma_fence_operands(o);
    wgmma_fence();
    pv_issue<D, BKV>(o, pa, v_desc, v_stage);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
}

// out rows of this thread: O / l as bf16, rows at or past q_len dropped. row_lo = query index (within the
// sequence's chunk) of the thread's first row; the second is row_lo + 8.
template <int D>
__device__ __forceinline__ void store_rows(const float (&o)[D / 2], const float (&l_row)[2], int row_lo, int q_len,
                                           int q_start, int num_q_heads, int h, int lane,
                                           __nv_bfloat16* __restrict__ out) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_row[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int i = row_lo + 8 * r;
        if (i >= q_len) continue;
        __nv_bfloat16* orow = out + ((long long)(q_start + i) * num_q_heads + h) * D + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<unsigned*>(orow + 8 * j) = pack_bf16x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
}

// The query rows of one consumer warpgroup (64 from row0) and the key position limits the softmax masks with.
struct WarpgroupRows {
    int row0;            // first query row (index within the sequence's chunk)
    int pos_lo, pos_hi;  // last key visible to this thread's two rows: lane / 4 and lane / 4 + 8 of its warp's 16
    int first, last;     // last key visible to the warpgroup's first / last row
    bool any;            // false: every row is padding past the chunk
};
__device__ __forceinline__ WarpgroupRows warpgroup_rows(const PrefillTile& t, int wg, int warp_in_wg, int lane,
                                                        int causal) {
    WarpgroupRows w;
    w.row0 = t.i0 + 64 * wg;
    w.pos_lo = causal ? t.offset + w.row0 + 16 * warp_in_wg + (lane >> 2) : t.kv_len - 1;
    w.pos_hi = w.pos_lo + (causal ? 8 : 0);
    w.first = causal ? t.offset + w.row0 : t.kv_len - 1;
    w.last = causal ? t.offset + w.row0 + 63 : t.kv_len - 1;
    w.any = w.row0 < t.q_len;
    return w;
}

}  // namespace prefill4

// K/V copies: with tensor maps (k_tmap, v_tmap non-null; block_size a multiple of 8 that divides BKV or is a
// multiple of it) the TMA copies every chunk of R = min(block_size, BKV) keys (one page, or one tile of a page)
// that lies wholly below kv_end; the rest of a tile (the sequence's last, partial chunk and rows past it) is copied
// by every thread with cp.async, zero-filled past kv_end so that stale or NaN cache slots never reach PV. Without
// tensor maps every row goes through cp.async.
template <int D, int NWG, int BKV>
__device__ __forceinline__ void prefill_v4(XSERV_PREFILL_ARGS, const void* k_tmap, const void* v_tmap) {
    using namespace prefill4;
    constexpr int BQ = 64 * NWG;
    constexpr int THREADS = 128 * NWG;
    constexpr int CH = D / 8;                   // 16-byte chunks per row
    constexpr int GROUPS = THREADS / CH;        // threads that copy one row together
    constexpr int RPT = (BKV + GROUPS - 1) / GROUPS;  // K (and V) rows one thread copies per tile (the last may idle)
    static_assert(THREADS % CH == 0, "copy layout");
    static_assert(D % 64 == 0 && BKV % 64 == 0, "whole panels and whole 8-row swizzle atoms");
    constexpr unsigned Q_BYTES = BQ * D * 2, KV_BYTES = BKV * D * 2;

    // 128-byte swizzle works on address bits: every tile starts on a 1024-byte boundary (the launch asks for
    // 1 KB more than the tiles need).
    extern __shared__ uint4 smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    const unsigned sQ = (raw + 1023u) & ~1023u;
    const unsigned sK = sQ + Q_BYTES;          // [2][BKV x D]
    const unsigned sV = sK + 2 * KV_BYTES;     // [2][BKV x D]
    const unsigned bars = sV + 2 * KV_BYTES;   // mbarriers: K stage 0, 1, V stage 0, 1 (8 bytes each)
    require_dynamic_smem(bars + 32 - raw);

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid >> 7, warp_in_wg = (tid >> 5) & 3;
    PrefillTile T;  // heaviest (last) q tiles first
    if (!prefill_tile(T, blockIdx.x, blockIdx.y, (gridDim.z - 1 - blockIdx.z) * BQ, BQ, BKV, XSERV_PREFILL_TABLES)) return;
    const int h = T.h, q_len = T.q_len, kv_head = T.kv_head, kv_end = T.kv_end, n_tiles = T.n_tiles;
    const int q_start = T.q_start;
    const int* table = T.table;

    // ---- Q tile -> shared (rows past the chunk zero-filled); joins the group of K tile 0
    load_q_rows<D>(q, q_row_stride, T, 0, BQ, tid, THREADS,
                   [&](int row, int ch) { return sQ + panel_offset(row, ch, BQ); });

    // ---- K/V copy layout: thread copies chunk my_ch of rows my_g * RPT .. my_g * RPT + RPT - 1 of each tile, one
    // page-table lookup per tile when those rows share a page.
    const int my_ch = tid % CH, my_g = tid / CH;
    const long long slot_stride = (long long)num_kv_heads * D;
    const __nv_bfloat16* k_head = k_cache + (long long)kv_head * D + my_ch * 8;
    const __nv_bfloat16* v_head = v_cache + (long long)kv_head * D + my_ch * 8;
    const bool grouped = block_size % RPT == 0 && BKV % RPT == 0;  // then a thread's rows never straddle a page
    auto page_of = [&](int kt) -> int {
        const int j = kt * BKV + my_g * RPT;
        return (grouped && j < kv_end) ? __ldg(table + j / block_size) : 0;
    };
    auto load_tile = [&](const __nv_bfloat16* head, unsigned dst, int kt, int page, int row_begin) {
        const int j0 = kt * BKV + my_g * RPT;
        const __nv_bfloat16* src0 = head + ((long long)page * block_size + j0 % block_size) * slot_stride;
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            const int row = my_g * RPT + r, j = j0 + r;
            if (GROUPS * RPT != BKV && row >= BKV) break;
            if (row < row_begin) continue;
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
            cp_async16(dst + panel_offset(row, my_ch, BKV), src, valid);
        }
    };

    // ---- TMA: chunks of R keys. Chunk c of a tile is copied (both panels of K and V) by lane c / W of warp c % W
    // (W warps): a few copies per warp rather than all by warp 0 (measured faster). The chunk's cache slot is looked
    // up one tile ahead (tma_slot), so that load's latency is never waited for.
    const bool use_tma = k_tmap != nullptr;
    const int R = min(block_size, BKV), chunks = BKV / R;
    const int my_chunk = lane * (4 * NWG) + (tid >> 5);
    const bool chunk_owner = use_tma && my_chunk < chunks;
    auto chunk_slot = [&](int t) -> int {
        const int key = t * BKV + my_chunk * R;
        return (chunk_owner && key < kv_end) ? __ldg(table + key / block_size) * block_size + key % block_size : 0;
    };
    int tma_slot = chunk_slot(0);
    if (use_tma) {
        if (tid == 0) {
            for (int i = 0; i < 4; ++i) mbarrier_init(bars + 8 * i, 1);
            mbarrier_init_fence();
        }
        __syncthreads();
    }
    // Copies of tile t into stage `stage` (byte offset): TMA for whole chunks below kv_end, cp.async for the rest.
    // Returns whether any cp.async was issued (those need a wait and a proxy fence before wgmma reads them).
    auto issue_tile = [&](int t, unsigned stage, int page) -> bool {
        int n_tma = 0;
        if (use_tma) {
            n_tma = max(0, min(chunks, (kv_end - t * BKV) / R));
            const unsigned bk = bars + (stage ? 8 : 0), bv = bars + (stage ? 24 : 16);
            if (tid == 0) {
                mbarrier_arrive_expect_tx(bk, n_tma * R * D * 2);
                mbarrier_arrive_expect_tx(bv, n_tma * R * D * 2);
            }
            if (my_chunk < n_tma) {
#pragma unroll
                for (int p = 0; p < D / 64; ++p) {
                    const unsigned off = stage + p * BKV * 128 + my_chunk * R * 128;
                    tma_load_3d(sK + off, k_tmap, bk, p * 64, kv_head, tma_slot);
                    tma_load_3d(sV + off, v_tmap, bv, p * 64, kv_head, tma_slot);
                }
            }
            tma_slot = chunk_slot(t + 1);
        }
        if (n_tma * R == BKV) return false;
        if (use_tma) page = page_of(t);  // not looked up ahead in TMA mode (rarely needed)
        load_tile(k_head, sK + stage, t, page, n_tma * R);
        load_tile(v_head, sV + stage, t, page, n_tma * R);
        return true;
    };

    // Prologue: Q, K0 and V0. Per tile kt, right after the barrier that publishes tile kt, the copies of tile kt+1
    // are issued; they have the whole of tile kt's compute to land.
    // page_of (a table lookup per thread) serves only the cp.async path.
    int page = use_tma ? 0 : page_of(0);
    issue_tile(0, 0, page);
    cp_async_commit();
    bool pending_cp_async = true;  // Q always goes through cp.async
    page = n_tiles > 1 && !use_tma ? page_of(1) : 0;

    // ---- wgmma descriptors (128-byte swizzle; stride byte offset 1024 = one 8-row swizzle atom). A k-step of 16
    // columns inside a panel advances the start address by 32 bytes; the next panel starts rows * 128 bytes on.
    //   Q (A, K-major): this warpgroup's 64 rows start at row 64 * wg.
    //   K (B, K-major): BKV rows (N) x D (K).
    //   V (B, MN-major): k-step = 16 keys = 2048 bytes; the leading byte offset steps N from one 64-column panel to
    //   the next.
    const unsigned long long q_desc = wgmma_desc_sw128(sQ + wg * 64 * 128, 16, 1024);
    const unsigned long long k_desc = wgmma_desc_sw128(sK, 16, 1024);
    const unsigned long long v_desc = wgmma_desc_sw128(sV, BKV * 128, 1024);

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_row[2] = {neg_inf(), neg_inf()}, l_row[2] = {0.f, 0.f};

    const WarpgroupRows rows = warpgroup_rows(T, wg, warp_in_wg, lane, causal);

    // Two stages: tile kt+1 goes to the stage tile kt-1 used, which every warpgroup finished (S and PV waited)
    // before it reached the barrier of tile kt.
    for (int kt = 0; kt < n_tiles; ++kt) {
        const unsigned stage = (kt & 1) * KV_BYTES;
        // cp.async rows of tile kt (warpgroup-uniform flag): wait, then make them visible to the async proxy. No
        // other copy is in flight then, so the fence has nothing else to wait for.
        if (pending_cp_async) {
            cp_async_wait<0>();
            fence_proxy_async();
        }
        __syncthreads();  // tile kt visible to every warpgroup; all are done with tile kt-1, whose stage is refilled
        pending_cp_async = kt + 1 < n_tiles && issue_tile(kt + 1, stage ^ KV_BYTES, page);
        cp_async_commit();
        page = kt + 2 < n_tiles && !use_tma ? page_of(kt + 2) : 0;

        const bool active = rows.any && kt * BKV <= rows.last;  // warpgroup-uniform
        if (!active) continue;

        // ---- S = Q K^T
        const unsigned parity = (kt >> 1) & 1;
        if (use_tma) mbarrier_wait(bars + (stage ? 8 : 0), parity);
        float sacc[BKV / 2];
        qk_product<D, BQ, BKV>(sacc, q_desc, k_desc, stage);
        wgmma_fence_operands(o);

        unsigned pa[BKV / 16][4];  // P as the A operand of the PV product
        // mask only tiles reaching past the warpgroup's first row
        softmax_to_p<D, BKV>(sacc, o, m_row, l_row, pa, kt * BKV + BKV - 1 > rows.first, kt * BKV + 2 * (lane & 3),
                             rows.pos_lo, rows.pos_hi, scale_log2);
        // ---- O += P V
        if (use_tma) mbarrier_wait(bars + (stage ? 24 : 16), parity);
        pv_product<D, BKV>(o, pa, v_desc, stage);
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
    store_rows<D>(o, l_row, rows.row0 + 16 * warp_in_wg + (lane >> 2), q_len, q_start, num_q_heads, h, lane, out);
}

// ------------------------------------------------------------------------------------------------------------
// v5: v4's math with warp specialisation. One extra producer warp (of a producer warpgroup that hands most of its
// registers to the consumers with setmaxnreg, so they get 232 each) issues every K/V copy through the TMA into a
// STAGES-deep ring and never computes; the consumer warpgroups never wait at a CTA-wide barrier: they wait on a
// stage's "full" mbarriers (K and V separately) and release it through its "empty" mbarrier (one arrival per
// consumer warp). So the warpgroups drift apart (one's softmax overlaps the other's wgmma) and copies run up to
// STAGES - 1 tiles ahead. Needs the tensor maps (the launcher falls back to v4 otherwise). A sequence's partial last
// chunk is copied as a whole page; each consumer warpgroup zeroes the V rows past kv_end of that last tile itself
// before its PV product (stale or NaN slots; K rows there are masked).
template <int D, int NWG, int BKV, int STAGES>
__device__ __forceinline__ void prefill_v5(XSERV_PREFILL_ARGS, const void* k_tmap, const void* v_tmap) {
    using namespace prefill4;
    constexpr int BQ = 64 * NWG, CONSUMERS = 128 * NWG, CH = D / 8;
    constexpr unsigned Q_BYTES = BQ * D * 2, KV_BYTES = BKV * D * 2;
    extern __shared__ uint4 smem_raw[];
    const unsigned sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned sK = sQ + Q_BYTES;                 // [STAGES][BKV x D]
    const unsigned sV = sK + STAGES * KV_BYTES;       // [STAGES][BKV x D]
    const unsigned full_k = sV + STAGES * KV_BYTES;   // mbarriers, 8 bytes each: full_k[STAGES], full_v, empty
    const unsigned full_v = full_k + 8 * STAGES, empty = full_v + 8 * STAGES;
    require_dynamic_smem(empty + 8 * STAGES - smem_u32(smem_raw));

    const int tid = threadIdx.x, lane = tid & 31;
    PrefillTile T;  // heaviest (last) q tiles first
    if (!prefill_tile(T, blockIdx.x, blockIdx.y, (gridDim.z - 1 - blockIdx.z) * BQ, BQ, BKV, XSERV_PREFILL_TABLES)) return;
    const int h = T.h, q_len = T.q_len, kv_head = T.kv_head, kv_end = T.kv_end, n_tiles = T.n_tiles;
    const int q_start = T.q_start;
    const int* table = T.table;

    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) {
            mbarrier_init(full_k + 8 * i, 1);
            mbarrier_init(full_v + 8 * i, 1);
            mbarrier_init(empty + 8 * i, NWG * 4);
        }
        mbarrier_init_fence();
    }
    __syncthreads();  // the last CTA-wide barrier

    // Registers: the block is NWG + 1 warpgroups, so ptxas budgets 65536 / (128 (NWG + 1)) per thread; the producer
    // warpgroup gives most of its share back (setmaxnreg) and the consumers take it.
    constexpr int CONSUMER_REGS = NWG == 2 ? 232 : 152;  // with the producer at 40: <= 65536 in all
    if (tid >= CONSUMERS) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid >= CONSUMERS + 32) return;  // one warp of the producer warpgroup issues the copies
        // ---- producer warp: tile t into stage t % STAGES once every consumer warp released its previous use
        const int R = min(block_size, BKV), chunks = BKV / R;
        for (int t = 0; t < n_tiles; ++t) {
            const int st = t % STAGES;
            if (t >= STAGES) mbarrier_wait(empty + 8 * st, ((t / STAGES) - 1) & 1);
            const int key0 = t * BKV;
            const int n = min(chunks, (kv_end - key0 + R - 1) / R);  // chunks holding keys below kv_end
            if (lane == 0) {
                mbarrier_arrive_expect_tx(full_k + 8 * st, n * R * D * 2);
                mbarrier_arrive_expect_tx(full_v + 8 * st, n * R * D * 2);
            }
            __syncwarp();
            for (int c = lane; c < n; c += 32) {
                const int key = key0 + c * R;
                const int slot = __ldg(table + key / block_size) * block_size + key % block_size;
#pragma unroll
                for (int p = 0; p < D / 64; ++p) {
                    const unsigned off = st * KV_BYTES + p * BKV * 128 + c * R * 128;
                    tma_load_3d(sK + off, k_tmap, full_k + 8 * st, p * 64, kv_head, slot);
                    tma_load_3d(sV + off, v_tmap, full_v + 8 * st, p * 64, kv_head, slot);
                }
            }
        }
        return;
    }

    // ---- consumer warpgroups
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
    const int wg = tid >> 7, warp_in_wg = (tid >> 5) & 3, wtid = tid & 127;
    // this warpgroup's 64 Q rows -> shared (rows past the chunk zero-filled)
    load_q_rows<D>(q, q_row_stride, T, 64 * wg, 64 * wg + 64, wtid, 128,
                   [&](int row, int ch) { return sQ + panel_offset(row, ch, BQ); });
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier_sync(1 + wg, 128);

    const unsigned long long q_desc = wgmma_desc_sw128(sQ + wg * 64 * 128, 16, 1024);
    const unsigned long long k_desc = wgmma_desc_sw128(sK, 16, 1024);
    const unsigned long long v_desc = wgmma_desc_sw128(sV, BKV * 128, 1024);
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_row[2] = {neg_inf(), neg_inf()}, l_row[2] = {0.f, 0.f};
    const WarpgroupRows rows = warpgroup_rows(T, wg, warp_in_wg, lane, causal);

    // The sequence's last tile: zero its V rows past kv_end (stale or NaN slots of a whole-page copy) before any PV
    // product reads them; each warpgroup does it for itself (a uniform condition), then fences and syncs.
    auto zero_tail = [&](int t, unsigned stage) {
        const int valid_rows = kv_end - t * BKV;
        if (valid_rows >= BKV) return;
        for (int c = wtid; c < (BKV - valid_rows) * CH; c += 128) {
            const int row = valid_rows + c / CH, ch = c % CH;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sV + stage + panel_offset(row, ch, BKV)),
                         "r"(0u)
                         : "memory");
        }
        fence_proxy_async();
        named_barrier_sync(1 + wg, 128);
    };
    auto release = [&](int st) {  // this warp is done with stage st
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty + 8 * st);
    };

    for (int t = 0; t < n_tiles; ++t) {
        const int st = t % STAGES;
        const unsigned parity = (t / STAGES) & 1, stage = st * KV_BYTES;
        // Every warp waits for the tile to land even where it skips the tile: its "empty" arrival must never
        // reach a stage's barrier before the producer refilled that stage, or the phases would run ahead.
        mbarrier_wait(full_k + 8 * st, parity);
        const bool active = rows.any && t * BKV <= rows.last;  // warpgroup-uniform: some key is visible to it
        if (!active) mbarrier_wait(full_v + 8 * st, parity);
        if (active) {
            float sacc[BKV / 2];
            qk_product<D, BQ, BKV>(sacc, q_desc, k_desc, stage);
            wgmma_fence_operands(o);
            unsigned pa[BKV / 16][4];
            softmax_to_p<D, BKV>(sacc, o, m_row, l_row, pa, t * BKV + BKV - 1 > rows.first, t * BKV + 2 * (lane & 3),
                                 rows.pos_lo, rows.pos_hi, scale_log2);
            mbarrier_wait(full_v + 8 * st, parity);
            zero_tail(t, stage);
            pv_product<D, BKV>(o, pa, v_desc, stage);
        }
        release(st);
    }
    store_rows<D>(o, l_row, rows.row0 + 16 * warp_in_wg + (lane >> 2), q_len, q_start, num_q_heads, h, lane, out);
}

// attention_prefill_v5_d{D}_w{NWG}_k{BKV}_s{STAGES}: block 128 (NWG + 1) (the producer warpgroup last); dynamic shared
// memory (64 NWG + 2 STAGES BKV) * D * 2 + 1024 + 24 STAGES bytes; arguments: XSERV_PREFILL_ARGS, k_tmap, v_tmap.
// The measured best per head_dim ships (the other tuning points are in cuda_src/dev/attention_prefill_sm90_dev.cu).
#define XSERV_PREFILL_V5(D, NWG, BKV, STAGES)                                                                   \
    extern "C" __global__ void __launch_bounds__(128 * NWG + 128, 1)                                             \
        attention_prefill_v5_d##D##_w##NWG##_k##BKV##_s##STAGES(XSERV_PREFILL_ARGS, const void* k_tmap,          \
                                                                 const void* v_tmap) {                           \
        prefill_v5<D, NWG, BKV, STAGES>(XSERV_PREFILL_PASS, k_tmap, v_tmap);                                     \
    }
XSERV_PREFILL_V5(128, 2, 128, 3)
XSERV_PREFILL_V5(64, 2, 128, 3)

// attention_prefill_v4_d{D}_w{NWG}_k{BKV}: NWG warpgroups (64 query rows each), key tiles of BKV;
// dynamic shared memory (64 NWG + 4 BKV) * D * 2 + 1024 + 32 bytes; arguments: XSERV_PREFILL_ARGS, then the
// K and V cache tensor maps (device addresses of CUtensorMap, or null for cp.async only). Runs on sm_90a where the
// block size rules out v5's TMA copies.
#define XSERV_PREFILL_V4(D, NWG, BKV)                                                                           \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 1) attention_prefill_v4_d##D##_w##NWG##_k##BKV(     \
        XSERV_PREFILL_ARGS, const void* k_tmap, const void* v_tmap) {                                           \
        prefill_v4<D, NWG, BKV>(XSERV_PREFILL_PASS, k_tmap, v_tmap);                                             \
    }
XSERV_PREFILL_V4(128, 2, 128)
XSERV_PREFILL_V4(64, 3, 128)
