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
//
// Why not cuBLASLt: at M <= 16 a projection is a read of W (bandwidth-bound), and cuBLASLt's kernels for these
// shapes leave a quarter of the bandwidth unused and need separate kernels for the norm, the activation and the
// residual add, each a launch and a round trip through memory.
//
// Shape of the work. A CTA is 4 warps. The prologue stages the m transformed x rows in shared memory once per CTA
// (bf16, m * K * 2 bytes), so every CTA is persistent over a grid-stride loop of tiles. A tile is
// (4 / split) row groups of R = 4 output rows; the `split` warps of a row group divide K between them
// (interleaved 16-byte chunks, coalesced) and add their partial sums through shared memory in a fixed order, so
// results do not depend on timing. Each lane keeps U chunks of each of its R rows in flight (R * U 16-byte loads)
// before it touches x, which is what keeps enough bytes in flight per SM to reach the bandwidth.
//
// Programmatic dependent launch: the weights do not depend on the previous kernel, so before pdl_wait() each
// warp asks the L2 to prefetch its first tile's rows (cp.async.bulk.prefetch); the x staging comes after the wait.
//
// Requirements (the launcher checks): K % 8 == 0, W and x rows 16-byte aligned (x_stride a multiple of 8 bf16 /
// 4 fp32 values), dynamic shared memory m * K * 2 bytes + the reduction buffer.
#include "norm.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 4;  // R: output rows per row group

enum Prologue : int { kBf16 = 0, kRmsNorm = 1, kSiluMul = 2 };
enum Epilogue : int { kStoreBf16 = 0, kStoreF32 = 1, kAddResidual = 2 };

// A weight load that should not displace x or the staged rows in L1: W is read exactly once.
__device__ __forceinline__ uint4 load_weight(const __nv_bfloat16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ float bf16_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}

__device__ __forceinline__ float dot8(const uint4& w, const float (&x)[8], float acc) {
    float f[8];
    unpack8(w, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(f[j], x[j], acc);
    return acc;
}

// silu(g) = g / (1 + 2^(-g * log2 e)) with ex2.approx and an IEEE division, exactly as activation.ptx.
__device__ __forceinline__ float silu(float g) {
    float e;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.4426950408889634f));
    return __fdiv_rn(g, 1.f + e);
}

// Stage the m transformed x rows in shared memory (bf16 [m][K]). Every thread of the CTA takes part.
template <int M>
__device__ __forceinline__ void stage_x(__nv_bfloat16* xs, float* scratch, const void* x, long long x_stride,
                                        const int* x_rows, const __nv_bfloat16* norm_w, float eps, int m, int K,
                                        int prologue) {
    const int chunks = K / 8;
    if (prologue == kRmsNorm) {
        // Pass 1: each row's sum of squares (per-thread partials, then warp and CTA sums in a fixed order).
        float ss[M];
#pragma unroll
        for (int i = 0; i < M; ++i) ss[i] = 0.f;
#pragma unroll
        for (int i = 0; i < M; ++i) {
            if (i < m) {
                const float* row = static_cast<const float*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
                for (int c = threadIdx.x; c < chunks; c += kThreads) {
                    const float4 a = reinterpret_cast<const float4*>(row + c * 8)[0];
                    const float4 b = reinterpret_cast<const float4*>(row + c * 8)[1];
                    ss[i] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
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
                    const float4 a = reinterpret_cast<const float4*>(row + c * 8)[0];
                    const float4 b = reinterpret_cast<const float4*>(row + c * 8)[1];
                    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
                    xserv::load8(norm_w + c * 8, w);
#pragma unroll
                    for (int j = 0; j < 8; ++j) v[j] = w[j] * (v[j] * inv);
                    xserv::store8(xs + (long long)i * K + c * 8, v);
                }
            }
        }
    } else if (prologue == kSiluMul) {
        for (int i = 0; i < m; ++i) {
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            for (int c = threadIdx.x; c < chunks; c += kThreads) {
                float g[8], u[8];
                xserv::load8(row + c * 8, g);
                xserv::load8(row + K + c * 8, u);
#pragma unroll
                for (int j = 0; j < 8; ++j) g[j] = xserv::round_bf16(silu(g[j])) * u[j];
                xserv::store8(xs + (long long)i * K + c * 8, g);
            }
        }
    } else {
        for (int i = 0; i < m; ++i) {
            const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(x) + (long long)(x_rows ? x_rows[i] : i) * x_stride;
            for (int c = threadIdx.x; c < chunks; c += kThreads)
                reinterpret_cast<uint4*>(xs + (long long)i * K)[c] = reinterpret_cast<const uint4*>(row)[c];
        }
    }
    __syncthreads();
}

// M: rows compiled for (m <= M at run time); U: 16-byte chunks per row a lane keeps in flight.
template <int M, int U>
__device__ __forceinline__ void gemv(const void* x, long long x_stride, const int* x_rows,
                                     const __nv_bfloat16* norm_w, float eps, const __nv_bfloat16* __restrict__ W,
                                     void* out, long long out_stride, int m, int N, int K, int split, int prologue,
                                     int epilogue) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float scratch[M * kWarps];
    __shared__ float partial[kWarps][kRows * M];
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups_per_tile = kWarps / split;
    const int slot = warp / split, part = warp % split;  // this warp's row group in the tile, its share of K
    const int chunks = K / 8;
    const int num_tiles = (N + kRows * groups_per_tile - 1) / (kRows * groups_per_tile);

    // Before the wait: the first tile's weight rows of this warp into L2 (lane r < R prefetches row r's share).
    if (blockIdx.x < num_tiles && lane < kRows) {
        const int n = (blockIdx.x * groups_per_tile + slot) * kRows + lane;
        if (n < N) {
            const int per = (chunks + split - 1) / split;  // chunks of this warp's K share, as 16-byte units
            const int c0 = min(part * per, chunks), c1 = min(c0 + per, chunks);
            if (c1 > c0) prefetch_l2(W + (long long)n * K + c0 * 8, (unsigned)(c1 - c0) * 16u);
        }
    }
    xserv::pdl_wait();
    stage_x<M>(xs, scratch, x, x_stride, x_rows, norm_w, eps, m, K, prologue);
    xserv::pdl_launch_dependents();

    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const int n0 = (tile * groups_per_tile + slot) * kRows;
        const __nv_bfloat16* wrow[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) wrow[r] = W + (long long)min(n0 + r, N - 1) * K;  // clamped: a valid row
        float acc[kRows][M];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int i = 0; i < M; ++i) acc[r][i] = 0.f;

        for (int c = part * 32 + lane; c < chunks; c += 32 * split * U) {
            uint4 w[U][kRows];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cu = c + u * 32 * split;
#pragma unroll
                for (int r = 0; r < kRows; ++r) w[u][r] = cu < chunks ? load_weight(wrow[r] + cu * 8) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int cu = c + u * 32 * split;
                if (cu < chunks) {
#pragma unroll
                    for (int i = 0; i < M; ++i) {
                        if (i < m) {
                            float xv[8];
                            unpack8(reinterpret_cast<const uint4*>(xs + (long long)i * K)[cu], xv);
#pragma unroll
                            for (int r = 0; r < kRows; ++r) acc[r][i] = dot8(w[u][r], xv, acc[r][i]);
                        }
                    }
                }
            }
        }
        // Reduce: the lanes of each warp, then the `split` warps of the row group, in warp order.
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int i = 0; i < M; ++i) {
                const float v = xserv::warp_sum(acc[r][i]);
                if (lane == 0) partial[warp][r * M + i] = v;
            }
        __syncthreads();
        if (part == 0) {
            for (int e = lane; e < kRows * M; e += 32) {
                const int r = e / M, i = e % M, n = n0 + r;
                if (i >= m || n >= N) continue;
                float v = 0.f;
                for (int p = 0; p < split; ++p) v += partial[warp + p][e];
                const long long o = (long long)i * out_stride + n;
                if (epilogue == kStoreBf16) static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16_rn(v);
                else if (epilogue == kStoreF32) static_cast<float*>(out)[o] = v;
                else static_cast<float*>(out)[o] += xserv::round_bf16(v);
            }
        }
        __syncthreads();  // `partial` is reused by the next tile
    }
}

}  // namespace

// x: see the prologues above; x_rows: int32 [m] or null; norm_w: bf16 [K] (kRmsNorm) or null; W: bf16 [N, K];
// out: [m, out_stride] (bf16 / fp32, or the fp32 residual for kAddResidual). grid: persistent (<= tiles),
// block: 128 threads, dynamic shared memory: m * K * 2 bytes.
#define XSERV_GEMV(M, U)                                                                                              \
    extern "C" __global__ void __launch_bounds__(kThreads) gemv_m##M(                                                 \
        const void* x, long long x_stride, const int* x_rows, const __nv_bfloat16* norm_w, float eps,                \
        const __nv_bfloat16* W, void* out, long long out_stride, int m, int N, int K, int split, int prologue,       \
        int epilogue) {                                                                                               \
        gemv<M, U>(x, x_stride, x_rows, norm_w, eps, W, out, out_stride, m, N, K, split, prologue, epilogue);       \
    }
XSERV_GEMV(1, 4)
XSERV_GEMV(2, 4)
XSERV_GEMV(4, 4)
XSERV_GEMV(8, 2)
XSERV_GEMV(16, 2)
#undef XSERV_GEMV
