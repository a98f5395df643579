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
// in (21-38 KB each against 62-170 KB for the generic entries; gemv.md, "v12").
//
// Programmatic dependent launch: the weights do not depend on the previous kernel, so each lane loads its first
// weights into registers before pdl_wait(); the x staging comes after the wait, pdl_launch_dependents() after it,
// or (gemv_row's early_trigger, the launcher's choice for small weights) first of all, so that the next kernel's
// launch is under way while this one runs (docs/kernels/gemv.md, "v13").
//
// Requirements (the launcher checks): K % 8 == 0, W and x rows 16-byte aligned (x_stride a multiple of 8 bf16 /
// 4 fp32 values), dynamic shared memory for the reduction buffers and the staged x.
#include "mma.cuh"
#include "norm.cuh"

namespace {

enum Prologue : int { kBf16 = 0, kRmsNorm = 1, kSiluMul = 2 };
enum Epilogue : int { kStoreBf16 = 0, kStoreF32 = 1, kAddResidual = 2, kSiluMulBf16 = 3 };

// A weight load that should not displace x or the staged rows in L1: W is read exactly once.
__device__ __forceinline__ uint4 load_weight(const __nv_bfloat16* p) {
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

__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
    const unsigned wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // bf16 -> fp32 is a shift (low half) or a mask (high half)
        acc = fmaf(__uint_as_float(wv[j] << 16), __uint_as_float(xv[j] << 16), acc);
        acc = fmaf(__uint_as_float(wv[j] & 0xffff0000u), __uint_as_float(xv[j] & 0xffff0000u), acc);
    }
    return acc;
}

__device__ __forceinline__ void load_step(uint4 (&w)[kU][kRows], const __nv_bfloat16* const (&wrow)[kRows], int c,
                                          int stride, int chunks) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int cu = c + u * stride;
#pragma unroll
        for (int r = 0; r < kRows; ++r) w[u][r] = cu < chunks ? load_weight(wrow[r] + cu * 8) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void fma_step(float (&acc)[kRows], const uint4 (&w)[kU][kRows], const __nv_bfloat16* xs,
                                         int c, int stride, int chunks) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int cu = c + u * stride;
        if (cu < chunks) {
            const uint4 xv = reinterpret_cast<const uint4*>(xs)[cu];
#pragma unroll
            for (int r = 0; r < kRows; ++r) acc[r] = dot8(w[u][r], xv, acc[r]);
        }
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
// ONE_STEP: a warp's share of a row is at most one load step (K <= 1024 * split; the launcher's choice), so a tile
// is one load and one FMA step, in one register set: 106-150 registers a thread, 3-4 CTAs per SM, and each CTA's
// first tile wholly loaded before the wait (the 0.6B's projections and lm_head, the 8B's qkv, o and lm_head at
// split 4: gemv.md, "v14"). Otherwise a tile loops over load steps, and the first tile's first step has registers
// of its own, so that the compiler can issue the loop's loads while that step's FMAs run (about 240 registers,
// 2 CTAs per SM; one register set there cost the 8B 10% at 2 CTAs per SM).
template <int prologue, int epilogue, bool FREE_WARPS, bool ONE_STEP>
__device__ __forceinline__ void gemv(const void* x, long long x_stride, const int* x_rows,
                                     const __nv_bfloat16* norm_w, float eps, const __nv_bfloat16* __restrict__ W,
                                     void* out, int N, int K, int split, int early_trigger) {
    extern __shared__ __align__(16) float smem[];
    float (*partial)[kRows] = reinterpret_cast<float (*)[kRows]>(smem);
    float* scratch = smem + kWarps * kRows;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(scratch + kWarps);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups_per_tile = kWarps / split;
    const int slot = warp / split, part = warp % split;  // this warp's row group in the tile, its share of K
    const int chunks = K / 8;
    const bool paired = epilogue == kSiluMulBf16;
    const int outputs = paired ? N / 2 : N, groups_out = paired ? groups_per_tile / 2 : groups_per_tile;
    const int num_tiles = (outputs + kRows * groups_out - 1) / (kRows * groups_out);
    const int first = part * 32 + lane, stride = 32 * split;  // this lane's first chunk, the step between its chunks
    // The first output of this warp's row group in `tile`, and the weight rows it reads (clamped rows: not stored).
    auto rows_of = [&](int tile, const __nv_bfloat16* (&wrow)[kRows]) {
        const int n0 = (tile * groups_out + (paired ? slot / 2 : slot)) * kRows;
        const long long base = paired && (slot & 1) ? outputs : 0;  // an up slot: rows I + j
#pragma unroll
        for (int r = 0; r < kRows; ++r) wrow[r] = W + (base + min(n0 + r, outputs - 1)) * K;
        return n0;
    };

    if (early_trigger) xserv::pdl_launch_dependents();
    uint4 w0[kU][kRows];  // the first tile's first load step, loaded before the wait
    if (blockIdx.x < num_tiles) {
        const __nv_bfloat16* wrow[kRows];
        rows_of(blockIdx.x, wrow);
        load_step(w0, wrow, first, stride, chunks);
    }
    xserv::pdl_wait();
    stage_x<1, kThreads>(xs, K, scratch, x, x_stride, x_rows, norm_w, eps, 1, K, 0, K, prologue);
    if (!early_trigger) xserv::pdl_launch_dependents();

    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const __nv_bfloat16* wrow[kRows];
        const int n0 = rows_of(tile, wrow);
        // The residual add's operands, in the lanes that store them (lane r of the row group's first warp: row
        // n0 + r), loaded now, after the wait (an earlier kernel wrote them): in flight with the k-loop's loads.
        float resid = 0.f;
        if (epilogue == kAddResidual && part == 0 && lane < kRows && n0 + lane < outputs)
            resid = static_cast<const float*>(out)[n0 + lane];
        float acc[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
        if (ONE_STEP) {
            if (tile != blockIdx.x) load_step(w0, wrow, first, stride, chunks);
            fma_step(acc, w0, xs, first, stride, chunks);
        } else {
            int c = first;
            if (tile == blockIdx.x) {
                fma_step(acc, w0, xs, c, stride, chunks);
                c += stride * kU;
            }
            for (; c < chunks; c += stride * kU) {
                uint4 w[kU][kRows];
                load_step(w, wrow, c, stride, chunks);
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
        row::gemv<PROLOGUE, EPILOGUE, FREE_WARPS, false>(x, x_stride, x_rows, norm_w, eps, W, out, N, K, split,      \
                                                         early_trigger);                                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(row::kThreads, row::one_step_ctas_per_sm(PROLOGUE))                \
        gemv_row_##NAME##_1step(                                                                                      \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, int N, int K, int split, int early_trigger) {                              \
        row::gemv<PROLOGUE, EPILOGUE, FREE_WARPS, true>(x, x_stride, x_rows, norm_w, eps, W, out, N, K, split,       \
                                                        early_trigger);                                               \
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
