// Skinny GEMM ("GEMV") for M = 1..16 rows: out[m, n] = sum_k x[m, k] * W[n, k], bf16 weights [N, K] (as stored in
// the checkpoints), fp32 accumulation, with the decoder layer's neighbours folded in so that a layer is a handful
// of launches:
//   prologue  kBf16     x is bf16 [m, K] (row stride x_stride)
//             kRmsNorm  x is the fp32 residual stream [*, K]: x = bf16(norm_w * (r * rsqrt(mean(r^2) + eps))), the
//                       rounding of fused_add_rmsnorm_f32res (rmsnorm.cu); rows may be picked through x_rows
//                       (lm_head over the sequences' last tokens)
//             kSiluMul  x is bf16 [m, 2K] = [gate | up]: x = bf16(bf16(silu(gate)) * up), the rounding of
//                       silu_and_mul (activation.ptx), K here being the intermediate size
//   epilogue  kStoreBf16 / kStoreF32  out[m, n] = acc
//             kAddResidual           out is the fp32 residual: out[m, n] += bf16(acc) (what hidden = linear(...)
//                                    followed by fused_add_rmsnorm_f32res's add does)
//             kSiluMulBf16           (gemv_row only) W is the fused [gate; up] weight [2I, K] and out bf16 [I]:
//                                    out[j] = bf16(bf16(silu(bf16(acc_gate_j))) * bf16(acc_up_j)), the rounding of
//                                    the gate/up projection's bf16 output followed by silu_and_mul. The tile pairs
//                                    gate rows with their up rows (see gemv_row), so the activation is computed
//                                    once per step, not by every CTA of the down projection (the kSiluMul
//                                    prologue's cost: every CTA recomputes the whole row).
//
// Why not cuBLASLt: at M <= 16 a projection is a read of W (bandwidth-bound), and cuBLASLt's kernels for these
// shapes leave part of the bandwidth unused and need separate kernels for the norm, the activation and the
// residual add, each a launch and a round trip through memory.
//
// xserv-shapes: rows=1,8,16 part=0,1 (compiled as six pieces: gemv:m1_* = gemv_row, gemv:m8_* / gemv:m16_* =
// gemv_mma_m8 / _m16; part 0 = the fused one-row chain's entries / the plain _bf16_bf16 mma entry, part 1 = the
// others; compiled whole, as the harness and CI do, it has them all)
// xserv-startup: m1_p0 m8_p0 m8_p1 (what a Qwen3 step launches: one row, the fused chain's four entries; 2..8 rows,
// the mma entries ops/gemv.py's MMA_PREFERRED takes, _sliced for 1.7B's down projection; 9..16 rows: cuBLASLt)
#if !defined(XSERV_ROWS)
#define XSERV_GEMV_PIECE(M, P) 1
#else
#define XSERV_GEMV_PIECE(M, P) ((M) == XSERV_ROWS && (P) == XSERV_PART)
#endif
//
// The prologues, the epilogues and gemv_row itself live in gemv_row.cuh, shared with gemv_fp8.cu (the same one-row
// kernel on e4m3 weights); this file instantiates gemv_row with the bf16 weight format (Bf16Weights below).
// Two kernels share the prologues and epilogues (docs/kernels/gemv.md has the versions and their measurements):
//   gemv_row        one x row, CUDA cores. A CTA of 4 warps; a row group is 4 weight rows, each lane holding
//                   U = 4 16-byte chunks of each in flight (16 loads), the lanes of a warp reading 512 contiguous
//                   bytes of a row per load: the best bandwidth measured at M = 1.
//   gemv_mma_m8/16  2..16 x rows, tensor cores (mma.sync m16n8k16; see "the tensor-core GEMV" below), so 2 and 16
//                   rows cost about the same: a CTA of 8 warps; a row group is 16 weight rows.
// In both, the prologue stages the transformed x rows in shared memory once per CTA and the CTA then loops over
// tiles (a persistent grid of at most 2 CTAs per SM; 3-4 for gemv_row's one-step tiles); the mma kernel may deal K out to several CTAs ("K slices"
// below) so that a CTA stages only part of x. A tile is (warps / split) row groups; the `split` warps of
// a row group divide K between them and add their partial sums through shared memory in a fixed order, so
// results do not depend on timing.
//
// Code size: in the decode chain every kernel starts with a cold instruction cache (the kernels alternate, and the
// weight stream evicts their code from L2), so the code a launch runs through counts. gemv_row has one entry per
// (prologue, epilogue) the ops use, and the mma kernel one for the plain bf16 -> bf16 projection, with those compiled
// in (21-38 KB each against 62-170 KB for the generic entries; docs/kernels/gemv.md).
//
// Programmatic dependent launch: the weights do not depend on the previous kernel, so each lane loads its first
// weights into registers before pdl_wait(); the x staging comes after the wait, pdl_launch_dependents() after it,
// or (gemv_row's early_trigger, the launcher's choice for small weights) first of all, so that the next kernel's
// launch is under way while this one runs (docs/kernels/gemv.md).
//
// Requirements (the launcher checks): K % 8 == 0, W and x rows 16-byte aligned (x_stride a multiple of 8 bf16 /
// 4 fp32 values), dynamic shared memory for the reduction buffers and the staged x.
#include "mma.cuh"
#include "gemv_row.cuh"

namespace {

using namespace xserv::gemv;

// ---- gemv_row: one x row on the CUDA cores (gemv_row.cuh), bf16 weights -----------------------------------------
// The bf16 weight format of row::gemv: 8 weights a 16-byte chunk, no scales.
struct Bf16Weights {
    using Elem = __nv_bfloat16;
    static constexpr int kValues = 8;
    struct Scales {};
    __device__ static __forceinline__ const float* scale_row(const float*, long long, int) { return nullptr; }
    __device__ static __forceinline__ void load_scale(Scales&, int, const float*, int, int) {}

    __device__ static __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
        const unsigned wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
    #pragma unroll
        for (int j = 0; j < 4; ++j) {  // bf16 -> fp32 is a shift (low half) or a mask (high half)
            acc = fmaf(__uint_as_float(wv[j] << 16), __uint_as_float(xv[j] << 16), acc);
            acc = fmaf(__uint_as_float(wv[j] & 0xffff0000u), __uint_as_float(xv[j] & 0xffff0000u), acc);
        }
        return acc;
    }

    __device__ static __forceinline__ void fma_chunk(float (&acc)[row::kRows], const uint4 (&w)[row::kRows],
                                                     const Scales&, int, const __nv_bfloat16* xs, int cu) {
        const uint4 xv = reinterpret_cast<const uint4*>(xs)[cu];
#pragma unroll
        for (int r = 0; r < row::kRows; ++r) acc[r] = dot8(w[r], xv, acc[r]);
    }
};


// ---- the tensor-core GEMV ---------------------------------------------------------------------------------------
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) with the weights as A (16 rows of a row group) and the staged x as
// B (8 x rows per n-tile; rows >= m read as zeros). A dot product may take its k terms in any order, so lane
// (g, t) (g = lane / 4, t = lane % 4) loads 8 consecutive k values (one 16-byte load) of weight rows g and g + 8
// for a 32-wide k block, and x row g's 8 values at the same k: the same k permutation on both sides, so every
// fragment comes from a 16-byte load. Of the lane's physical k = block + t*8 + [0, 8), mma 0 takes [0, 4) as the
// logical k pairs (2t, 2t+1) and (2t+8, 2t+9), mma 1 takes [4, 8).
// C: c0, c1 = weight row g, x rows 2t, 2t+1; c2, c3 = weight row g + 8.
namespace mma {

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kGroupRows = 16;  // weight rows per row group: the mma's M
constexpr int kPad = 32;        // bf16 padding per staged x row: rows g and g + 1 start in different banks
constexpr int kU = 4;           // k blocks a lane keeps in flight (2 loads each)

struct Frag {
    uint4 lo, hi;  // weight rows g and g + 8: 8 bf16 each
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void load_blocks(Frag (&w)[kU], const __nv_bfloat16* lo, const __nv_bfloat16* hi, int k0,
                                            int kstep, int K) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int k = k0 + u * kstep;
        w[u].lo = k < K ? load_weight(lo + k) : make_uint4(0, 0, 0, 0);
        w[u].hi = k < K ? load_weight(hi + k) : make_uint4(0, 0, 0, 0);
    }
}

// mma.sync needs the whole warp: a block runs when its start (k - t * 8, the same in every lane) is inside K;
// lanes whose 8 values lie past K (K % 32 != 0) feed zeros, as load_blocks did for the weights, and so do the
// lanes of x rows >= m (only m rows are staged).
template <int NT>
__device__ __forceinline__ void mma_blocks(float (&acc)[NT][4], const Frag (&w)[kU], const __nv_bfloat16* xs, int g,
                                           int t, int k0, int kstep, int K, int KS, int m) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int k = k0 + u * kstep;
        if (k - t * 8 < K) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int i = g + nt * 8;
                const uint4 xv = k < K && i < m ? *reinterpret_cast<const uint4*>(xs + (long long)i * KS + k)
                                                : make_uint4(0, 0, 0, 0);
                mma_bf16(acc[nt], w[u].lo.x, w[u].hi.x, w[u].lo.y, w[u].hi.y, xv.x, xv.y);
                mma_bf16(acc[nt], w[u].lo.z, w[u].hi.z, w[u].lo.w, w[u].hi.w, xv.z, xv.w);
            }
        }
    }
}

// NT n-tiles of 8 x rows (m <= 8 * NT). Dynamic shared memory: partial sums [kWarps][32][NT * 4], the RMS
// scratch [8 * NT * kWarps], then x [m][KL + kPad] bf16 (KL: the k slice's length).
//
// K slices: with slices > 1 the CTAs are dealt round-robin to `slices` ranges of K (kc values each, a multiple of 32;
// the last may be shorter), and each stages only its range of x. A CTA's shared memory takes L1 space from the
// weights' loads in flight (docs/kernels/gemv.md: 98 KB of staged x per CTA halved the 8B down projection's bandwidth
// at 4 rows), and 16 rows of a long K would not fit at all. A slice's sums go to `partials` [slices][m][N] (fp32);
// the CTAs of the slices that share a set of tiles count themselves done on `counters` [CTAs per slice] (reset by the
// last), and the last adds the slices in slice order, so the result does not depend on timing, and applies the
// epilogue. P / E >= 0: the prologue / epilogue compiled in (the arguments are then ignored).
template <int NT, int P = -1, int E = -1>
__device__ __forceinline__ void gemv(const void* x, long long x_stride, const int* x_rows,
                                     const __nv_bfloat16* norm_w, float eps, const __nv_bfloat16* __restrict__ W,
                                     void* out, long long out_stride, int m, int N, int K, int split, int slices,
                                     int kc, float* partials, int* counters, int prologue_arg, int epilogue_arg) {
    constexpr int M = 8 * NT;
    const int prologue = P >= 0 ? P : prologue_arg, epilogue = E >= 0 ? E : epilogue_arg;
    extern __shared__ __align__(16) float smem[];
    __shared__ int last;
    float (*partial)[32][NT * 4] = reinterpret_cast<float (*)[32][NT * 4]>(smem);
    float* scratch = smem + kWarps * 32 * NT * 4;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(scratch + M * kWarps);

    // This CTA's slice of K, [k_lo, k_lo + KL), and its place among the slice's CTAs (gridDim.x % slices == 0).
    const int slice = blockIdx.x % slices, cta = blockIdx.x / slices, ctas = gridDim.x / slices;
    const int k_lo = slice * kc, KL = min(K - k_lo, kc), KS = KL + kPad;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int groups_per_tile = kWarps / split;
    const int slot = warp / split, part = warp % split;  // this warp's row group in the tile, its share of K
    const int num_tiles = (N + kGroupRows * groups_per_tile - 1) / (kGroupRows * groups_per_tile);
    const int k_first = part * 32 + t * 8, kstep = 32 * split;  // this lane's first k, the step between its blocks
    auto rows_of = [&](int tile, const __nv_bfloat16*& lo, const __nv_bfloat16*& hi) {
        const int n0 = (tile * groups_per_tile + slot) * kGroupRows;
        lo = W + (long long)min(n0 + g, N - 1) * K + k_lo;  // clamped: a valid row, its result is not stored
        hi = W + (long long)min(n0 + g + 8, N - 1) * K + k_lo;
        return n0;
    };

    Frag w0[kU];  // the first tile's first blocks, loaded before the wait
    if (cta < num_tiles) {
        const __nv_bfloat16 *lo, *hi;
        rows_of(cta, lo, hi);
        load_blocks(w0, lo, hi, k_first, kstep, KL);
    }
    xserv::pdl_wait();
    stage_x<M, kThreads>(xs, KS, scratch, x, x_stride, x_rows, norm_w, eps, m, K, k_lo, KL, prologue);
    xserv::pdl_launch_dependents();

    for (int tile = cta; tile < num_tiles; tile += ctas) {
        const __nv_bfloat16 *lo, *hi;
        const int n0 = rows_of(tile, lo, hi);
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[nt][j] = 0.f;
        int k = k_first;
        if (tile == cta) {
            mma_blocks<NT>(acc, w0, xs, g, t, k, kstep, KL, KS, m);
            k += kstep * kU;
        }
        for (; k - t * 8 < KL; k += kstep * kU) {  // the block's start (the same in every lane) is inside the slice
            Frag w[kU];
            load_blocks(w, lo, hi, k, kstep, KL);
            mma_blocks<NT>(acc, w, xs, g, t, k, kstep, KL, KS, m);
        }
        // Sum the `split` warps of the row group in warp order.
        if (split > 1) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) partial[warp][lane][nt * 4 + j] = acc[nt][j];
            __syncthreads();
            if (part == 0)
                for (int p = 1; p < split; ++p)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int j = 0; j < 4; ++j) acc[nt][j] += partial[warp + p][lane][nt * 4 + j];
        }
        // Write the outputs this lane holds (c0, c1: weight row g, x rows 2t, 2t + 1; c2, c3: row g + 8): with K
        // slices, this slice's sums, added up below.
        if (part == 0) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int n = n0 + g + (j >> 1) * 8, i = nt * 8 + 2 * t + (j & 1);
                    if (i < m && n < N) {
                        if (slices == 1) store_out(out, (long long)i * out_stride + n, acc[nt][j], epilogue);
                        else partials[((long long)slice * m + i) * N + n] = acc[nt][j];
                    }
                }
        }
        if (split > 1) __syncthreads();  // `partial` is reused by the next tile
    }
    // The CTAs of every slice with this `cta` index took the same tiles: the last of them to finish adds up those
    // tiles' slices (in slice order) and applies the epilogue. One hand-off per CTA, not per tile, so the weight
    // loop above runs on without waiting.
    if (slices > 1 && cta < num_tiles && xserv::last_to_arrive(counters + cta, slices, last)) {
        const int tile_rows = kGroupRows * groups_per_tile;
        for (int tile = cta; tile < num_tiles; tile += ctas) {
            const int n_first = tile * tile_rows;
#pragma unroll 1  // a rolled loop: it must not add registers to the weight loop's
            for (int e = threadIdx.x; e < m * tile_rows; e += kThreads) {
                const int i = e / tile_rows, n = n_first + e % tile_rows;
                if (n < N) {
                    float v = 0.f;
#pragma unroll 1
                    for (int s = 0; s < slices; ++s) v += __ldcg(partials + ((long long)s * m + i) * N + n);
                    store_out(out, (long long)i * out_stride + n, v, epilogue);
                }
            }
        }
        if (threadIdx.x == 0) counters[cta] = 0;
    }
}

}  // namespace mma

}  // namespace

// x: see the prologues above; x_rows: int32 [m] or null; norm_w: bf16 [K] (kRmsNorm) or null; W: bf16 [N, K];
// out: [m, out_stride] (bf16 / fp32, or the fp32 residual for kAddResidual). grid: persistent (<= tiles).
// gemv_row: m = 1, block 128, dynamic shared memory (4 * 4 + 4) * 4 + K * 2 bytes; early_trigger: see the header.
// gemv_row_<prologue>_<epilogue>[_1step]: one entry per combination the ops use, the prologue and epilogue compiled
// in (see "Code size" in the header); _1step: for K <= 1024 * split (ONE_STEP above).
#define XSERV_GEMV_ROW(NAME, PROLOGUE, EPILOGUE, FREE_WARPS)                                                          \
    extern "C" __global__ void __launch_bounds__(row::kThreads) gemv_row_##NAME(                                      \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, int N, int K, int split, int early_trigger) {                              \
        row::gemv<Bf16Weights, PROLOGUE, EPILOGUE, FREE_WARPS, false>(x, x_stride, x_rows, norm_w, eps, W, nullptr,  \
                                                                      out, N, K, split, early_trigger);               \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(row::kThreads, row::one_step_ctas_per_sm(PROLOGUE))                \
        gemv_row_##NAME##_1step(                                                                                      \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, int N, int K, int split, int early_trigger) {                              \
        row::gemv<Bf16Weights, PROLOGUE, EPILOGUE, FREE_WARPS, true>(x, x_stride, x_rows, norm_w, eps, W, nullptr,   \
                                                                     out, N, K, split, early_trigger);                \
    }
// part 0: the fused one-token decode step's entries (models/dense.py _forward_fused); part 1: the others
#if XSERV_GEMV_PIECE(1, 0)
XSERV_GEMV_ROW(bf16_add, kBf16, kAddResidual, false)
XSERV_GEMV_ROW(rmsnorm_bf16, kRmsNorm, kStoreBf16, false)
XSERV_GEMV_ROW(rmsnorm_f32, kRmsNorm, kStoreF32, true)  // the lm_head
XSERV_GEMV_ROW(rmsnorm_silu_mul, kRmsNorm, kSiluMulBf16, false)
#endif
#if XSERV_GEMV_PIECE(1, 1)
XSERV_GEMV_ROW(bf16_bf16, kBf16, kStoreBf16, false)
XSERV_GEMV_ROW(bf16_f32, kBf16, kStoreF32, false)
XSERV_GEMV_ROW(silu_mul_add, kSiluMul, kAddResidual, false)
#endif
#undef XSERV_GEMV_ROW

// gemv_mma_m<M>: m <= M, block 256, dynamic shared memory (8 * 32 * 4 * NT + M * 8) * 4 + m * (K + 32) * 2 bytes.
// gemv_mma_m<M>_sliced: K in slices = ceil(K / kc) ranges, the grid a multiple of `slices`, dynamic shared memory
// with kc in place of K; partials fp32 [slices, m, N], counters int32 [grid / slices] (zero between calls). Two
// entries so that the one-slice kernel is compiled with the slicing folded away (slices = 1 is a constant there):
// in one entry the general code cost the unsliced shapes 3-9%.
#define XSERV_GEMV_MMA(M, NT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(mma::kThreads) gemv_mma_m##M(                                       \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, long long out_stride, int m, int N, int K, int split, int prologue,       \
        int epilogue) {                                                                                               \
        mma::gemv<NT>(x, x_stride, x_rows, norm_w, eps, W, out, out_stride, m, N, K, split, 1, K, nullptr, nullptr,  \
                      prologue, epilogue);                                                                            \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(mma::kThreads) gemv_mma_m##M##_sliced(                              \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, long long out_stride, int m, int N, int K, int split, int slices, int kc, \
        float* partials, int* counters, int prologue, int epilogue) {                                                 \
        mma::gemv<NT>(x, x_stride, x_rows, norm_w, eps, W, out, out_stride, m, N, K, split, slices, kc, partials,    \
                      counters, prologue, epilogue);                                                                  \
    }
#if XSERV_GEMV_PIECE(8, 1)
XSERV_GEMV_MMA(8, 1)
#endif
#if XSERV_GEMV_PIECE(16, 1)
XSERV_GEMV_MMA(16, 2)
#endif
#undef XSERV_GEMV_MMA

// The plain bf16 -> bf16 projection (the model's few-row steps: linear_gemv), unsliced, its prologue and epilogue
// compiled in (see "Code size" in the header).
#define XSERV_GEMV_MMA_PLAIN(M, NT)                                                                                   \
    extern "C" __global__ void __launch_bounds__(mma::kThreads) gemv_mma_m##M##_bf16_bf16(                            \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, long long out_stride, int m, int N, int K, int split) {                   \
        mma::gemv<NT, kBf16, kStoreBf16>(x, x_stride, x_rows, norm_w, eps, W, out, out_stride, m, N, K, split, 1, K, \
                                         nullptr, nullptr, 0, 0);                                                     \
    }
#if XSERV_GEMV_PIECE(8, 0)
XSERV_GEMV_MMA_PLAIN(8, 1)
#endif
#if XSERV_GEMV_PIECE(16, 0)
XSERV_GEMV_MMA_PLAIN(16, 2)
#endif
#undef XSERV_GEMV_MMA_PLAIN
