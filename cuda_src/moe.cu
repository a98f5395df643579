// Mixture-of-experts feed-forward (Qwen3-MoE's sparse block), after the router projection (a linear):
//
//   routing            softmax over each token's router logits (fp32), its top-k experts (ties: the lower id), the
//                      weights (renormalised when asked), then the expert-sorted entry list: an entry is
//                      (token, slot) = token * k + slot; each expert's entries are padded to whole token tiles, and
//                      tile_expert names the expert of each tile. Everything stays on the GPU (no host round trip),
//                      so a decode step's forward is captured in a CUDA graph with device-side expert ids.
//                      Decode-sized steps: moe_route_p* (one CTA does both); prefill: moe_topk_p* (a warp per token
//                      over a grid) then moe_sort (one CTA): one CTA routing 2,048 tokens took 0.6 ms (H100).
//   moe_gemm_gate_up   grouped GEMM: a CTA multiplies one token tile (up to TILE entries of one expert) by a slab of
//                      that expert's [gate; up] rows, pairs gate row j with up row j in its registers and writes
//                      act = bf16(bf16(silu(bf16(gate))) * bf16(up)) in expert-sorted row order.
//   moe_gemm_down      grouped GEMM over the same tiles: act @ down[e]^T, rounded to bf16 and written straight to the
//                      entry's row of y [T * k, H] (the scatter back to token order is the store).
//   moe_combine_*      out[t] = bf16(sum_j w[t, j] * y[t * k + j]) in slot order (stored, or added to the fp32
//                      residual stream). A fixed order, so results never depend on timing: the routing's atomics
//                      only choose which row of a tile an entry takes, and rows of a tile are independent.
//   moe_gemm_down_one_* one token: the down GEMM with the combine folded in (the CTA that stores a row block's last
//                      expert rows combines that block; docs/kernels/moe.md, "Launches"), bit-identical to down +
//                      combine.
//
// The grouped GEMMs (mma.sync m16n8k16, cp.async ring, ldmatrix; every arch from sm_80) put the weights on the mma's
// M side and the tokens on its N side (8 per n-tile): a decode step with a handful of tokens per expert still
// streams each selected expert's weights once, at full width, which is what bounds it. Two shapes:
//   small  (decode-sized steps)  TILE = 8 tokens, 32 weight rows a CTA, 4 warps splitting each 64-wide K chunk
//                                (their partial sums added in warp order), 4 stages: many small CTAs keep the
//                                weight stream's bytes in flight on every SM.
//   large  (prefill)             TILE = 64 tokens, 128 weight rows a CTA, 4 warps of 32 rows x 64 tokens, 3 stages.
// A tile's rows past its expert's entries are padding (entry -1): they load zeros and store nothing.
//
// Requirements (ops/moe.py checks): H and I multiples of 8 (16-byte rows), E <= 512, k <= 32, 16-byte aligned
// tensors. K tails (K % 64) and N tails are predicated (zero-filled loads, skipped stores).
//
// FP8 experts (the *_fp8 entries; a -FP8 checkpoint's experts, kept e4m3 in GPU memory): the weights are e4m3 with a
// float32 scale per 128 x 128 block (scale [E, rows / 128, K / 128]; H and I multiples of 128). The ring streams the
// e4m3 bytes (half the bf16 bytes); each thread reads its A fragments' codes straight from the ring (16-byte pieces
// swizzled per row so that a warp's reads are conflict-free) and converts them in registers, each weight
// bf16(float(e4m3) * scale) (models/fp8.py's dequantize_blockwise rounding), into the fragments ldmatrix gives the
// bf16 form; the mma loop is otherwise unchanged. So the FP8 entries give the bits the bf16 ones give on the
// dequantized weights.
//
// xserv-shapes: moe=1 moe_fp8=0,1 (pieces moe:e1_x0, the bf16 experts' GEMMs, and moe:e1_x1, the FP8 experts'; both
// hold the routing and the combine. A MoE model's start-up compiles its experts' one; a dense model never loads either)
#include "e4m3.cuh"
#include "mma.cuh"
#include "norm.cuh"

// The GEMM entries of the piece being compiled (the family compiled whole: both; XSERV_MOE_FP8 from the piece's name).
#if !defined(XSERV_MOE_FP8) || XSERV_MOE_FP8 == 0
#define XSERV_MOE_BF16_ENTRY(...) __VA_ARGS__
#else
#define XSERV_MOE_BF16_ENTRY(...)
#endif
#if !defined(XSERV_MOE_FP8) || XSERV_MOE_FP8 == 1
#define XSERV_MOE_FP8_ENTRY(...) __VA_ARGS__
#else
#define XSERV_MOE_FP8_ENTRY(...)
#endif

namespace {

using bf16 = __nv_bfloat16;
using xserv::cp_async16;
using xserv::cp_async_commit;
using xserv::cp_async_wait;
using xserv::ldmatrix_x2;
using xserv::ldmatrix_x4;
using xserv::mma_bf16_16816;
using xserv::round_bf16;
using xserv::smem_u32;
using xserv::swizzled_chunk;


__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Programmatic dependent launch (sm_90+; nothing below, where the launches carry no attribute): every kernel here
// reads what the launch before it wrote, so it waits first, then at once lets the next launch begin (that one's
// own wait still holds it until this grid has finished and its writes are visible). What this hides is the launch
// and the start of the next kernel's CTAs: a decode step runs five of these per layer.
__device__ __forceinline__ void pdl_start() {
    xserv::pdl_wait();
    xserv::pdl_launch_dependents();
}

}  // namespace

// ---- routing ------------------------------------------------------------------------------------------------------
// Token t's top-k by one warp: softmax over its E router logits (fp32; lane l holds experts l, l + 32, ...), k rounds
// of a warp argmax (the larger probability; equal ones: the lower expert id), the weights renormalised when asked.
// Writes ids[t * k + j], weights[t * k + j]; returns lane j's pick (j < k) for the caller's counting, else -1.
template <int PER_LANE>
__device__ __forceinline__ int route_token(const float* __restrict__ logits, int* ids, float* weights, int t, int E,
                                           int K, int renormalize, int lane, bool write = true) {
    const float* row = logits + (long long)t * E;
    float p[PER_LANE];
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? row[e] : -__int_as_float(0x7f800000);
        m = fmaxf(m, p[j]);
    }
    m = xserv::warp_max(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        p[j] = lane + 32 * j < E ? expf(p[j] - m) : 0.f;
        s += p[j];
    }
    s = xserv::warp_sum(s);
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) p[j] = lane + 32 * j < E ? __fdiv_rn(p[j], s) : -1.f;  // -1: padding
    float picked = 0.f, total = 0.f;
    int picked_id = -1;
    for (int j = 0; j < K; ++j) {
        float best = -2.f;
        int best_id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (p[i] > best) best = p[i], best_id = lane + 32 * i;  // ascending ids: ties keep the lower
#pragma unroll
        for (int off = 16; off; off >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, off);
            if (ob > best || (ob == best && oi < best_id)) best = ob, best_id = oi;
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (lane + 32 * i == best_id) p[i] = -2.f;  // taken
        if (lane == j) picked = best, picked_id = best_id;
        total += best;
    }
    if (write && lane < K) {
        ids[t * K + lane] = picked_id;
        weights[t * K + lane] = renormalize ? __fdiv_rn(picked, total) : picked;
    }
    return picked_id;
}

// The expert-sorted list from the ids, by one CTA: count per expert (shared atomics; skipped when the caller
// counted), scan the per-expert tile counts (warp 0; lane l a contiguous run of experts), name each tile's expert,
// scatter the entries, mark the padding. Shared memory: count, first row, cursor per expert (3 * E ints).
__device__ __forceinline__ void sort_entries(const int* ids, int* __restrict__ sorted, int* __restrict__ tile_expert,
                                             int entries, int E, int tile, int max_tiles, int* count, bool counted) {
    int* first = count + E;
    int* cursor = count + 2 * E;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!counted) {
        for (int i = threadIdx.x; i < entries; i += blockDim.x) atomicAdd(&count[ids[i]], 1);
        __syncthreads();
    }
    if (warp == 0) {
        const int run = cdiv(E, 32);
        int local = 0;
        for (int i = 0; i < run; ++i) {
            const int e = lane * run + i;
            if (e < E) local += cdiv(count[e], tile);
        }
        int inclusive = local;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inclusive, off);
            if (lane >= off) inclusive += v;
        }
        if (__shfl_sync(0xffffffffu, inclusive, 31) > max_tiles) __trap();  // the launcher sized the grid wrong
        int next = inclusive - local;
        for (int i = 0; i < run; ++i) {
            const int e = lane * run + i;
            if (e >= E) break;
            first[e] = next * tile;
            const int n = cdiv(count[e], tile);
            for (int q = 0; q < n; ++q) tile_expert[1 + next + q] = e;
            next += n;
        }
        if (lane == 31) tile_expert[0] = inclusive;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < entries; i += blockDim.x) {
        const int e = ids[i];
        sorted[first[e] + atomicAdd(&cursor[e], 1)] = i;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const int n = count[e];
        for (int r = n; r < cdiv(n, tile) * tile; ++r) sorted[first[e] + r] = -1;
    }
}

__device__ __forceinline__ void zero_counts(int* count, int E) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = count[2 * E + e] = 0;  // count, cursor
}

// Decode-sized steps: routing and sorting in one CTA of 256 threads (a launch less; ids written by this CTA are
// visible to it after the barrier). logits fp32 [T, E] -> ids int32 [T * k], weights fp32 [T * k], sorted int32
// [tiles * tile] (entry per row, -1 = padding), tile_expert int32 [1 + tiles] ([0] = the tile count).
template <int PER_LANE>
__device__ __forceinline__ void route_one_cta(const float* __restrict__ logits, int* ids, float* weights,
                                              int* __restrict__ sorted, int* __restrict__ tile_expert, int T, int E,
                                              int K, int renormalize, int tile, int max_tiles) {
    extern __shared__ int route_smem[];
    zero_counts(route_smem, E);
    pdl_start();
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int t = threadIdx.x >> 5; t < T; t += blockDim.x >> 5) {
        const int e = route_token<PER_LANE>(logits, ids, weights, t, E, K, renormalize, lane);
        if (lane < K) atomicAdd(&route_smem[e], 1);
    }
    __syncthreads();
    sort_entries(ids, sorted, tile_expert, T * K, E, tile, max_tiles, route_smem, true);
}

// Prefill-sized steps: the top-k over a grid (a warp per token), then moe_sort (one CTA of 1024 threads).
template <int PER_LANE>
__device__ __forceinline__ void topk_grid(const float* __restrict__ logits, int* ids, float* weights, int T, int E,
                                          int K, int renormalize) {
    pdl_start();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t < T) route_token<PER_LANE>(logits, ids, weights, t, E, K, renormalize, threadIdx.x & 31);
}

#define XSERV_MOE_ROUTE(PER_LANE)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) moe_route_p##PER_LANE(                                        \
        const float* __restrict__ logits, int* ids, float* weights, int* __restrict__ sorted,                       \
        int* __restrict__ tile_expert, int T, int E, int K, int renormalize, int tile, int max_tiles) {             \
        route_one_cta<PER_LANE>(logits, ids, weights, sorted, tile_expert, T, E, K, renormalize, tile, max_tiles);  \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) moe_topk_p##PER_LANE(                                         \
        const float* __restrict__ logits, int* ids, float* weights, int T, int E, int K, int renormalize) {         \
        topk_grid<PER_LANE>(logits, ids, weights, T, E, K, renormalize);                                            \
    }
XSERV_MOE_ROUTE(4)   // up to 128 experts (Qwen3-30B-A3B, 235B-A22B)
XSERV_MOE_ROUTE(16)  // up to 512

extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids, int* __restrict__ sorted,
                                                            int* __restrict__ tile_expert, int entries, int E,
                                                            int tile, int max_tiles) {
    extern __shared__ int route_smem[];
    zero_counts(route_smem, E);
    pdl_start();
    __syncthreads();
    sort_entries(ids, sorted, tile_expert, entries, E, tile, max_tiles, route_smem, false);
}

// ---- grouped GEMM ---------------------------------------------------------------------------------------------------
// out rows for the CTA's token tile (blockIdx.y) and weight slab (blockIdx.x). K = the reduced dimension (H for
// gate/up, I for down), N = the output width (I for gate/up: the CTA takes ROWS / 2 gate rows and the same up rows;
// H for down). x: gate/up reads token rows x[entry / top_k]; down reads act rows in sorted order.
// One token (a batch-1 decode step), ROUTE_ONE: there is no routing launch; warp 0 of every CTA routes the token
// itself (route_token: a few hundred instructions against the 128 KB of weights the CTA streams), tile y takes the
// y-th smallest picked expert, and CTA (0, 0) publishes ids, weights, the sorted list and tile_expert (the down
// GEMM and the combine read them as the routing launch would have written them).
struct OneToken {
    const float* logits;
    int* ids;
    float* weights;
    int* sorted;
    int* tile_expert;
    int E, renormalize;
};

// The one-token down GEMM's combine (COMBINE): the routing weights, the combine's output (bf16 [1, H] stored, or the
// fp32 residual [1, H] added to) and a counter per row block (int32 [H / ROWS], zero between launches).
struct Combine {
    const float* weights;
    void* out;
    int* counters;
};
enum { kNoCombine = 0, kCombineStore = 1, kCombineAdd = 2 };

template <bool ADD, int ROWS>
__device__ __forceinline__ void finish_row_block(const bf16* y, const Combine& comb, int tiles, int K, int N,
                                                 float* scratch);

// FP8: w holds e4m3 codes (one byte a weight; passed as bf16* to keep the bf16 forms' code) and `wscale` their
// block scales (see the file's head); else bf16 weights and no scales.
template <int WARPS_M, int WARPS_N, int WARPS_K, int TILE, int STAGES, int BK, bool GATE_UP, bool ROUTE_ONE = false,
          int COMBINE = kNoCombine, bool FP8 = false>
__device__ __forceinline__ void moe_gemm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                         const int* __restrict__ sorted, const int* __restrict__ tile_expert,
                                         bf16* __restrict__ out, int top_k, int K, int N, OneToken one = {},
                                         Combine comb = {}, const float* __restrict__ wscale = nullptr) {
    constexpr int ROWS = 32 * WARPS_M;  // a warp: 32 weight rows (two m-tiles; gate/up: one gate, one up)
    constexpr int THREADS = 32 * WARPS_M * WARPS_N * WARPS_K;
    constexpr int NT = TILE / 8 / WARPS_N;  // n-tiles (8 tokens each) per warp
    // bf16 elements per stage: the weight rows then the token rows (FP8: the weight rows' e4m3 bytes take half)
    constexpr int STAGE = (FP8 ? ROWS / 2 + TILE : ROWS + TILE) * BK;
    constexpr int KSTEPS = BK / 16 / WARPS_K;  // k16 steps per chunk per warp
    constexpr int CHUNKS = BK / 8;  // 16-byte pieces of a tile row (bf16)
    constexpr int CHUNKS8 = BK / 16;  // 16-byte pieces of an e4m3 weight row
    // FP8: where piece p of ring row r lies (p ^ swizzle(r)): a k-step's fragment reads take one piece of 8 rows
    // (rows g of a warp's m-tile), and rows BK bytes apart would share banks; the XOR spreads them over all 32 banks
    // (BK 64: 4 pieces a row, rows of equal parity shifted by (r >> 1) & 3; BK >= 128: rows shifted by r & 7).
    auto fp8_piece_swizzle = [](int r) { return CHUNKS8 >= 8 ? (r & 7) : ((r >> 1) & 3); };
    static_assert(TILE % (8 * WARPS_N) == 0 && (BK / 16) % WARPS_K == 0 && BK % 64 == 0, "tile shape");
    static_assert(COMBINE == kNoCombine || (!GATE_UP && !ROUTE_ONE), "the combine follows the down GEMM");
    extern __shared__ __align__(128) bf16 gemm_smem[];
    __shared__ int entry_of[TILE];
    __shared__ int xrow_of[TILE];  // the x row a tile row reads (gate/up: the entry's token; down: the sorted row)

    if constexpr (COMBINE == kNoCombine) {
        pdl_start();
    } else {  // no trigger: the next launch begins when this grid ends, as after moe_combine_add (which it replaces)
        xserv::pdl_wait();
    }
    const int tile = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = (warp / WARPS_M) % WARPS_N, wk = warp / (WARPS_M * WARPS_N);
    int expert;
    if constexpr (ROUTE_ONE) {
        __shared__ int picked_expert;
        if (warp == 0) {
            const bool publish = blockIdx.x == 0 && tile == 0;
            const int id = route_token<4>(one.logits, one.ids, one.weights, 0, one.E, top_k, one.renormalize, lane,
                                          publish);
            int rank = 0;  // among the k picks (distinct ids), how many are smaller: the pick's tile
            for (int j = 0; j < top_k; ++j) rank += __shfl_sync(0xffffffffu, id, j) < id;
            if (lane < top_k) {
                if (rank == tile) picked_expert = id, entry_of[0] = lane, xrow_of[0] = 0;
                if (publish) {
                    one.tile_expert[1 + rank] = id;
                    one.sorted[rank * TILE] = lane;  // entry = token 0 * k + slot
                    for (int r = 1; r < TILE; ++r) one.sorted[rank * TILE + r] = -1;
                }
            }
            if (publish && lane == 0) one.tile_expert[0] = top_k;
            for (int i = 1 + lane; i < TILE; i += 32) entry_of[i] = xrow_of[i] = -1;
        }
        __syncthreads();
        expert = picked_expert;
    } else {
        if (tile >= tile_expert[0]) return;  // the grid covers the most tiles any routing can need
        expert = tile_expert[1 + tile];
        for (int i = tid; i < TILE; i += THREADS) {
            const int e = sorted[tile * TILE + i];
            entry_of[i] = e;
            xrow_of[i] = e < 0 ? -1 : GATE_UP ? e / top_k : tile * TILE + i;
        }
        __syncthreads();
    }

    const long long wexp_offset = (long long)expert * (GATE_UP ? 2 : 1) * N * K;  // the expert's first weight
    const bf16* wexp = w + wexp_offset;  // (bf16 weights)
    const int row0 = blockIdx.x * (GATE_UP ? ROWS / 2 : ROWS);
    // The checkpoint row of the CTA's weight row r, and whether it exists: gate/up's rows [0, ROWS/2) are gate rows
    // row0.., [ROWS/2, ROWS) the same up rows.
    auto weight_row = [&](int r, bool& valid) {
        if (GATE_UP) {
            const int j = row0 + r % (ROWS / 2);
            valid = j < N;
            return r < ROWS / 2 ? j : N + j;
        }
        valid = row0 + r < N;
        return row0 + r;
    };

    auto load = [&](int chunk, int stage) {
        bf16* sw = gemm_smem + stage * STAGE;
        bf16* sx = sw + (FP8 ? ROWS / 2 : ROWS) * BK;
        const int k0 = chunk * BK;
        if constexpr (FP8) {  // the weight rows' e4m3 bytes, unswizzled (the conversion reads each piece once)
            const unsigned char* wexp8 = reinterpret_cast<const unsigned char*>(w) + wexp_offset;
            unsigned char* sw8 = reinterpret_cast<unsigned char*>(sw);
#pragma unroll
            for (int i = tid; i < ROWS * CHUNKS8; i += THREADS) {
                const int r = i / CHUNKS8, c = i % CHUNKS8, k = k0 + c * 16;
                bool valid;
                const int wrow = weight_row(r, valid);
                valid = valid && k < K;
                cp_async16(smem_u32(sw8 + r * BK + (c ^ fp8_piece_swizzle(r)) * 16),
                           valid ? wexp8 + (long long)wrow * K + k : wexp8, valid);
            }
        }
#pragma unroll
        for (int i = FP8 ? ROWS * CHUNKS + tid : tid; i < (ROWS + TILE) * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS, k = k0 + c * 8;
            const bf16* src;
            bf16* dst;
            bool valid;
            if (!FP8 && r < ROWS) {
                const int wrow = weight_row(r, valid);
                valid = valid && k < K;
                src = valid ? wexp + (long long)wrow * K + k : w;
                dst = sw + r * BK + swizzled_chunk(r, c) * 8;
            } else {
                const int q = r - ROWS, xrow = xrow_of[q];
                valid = xrow >= 0 && k < K;
                src = valid ? x + (long long)xrow * K + k : x;
                dst = sx + q * BK + swizzled_chunk(q, c) * 8;
            }
            cp_async16(smem_u32(dst), src, valid);
        }
    };
    // FP8: the A fragments of the m-tile whose first row is `mrow` (rows mrow + g and mrow + g + 8, columns 2t, 2t + 1
    // and 2t + 8, 2t + 9 of k-step ks: what ldmatrix_x4 gives the bf16 form) from the e4m3 codes in `sw8`, each
    // bf16(float(code) * scale); `scale`: the m-tile's block scale for this k-step (16 rows lie in one 128-row block).
    auto fp8_fragment = [&](unsigned (&frag)[4], const unsigned char* sw8, int mrow, int ks, float scale) {
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: row g (frag 0, 2); 1: row g + 8 (frag 1, 3)
            const int r = mrow + g + 8 * h;
            const unsigned char* piece = sw8 + r * BK + (ks ^ fp8_piece_swizzle(r)) * 16 + 2 * t;
            const unsigned codes = *reinterpret_cast<const unsigned short*>(piece) |
                                   (unsigned)*reinterpret_cast<const unsigned short*>(piece + 8) << 16;
            float f[4];
            xserv::e4m3::e4m3x4_to_float4(codes, f);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(f[0] * scale, f[1] * scale);
            const __nv_bfloat162 hi = __floats2bfloat162_rn(f[2] * scale, f[3] * scale);
            frag[h] = *reinterpret_cast<const unsigned*>(&lo);
            frag[2 + h] = *reinterpret_cast<const unsigned*>(&hi);
        }
    };
    // FP8: the block scale of the m-tile starting at `mrow` for columns from k (0 where its rows are past N or k
    // past K: those codes are the ring's zero-fill)
    auto fp8_scale = [&](int mrow, int k) {
        const int scale_rows = (GATE_UP ? 2 * N : N) / 128, scale_cols = K / 128;
        bool valid;
        const int wrow = weight_row(mrow, valid);
        return valid && k < K ? __ldg(wscale + ((long long)expert * scale_rows + (wrow >> 7)) * scale_cols + (k >> 7))
                              : 0.f;
    };

    const int chunks = cdiv(K, BK);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < chunks) load(s, s);
        cp_async_commit();
    }
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    // The warp's two m-tiles: gate/up pairs gate rows [16 wm, +16) with up rows [ROWS/2 + 16 wm, +16).
    const int mrow0 = GATE_UP ? 16 * wm : 32 * wm;
    const int mrow1 = GATE_UP ? ROWS / 2 + 16 * wm : 32 * wm + 16;

    for (int c = 0; c < chunks; ++c) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // chunk c landed for every thread; chunk c - 1's stage is free
        if (c + STAGES - 1 < chunks) load(c + STAGES - 1, (c + STAGES - 1) % STAGES);
        cp_async_commit();
        const bf16* sw = gemm_smem + (c % STAGES) * STAGE;
        const bf16* sx = sw + (FP8 ? ROWS / 2 : ROWS) * BK;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            const int ks = wk * KSTEPS + s;
            unsigned a[2][4];
            if constexpr (FP8) {
                const unsigned char* sw8 = reinterpret_cast<const unsigned char*>(sw);
                const int k = c * BK + 16 * ks;
                fp8_fragment(a[0], sw8, mrow0, ks, fp8_scale(mrow0, k));
                fp8_fragment(a[1], sw8, mrow1, ks, fp8_scale(mrow1, k));
            } else {
                const int r0 = mrow0 + (lane & 15), r1 = mrow1 + (lane & 15), ch = 2 * ks + (lane >> 4);
                ldmatrix_x4(a[0], smem_u32(sw + r0 * BK + swizzled_chunk(r0, ch) * 8));
                ldmatrix_x4(a[1], smem_u32(sw + r1 * BK + swizzled_chunk(r1, ch) * 8));
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned b[2];
                const int r = (wn * NT + nt) * 8 + (lane & 7), ch = 2 * ks + ((lane >> 3) & 1);
                ldmatrix_x2(b, smem_u32(sx + r * BK + swizzled_chunk(r, ch) * 8));
                mma_bf16_16816(acc[0][nt], a[0], b[0], b[1]);
                mma_bf16_16816(acc[1][nt], a[1], b[0], b[1]);
            }
        }
    }
    cp_async_wait<0>();

    if constexpr (WARPS_K > 1) {  // add the K-split warps' partial sums in warp order (deterministic)
        constexpr int V = 2 * NT * 4;
        float* red = reinterpret_cast<float*>(gemm_smem);
        __syncthreads();  // every warp is done reading the ring
        if (wk > 0) {
            const float* flat = &acc[0][0][0];
#pragma unroll
            for (int i = 0; i < V; ++i) red[(warp * 32 + lane) * V + i] = flat[i];
        }
        __syncthreads();
        if (wk > 0) {
            if constexpr (COMBINE == kNoCombine) return;  // the combine's barrier below needs every thread
        } else {
            float* flat = &acc[0][0][0];
            for (int q = 1; q < WARPS_K; ++q)
#pragma unroll
                for (int i = 0; i < V; ++i) flat[i] += red[((q * WARPS_M * WARPS_N + warp) * 32 + lane) * V + i];
        }
    }

    // C fragment: acc[mt][nt][i] is weight row (g + 8 (i >> 1)) of m-tile mt and token column nt * 8 + cq + (i & 1).
    const int g = lane >> 2, cq = 2 * (lane & 3);
#pragma unroll
    for (int nt = 0; nt < NT && (COMBINE == kNoCombine || wk == 0); ++nt)  // (fused: the K-split warps store none)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = (wn * NT + nt) * 8 + cq + (i & 1), e = entry_of[n];
            if (e < 0) continue;
            const int dr = g + 8 * (i >> 1);
            if (GATE_UP) {
                const int j = row0 + 16 * wm + dr;
                if (j >= N) continue;
                const float gate = round_bf16(acc[0][nt][i]), up = round_bf16(acc[1][nt][i]);
                out[((long long)tile * TILE + n) * N + j] = __float2bfloat16_rn(round_bf16(xserv::silu(gate)) * up);
            } else {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const int h = row0 + 32 * wm + 16 * mt + dr;
                    if (h < N) out[(long long)e * N + h] = __float2bfloat16_rn(acc[mt][nt][i]);
                }
            }
        }
    if constexpr (COMBINE != kNoCombine) {  // the ring's shared memory holds the combine's products (<= 32 slots)
        static_assert(STAGES * STAGE * sizeof(bf16) >= 32 * ROWS * sizeof(float), "combine scratch");
        finish_row_block<COMBINE == kCombineAdd, ROWS>(out, comb, tile_expert[0], top_k, N,
                                                       reinterpret_cast<float*>(gemm_smem));
    }
}

// ops/moe.py's _GEMM table mirrors these shapes (rows = 32 * WARPS_M, threads, the ring's shared memory). Each
// shape has an FP8 twin NAME_fp8 (e4m3 weights and their block scales `wscale`; see the file's head).
#define XSERV_MOE_GEMM(NAME, WARPS_M, WARPS_N, WARPS_K, TILE, STAGES, BK, GATE_UP)                                  \
    XSERV_MOE_BF16_ENTRY(                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N * WARPS_K)                                   \
        NAME(const bf16* __restrict__ x, const bf16* __restrict__ w, const int* __restrict__ sorted,                 \
             const int* __restrict__ tile_expert, bf16* __restrict__ out, int top_k, int K, int N) {                  \
        moe_gemm<WARPS_M, WARPS_N, WARPS_K, TILE, STAGES, BK, GATE_UP>(x, w, sorted, tile_expert, out, top_k, K, N);\
    })                                                                                                               \
    XSERV_MOE_FP8_ENTRY(                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N * WARPS_K)                                   \
        NAME##_fp8(const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ wscale, \
                   const int* __restrict__ sorted, const int* __restrict__ tile_expert, bf16* __restrict__ out,      \
                   int top_k, int K, int N) {                                                                        \
        moe_gemm<WARPS_M, WARPS_N, WARPS_K, TILE, STAGES, BK, GATE_UP, false, kNoCombine, true>(                     \
            x, reinterpret_cast<const bf16*>(w), sorted, tile_expert, out, top_k, K, N, OneToken{}, Combine{},       \
            wscale);                                                                                                 \
    })
// BK: 64 everywhere; 256-wide chunks for the decode shape (3 stages, 512 contiguous bytes per weight row and stage)
// measured the same for gate/up and 15% slower for down at one token (H100), so the template keeps BK but no entry
// uses another width.
XSERV_MOE_GEMM(moe_gemm_gate_up_small, 1, 1, 4, 8, 4, 64, true)
XSERV_MOE_GEMM(moe_gemm_down_small, 1, 1, 4, 8, 4, 64, false)

// The one-token gate/up (ROUTE_ONE; the small shape, up to 128 experts): grid (I / 16, k). _fp8: e4m3 experts.
#if !defined(XSERV_MOE_FP8) || XSERV_MOE_FP8 == 0
extern "C" __global__ void __launch_bounds__(128) moe_gemm_gate_up_one(
    const bf16* __restrict__ x, const bf16* __restrict__ w, const float* __restrict__ logits, int* ids, float* weights,
    int* sorted, int* tile_expert, bf16* __restrict__ out, int top_k, int K, int N, int E, int renormalize) {
    moe_gemm<1, 1, 4, 8, 4, 64, true, true>(x, w, sorted, tile_expert, out, top_k, K, N,
                                        OneToken{logits, ids, weights, sorted, tile_expert, E, renormalize});
}
#endif
#if !defined(XSERV_MOE_FP8) || XSERV_MOE_FP8 == 1
extern "C" __global__ void __launch_bounds__(128) moe_gemm_gate_up_one_fp8(
    const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ wscale,
    const float* __restrict__ logits, int* ids, float* weights, int* sorted, int* tile_expert, bf16* __restrict__ out,
    int top_k, int K, int N, int E, int renormalize) {
    moe_gemm<1, 1, 4, 8, 4, 64, true, true, kNoCombine, true>(
        x, reinterpret_cast<const bf16*>(w), sorted, tile_expert, out, top_k, K, N,
        OneToken{logits, ids, weights, sorted, tile_expert, E, renormalize}, Combine{}, wscale);
}
#endif
XSERV_MOE_GEMM(moe_gemm_gate_up_mid, 4, 1, 1, 64, 3, 64, true)
XSERV_MOE_GEMM(moe_gemm_down_mid, 4, 1, 1, 64, 3, 64, false)
XSERV_MOE_GEMM(moe_gemm_gate_up_large, 4, 2, 1, 128, 3, 64, true)
XSERV_MOE_GEMM(moe_gemm_down_large, 4, 2, 1, 128, 3, 64, false)

// ---- combine --------------------------------------------------------------------------------------------------------
// out[t] = bf16(sum_j w[t, j] * y[t * k + j]): the sum in slot order, each product rounded before the add (no fused
// multiply-add), as the NumPy reference computes. Two helpers hold the arithmetic both forms share: the product and
// add of one slot, and the end (stored as bf16, or rounded to bf16 and added to the fp32 residual).
__device__ __forceinline__ void add_product8(float (&acc)[8], float wj, const float (&v)[8]) {
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(wj, v[q]));
}

template <bool ADD>
__device__ __forceinline__ void finish8(const float (&acc)[8], void* __restrict__ out, long long o, float (&cur)[8]) {
    if (ADD) {  // cur: the residual's 8 values, loaded by the caller
        float* r = static_cast<float*>(out) + o;
#pragma unroll
        for (int q = 0; q < 8; ++q) cur[q] += round_bf16(acc[q]);
        xserv::store8(r, cur);
    } else {
        xserv::store8(static_cast<bf16*>(out) + o, acc);
    }
}

// Token t's 8 columns from column 8 c, its k slots one after another (a thread per (token, 8 columns)).
template <bool ADD>
__device__ __forceinline__ void combine_vec(const bf16* __restrict__ y, const float* __restrict__ weights,
                                            void* __restrict__ out, int t, int c, int K, int H) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < K; ++j) {
        const float wj = weights[t * K + j];
        float v[8];
        xserv::load8(y + ((long long)t * K + j) * H + c * 8, v);
        add_product8(acc, wj, v);
    }
    const long long o = (long long)t * H + c * 8;
    float cur[8];
    if (ADD) xserv::load8(static_cast<float*>(out) + o, cur);
    finish8<ADD>(acc, out, o, cur);
}

template <bool ADD, bool LATE = false>
__device__ __forceinline__ void moe_combine(const bf16* __restrict__ y, const float* __restrict__ weights,
                                            void* __restrict__ out, int T, int K, int H) {
    if (LATE) xserv::pdl_wait();  // and no early trigger: the next launch begins when this grid ends
    else pdl_start();
    const int vecs = H / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * vecs) return;
    combine_vec<ADD>(y, weights, out, (int)(i / vecs), (int)(i % vecs), K, H);
}

// The fused combine at one token: every down CTA of row block blockIdx.x (ROWS hidden rows, VECS = ROWS / 8 column
// groups) has stored its expert's rows of y; the one that arrives last of the `tiles` that hold an expert (CTAs past
// the tile count returned before arriving) combines the block. last_to_arrive's barrier orders the CTA's y stores
// before its thread 0's acq_rel atomic, which publishes them at GPU scope (release is cumulative) and, in the last
// CTA, acquires the others'; the rows are read with ld.global.cg (L2: the SM's L1 is not coherent with the other
// SMs' stores). This tail is on the layer's critical path, so its loads go out at once, a (slot, column group) per
// thread (k * VECS <= 32 * 4 = the CTA's 128 threads), each thread's rounded products land in `scratch` (the ring's
// shared memory, idle now), and a thread per column group adds them in slot order: the same arithmetic as
// combine_vec. The residual's load is issued before the barrier, beside the rows'. The last CTA resets the counter:
// CUDA graph replays reuse it, and the next launch on the stream (the next layer's down GEMM) starts counting only
// after this grid has finished.
template <bool ADD, int ROWS>
__device__ __forceinline__ void finish_row_block(const bf16* y, const Combine& comb, int tiles, int K, int N,
                                                 float* scratch) {
    constexpr int VECS = ROWS / 8;
    __shared__ int last;
    // Each storing thread's own fence first (the threadfence-reduction order). Under the PTX memory model the
    // barrier and the acq_rel atomic below already suffice (the split GEMV, argmax and decode attention rely on
    // that alone); the fence makes the order hold without relying on the model's cumulativity, for the cost of
    // waiting for the stores' acknowledgement (about one L2 round trip on the tail; docs/kernels/history/moe.md).
    __threadfence();
    if (!xserv::last_to_arrive(comb.counters + blockIdx.x, tiles, last)) return;
    const int c0 = blockIdx.x * VECS;  // the block's first column group; N % 8 == 0 (ops/moe.py checks)
    const int vecs = min(VECS, N / 8 - c0);
    const int tid = threadIdx.x;
    float cur[8];
    if (ADD && tid < vecs) xserv::load8(static_cast<float*>(comb.out) + (c0 + tid) * 8, cur);
    for (int i = tid; i < K * vecs; i += blockDim.x) {
        const int j = i / vecs, v = i % vecs;
        float row[8], prod[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        xserv::bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(y + (long long)j * N + (c0 + v) * 8)), row);
        add_product8(prod, comb.weights[j], row);  // 0 + rounded product: the rounded product itself
#pragma unroll
        for (int q = 0; q < 8; ++q) scratch[(j * VECS + v) * 8 + q] = prod[q];
    }
    __syncthreads();  // every slot's products are in shared memory
    if (tid < vecs) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < K; ++j)
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], scratch[(j * VECS + tid) * 8 + q]);
        finish8<ADD>(acc, comb.out, (long long)(c0 + tid) * 8, cur);
    }
    if (tid == 0) comb.counters[blockIdx.x] = 0;
}

extern "C" __global__ void __launch_bounds__(256) moe_combine_store(const bf16* __restrict__ y,
                                                                    const float* __restrict__ weights,
                                                                    bf16* __restrict__ out, int T, int K, int H) {
    moe_combine<false>(y, weights, out, T, K, H);
}

// The add form ends a decode layer: the next launch (the next layer's qkv GEMV) may begin only when it ends. With
// the early trigger that GEMV's weight prefetch crowded this kernel's few loads (H100, 30B-A3B-shaped 12 layers,
// batch 1: 957 -> 1,011 tok/s with the late one, two rounds each).
extern "C" __global__ void __launch_bounds__(256) moe_combine_add(const bf16* __restrict__ y,
                                                                  const float* __restrict__ weights,
                                                                  float* __restrict__ out, int T, int K, int H) {
    moe_combine<true, true>(y, weights, out, T, K, H);
}

// The one-token down GEMM with the combine folded in (the small shape; a launch less than down + combine, the same
// bits): grid (H / 32, max tiles) as moe_gemm_down_small. y [k, H] bf16 (the expert rows, still stored: the last
// CTA of each row block reads them back from L2); weights fp32 [k]; out bf16 [1, H] (store) or fp32 [1, H] (the
// residual, add); counters int32 [H / 32], zero between launches.
// STAGES, BK: the ring. At one token a CTA streams 32 rows x K = 768 of one expert; 4 stages of 128-wide chunks send
// its loads out in 2 dependent rounds (41 KB, one wave of CTAs), where the GEMMs' 64-wide chunks took 4 and left down
// ending well after its bytes (docs/kernels/moe.md). NAME_fp8: e4m3 experts and their block scales.
#define XSERV_MOE_DOWN_ONE(NAME, MODE, OUT, STAGES, BK)                                                              \
    XSERV_MOE_BF16_ENTRY(                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                          \
        const bf16* __restrict__ act, const bf16* __restrict__ w, const int* __restrict__ sorted,                     \
        const int* __restrict__ tile_expert, bf16* __restrict__ y, int top_k, int K, int N,                         \
        const float* __restrict__ weights, OUT* out, int* counters) {                                                \
        moe_gemm<1, 1, 4, 8, STAGES, BK, false, false, MODE>(act, w, sorted, tile_expert, y, top_k, K, N,            \
                                                             OneToken{}, Combine{weights, out, counters});           \
    })                                                                                                               \
    XSERV_MOE_FP8_ENTRY(                                                                                             \
    extern "C" __global__ void __launch_bounds__(128) NAME##_fp8(                                                    \
        const bf16* __restrict__ act, const unsigned char* __restrict__ w, const float* __restrict__ wscale,          \
        const int* __restrict__ sorted, const int* __restrict__ tile_expert, bf16* __restrict__ y, int top_k, int K,  \
        int N, const float* __restrict__ weights, OUT* out, int* counters) {                                         \
        moe_gemm<1, 1, 4, 8, STAGES, BK, false, false, MODE, true>(                                                  \
            act, reinterpret_cast<const bf16*>(w), sorted, tile_expert, y, top_k, K, N, OneToken{},                  \
            Combine{weights, out, counters}, wscale);                                                                \
    })
XSERV_MOE_DOWN_ONE(moe_gemm_down_one_store_k128, kCombineStore, bf16, 4, 128)
XSERV_MOE_DOWN_ONE(moe_gemm_down_one_add_k128, kCombineAdd, float, 4, 128)
