// The mixture-of-experts grouped GEMMs of prefill-sized steps on Hopper's warpgroup MMA (wgmma.mma_async), sm_90a
// only: moe_wg_gate_up_{mid,large} and moe_wg_down_{mid,large}, drop-in twins of moe.cu's moe_gemm_*_{mid,large}
// (same arguments, grid, token tiles and outputs; bf16 experts; docs/kernels/moe.md, "Launches").
//
// Why: moe.cu's mma.sync tiles ran the 2,048-token prefill's expert GEMMs at 17-26% of the cuBLAS bf16 rate on an
// H100 (one 16x8x16 product per warp instruction, both operands through ldmatrix and registers). wgmma lets a
// warpgroup issue a 64 x TILE x 16 product whose operands come straight from shared memory.
//
// Structure (one CTA = one token tile of one expert x ROWS weight rows; every thread also copies):
//   the ring   STAGES stages of 64-wide K chunks: the CTA's ROWS weight rows then the tile's TILE token rows, 128
//              bytes a row with 16-byte piece c of row r at c ^ (r % 8): exactly the K-major 128-byte-swizzle
//              layout wgmma's matrix descriptors read (stride byte offset 1024 = one 8-row atom; a k16 step advances
//              the start address 32 bytes). Stages start on 1024-byte boundaries (the swizzle is applied to address
//              bits), so the dynamic shared memory is 1 KB more than the ring. The weight rows come by TMA (the
//              same swizzle, one box and an mbarrier a stage: both GEMMs 13-18% faster than by cp.async, moe.md);
//              the token rows, gathered through the sorted list, by cp.async as in moe.cu.
//   the MMA    warpgroup wg owns MB blocks of 64 weight rows (A, from the ring) x all TILE tokens (B, from the ring):
//              per chunk 4 k16 steps per block, then commit and wait; the barrier at the next chunk frees the
//              stage. (Measured slower and dropped: 256 weight rows a CTA, and products running on over the next
//              barrier with one more stage: docs/kernels/history/moe.md, "the grouped GEMMs on wgmma".)
//   gate/up    the CTA's weight rows alternate in groups of 8: rows 16q..16q+7 are gate rows row0 + 8q.., rows
//              16q+8..16q+15 the same up rows. A thread's accumulators hold D rows g and g + 8 of its warp's 16 (the
//              mma C-fragment layout): a gate value and its up value, which the epilogue pairs as moe.cu does:
//              act = bf16(bf16(silu(bf16(gate))) * bf16(up)), stored at the tile's sorted row.
//   down       weight rows row0 + r; bf16(sum) stored at the entry's row of y [T * k, H] (the scatter), as moe.cu.
// Sums run in fp32 over the same 64-wide chunks in K order, but wgmma's internal order within a k16 step is the
// hardware's: results match moe.cu's within rounding, not bit for bit.
//
// xserv-arch: sm_90a (wgmma: the hopper path of the moe op's mid and large tiles; elsewhere moe.cu's mma.sync ones)
// xserv-shapes: moe=1 (compiled at the start of a mixture-of-experts model only)
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "moe_sm90 needs sm_90a (wgmma); other archs run moe.cu's mma.sync GEMMs"
#endif
#include <cuda_bf16.h>

#include "common.cuh"
#include "mma.cuh"
#include "norm.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

using bf16 = __nv_bfloat16;
using xserv::cp_async16;
using xserv::cp_async_commit;
using xserv::cp_async_wait;
using xserv::round_bf16;
using xserv::smem_u32;

constexpr int kBK = 64;  // K chunk: 64 bf16 = one 128-byte swizzled row

template <int WG, int MB, int TILE, int STAGES, bool GATE_UP>
__device__ __forceinline__ void moe_gemm_wg(const bf16* __restrict__ x, const bf16* __restrict__ w, const void* w_map,
                                            const int* __restrict__ sorted, const int* __restrict__ tile_expert,
                                            bf16* __restrict__ out, int top_k, int K, int N) {
    constexpr int ROWS = 64 * WG * MB;  // weight rows per CTA
    constexpr int THREADS = 128 * WG;
    constexpr int STAGE_BYTES = (ROWS + TILE) * kBK * 2;
    constexpr int AHEAD = STAGES - 1;  // chunks in flight ahead of the one multiplied
    static_assert(AHEAD >= 1, "ring depth");
    static_assert(STAGE_BYTES % 1024 == 0 && (TILE == 64 || TILE == 128), "stage alignment, wgmma N");
    extern __shared__ __align__(128) unsigned char wg_smem[];
    __shared__ int entry_of[TILE];
    __shared__ int xrow_of[TILE];  // the x row a tile row reads (gate/up: the entry's token; down: the sorted row)
    __shared__ __align__(8) unsigned long long w_landed[STAGES];  // a stage's weight rows landed

    xserv::pdl_wait();  // the sorted list and x (gate/up) or act (down) come from the launches before
    xserv::pdl_launch_dependents();
    const int tile = blockIdx.y;
    if (tile >= tile_expert[0]) return;  // the grid covers the most tiles any routing can need
    const int expert = tile_expert[1 + tile];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, wq = warp & 3;
    for (int i = tid; i < TILE; i += THREADS) {
        const int e = sorted[tile * TILE + i];
        entry_of[i] = e;
        xrow_of[i] = e < 0 ? -1 : GATE_UP ? e / top_k : tile * TILE + i;
    }
    const unsigned bars = smem_u32(w_landed);
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) xserv::mbarrier_init(bars + 8 * s, 1);
        xserv::mbarrier_init_fence();
    }
    __syncthreads();

    const unsigned ring = (smem_u32(wg_smem) + 1023u) & ~1023u;
    const bf16* wexp = w + (long long)expert * (GATE_UP ? 2 : 1) * N * K;
    const int row0 = blockIdx.x * (GATE_UP ? ROWS / 2 : ROWS);
    // The checkpoint row of the CTA's weight row r, and whether it exists (gate/up: groups of 8 alternate, above).
    auto weight_row = [&](int r, bool& valid) {
        if (GATE_UP) {
            const int j = row0 + (r >> 4) * 8 + (r & 7);
            valid = j < N;
            return (r & 8) ? N + j : j;
        }
        valid = row0 + r < N;
        return row0 + r;
    };
    // The weight rows by TMA, one box of 64 columns a stage, 128-byte swizzled like the token rows' cp.async pieces;
    // thread 0 announces the stage's bytes and issues it. Down: w_map is the stacked weights as one [experts x N, K]
    // matrix, the box ROWS rows (rows past the CTA's N land and are discarded with their outputs, zeros past the
    // matrix's end). Gate/up: w_map sees the weights as (K, 8 rows, gate / up, N / 8 groups, experts), so that one box
    // of (64, 8, 2, ROWS / 16, 1) lands as 8 gate rows, then the same 8 up rows, group after group: the CTA's
    // alternating rows (groups past N are zeros). The token rows by cp.async.
    auto load = [&](int chunk, int stage) {
        const unsigned dst0 = ring + stage * STAGE_BYTES;
        const int k0 = chunk * kBK;
        if (tid == 0) {
            const unsigned bar = bars + 8 * stage;
            xserv::mbarrier_arrive_expect_tx(bar, ROWS * 128);
            if (GATE_UP) {  // one box: (64 columns, 8 rows, gate / up, ROWS / 16 groups of 8, this expert)
                xserv::tma_load_5d(dst0, w_map, bar, k0, 0, 0, row0 / 8, expert);
            } else {
                xserv::tma_load_2d(dst0, w_map, bar, k0, expert * N + row0);
            }
        }
#pragma unroll 4
        for (int i = ROWS * 8 + tid; i < (ROWS + TILE) * 8; i += THREADS) {
            const int r = i >> 3, c = i & 7, k = k0 + c * 8;
            const bf16* src;
            bool valid;
            if (r < ROWS) {  // never (i starts past the weight rows): kept, as taking it out moves the machine code
                const int wrow = weight_row(r, valid);
                valid = valid && k < K;
                src = valid ? wexp + (long long)wrow * K + k : w;
            } else {
                const int xrow = xrow_of[r - ROWS];
                valid = xrow >= 0 && k < K;
                src = valid ? x + (long long)xrow * K + k : x;
            }
            cp_async16(dst0 + r * 128 + ((c ^ (r & 7)) << 4), src, valid);
        }
    };

    const int chunks = (K + kBK - 1) / kBK;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < chunks) load(s, s);
        cp_async_commit();
    }
    float acc[MB][TILE / 2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int i = 0; i < TILE / 2; ++i) acc[mb][i] = 0.f;

    // Chunk c + AHEAD refills the stage of chunk c - 1, whose wgmma every warpgroup has waited for before this
    // barrier.
    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<AHEAD - 1>();
        xserv::fence_proxy_async();  // this thread's copies of chunk c, visible to wgmma's async proxy
        xserv::mbarrier_wait(bars + 8 * (c % STAGES), (c / STAGES) & 1);  // its weight rows
        __syncthreads();  // chunk c landed for every thread
        if (c + AHEAD < chunks) load(c + AHEAD, (c + AHEAD) % STAGES);
        cp_async_commit();
        const unsigned stage = ring + (c % STAGES) * STAGE_BYTES;
        const unsigned long long b_desc = xserv::wgmma_desc_sw128(stage + ROWS * 128, 16, 1024);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) xserv::wgmma_fence_operands(acc[mb]);
        xserv::wgmma_fence();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
            const unsigned long long a_desc = xserv::wgmma_desc_sw128(stage + (wg * MB + mb) * 64 * 128, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < kBK / 16; ++kk)  // +32 bytes a k16 step: +2 in the 16-byte start address field
                xserv::wgmma_ss<TILE>(acc[mb], a_desc + 2 * kk, b_desc + 2 * kk, 1);
        }
        xserv::wgmma_commit();
        xserv::wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) xserv::wgmma_fence_operands(acc[mb]);
    }
    xserv::wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) xserv::wgmma_fence_operands(acc[mb]);
    cp_async_wait<0>();

    // acc[mb][4 j + 2 r + e] = D[16 wq + g + 8 r][8 j + 2 t + e] of m-block (wg, mb): CTA weight row
    // (wg * MB + mb) * 64 + 16 wq + g + 8 r, token column 8 j + 2 t + e.
    const int g = lane >> 2, t2 = 2 * (lane & 3);
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
        const int block = wg * MB + mb;
#pragma unroll
        for (int j = 0; j < TILE / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int n = 8 * j + t2 + e, entry = entry_of[n];
                if (entry < 0) continue;
                if (GATE_UP) {  // D rows g (gate) and g + 8 (up) of output column row0 + block * 32 + 8 wq + g
                    const int col = row0 + block * 32 + 8 * wq + g;
                    if (col >= N) continue;
                    const float gate = round_bf16(acc[mb][4 * j + e]), up = round_bf16(acc[mb][4 * j + 2 + e]);
                    out[((long long)tile * TILE + n) * N + col] =
                        __float2bfloat16_rn(round_bf16(xserv::silu(gate)) * up);
                } else {
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int h = row0 + block * 64 + 16 * wq + g + 8 * r;
                        if (h < N) out[(long long)entry * N + h] = __float2bfloat16_rn(acc[mb][4 * j + 2 * r + e]);
                    }
                }
            }
    }
}

}  // namespace

// ops/moe.py's _WGMMA_TILES gives the shapes (mid: one warpgroup of two 64-row blocks x 64 tokens, 128 threads;
// large: two warpgroups of one 64-row block x 128 tokens, 256 threads; 128 weight rows a CTA, 3 stages) and the grids
// (moe.cu's token tiles). They take the weights' tensor map after the weights.
#define XSERV_MOE_WG_GEMM(NAME, WG, MB, TILE, STAGES, GATE_UP)                                                      \
    extern "C" __global__ void __launch_bounds__(128 * WG)                                                          \
        NAME##_tma(const bf16* __restrict__ x, const bf16* __restrict__ w, const void* w_map,                        \
                   const int* __restrict__ sorted, const int* __restrict__ tile_expert, bf16* __restrict__ out,      \
                   int top_k, int K, int N) {                                                                        \
        moe_gemm_wg<WG, MB, TILE, STAGES, GATE_UP>(x, w, w_map, sorted, tile_expert, out, top_k, K, N);        \
    }
XSERV_MOE_WG_GEMM(moe_wg_gate_up_mid, 1, 2, 64, 3, true)
XSERV_MOE_WG_GEMM(moe_wg_down_mid, 1, 2, 64, 3, false)
XSERV_MOE_WG_GEMM(moe_wg_gate_up_large, 2, 1, 128, 3, true)
XSERV_MOE_WG_GEMM(moe_wg_down_large, 2, 1, 128, 3, false)
