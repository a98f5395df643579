// FP8 conversions for the M > 8 paths of ops/fp8_linear.py's linear_fp8 (launchers and NumPy references in
// xserv/ops/fp8_quant.py):
//
//   fp8_quantize_1x128   x bf16 [M, K] -> q e4m3 [M, K] and one float32 scale per (row, 128-column group), the
//                        activation operand of cuBLASLt's block-scaled FP8 GEMM (runtime/cublas.py, gemm_fp8):
//                        scale = amax(|x[m, 128g : 128g + 128]|) / 448 (1 for an all-zero group), q = e4m3(x / scale)
//                        with an IEEE float32 division, rounded to nearest even, saturated to +-448 (fp8.py's
//                        quantize convention, per 1 x 128 instead of 128 x 128). The scales are stored "outer-dim
//                        major", the layout cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F reads for a K-major
//                        operand of M rows: scales[g * scale_ld + m] with scale_ld = M (the M scales of group g
//                        contiguous; PyTorch's _scaled_mm asks the same of its 1x128 scales, `scale.t().contiguous().t()`).
//   fp8_dequantize_bf16  W e4m3 [N, K] with scale_inv float32 [ceil(N / 128), ceil(K / 128)] -> bf16 [N, K]:
//                        bf16_rn(float(W) * scale_inv), the float32 product rounded once, exactly as
//                        models/fp8.py's dequantize_blockwise(..., bfloat16) rounds (the bf16 GEMM path, no FP8 MMA).
//   fp8_pad_scales       scale_inv [nb, kb] -> [nb, ld] with ld = round_up(kb, 4), zero padding: cuBLASLt's
//                        BLK128x128_32F reads a weight's scale rows at a 16-byte-aligned stride.
//
// e4m3 <-> float use cuda_fp8.h's conversions: the hardware cvt on sm_89+, the header's own bit arithmetic below
// (sm_80 has no FP8 instructions); both are exact for e4m3 -> half, and round to nearest even with saturation
// (__NV_SATFINITE) for float -> e4m3. Every kernel is memory-bound: 16-byte (dequantize) or 8-byte (quantize,
// a lane's 4 columns of a 128-column group) accesses, grid-stride loops where the work is large.
//
// xserv-shapes: fp8=1 (compiled as the piece fp8:f1 at the start of an FP8-quantized model only; others never load it)
#include "common.cuh"
#include <cuda_fp8.h>

namespace {

constexpr int kBlock = 128;      // quantization group / weight block, both dimensions
constexpr float kE4m3Max = 448.f;

__device__ __forceinline__ float2 e4m3x2_to_float2(unsigned short v) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
    return __half22float2(__half2(h));  // e4m3 -> f16 exact, f16 -> f32 exact
}

}  // namespace

// x: bf16 [M, x_stride] (the first K columns), q: e4m3 bytes [M, K], scales: float32 [ceil(K / 128), scale_ld]
// (scales[g * scale_ld + m]). One warp per (row, group): warp w takes m = w % M, g = w / M, so consecutive warps
// write consecutive scales. Lane l holds columns 128g + 4l .. +3 (present when < K: K % 16 == 0, so a lane's four
// columns are all in or all out). Block 256 threads; grid ceil(M * ceil(K / 128) / 8).
// Requirements (the launcher checks): K % 16 == 0; x, q 8-byte aligned, x_stride % 4 == 0; scale_ld >= M.
extern "C" __global__ void __launch_bounds__(256) fp8_quantize_1x128(
    const __nv_bfloat16* __restrict__ x, long long x_stride, unsigned char* __restrict__ q,
    float* __restrict__ scales, int M, int K, int scale_ld) {
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int groups = (K + kBlock - 1) / kBlock;
    if (warp >= (long long)M * groups) return;  // whole warps only: the shuffles below see all 32 lanes
    const int m = (int)(warp % M), g = (int)(warp / M);
    const int col = g * kBlock + 4 * lane;
    const bool present = col < K;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (present) {
        const uint2 raw = *reinterpret_cast<const uint2*>(x + (long long)m * x_stride + col);
        v[0] = __uint_as_float(raw.x << 16);  // bf16 -> fp32: the bits moved up (low half), masked (high half)
        v[1] = __uint_as_float(raw.x & 0xffff0000u);
        v[2] = __uint_as_float(raw.y << 16);
        v[3] = __uint_as_float(raw.y & 0xffff0000u);
    }
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // the group's amax
    const float scale = amax > 0.f ? __fdiv_rn(amax, kE4m3Max) : 1.f;
    if (present) {
        // x / scale with an IEEE division (what the NumPy reference computes), then RN-even to e4m3, saturated
        const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
            make_float2(__fdiv_rn(v[0], scale), __fdiv_rn(v[1], scale)), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(__fdiv_rn(v[2], scale), __fdiv_rn(v[3], scale)), __NV_SATFINITE, __NV_E4M3);
        *reinterpret_cast<unsigned*>(q + (long long)m * K + col) = (unsigned)lo | ((unsigned)hi << 16);  // byte 0 = col
    }
    if (lane == 0) scales[(long long)g * scale_ld + m] = scale;
}

// W: e4m3 bytes [N, K]; scale_inv: float32 [ceil(N / 128), ceil(K / 128)]; out: bf16 [N, K]. An item is 8 weights
// (8 bytes in, one 16-byte store out; K % 16 == 0, so an item lies in one row and one scale block); a thread takes
// kItems items a step, `stride` apart, all loads issued before any use, so that consecutive lanes load and store
// consecutive 8 / 16 bytes (a warp's store is 512 contiguous bytes: whole sectors, no partial writes). Grid-stride;
// 32-bit item indices (the launcher checks N * K / 8 < 2^31). Block 256 threads. Requirements (the launcher
// checks): K % 16 == 0; W, out 16-byte aligned.
constexpr int kItems = 4;

extern "C" __global__ void __launch_bounds__(256) fp8_dequantize_bf16(
    const unsigned char* __restrict__ W, const float* __restrict__ scale_inv, __nv_bfloat16* __restrict__ out,
    int N, int K) {
    const unsigned row_items = (unsigned)K / 8u, kblocks = (unsigned)(K + kBlock - 1) / kBlock;
    const unsigned items = (unsigned)N * row_items, stride = gridDim.x * blockDim.x;
    for (unsigned base = blockIdx.x * blockDim.x + threadIdx.x; base < items; base += stride * kItems) {
        uint2 w[kItems];
        float s[kItems];
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
            const unsigned i = base + u * stride;
            if (i < items) {
                const unsigned n = i / row_items, k0 = (i - n * row_items) * 8u;
                w[u] = __ldg(reinterpret_cast<const uint2*>(W) + i);
                s[u] = __ldg(scale_inv + (n / kBlock) * kblocks + k0 / kBlock);
            }
        }
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
            const unsigned i = base + u * stride;
            if (i < items) {
                const unsigned words[2] = {w[u].x, w[u].y};
                xserv::bf16x8 o;
#pragma unroll
                for (int j = 0; j < 4; ++j) {  // j: a pair of weights (columns k0 + 2j, k0 + 2j + 1)
                    const float2 f = e4m3x2_to_float2(static_cast<unsigned short>(words[j / 2] >> (16 * (j % 2))));
                    o.h[j] = __floats2bfloat162_rn(__fmul_rn(f.x, s[u]), __fmul_rn(f.y, s[u]));  // one rounding each
                }
                reinterpret_cast<xserv::bf16x8*>(out)[i] = o;
            }
        }
    }
}

// src: float32 [rows, cols]; dst: float32 [rows, ld] (ld >= cols), the columns past cols zeroed. A thread an element.
extern "C" __global__ void __launch_bounds__(256) fp8_pad_scales(const float* __restrict__ src, float* __restrict__ dst,
                                                                int rows, int cols, int ld) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * ld) return;
    const int r = (int)(i / ld), c = (int)(i % ld);
    dst[i] = c < cols ? src[(long long)r * cols + c] : 0.f;
}
