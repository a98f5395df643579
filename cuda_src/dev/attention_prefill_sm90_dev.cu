// Development kernels of the sm_90a prefill family (not shipped: compiled only on request by the tests marked `dev`,
// tools/bench_attention.py and the kernel harness). Built on the production file, whose helpers and kernels it
// includes; measured in docs/kernels/attention.md ("v4 prefill", "v5 prefill").
//   v4 / v5 tuning points that do not ship (production has the measured best per head_dim).
//   prefill_v4_exp: the v4 kernel as measured, with its experiment switches: PROBE (a timing decomposition) and
//   tma_spread (0: warp 0 issues every TMA copy), as attention_prefill_v4probe{P}_d128_w2_k128, P = 0 the real kernel.
// xserv-arch: sm_90a (wgmma, setmaxnreg, TMA, as the production file it includes)
#include "../attention_prefill_sm90.cu"

using namespace xserv;

// v4 tuning points
XSERV_PREFILL_V4(128, 2, 64)
XSERV_PREFILL_V4(128, 3, 64)
XSERV_PREFILL_V4(64, 2, 128)
XSERV_PREFILL_V4(64, 2, 64)

// v5 tuning points
XSERV_PREFILL_V5(128, 2, 128, 2)
XSERV_PREFILL_V5(128, 2, 64, 4)
XSERV_PREFILL_V5(128, 3, 64, 3)
XSERV_PREFILL_V5(64, 3, 128, 3)

// ------------------------------------------------------------------------------------------------------------
// PROBE (timing decomposition only; the result is wrong on purpose): 0 = the real kernel, 1 = no K/V copies after
// the first tile, 2 = no softmax (P = S), 3 = no PV product. tools/bench_attention --v4-probes times them.
//
// K/V copies: with tensor maps (k_tmap, v_tmap non-null; block_size a multiple of 8 that divides BKV or is a
// multiple of it) the TMA copies every chunk of R = min(block_size, BKV) keys (one page, or one tile of a page)
// that lies wholly below kv_end; the rest of a tile (the sequence's last, partial chunk and rows past it) is copied
// by every thread with cp.async, zero-filled past kv_end so that stale or NaN cache slots never reach PV. Without
// tensor maps every row goes through cp.async.
template <int D, int NWG, int BKV, int PROBE>
__device__ __forceinline__ void prefill_v4_exp(XSERV_PREFILL_ARGS, const void* k_tmap, const void* v_tmap, int tma_spread) {
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
    // (W warps) with tma_spread (a few copies per warp), else by lane c of warp 0. The chunk's cache
    // slot is looked up one tile ahead (tma_slot), so that load's latency is never waited for.
    const bool use_tma = k_tmap != nullptr;
    const int R = min(block_size, BKV), chunks = BKV / R;
    const int my_chunk = tma_spread ? lane * (4 * NWG) + (tid >> 5) : (tid < 32 ? lane : BKV);
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
        pending_cp_async = kt + 1 < n_tiles && PROBE != 1 && issue_tile(kt + 1, stage ^ KV_BYTES, page);
        cp_async_commit();
        page = kt + 2 < n_tiles && !use_tma ? page_of(kt + 2) : 0;

        const bool active = rows.any && kt * BKV <= rows.last;  // warpgroup-uniform
        if (!active) continue;

        // ---- S = Q K^T
        const unsigned parity = (kt >> 1) & 1;
        if (use_tma && PROBE != 1) mbarrier_wait(bars + (stage ? 8 : 0), parity);
        float sacc[BKV / 2];
        qk_product<D, BQ, BKV>(sacc, q_desc, k_desc, stage);
        wgmma_fence_operands(o);

        unsigned pa[BKV / 16][4];  // P as the A operand of the PV product
        if constexpr (PROBE == 2) {  // no softmax: P = S
#pragma unroll
            for (int ks = 0; ks < BKV / 16; ++ks)
#pragma unroll
                for (int i = 0; i < 4; ++i) pa[ks][i] = pack_bf16x2(sacc[8 * ks + 2 * i], sacc[8 * ks + 2 * i + 1]);
        } else {
            // mask only tiles reaching past the warpgroup's first row
            softmax_to_p<D, BKV>(sacc, o, m_row, l_row, pa, kt * BKV + BKV - 1 > rows.first, kt * BKV + 2 * (lane & 3),
                                 rows.pos_lo, rows.pos_hi, scale_log2);
        }
        if constexpr (PROBE == 3) {  // no PV product
#pragma unroll
            for (int ks = 0; ks < BKV / 16; ++ks) o[ks] += __uint_as_float(pa[ks][0] ^ pa[ks][1] ^ pa[ks][2] ^ pa[ks][3]);
            continue;
        }
        // ---- O += P V
        if (use_tma && PROBE != 1) mbarrier_wait(bars + (stage ? 24 : 16), parity);
        pv_product<D, BKV>(o, pa, v_desc, stage);
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
    store_rows<D>(o, l_row, rows.row0 + 16 * warp_in_wg + (lane >> 2), q_len, q_start, num_q_heads, h, lane, out);
}


// probes of the d128 kernel (arguments as v4, then tma_spread)
#define XSERV_PREFILL_V4_PROBE(P)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1) attention_prefill_v4probe##P##_d128_w2_k128(            \
        XSERV_PREFILL_ARGS, const void* k_tmap, const void* v_tmap, int tma_spread) {                            \
        prefill_v4_exp<128, 2, 128, P>(XSERV_PREFILL_PASS, k_tmap, v_tmap, tma_spread);                          \
    }
XSERV_PREFILL_V4_PROBE(0)
XSERV_PREFILL_V4_PROBE(1)
XSERV_PREFILL_V4_PROBE(2)
XSERV_PREFILL_V4_PROBE(3)
