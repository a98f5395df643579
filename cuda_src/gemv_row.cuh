// The one-row GEMV (gemv_row) and the decoder layer's neighbours folded into the skinny GEMMs: the prologues that
// stage x in shared memory (plain bf16, RMSNorm of the fp32 residual stream, SiLU-and-mul) and the epilogues (bf16 /
// fp32 store, the fp32 residual add, the paired SiLU-and-mul of a gate/up projection). Shared by gemv.cu (bf16
// weights: gemv_row_* and the mma kernel's staging and stores) and gemv_fp8.cu (e4m3 weights with 128 x 128 block
// scales: gemv_fp8_row_*), so that both formats compute the same prologue and epilogue bits; gemv.cu's header comment
// describes them, docs/kernels/gemv.md has the versions and their measurements.
//
// gemv_row is generic over the weight format (row::gemv<Fmt, ...>, "The weight format" below): the layout (4 warps,
// row groups of 4 rows, kU = 4 16-byte chunks of each row in flight per lane, split warps sharing K, paired gate/up
// slots), the PDL order (first weights before pdl_wait, x staged after it, early_trigger) and the tile's reduction
// and epilogue are the same code for both; a format supplies the chunk's load (its scale) and its dot product.
#pragma once
#include "mma.cuh"   // silu (the SwiGLU epilogues round as silu_and_mul)
#include "norm.cuh"

namespace xserv {
namespace gemv {

enum Prologue : int { kBf16 = 0, kRmsNorm = 1, kSiluMul = 2 };
enum Epilogue : int { kStoreBf16 = 0, kStoreF32 = 1, kAddResidual = 2, kSiluMulBf16 = 3 };

// A 16-byte weight load (8 bf16 or 16 e4m3 weights) that should not displace x or the staged rows in L1: W is read
// exactly once.
__device__ __forceinline__ uint4 load_weight(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void store_out(void* out, long long o, float v, int epilogue) {
    if (epilogue == kStoreBf16) static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16_rn(v);
    else if (epilogue == kStoreF32) static_cast<float*>(out)[o] = v;
    else static_cast<float*>(out)[o] += xserv::round_bf16(v);
}

// gemv_row's store: the residual add takes the value its lane loaded at the tile's start (resid), so that a tile
// does not end on a dependent load (the same sum as store_out's +=).
__device__ __forceinline__ void store_row(void* out, long long o, float v, float resid, int epilogue) {
    if (epilogue == kAddResidual) static_cast<float*>(out)[o] = resid + xserv::round_bf16(v);
    else store_out(out, o, v, epilogue);
}

// The RMSNorm prologue's arithmetic on 8 values, shared by its two forms below (the same expressions, so the same
// bits): their sum of squares, and x = w * (r * inv) (fused_add_rmsnorm_f32res's rounding, rmsnorm.cu).
__device__ __forceinline__ float sum_squares8(const float (&v)[8]) {
    return v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3] + v[4] * v[4] + v[5] * v[5] + v[6] * v[6] +
           v[7] * v[7];
}
__device__ __forceinline__ void normalise8(float (&v)[8], const float (&w)[8], float inv) {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = w[e] * (v[e] * inv);
}

// The RMSNorm prologue of one whole row (gemv_row) where a thread's share of it fits in registers (at most
// kHeldChunks 8-value chunks: K <= 4096 with 128 threads): the row and the norm weight are loaded together, once, and
// kept in registers between the two passes, so the prologue costs one round trip to L2 after the wait instead of two
// (stage_x's pass 2 re-reads the row and loads the weight). The same arithmetic in the same order as stage_x.
constexpr int kHeldChunks = 4;

template <int THREADS>
__device__ __forceinline__ void stage_normed_row(__nv_bfloat16* xs, float* scratch, const float* row,
                                                 const __nv_bfloat16* norm_w, float eps, int K) {
    constexpr int kWarps = THREADS / 32;
    const int row_chunks = K / 8;
    float v[kHeldChunks][8], w[kHeldChunks][8];
#pragma unroll
    for (int j = 0; j < kHeldChunks; ++j) {
        const int c = threadIdx.x + j * THREADS;
        if (c < row_chunks) {
            xserv::load8(row + c * 8, v[j]);
            xserv::load8(norm_w + c * 8, w[j]);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kHeldChunks; ++j) {
        if (threadIdx.x + j * THREADS < row_chunks) ss += sum_squares8(v[j]);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float s = xserv::warp_sum(ss);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += scratch[i];
    const float inv = xserv::rms_inv(total, K, eps);
#pragma unroll
    for (int j = 0; j < kHeldChunks; ++j) {
        const int c = threadIdx.x + j * THREADS;
        if (c < row_chunks) {
            normalise8(v[j], w[j], inv);
            xserv::store8(xs + c * 8, v[j]);
        }
    }
    __syncthreads();
}

// Stage the columns [k0, k0 + KL) of the m transformed x rows in shared memory (bf16 [m][KL], row stride KS).
// K is the whole row (the RMS mean is over all of it; the up half of [gate | up] starts at K). Every thread of the
// CTA takes part.
template <int M, int THREADS>
__device__ __forceinline__ void stage_x(__nv_bfloat16* xs, int KS, float* scratch, const void* x, long long x_stride,
                                        const int* x_rows, const __nv_bfloat16* norm_w, float eps, int m, int K,
                                        int k0, int KL, int prologue) {
    constexpr int kThreads = THREADS, kWarps = THREADS / 32;
    const int chunks = KL / 8;
    if (M == 1 && prologue == kRmsNorm && k0 == 0 && KL == K && K <= THREADS * 8 * kHeldChunks) {
        const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[0] : 0) * x_stride;
        stage_normed_row<THREADS>(xs, scratch, row, norm_w, eps, K);
        return;
    }
    if (prologue == kRmsNorm) {
        const int row_chunks = K / 8;
        // Pass 1: each row's sum of squares (per-thread partials, then warp and CTA sums in a fixed order).
        float ss[M];
#pragma unroll
        for (int i = 0; i < M; ++i) ss[i] = 0.f;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
                for (int c = threadIdx.x; c < row_chunks; c += kThreads) {
                    float v[8];
                    xserv::load8(row + c * 8, v);
                    ss[i] += sum_squares8(v);
                }
            }
        }
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            const float s = xserv::warp_sum(ss[i]);
            if (lane == 0) scratch[i * kWarps + warp] = s;
        }
        __syncthreads();
        // Pass 2: x = bf16(w * (r * inv)), re-reading the row (L1/L2 hits).
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                float total = 0.f;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) total += scratch[i * kWarps + w];
                const float inv = xserv::rms_inv(total, K, eps);
                const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
                for (int c = threadIdx.x; c < chunks; c += kThreads) {
                    float v[8], w[8];
                    xserv::load8(row + k0 + c * 8, v);
                    xserv::load8(norm_w + k0 + c * 8, w);
                    normalise8(v, w, inv);
                    xserv::store8(xs + (long long)i * KS + c * 8, v);
                }
            }
        }
    } else if (prologue == kSiluMul) {
        // One flat loop over (row, chunk) so that a thread's loads are independent (in flight together).
#pragma unroll 4
        for (int e = threadIdx.x; e < m * chunks; e += kThreads) {
            const int i = e / chunks, c = e - i * chunks;
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            float g[8], u[8];
            xserv::load8(row + k0 + c * 8, g);
            xserv::load8(row + K + k0 + c * 8, u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = xserv::round_bf16(xserv::silu(g[j])) * u[j];
            xserv::store8(xs + (long long)i * KS + c * 8, g);
        }
    } else {
#pragma unroll 4
        for (int e = threadIdx.x; e < m * chunks; e += kThreads) {
            const int i = e / chunks, c = e - i * chunks;
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            reinterpret_cast<uint4*>(xs + (long long)i * KS)[c] = reinterpret_cast<const uint4*>(row + k0)[c];
        }
    }
    __syncthreads();
}

// ---- gemv_row: one x row on the CUDA cores -----------------------------------------------------------------------
namespace row {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kRows = 4;  // weight rows per row group
constexpr int kU = 4;     // 16-byte chunks per row a lane keeps in flight
// The one-step entries (ONE_STEP below) are compiled so that this many CTAs fit an SM: 3 with the RMSNorm prologue
// (at most 168 registers a thread; the held row takes them to ~150), 4 with the others (at most 128; they take
// ~110). The launcher runs up to that many (gemv.py's ONE_STEP_CTAS_PER_SM, ONE_STEP_PLAIN_CTAS_PER_SM).
constexpr int one_step_ctas_per_sm(int prologue) { return prologue == kRmsNorm ? 3 : 4; }

// The weight format is a template argument Fmt (gemv.cu's Bf16Weights, gemv_fp8.cu's E4m3Weights):
//   Fmt::Elem        a weight's storage type (W is Elem [N, K])
//   Fmt::kValues     weights per 16-byte chunk (8 bf16, 16 e4m3)
//   Fmt::Scales      what a load step holds besides the weights (the e4m3 block scales of its kU chunks; empty
//                    for bf16)
//   Fmt::scale_row(scale_inv, row, K)           the scales of weight row `row` (nullptr for bf16)
//   Fmt::load_scale(s, u, srow, cu, chunks)      step slot u's scale, for chunk cu of the row
//   Fmt::fma_chunk(acc, w, s, u, xs, cu)        acc[r] += step slot u's chunk (chunk cu) of row r . x (xs: the
//                                               staged x row; the chunk's x are xs[cu * kValues, +kValues))
// A load step: kU 16-byte chunks of each of the kRows weight rows (kU * kRows independent loads) and their scales.
template <class Fmt>
struct Step {
    uint4 w[kU][kRows];
    typename Fmt::Scales s;
};

template <class Fmt>
__device__ __forceinline__ void load_step(Step<Fmt>& st, const typename Fmt::Elem* const (&wrow)[kRows],
                                          const float* srow, int c, int stride, int chunks) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int cu = c + u * stride;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
            st.w[u][r] = cu < chunks ? load_weight(wrow[r] + cu * Fmt::kValues) : make_uint4(0, 0, 0, 0);
        Fmt::load_scale(st.s, u, srow, cu, chunks);
    }
}

template <class Fmt>
__device__ __forceinline__ void fma_step(float (&acc)[kRows], const Step<Fmt>& st, const __nv_bfloat16* xs, int c,
                                         int stride, int chunks) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int cu = c + u * stride;
        if (cu < chunks) Fmt::fma_chunk(acc, st.w[u], st.s, u, xs, cu);
    }
}

// Dynamic shared memory: partial sums [kWarps][kRows], the RMS scratch [kWarps], then x [K] bf16.
// kSiluMulBf16 pairs the row groups of a tile (split <= 2, so a tile holds an even number of them): slot 2p takes
// gate rows j0..j0+3 (rows j of W), slot 2p + 1 the matching up rows (rows I + j), and the gate slot's lanes combine
// both sums; N is then W's 2I rows and the tiles cover the I activations.
// The prologue and epilogue are template arguments: each entry holds only its own paths (see the entries below).
// FREE_WARPS: where split == 1 (and not paired) a warp owns its row group and stores its rows itself, without the
// two barriers per tile, so that over many tiles (the lm_head's 36 per CTA) one warp's reduction overlaps the other
// warps' loads (only the lm_head's entry: in every entry it cost the step more than the lm_head gained).
// ONE_STEP: a warp's share of a row is at most one load step (K <= 32 * kU * Fmt::kValues * split: 1024 * split for
// bf16, 2048 * split for e4m3; the launcher's choice), so a tile
// is one load and one FMA step, in one register set: 106-150 registers a thread, 3-4 CTAs per SM, and each CTA's
// first tile wholly loaded before the wait (the 0.6B's projections and lm_head, the 8B's qkv, o and lm_head at
// split 4: docs/kernels/gemv.md). Otherwise a tile loops over load steps, and the first tile's first step has registers
// of its own, so that the compiler can issue the loop's loads while that step's FMAs run (about 240 registers,
// 2 CTAs per SM; one register set there cost the 8B 10% at 2 CTAs per SM).
template <class Fmt, int prologue, int epilogue, bool FREE_WARPS, bool ONE_STEP>
__device__ __forceinline__ void gemv(const void* x, long long x_stride, const int* x_rows,
                                     const __nv_bfloat16* norm_w, float eps,
                                     const typename Fmt::Elem* __restrict__ W, const float* __restrict__ scale_inv,
                                     void* out, int N, int K, int split, int early_trigger) {
    using Elem = typename Fmt::Elem;
    extern __shared__ __align__(16) float smem[];
    float (*partial)[kRows] = reinterpret_cast<float (*)[kRows]>(smem);
    float* scratch = smem + kWarps * kRows;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(scratch + kWarps);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups_per_tile = kWarps / split;
    const int slot = warp / split, part = warp % split;  // this warp's row group in the tile, its share of K
    const int chunks = K / Fmt::kValues;
    const bool paired = epilogue == kSiluMulBf16;
    const int outputs = paired ? N / 2 : N, groups_out = paired ? groups_per_tile / 2 : groups_per_tile;
    const int num_tiles = (outputs + kRows * groups_out - 1) / (kRows * groups_out);
    const int first = part * 32 + lane, stride = 32 * split;  // this lane's first chunk, the step between its chunks
    // The first output of this warp's row group in `tile`, the weight rows it reads (clamped rows: not stored) and
    // their scales (the group's kRows rows share a scale row: kRows | 128, and an up slot's rows start at I, which
    // the launcher requires to be a multiple of kRows).
    auto rows_of = [&](int tile, const Elem* (&wrow)[kRows], const float*& srow) {
        const int n0 = (tile * groups_out + (paired ? slot / 2 : slot)) * kRows;
        const long long base = paired && (slot & 1) ? outputs : 0;  // an up slot: rows I + j
#pragma unroll
        for (int r = 0; r < kRows; ++r) wrow[r] = W + (base + min(n0 + r, outputs - 1)) * K;
        srow = Fmt::scale_row(scale_inv, base + min(n0, outputs - 1), K);
        return n0;
    };

    if (early_trigger) xserv::pdl_launch_dependents();
    Step<Fmt> w0;  // the first tile's first load step, loaded before the wait
    if (blockIdx.x < num_tiles) {
        const Elem* wrow[kRows];
        const float* srow;
        rows_of(blockIdx.x, wrow, srow);
        load_step(w0, wrow, srow, first, stride, chunks);
    }
    xserv::pdl_wait();
    stage_x<1, kThreads>(xs, K, scratch, x, x_stride, x_rows, norm_w, eps, 1, K, 0, K, prologue);
    if (!early_trigger) xserv::pdl_launch_dependents();

    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const Elem* wrow[kRows];
        const float* srow;
        const int n0 = rows_of(tile, wrow, srow);
        // The residual add's operands, in the lanes that store them (lane r of the row group's first warp: row
        // n0 + r), loaded now, after the wait (an earlier kernel wrote them): in flight with the k-loop's loads.
        float resid = 0.f;
        if (epilogue == kAddResidual && part == 0 && lane < kRows && n0 + lane < outputs)
            resid = static_cast<const float*>(out)[n0 + lane];
        float acc[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
        if (ONE_STEP) {
            if (tile != blockIdx.x) load_step(w0, wrow, srow, first, stride, chunks);
            fma_step(acc, w0, xs, first, stride, chunks);
        } else {
            int c = first;
            if (tile == blockIdx.x) {
                fma_step(acc, w0, xs, c, stride, chunks);
                c += stride * kU;
            }
            for (; c < chunks; c += stride * kU) {
                Step<Fmt> w;
                load_step(w, wrow, srow, c, stride, chunks);
                fma_step(acc, w, xs, c, stride, chunks);
            }
        }
        if (FREE_WARPS && split == 1 && !paired) {
            // lane r stores row r: the butterfly sum leaves the same bits in every lane; 0 + v as the path below
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const float v = xserv::warp_sum(acc[r]);
                if (lane == r && n0 + r < outputs) store_row(out, n0 + r, 0.f + v, resid, epilogue);
            }
            continue;
        }
        // Sum the lanes of each warp, then the `split` warps of the row group in warp order.
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float v = xserv::warp_sum(acc[r]);
            if (lane == 0) partial[warp][r] = v;
        }
        __syncthreads();
        if (part == 0 && lane < kRows && n0 + lane < outputs && !(paired && (slot & 1))) {
            float v = 0.f;
            for (int p = 0; p < split; ++p) v += partial[warp + p][lane];
            if (paired) {  // the up slot's warps follow this one's: warp + split
                float up = 0.f;
                for (int p = 0; p < split; ++p) up += partial[warp + split + p][lane];
                const float act = xserv::round_bf16(xserv::silu(xserv::round_bf16(v))) * xserv::round_bf16(up);
                static_cast<__nv_bfloat16*>(out)[n0 + lane] = __float2bfloat16_rn(act);
            } else {
                store_row(out, n0 + lane, v, resid, epilogue);
            }
        }
        __syncthreads();  // `partial` is reused by the next tile
    }
}

}  // namespace row

}  // namespace gemv
}  // namespace xserv
