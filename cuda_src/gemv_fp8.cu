// FP8 weight-only skinny GEMM (ops/gemv_fp8.py, the M <= 8 path of ops/fp8_linear.py's linear_fp8):
//   out[m, n] = sum_k x[m, k] * dequant(W)[n, k]      m = 1..8 rows
// x bf16 [m, K] (row stride x_stride), W float8_e4m3fn [N, K] (1 byte a weight, Qwen's / DeepSeek's -FP8 layout),
// scale_inv float32 [ceil(N / 128), ceil(K / 128)]: dequant(W)[n, k] = float(W[n, k]) * scale_inv[n / 128][k / 128]
// (xserv/models/fp8.py). fp32 accumulation; out bf16 or fp32 [m, N] (row stride N).
//
// Why: at batch 1 a decode step is a read of the weights; 1 byte a weight instead of 2 halves the step. The kernel
// is laid out for bandwidth like gemv.cu's gemv_row (read its comments): a CTA of 4 warps, a row group of 4 weight
// rows per warp (or per `split` warps sharing K), each lane holding kU = 4 16-byte chunks (16 weights) of each of
// the 4 rows in flight (16 independent 16-byte loads, 256 bytes a lane), the 32 lanes of a warp reading 512
// contiguous bytes of a row per load, with ld.global.nc.L1::no_allocate (W is read exactly once). Persistent grid
// (the launcher's plan: at most kCtasPerSm CTAs per SM) looping over tiles.
//
// Dequantization in registers: e4m3 -> f16 (exact: every e4m3 value, subnormals included, is an f16 normal) ->
// f32 (exact). Two conversions that give bit-identical floats (NaN for NaN, any payload):
//   hardware  cvt.rn.f16x2.e4m3x2 (PTX, sm_89 and later): used by the plain entries where __CUDA_ARCH__ >= 890;
//   soft      bit manipulation, every arch (sm_80 has no FP8 conversion): the byte moved into the high byte of an
//             f16 lane (prmt), then f16 bits = sign | (eeeemmm << 7), which is the e4m3 value times 2^-8 (the f16
//             bias is 15, e4m3's 7; an e4m3 subnormal m * 2^-9 lands on the f16 subnormal m * 2^-17: the same bit
//             trick holds), times 256 in f16 (HMUL2: exact, a power of two, no overflow: 448 max). e4m3fn has no
//             infinities; its NaN is S.1111.111 (0x7f / 0xff), which the bit trick would read as 480: a NaN code
//             gets exponent 31 and a nonzero mantissa OR-ed in before the multiply (a rare branch per 4 codes).
//   The _soft entries force the soft path on every arch, so that a GPU test compares the two bit for bit;
//   tests/ops/test_gemv_fp8.py re-implements the soft word arithmetic in NumPy over all 256 codes.
//
// The block scale and the rounding: a lane's chunk (16 weights, never across a 128-column block since K % 16 == 0)
// is summed unscaled, p = sum_e float(W) * x in 16 fp32 fmaf, and the chunk's block scale is applied to that partial
// sum once: acc = fmaf(p, scale_inv, acc) (one multiply per 16 weights, not one per weight). A lane's chunks of one
// block are never in the same load step (lanes of a warp cover 512 consecutive columns per load), so the scale is
// applied per 16-wide chunk, not per 128-wide block. In exact arithmetic this is the reference's dequantize-then-
// multiply; the fp32 roundings differ at the 1e-7 relative level (ops/gemv_fp8.py's linear_fp8_reference rounds
// the dequantized weight to fp32 as fp8.py does, then sums in float64).
//
// Reduction, deterministic: each lane's accumulators go through the xor butterfly of common.cuh's warp_sum, then
// the `split` warps of a row group add their sums in warp order through shared memory.
//
// Requirements (the launcher checks): K % 16 == 0, K > 0; W, x 16-byte aligned, x_stride % 8 == 0; 1 <= m <= M
// of the entry (rows >= m are not read or written); any N (clamped rows of the last tile are read, not stored).
//
// Expected cost: at m = 1 about 4 instructions a weight (conversion 1.5 hardware / ~3.5 soft, one FMA), well under
// the issue rate at H100/H200 FP8 bandwidth; at m = 8 eight FMAs a weight plus the conversion bring the CUDA cores
// near their issue limit (~12 instructions a weight against ~9 available at 3.35 TB/s of weights on an H100): a
// tensor-core (mma.sync, e4m3 -> bf16 in registers) variant is the next step there if the numbers say so.
// The measured shares of copy bandwidth at m = 1 and 8 (where m = 8 falls short: the CUDA cores' issue rate, so on
// sm_90 and later 8 rows go to cuBLASLt's FP8 GEMM) and the soft conversion's cost are in docs/kernels/gemv.md,
// "FP8 weight-only".
//
// xserv-shapes: fp8=1 (compiled as the piece gemv_fp8:f1 at the start of an FP8-quantized model only; others never load it)
#include "e4m3.cuh"
#include "gemv_row.cuh"

namespace {

using namespace xserv::gemv;  // load_weight; the one-row kernel row::gemv and its prologues / epilogues

// gemv_row's layout (gemv_row.cuh), which the one-row entries below run as they are
constexpr int kWarps = row::kWarps, kThreads = row::kThreads;
constexpr int kRows = row::kRows;  // weight rows per row group (4 | 128: a group's rows share their scale row)
constexpr int kU = row::kU;        // 16-byte chunks per row a lane keeps in flight
constexpr int kCtasPerSm = 2;
constexpr int kBlock = 128;  // the scale block, both dimensions (weight_block_size [128, 128])
constexpr int kChunk = 16;   // weights per 16-byte chunk
enum OutDtype : int { kOutBf16 = 0, kOutF32 = 1 };

// The e4m3 -> float conversions (hardware cvt from sm_89, the bit-identical soft one everywhere): e4m3.cuh.
using xserv::e4m3::e4m3x4_to_float4;

template <bool HW>
__device__ __forceinline__ void e4m3x16_to_float(const uint4& w, float (&f)[kChunk]) {
    e4m3x4_to_float4<HW>(w.x, f);
    e4m3x4_to_float4<HW>(w.y, f + 4);
    e4m3x4_to_float4<HW>(w.z, f + 8);
    e4m3x4_to_float4<HW>(w.w, f + 12);
}

// 16 bf16 (two 16-byte words, in column order) -> float.
__device__ __forceinline__ void bf16x16_to_float(const uint4& a, const uint4& b, float (&f)[kChunk]) {
    const unsigned v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // bf16 -> fp32: a shift (low half) or a mask (high half)
        f[2 * j] = __uint_as_float(v[j] << 16);
        f[2 * j + 1] = __uint_as_float(v[j] & 0xffff0000u);
    }
}

// 16 bf16 of x (two 16-byte loads through L1: every warp of the SM reads the same x) -> float.
__device__ __forceinline__ void load_x16(const __nv_bfloat16* p, float (&f)[kChunk]) {
    bf16x16_to_float(__ldg(reinterpret_cast<const uint4*>(p)), __ldg(reinterpret_cast<const uint4*>(p) + 1), f);
}

// A chunk's unscaled partial sum, sum_e float(W) * x in 16 fp32 fmaf (the caller applies the block scale once).
__device__ __forceinline__ float chunk_dot(const float (&wf)[kChunk], const float (&xf)[kChunk]) {
    float p = 0.f;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) p = fmaf(wf[e], xf[e], p);
    return p;
}

// M: the entry's most rows (m <= M at run time); HW: the hardware conversion where the arch has one.
template <int M, bool HW>
__device__ __forceinline__ void gemv_fp8(const __nv_bfloat16* __restrict__ x, long long x_stride,
                                         const unsigned char* __restrict__ W, const float* __restrict__ scale_inv,
                                         void* __restrict__ out, int out_dtype, int m, int N, int K, int split) {
    __shared__ float partial[kWarps][kRows][M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups_per_tile = kWarps / split;
    const int slot = warp / split, part = warp % split;  // this warp's row group in the tile, its share of K
    const int chunks = K / kChunk, kblocks = (K + kBlock - 1) / kBlock;
    const int num_tiles = (N + kRows * groups_per_tile - 1) / (kRows * groups_per_tile);
    const int first = part * 32 + lane, stride = 32 * split;  // this lane's first chunk, the step between its chunks

    // The tile's weight rows (clamped rows: read, not stored) and its scale row.
    auto rows_of = [&](int tile, const unsigned char* (&wrow)[kRows]) {
        const int n0 = (tile * groups_per_tile + slot) * kRows;
#pragma unroll
        for (int r = 0; r < kRows; ++r) wrow[r] = W + (long long)min(n0 + r, N - 1) * K;
        return n0;
    };
    // One load step from chunk c: kU x kRows independent 16-byte weight loads and kU scales, all issued before any
    // use.
    uint4 w[kU][kRows];
    float s[kU];
    auto load_step = [&](const unsigned char* const (&wrow)[kRows], const float* srow, int c) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int cu = c + u * stride;
#pragma unroll
            for (int r = 0; r < kRows; ++r)
                w[u][r] = cu < chunks ? load_weight(wrow[r] + (long long)cu * kChunk) : make_uint4(0, 0, 0, 0);
            s[u] = cu < chunks ? __ldg(srow + cu * kChunk / kBlock) : 0.f;
        }
    };
    auto scale_row = [&](int n0) { return scale_inv + (long long)(min(n0, N - 1) / kBlock) * kblocks; };

    // Programmatic dependent launch: the weights and scales do not depend on the previous kernel, so the first tile's
    // first load step is issued before pdl_wait() (the weight stream starts while the previous kernel finishes); x,
    // which it wrote, is read after the wait, and so is `out` written (it may still be read before the wait).
    bool loaded = false;  // w / s hold the first tile's first step
    if (blockIdx.x < num_tiles && first < chunks) {
        const unsigned char* wrow[kRows];
        load_step(wrow, scale_row(rows_of(blockIdx.x, wrow)), first);
        loaded = true;
    }
    xserv::pdl_wait();
    xserv::pdl_launch_dependents();

    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const unsigned char* wrow[kRows];
        const int n0 = rows_of(tile, wrow);
        const float* srow = scale_row(n0);
        float acc[kRows][M];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

        for (int c = first; c < chunks; c += stride * kU) {
            if (!loaded) load_step(wrow, srow, c);
            loaded = false;
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int cu = c + u * stride;
                if (cu < chunks) {
                    float wf[kRows][kChunk];  // each row's chunk converted once, used by every x row
#pragma unroll
                    for (int r = 0; r < kRows; ++r) e4m3x16_to_float<HW>(w[u][r], wf[r]);
#pragma unroll
                    for (int i = 0; i < M; ++i) {
                        if (i < m) {
                            float xf[kChunk];
                            load_x16(x + (long long)i * x_stride + (long long)cu * kChunk, xf);
#pragma unroll
                            for (int r = 0; r < kRows; ++r)  // the block scale, once per chunk
                                acc[r][i] = fmaf(chunk_dot(wf[r], xf), s[u], acc[r][i]);
                        }
                    }
                }
            }
        }
        // Sum the lanes of each warp (butterfly), then the `split` warps of the row group in warp order.
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float v = xserv::warp_sum(acc[r][i]);
                if (lane == 0) partial[warp][r][i] = v;
            }
        __syncthreads();  // the partials are visible to the row group's first warp
        if (part == 0 && lane < kRows * M) {
            const int r = lane / M, i = lane % M, n = n0 + r;
            if (i < m && n < N) {
                float v = 0.f;
                for (int p = 0; p < split; ++p) v += partial[warp + p][r][i];
                const long long o = (long long)i * N + n;
                if (out_dtype == kOutF32) static_cast<float*>(out)[o] = v;
                else static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16_rn(v);
            }
        }
        __syncthreads();  // `partial` is reused by the next tile
    }
}

// ---- one row with the decoder layer's neighbours folded in: gemv_row (gemv_row.cuh) on e4m3 weights ---------------
// The e4m3 weight format of row::gemv: 16 weights a 16-byte chunk, each load step also loads its kU chunks' block
// scales (a chunk lies in one 128-column block; a row group's 4 rows share a scale row), and a chunk's sum is the
// multi-row kernel's: 16 fp32 fmaf of the converted weights and the staged x (bf16 -> fp32), then one fmaf by the
// scale. So for the same x and split the outputs equal gemv_fp8_m1's bit for bit.
template <bool HW>
struct E4m3Weights {
    using Elem = unsigned char;
    static constexpr int kValues = kChunk;
    struct Scales {
        float v[kU];
    };
    __device__ static __forceinline__ const float* scale_row(const float* scale_inv, long long row, int K) {
        return scale_inv + (row / kBlock) * ((K + kBlock - 1) / kBlock);
    }
    __device__ static __forceinline__ void load_scale(Scales& s, int u, const float* srow, int cu, int chunks) {
        s.v[u] = cu < chunks ? __ldg(srow + cu * kChunk / kBlock) : 0.f;
    }
    __device__ static __forceinline__ void fma_chunk(float (&acc)[kRows], const uint4 (&w)[kRows], const Scales& s,
                                                     int u, const __nv_bfloat16* xs, int cu) {
        const uint4* xv = reinterpret_cast<const uint4*>(xs + cu * kChunk);
        float xf[kChunk];
        bf16x16_to_float(xv[0], xv[1], xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            float wf[kChunk];
            e4m3x16_to_float<HW>(w[r], wf);
            acc[r] = fmaf(chunk_dot(wf, xf), s.v[u], acc[r]);
        }
    }
};

}  // namespace

// x: bf16 [m, x_stride] (first K columns used); W: e4m3 bytes [N, K]; scale_inv: float32 [ceil(N/128), ceil(K/128)];
// out: [m, N], bf16 (out_dtype 0) or float32 (1). block 128 threads, no dynamic shared memory, grid persistent
// (<= tiles = ceil(N / (4 * 4 / split))); split in {1, 2, 4} warps per row group.
// gemv_fp8_m<M>: m <= M rows, the hardware e4m3 conversion on sm_89+ (soft below); gemv_fp8_m<M>_soft: the soft
// conversion on every arch (the bit-identity test, and the comparison to measure).
#define XSERV_GEMV_FP8(M)                                                                                            \
    extern "C" __global__ void __launch_bounds__(kThreads, kCtasPerSm) gemv_fp8_m##M(                              \
        const __nv_bfloat16* x, long long x_stride, const unsigned char* W, const float* scale_inv, void* out,      \
        int out_dtype, int m, int N, int K, int split) {                                                            \
        gemv_fp8<M, true>(x, x_stride, W, scale_inv, out, out_dtype, m, N, K, split);                               \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(kThreads, kCtasPerSm) gemv_fp8_m##M##_soft(                       \
        const __nv_bfloat16* x, long long x_stride, const unsigned char* W, const float* scale_inv, void* out,      \
        int out_dtype, int m, int N, int K, int split) {                                                            \
        gemv_fp8<M, false>(x, x_stride, W, scale_inv, out, out_dtype, m, N, K, split);                              \
    }
XSERV_GEMV_FP8(1)
XSERV_GEMV_FP8(2)
XSERV_GEMV_FP8(4)
XSERV_GEMV_FP8(8)
#undef XSERV_GEMV_FP8

// The one-token decode step's FP8 projections (models/dense.py _forward_fused; ops/gemv.py's rmsnorm_linear,
// linear_add and rmsnorm_linear_silu_mul on an Fp8Weight): gemv_row with the e4m3 format, the prologue and epilogue
// compiled in, the hardware conversion where the arch has one. Arguments as gemv.cu's gemv_row_* with scale_inv
// (float32 [ceil(N/128), ceil(K/128)]) after W (e4m3 bytes [N, K]); K % 16 == 0; for the paired SiLU-and-mul
// epilogue N = 2I with I % 4 == 0 (an up row group shares a scale row). Block 128, dynamic shared memory
// (4 * 4 + 4) * 4 + K * 2 bytes (the staged x row). _1step: K <= 2048 * split, compiled for 3 CTAs per SM with the
// RMSNorm prologue and 4 without (row::one_step_ctas_per_sm).
#define XSERV_GEMV_FP8_ROW(NAME, PROLOGUE, EPILOGUE)                                                                  \
    extern "C" __global__ void __launch_bounds__(row::kThreads) gemv_fp8_row_##NAME(                                  \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const unsigned char* W, const float* scale_inv, void* out, int N, int K, int split, int early_trigger) {     \
        row::gemv<E4m3Weights<true>, PROLOGUE, EPILOGUE, false, false>(x, x_stride, x_rows, norm_w, eps, W,          \
                                                                       scale_inv, out, N, K, split, early_trigger);  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(row::kThreads, row::one_step_ctas_per_sm(PROLOGUE))                \
        gemv_fp8_row_##NAME##_1step(                                                                                  \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const unsigned char* W, const float* scale_inv, void* out, int N, int K, int split, int early_trigger) {     \
        row::gemv<E4m3Weights<true>, PROLOGUE, EPILOGUE, false, true>(x, x_stride, x_rows, norm_w, eps, W,           \
                                                                      scale_inv, out, N, K, split, early_trigger);   \
    }
XSERV_GEMV_FP8_ROW(rmsnorm_bf16, kRmsNorm, kStoreBf16)             // qkv
XSERV_GEMV_FP8_ROW(bf16_add, kBf16, kAddResidual)                  // o, down
XSERV_GEMV_FP8_ROW(rmsnorm_silu_mul, kRmsNorm, kSiluMulBf16)       // gate/up + SiLU-and-mul
#undef XSERV_GEMV_FP8_ROW
