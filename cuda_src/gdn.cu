// Gated DeltaNet family (Qwen3.5 / Qwen3-Next linear attention; xserv/ops/gdn.py has the maths and the references):
//   causal_conv1d_silu_k4   u = bf16(silu(depthwise causal conv, K = 4, over [stored window | new tokens]))
//   gdn_recurrent_d128      the delta rule token by token, one CTA per (sequence, value head): decode steps
//   gdn_chunked_d128        the same maths in the chunked WY form (chunk 64, mma.sync bf16): prefill
//   gated_rmsnorm_silu_d128 y = bf16(bf16(bf16(o * rsqrt(mean(o^2) + eps)) * w) * silu(z)), one warp per head row
// Batches are packed: sequence b owns rows cu_seqlens[b] .. cu_seqlens[b+1]-1 of every [T, *] tensor; its start is
// kv_lens[b] - q_len (0: a fresh sequence, whose window / state are zero and whose slot is written, never read); its
// state lives at state_slots[b] and is updated in place. dk = dv = 128 for the delta rule and the norm.
// Storage bf16 (activations, conv window), fp32 (SSM state); all arithmetic fp32 (tensor-core products: bf16 inputs,
// fp32 accumulators).
// xserv-shapes: gdn=1 (compiled at the start of a hybrid model only; others never load it)
#include "mma.cuh"
#include "norm.cuh"

namespace {

constexpr int kD = 128;            // head_k_dim = head_v_dim
constexpr float kL2Eps = 1e-6f;    // added to the sum of squares, inside the sqrt
constexpr int kConvTokens = 64;    // tokens per CTA of the conv (the launcher's _CONV_TOKENS)

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_exact(float x) { return x / (1.f + expf(-x)); }

// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) of value head h at one packed row.
__device__ __forceinline__ void gates(const __nv_bfloat16* __restrict__ proj_row, const float* __restrict__ A_log,
                                      const float* __restrict__ dt_bias, int nv, int ba_col, int h, float& beta,
                                      float& g) {
    beta = sigmoid(__bfloat162float(proj_row[ba_col + h]));
    g = -expf(A_log[h]) * softplus(__bfloat162float(proj_row[ba_col + nv + h]) + dt_bias[h]);
}

}  // namespace

// ---- causal conv + SiLU ---------------------------------------------------------------------------------------
// grid (conv_dim / 2 / 128 channel-pair blocks, B, ceil(max_q_len / 64)), 128 threads; a thread owns two adjacent
// channels and walks up to 64 tokens of one sequence with the last three inputs in registers. The CTA of the first
// token block (blockIdx.z == 0) both reads the stored window and writes the new one, each thread for its own
// channels only, so no other CTA touches the state (the later blocks read their window from proj).
extern "C" __global__ void __launch_bounds__(128) causal_conv1d_silu_k4(
    const __nv_bfloat16* __restrict__ proj,   // [T, P] (columns 0..conv_dim-1 read)
    const __nv_bfloat16* __restrict__ weight, // [conv_dim, 4]
    __nv_bfloat16* conv_state,                // [slots, 3, conv_dim]
    const int* __restrict__ cu_seqlens,       // [B + 1]
    const int* __restrict__ kv_lens,          // [B]
    const int* __restrict__ state_slots,      // [B]
    __nv_bfloat16* __restrict__ out,          // [T, conv_dim]
    int conv_dim, int P) {
    const int c = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    const int b = blockIdx.y;
    const int r0 = cu_seqlens[b], n = cu_seqlens[b + 1] - r0;
    const int t0 = blockIdx.z * kConvTokens;
    if (c >= conv_dim || t0 >= n) return;
    const int start = kv_lens[b] - n;
    float w0[4], w1[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        w0[j] = __bfloat162float(weight[(size_t)c * 4 + j]);
        w1[j] = __bfloat162float(weight[(size_t)(c + 1) * 4 + j]);
    }
    // x[0..2]: the inputs 3, 2, 1 tokens before t0 (oldest first)
    float2 x[3];
    __nv_bfloat16* window = conv_state + (size_t)state_slots[b] * 3 * conv_dim + c;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        if (t0 > 0) {
            x[j] = __bfloat1622float2(
                *reinterpret_cast<const __nv_bfloat162*>(proj + (size_t)(r0 + t0 - 3 + j) * P + c));
        } else if (start > 0) {
            x[j] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(window + (size_t)j * conv_dim));
        } else {
            x[j] = make_float2(0.f, 0.f);
        }
    }
    const float2 old0 = x[0], old1 = x[1], old2 = x[2];
    const int t1 = min(n, t0 + kConvTokens);
#pragma unroll 4
    for (int t = t0; t < t1; ++t) {
        const float2 xt = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(proj + (size_t)(r0 + t) * P + c));
        float a0 = w0[0] * x[0].x, a1 = w1[0] * x[0].y;
        a0 = fmaf(w0[1], x[1].x, a0); a1 = fmaf(w1[1], x[1].y, a1);
        a0 = fmaf(w0[2], x[2].x, a0); a1 = fmaf(w1[2], x[2].y, a1);
        a0 = fmaf(w0[3], xt.x, a0);   a1 = fmaf(w1[3], xt.y, a1);
        *reinterpret_cast<__nv_bfloat162*>(out + (size_t)(r0 + t) * conv_dim + c) =
            __floats2bfloat162_rn(silu_exact(a0), silu_exact(a1));
        x[0] = x[1]; x[1] = x[2]; x[2] = xt;
    }
    if (blockIdx.z == 0) {
        // the window after the last token: sequence positions n-3 .. n-1, from proj or (short steps) the old window
#pragma unroll
        for (int j = 0; j < 3; ++j) {
            const int pos = n - 3 + j;
            const float2 v = pos >= 0 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
                                            proj + (size_t)(r0 + pos) * P + c))
                                      : (pos == -3 ? old0 : pos == -2 ? old1 : old2);
            *reinterpret_cast<__nv_bfloat162*>(window + (size_t)j * conv_dim) = __floats2bfloat162_rn(v.x, v.y);
        }
    }
}

// ---- recurrent delta rule (decode) ----------------------------------------------------------------------------
// grid (nv, B), 256 threads. The CTA's state S [128 keys, 128 values] lives in registers: warp w holds key rows
// 16w .. 16w+15, lane l value columns 4l .. 4l+3 (16 float4), read once at the start and written once at the end.
// Per token: S *= exp(g); m = S^T k and p = S^T q (one pass, partial over each warp's rows, summed across warps in
// shared memory); delta = beta (v - m); S += k delta^T; o = S_new^T q = p + delta (k . q).
extern "C" __global__ void __launch_bounds__(256, 2) gdn_recurrent_d128(
    const __nv_bfloat16* __restrict__ u,     // [T, conv_dim]: q (nk*128) | k (nk*128) | v (nv*128)
    const __nv_bfloat16* __restrict__ proj,  // [T, P]: b at ba_col + h, a at ba_col + nv + h
    const float* __restrict__ A_log,         // [nv]
    const float* __restrict__ dt_bias,       // [nv]
    float* ssm_state,                        // [slots, nv, 128, 128]
    const int* __restrict__ cu_seqlens,      // [B + 1]
    const int* __restrict__ kv_lens,         // [B]
    const int* __restrict__ state_slots,     // [B]
    __nv_bfloat16* __restrict__ out,         // [T, nv * 128]
    int nk, int nv, int P, int ba_col) {
    __shared__ float part[8];                 // per-warp sums of squares (warps 0-3: q, 4-7: k)
    __shared__ float qs[kD], ks[kD];          // the token's normalised q (scaled) and k
    __shared__ float4 red[2][8][kD / 4];      // per-warp partials of m and p
    __shared__ float red_kq[8];
    const int h = blockIdx.x, b = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r0 = cu_seqlens[b], n = cu_seqlens[b + 1] - r0;
    if (n <= 0) return;
    const bool fresh = kv_lens[b] == n;
    const int kh = h / (nv / nk), conv_dim = (2 * nk + nv) * kD;
    float* S = ssm_state + ((size_t)state_slots[b] * nv + h) * kD * kD;
    float4 s[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
        s[j] = fresh ? make_float4(0.f, 0.f, 0.f, 0.f)
                     : reinterpret_cast<const float4*>(S + (size_t)(16 * warp + j) * kD)[lane];
    const float scale = rsqrtf((float)kD);
    for (int t = 0; t < n; ++t) {
        const __nv_bfloat16* row = u + (size_t)(r0 + t) * conv_dim;
        const float x = __bfloat162float(tid < kD ? row[kh * kD + tid] : row[nk * kD + kh * kD + tid - kD]);
        const float ss = xserv::warp_sum(x * x);
        if (lane == 0) part[warp] = ss;
        float beta, g;
        gates(proj + (size_t)(r0 + t) * P, A_log, dt_bias, nv, ba_col, h, beta, g);
        const float decay = expf(g);
        const uint2 vraw = reinterpret_cast<const uint2*>(row + 2 * nk * kD + h * kD)[lane];
        const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vraw.x));
        const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&vraw.y));
        // every warp's sum of squares is in; the previous token's readers of qs / ks / red are past their reads
        __syncthreads();
        const int base = tid < kD ? 0 : 4;
        const float norm = rsqrtf(part[base] + part[base + 1] + part[base + 2] + part[base + 3] + kL2Eps);
        if (tid < kD) qs[tid] = x * norm * scale;
        else ks[tid - kD] = x * norm;
        __syncthreads();  // qs, ks complete
        float4 m = make_float4(0.f, 0.f, 0.f, 0.f), p = m;
        float kq = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = 16 * warp + j;
            const float ki = ks[i], qi = qs[i];
            kq = fmaf(ki, qi, kq);
            s[j].x *= decay; s[j].y *= decay; s[j].z *= decay; s[j].w *= decay;
            m.x = fmaf(s[j].x, ki, m.x); m.y = fmaf(s[j].y, ki, m.y);
            m.z = fmaf(s[j].z, ki, m.z); m.w = fmaf(s[j].w, ki, m.w);
            p.x = fmaf(s[j].x, qi, p.x); p.y = fmaf(s[j].y, qi, p.y);
            p.z = fmaf(s[j].z, qi, p.z); p.w = fmaf(s[j].w, qi, p.w);
        }
        red[0][warp][lane] = m;
        red[1][warp][lane] = p;
        if (lane == 0) red_kq[warp] = kq;
        __syncthreads();  // every warp's partials are in
        m = make_float4(0.f, 0.f, 0.f, 0.f); p = m; kq = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const float4 mw = red[0][w][lane], pw = red[1][w][lane];
            m.x += mw.x; m.y += mw.y; m.z += mw.z; m.w += mw.w;
            p.x += pw.x; p.y += pw.y; p.z += pw.z; p.w += pw.w;
            kq += red_kq[w];
        }
        const float4 d = make_float4(beta * (v01.x - m.x), beta * (v01.y - m.y), beta * (v23.x - m.z),
                                     beta * (v23.y - m.w));
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float ki = ks[16 * warp + j];
            s[j].x = fmaf(ki, d.x, s[j].x); s[j].y = fmaf(ki, d.y, s[j].y);
            s[j].z = fmaf(ki, d.z, s[j].z); s[j].w = fmaf(ki, d.w, s[j].w);
        }
        if (warp == 0) {
            uint2 o;
            o.x = xserv::pack_bf16x2(fmaf(d.x, kq, p.x), fmaf(d.y, kq, p.y));
            o.y = xserv::pack_bf16x2(fmaf(d.z, kq, p.z), fmaf(d.w, kq, p.w));
            reinterpret_cast<uint2*>(out + (size_t)(r0 + t) * nv * kD + h * kD)[lane] = o;
        }
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) reinterpret_cast<float4*>(S + (size_t)(16 * warp + j) * kD)[lane] = s[j];
}

// ---- chunked delta rule (prefill) -----------------------------------------------------------------------------
// grid (128 / 32 value-column blocks, nv, B), 128 threads (4 warps). The value columns of S evolve independently,
// so each CTA owns columns c0 .. c0+31 of one (sequence, head) state and walks its chunks of 64 tokens in order;
// the per-chunk key-side work (K K^T, Q K^T, the triangular inverse) is repeated by the 4 CTAs of a head, which buys
// 4x the CTAs for long single sequences. Per chunk (i, m: rows of the chunk; Gamma = cumsum g inside it):
//   L[i,m] = beta_i (k_i . k_m) e^(Gamma_i - Gamma_m) (m < i);  T = (I + L)^-1 (blocked forward substitution, fp32)
//   R      = beta (v - e^Gamma (K S))                             (so that V' = T R = U - W S of the WY form)
//   V'     = T R
//   O      = e^Gamma (Q S) + (Q K^T e^(Gamma_i - Gamma_m), m <= i) V'
//   S      = e^Gamma_last S + K^T (e^(Gamma_last - Gamma) V')
// Tensor-core products take bf16 operands (q, k, T, R, V', and a bf16 copy of S) with fp32 accumulators; S itself
// stays fp32 in the accumulator registers of the last product across the whole sequence.
namespace {

constexpr int kC = 64;        // chunk
constexpr int kBV = 32;       // value columns per CTA
constexpr int kSK = kD + 8;   // row strides (elements) of the bf16 tiles: +16 bytes so that the 8 rows one
constexpr int kSC = kC + 8;   // ldmatrix phase reads start in different bank groups
constexpr int kSV = kBV + 8;
constexpr int kSL = kC + 1;   // fp32 L / T rows

struct ChunkSmem {
    __nv_bfloat16 q[kC * kSK];     // normalised, scaled q of the chunk (zero rows past its end)
    __nv_bfloat16 k[kC * kSK];     // normalised k
    __nv_bfloat16 vr[kC * kSV];    // v of the CTA's columns, then R in place
    __nv_bfloat16 a[kC * kSC];     // Q K^T with decay, causal (m <= i)
    __nv_bfloat16 t[kC * kSC];     // T = (I + L)^-1
    __nv_bfloat16 vp[kC * kSV];    // V' (its first bytes hold the inversion's scratch before V' is formed)
    __nv_bfloat16 vd[kC * kSV];    // e^(Gamma_last - Gamma) V'
    __nv_bfloat16 s[kD * kSV];     // bf16 copy of the state columns (B operand of K S and Q S)
    float l[kC * kSL];             // L, then the inverse in place (diagonal blocks; off-diagonal ones transposed)
    float beta[kC], gam[kC], eg[kC], egl[kC];
};
static_assert(sizeof(float) * 3 * 16 * 17 <= sizeof(__nv_bfloat16) * kC * kSV, "inversion scratch must fit vp");

__device__ __forceinline__ unsigned lds_addr(const __nv_bfloat16* base, int row, int col, int stride) {
    return xserv::smem_u32(base + row * stride + col);
}

// A fragment of the 16x16 tile at (m0, k0) of a row-major [M][K] tile.
__device__ __forceinline__ void load_a(unsigned (&f)[4], const __nv_bfloat16* base, int stride, int m0, int k0) {
    const int lane = threadIdx.x & 31;
    xserv::ldmatrix_x4(f, lds_addr(base, m0 + (lane & 15), k0 + (lane >> 4) * 8, stride));
}
// A fragment of the 16x16 tile at (m0, k0) of A = X^T, X stored row-major [K][M].
__device__ __forceinline__ void load_a_trans(unsigned (&f)[4], const __nv_bfloat16* base, int stride, int m0, int k0) {
    const int lane = threadIdx.x & 31, mat = lane >> 3;
    xserv::ldmatrix_x4_trans(f, lds_addr(base, k0 + (lane & 7) + (mat >> 1) * 8, m0 + (mat & 1) * 8, stride));
}
// B fragments of two n8 tiles (n0, n0+8) at k0, B[k][n] = Y[n][k] with Y stored row-major [N][K]:
// f[0], f[1] = (b0, b1) of tile n0; f[2], f[3] those of n0+8.
__device__ __forceinline__ void load_b_nk(unsigned (&f)[4], const __nv_bfloat16* base, int stride, int n0, int k0) {
    const int lane = threadIdx.x & 31, mat = lane >> 3;
    xserv::ldmatrix_x4(f, lds_addr(base, n0 + (lane & 7) + (mat >> 1) * 8, k0 + (mat & 1) * 8, stride));
}
// The same with B stored row-major [K][N].
__device__ __forceinline__ void load_b_kn(unsigned (&f)[4], const __nv_bfloat16* base, int stride, int n0, int k0) {
    const int lane = threadIdx.x & 31, mat = lane >> 3;
    xserv::ldmatrix_x4_trans(f, lds_addr(base, k0 + (lane & 7) + (mat & 1) * 8, n0 + (mat >> 1) * 8, stride));
}

// acc[16 rows m0.. of the warp][64 columns] = X[m0.., :128] K^T (X = q or k tile), K K^T / Q K^T of the chunk.
__device__ __forceinline__ void gram(float (&acc)[8][4], const __nv_bfloat16* x, const __nv_bfloat16* k, int m0) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < kD; k0 += 16) {
        unsigned fa[4];
        load_a(fa, x, kSK, m0, k0);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            if (16 * np > m0) break;  // causal: columns past the warp's last row are never used
            unsigned fb[4];
            load_b_nk(fb, k, kSK, 16 * np, k0);
            xserv::mma_bf16_16816(acc[2 * np], fa, fb[0], fb[1]);
            xserv::mma_bf16_16816(acc[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

// acc[16 rows m0..][32 columns] = X[m0.., :128] S (X = q or k tile, S the bf16 state copy [128][32]).
__device__ __forceinline__ void times_state(float (&acc)[4][4], const __nv_bfloat16* x, const __nv_bfloat16* s,
                                            int m0) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int k0 = 0; k0 < kD; k0 += 16) {
        unsigned fa[4];
        load_a(fa, x, kSK, m0, k0);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            unsigned fb[4];
            load_b_kn(fb, s, kSV, 16 * np, k0);
            xserv::mma_bf16_16816(acc[2 * np], fa, fb[0], fb[1]);
            xserv::mma_bf16_16816(acc[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

// acc[16 rows m0..][32] += Lower[m0.., :] Y for a lower-triangular [64][64] tile (k-steps up to the warp's rows).
__device__ __forceinline__ void lower_times(float (&acc)[4][4], const __nv_bfloat16* lower, const __nv_bfloat16* y,
                                            int m0) {
    for (int k0 = 0; k0 <= m0; k0 += 16) {
        unsigned fa[4];
        load_a(fa, lower, kSC, m0, k0);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            unsigned fb[4];
            load_b_kn(fb, y, kSV, 16 * np, k0);
            xserv::mma_bf16_16816(acc[2 * np], fa, fb[0], fb[1]);
            xserv::mma_bf16_16816(acc[2 * np + 1], fa, fb[2], fb[3]);
        }
    }
}

// T = (I + L)^-1 for the strictly lower-triangular fp32 L in sm.l (all 128 threads). Blocks of 16: each warp inverts
// one diagonal block by forward substitution (in place: lane j its column), then the off-diagonal blocks follow by
// distance d = i - j: X_ij = -D_i^-1 sum_{m=j}^{i-1} L_im X_mj. X_ij (i > j) is written transposed into the unused
// upper triangle, block (j, i), because L_ij is still read by later distances. The result goes to sm.t as bf16.
__device__ void invert_unit_lower(ChunkSmem& sm) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* l = sm.l;
    {
        const int o = 16 * warp;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            float v = (i == lane) ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < i; ++m) v = fmaf(-l[(o + i) * kSL + o + m], x[m], v);
            x[i] = v;
        }
        __syncwarp();  // every lane has read the block's L before any lane overwrites it
        if (lane < 16) {
#pragma unroll
            for (int i = 0; i < 16; ++i) l[(o + i) * kSL + o + lane] = x[i];
        }
    }
    __syncthreads();  // the diagonal inverses are in
    float* scratch = reinterpret_cast<float*>(sm.vp);  // [3][16][17]: P = sum_m L_im X_mj per block of this distance
    for (int d = 1; d < 4; ++d) {
        const int blocks = 4 - d;
        for (int e = tid; e < blocks * 256; e += blockDim.x) {
            const int j = e >> 8, i = j + d, r = (e >> 4) & 15, c = e & 15;
            float acc = 0.f;
            for (int m = j; m < i; ++m) {
#pragma unroll
                for (int t = 0; t < 16; ++t) {
                    // X_mj[t][c]: the diagonal block in place (m == j), else stored transposed at block (j, m)
                    const float xv = m == j ? l[(16 * j + t) * kSL + 16 * j + c] : l[(16 * j + c) * kSL + 16 * m + t];
                    acc = fmaf(l[(16 * i + r) * kSL + 16 * m + t], xv, acc);
                }
            }
            scratch[(j * 16 + r) * 17 + c] = acc;
        }
        __syncthreads();  // P of every block of this distance is in
        for (int e = tid; e < blocks * 256; e += blockDim.x) {
            const int j = e >> 8, i = j + d, r = (e >> 4) & 15, c = e & 15;
            float acc = 0.f;
#pragma unroll
            for (int t = 0; t < 16; ++t)
                if (t <= r) acc = fmaf(l[(16 * i + r) * kSL + 16 * i + t], scratch[(j * 16 + t) * 17 + c], acc);
            l[(16 * j + c) * kSL + 16 * i + r] = -acc;
        }
        __syncthreads();  // X of this distance is in before the next reads it (and before scratch is reused)
    }
    for (int e = tid; e < kC * kC; e += blockDim.x) {
        const int i = e >> 6, m = e & 63;
        float v = 0.f;
        if ((i >> 4) == (m >> 4)) v = m <= i ? l[i * kSL + m] : 0.f;
        else if (m < i) v = l[m * kSL + i];
        sm.t[i * kSC + m] = __float2bfloat16_rn(v);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128, 2) gdn_chunked_d128(
    const __nv_bfloat16* __restrict__ u,     // [T, conv_dim]: q (nk*128) | k (nk*128) | v (nv*128)
    const __nv_bfloat16* __restrict__ proj,  // [T, P]: b at ba_col + h, a at ba_col + nv + h
    const float* __restrict__ A_log,         // [nv]
    const float* __restrict__ dt_bias,       // [nv]
    float* ssm_state,                        // [slots, nv, 128, 128]
    const int* __restrict__ cu_seqlens,      // [B + 1]
    const int* __restrict__ kv_lens,         // [B]
    const int* __restrict__ state_slots,     // [B]
    __nv_bfloat16* __restrict__ out,         // [T, nv * 128]
    int nk, int nv, int P, int ba_col) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    ChunkSmem& sm = *reinterpret_cast<ChunkSmem*>(smem_raw);
    xserv::require_dynamic_smem(sizeof(ChunkSmem));
    const int c0 = blockIdx.x * kBV, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, cq = 2 * (lane & 3);
    const int r0 = cu_seqlens[b], n = cu_seqlens[b + 1] - r0;
    if (n <= 0) return;
    const bool fresh = kv_lens[b] == n;
    const int kh = h / (nv / nk), conv_dim = (2 * nk + nv) * kD;
    const float scale = rsqrtf((float)kD);
    float* S = ssm_state + ((size_t)state_slots[b] * nv + h) * kD * kD + c0;
    // The state columns as the accumulator of the update product: warp w, m-tile mt -> key rows 32w + 16mt + g (+8),
    // n-tile nt -> columns 8nt + cq (+1).
    float st[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = 32 * warp + 16 * mt + g + 8 * hf;
                const float2 v = fresh ? make_float2(0.f, 0.f)
                                       : *reinterpret_cast<const float2*>(S + (size_t)row * kD + 8 * nt + cq);
                st[mt][nt][2 * hf] = v.x;
                st[mt][nt][2 * hf + 1] = v.y;
            }
    const int m0 = 16 * warp;  // the warp's rows of the chunk in the [64 x *] products
    for (int cs = 0; cs < n; cs += kC) {
        const int len = min(kC, n - cs);
        // the bf16 copy of S for this chunk's K S and Q S (the previous chunk's readers are past the end barrier)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    *reinterpret_cast<unsigned*>(&sm.s[(32 * warp + 16 * mt + g + 8 * hf) * kSV + 8 * nt + cq]) =
                        xserv::pack_bf16x2(st[mt][nt][2 * hf], st[mt][nt][2 * hf + 1]);
        // gates: one thread per row
        if (tid < kC) {
            float beta = 0.f, gl = 0.f;
            if (tid < len) gates(proj + (size_t)(r0 + cs + tid) * P, A_log, dt_bias, nv, ba_col, h, beta, gl);
            sm.beta[tid] = beta;
            sm.gam[tid] = gl;
        }
        // q, k rows: warp w takes rows w, w+4, ..., lane l elements 4l .. 4l+3. Every row's loads are issued before the
        // first norm (a warp reduction) waits on them: one memory latency per chunk, not one per row.
        uint2 qr[kC / 4], kr[kC / 4];
#pragma unroll
        for (int j = 0; j < kC / 4; ++j) {
            const int i = warp + 4 * j;
            qr[j] = kr[j] = make_uint2(0u, 0u);
            if (i < len) {
                const __nv_bfloat16* row = u + (size_t)(r0 + cs + i) * conv_dim;
                qr[j] = reinterpret_cast<const uint2*>(row + kh * kD)[lane];
                kr[j] = reinterpret_cast<const uint2*>(row + nk * kD + kh * kD)[lane];
            }
        }
#pragma unroll
        for (int j = 0; j < kC / 4; ++j) {
            const int i = warp + 4 * j;
            const float2 qa = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qr[j].x));
            const float2 qb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qr[j].y));
            const float2 ka = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kr[j].x));
            const float2 kb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kr[j].y));
            const float qq = qa.x * qa.x + qa.y * qa.y + qb.x * qb.x + qb.y * qb.y;
            const float kk = ka.x * ka.x + ka.y * ka.y + kb.x * kb.x + kb.y * kb.y;
            const float rq = rsqrtf(xserv::warp_sum(qq) + kL2Eps) * scale, rk = rsqrtf(xserv::warp_sum(kk) + kL2Eps);
            uint2 qo, ko;
            qo.x = xserv::pack_bf16x2(qa.x * rq, qa.y * rq); qo.y = xserv::pack_bf16x2(qb.x * rq, qb.y * rq);
            ko.x = xserv::pack_bf16x2(ka.x * rk, ka.y * rk); ko.y = xserv::pack_bf16x2(kb.x * rk, kb.y * rk);
            *reinterpret_cast<uint2*>(&sm.q[i * kSK + 4 * lane]) = qo;
            *reinterpret_cast<uint2*>(&sm.k[i * kSK + 4 * lane]) = ko;
        }
        // v of the CTA's 32 columns: 64 rows x 4 sixteen-byte pieces
#pragma unroll
        for (int e = tid; e < kC * 4; e += 128) {
            const int i = e >> 2, piece = e & 3;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (i < len)
                v = *reinterpret_cast<const uint4*>(u + (size_t)(r0 + cs + i) * conv_dim + 2 * nk * kD + h * kD + c0 +
                                                    8 * piece);
            *reinterpret_cast<uint4*>(&sm.vr[i * kSV + 8 * piece]) = v;
        }
        __syncthreads();  // g of every row is in for the scan; q, k, v, s tiles complete
        if (warp == 0) {
            // Gamma = inclusive cumsum of g: lane l holds rows 2l, 2l+1
            const float ga = sm.gam[2 * lane], gb = sm.gam[2 * lane + 1];
            float incl = ga + gb;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float up = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += up;
            }
            const float last = __shfl_sync(0xffffffffu, incl, 31);
            const float g0 = incl - gb, g1 = incl;
            sm.gam[2 * lane] = g0; sm.gam[2 * lane + 1] = g1;
            sm.eg[2 * lane] = expf(g0); sm.eg[2 * lane + 1] = expf(g1);
            sm.egl[2 * lane] = expf(last - g0); sm.egl[2 * lane + 1] = expf(last - g1);
        }
        __syncthreads();  // Gamma and its exponentials are in
        {
            // L (fp32, strictly lower) and A (bf16, causal) from K K^T and Q K^T
            float acc[8][4];
            gram(acc, sm.k, sm.k, m0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = m0 + g + 8 * (e >> 1), m = 8 * nt + cq + (e & 1);
                    sm.l[i * kSL + m] = m < i ? sm.beta[i] * acc[nt][e] * expf(sm.gam[i] - sm.gam[m]) : 0.f;
                }
            gram(acc, sm.q, sm.k, m0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int i = m0 + g + 8 * (e >> 1), m = 8 * nt + cq;
                    const float a0 = m <= i ? acc[nt][e] * expf(sm.gam[i] - sm.gam[m]) : 0.f;
                    const float a1 = m + 1 <= i ? acc[nt][e + 1] * expf(sm.gam[i] - sm.gam[m + 1]) : 0.f;
                    *reinterpret_cast<unsigned*>(&sm.a[i * kSC + m]) = xserv::pack_bf16x2(a0, a1);
                }
        }
        float qs[4][4];
        {
            // R = beta (v - e^Gamma (K S)) in place of v (each element read and written by the same thread)
            float ks[4][4];
            times_state(ks, sm.k, sm.s, m0);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int i = m0 + g + 8 * (e >> 1), c = 8 * nt + cq;
                    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&sm.vr[i * kSV + c]);
                    const float2 v = __bfloat1622float2(*p);
                    const float bi = sm.beta[i], ei = sm.eg[i];
                    *p = __floats2bfloat162_rn(bi * (v.x - ei * ks[nt][e]), bi * (v.y - ei * ks[nt][e + 1]));
                }
            times_state(qs, sm.q, sm.s, m0);
        }
        __syncthreads();  // L is complete for the inversion; R and A are complete
        invert_unit_lower(sm);
        __syncthreads();  // T is in (and the inversion's scratch in vp is free)
        {
            // V' = T R; also e^(Gamma_last - Gamma) V' for the state update
            float vp[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) vp[nt][0] = vp[nt][1] = vp[nt][2] = vp[nt][3] = 0.f;
            lower_times(vp, sm.t, sm.vr, m0);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int i = m0 + g + 8 * (e >> 1), c = 8 * nt + cq;
                    *reinterpret_cast<unsigned*>(&sm.vp[i * kSV + c]) = xserv::pack_bf16x2(vp[nt][e], vp[nt][e + 1]);
                    const float el = sm.egl[i];
                    *reinterpret_cast<unsigned*>(&sm.vd[i * kSV + c]) =
                        xserv::pack_bf16x2(el * vp[nt][e], el * vp[nt][e + 1]);
                }
        }
        __syncthreads();  // V' of every row is in
        {
            // O = e^Gamma (Q S) + A V'
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) qs[nt][e] *= sm.eg[m0 + g + 8 * (e >> 1)];
            lower_times(qs, sm.a, sm.vp, m0);
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int i = m0 + g + 8 * (e >> 1);
                if (i < len) {
                    __nv_bfloat16* orow = out + (size_t)(r0 + cs + i) * nv * kD + h * kD + c0;
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
                        *reinterpret_cast<unsigned*>(orow + 8 * nt + cq) = xserv::pack_bf16x2(qs[nt][e], qs[nt][e + 1]);
                }
            }
        }
        {
            // S = e^Gamma_last S + K^T (e^(Gamma_last - Gamma) V')
            const float el = sm.eg[kC - 1];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[mt][nt][e] *= el;
#pragma unroll
            for (int k0 = 0; k0 < kC; k0 += 16) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    unsigned fa[4];
                    load_a_trans(fa, sm.k, kSK, 32 * warp + 16 * mt, k0);
#pragma unroll
                    for (int np = 0; np < 2; ++np) {
                        unsigned fb[4];
                        load_b_kn(fb, sm.vd, kSV, 16 * np, k0);
                        xserv::mma_bf16_16816(st[mt][2 * np], fa, fb[0], fb[1]);
                        xserv::mma_bf16_16816(st[mt][2 * np + 1], fa, fb[2], fb[3]);
                    }
                }
            }
        }
        __syncthreads();  // every read of this chunk's tiles is done before the next chunk overwrites them
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int row = 32 * warp + 16 * mt + g + 8 * hf;
                *reinterpret_cast<float2*>(S + (size_t)row * kD + 8 * nt + cq) =
                    make_float2(st[mt][nt][2 * hf], st[mt][nt][2 * hf + 1]);
            }
}

// ---- gated RMSNorm + SiLU gate --------------------------------------------------------------------------------
// 256 threads = 8 warps, one warp per (row, value head) of 128 values, lane l elements 4l .. 4l+3.
extern "C" __global__ void __launch_bounds__(256) gated_rmsnorm_silu_d128(
    const __nv_bfloat16* o,                  // [T, nv * 128] (may be `out`)
    const __nv_bfloat16* __restrict__ proj,  // [T, P]: z at z_col
    const __nv_bfloat16* __restrict__ weight,// [128]
    __nv_bfloat16* out,                      // [T, nv * 128]
    int nv, int P, int z_col, long long heads, float eps) {
    const long long e = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (e >= heads) return;
    const int lane = threadIdx.x & 31;
    const long long row = e / nv;
    const int h = (int)(e - row * nv);
    const uint2 oraw = reinterpret_cast<const uint2*>(o + e * kD)[lane];
    const uint2 zraw = reinterpret_cast<const uint2*>(proj + row * P + z_col + h * kD)[lane];
    const uint2 wraw = reinterpret_cast<const uint2*>(weight)[lane];
    float x[4], z[4], w[4];
    {
        const __nv_bfloat162* op = reinterpret_cast<const __nv_bfloat162*>(&oraw);
        const __nv_bfloat162* zp = reinterpret_cast<const __nv_bfloat162*>(&zraw);
        const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&wraw);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const float2 a = __bfloat1622float2(op[j]), c = __bfloat1622float2(zp[j]), d = __bfloat1622float2(wp[j]);
            x[2 * j] = a.x; x[2 * j + 1] = a.y; z[2 * j] = c.x; z[2 * j + 1] = c.y; w[2 * j] = d.x; w[2 * j + 1] = d.y;
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) ss = fmaf(x[j], x[j], ss);
    const float inv = xserv::rms_inv(xserv::warp_sum(ss), kD, eps);
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = xserv::round_bf16(xserv::rms_apply(x[j], inv, w[j])) * silu_exact(z[j]);
    uint2 res;
    res.x = xserv::pack_bf16x2(y[0], y[1]);
    res.y = xserv::pack_bf16x2(y[2], y[3]);
    reinterpret_cast<uint2*>(out + e * kD)[lane] = res;
}
