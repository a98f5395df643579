// Rotary position embedding, Qwen3 / GPT-NeoX rotate-half layout. For a head vector v of D values (D = 64 or 128)
// at position p, with c_i = cos_sin[p][i] and s_i = cos_sin[p][D/2 + i] for i < D/2:
//     out[i]       = v[i] * c_i - v[i + D/2] * s_i
//     out[i + D/2] = v[i + D/2] * c_i + v[i] * s_i
// cos_sin is an fp32 table (YaRN's attention factor already folded in); math in fp32, one rounding to bf16 at the
// store. (HF in bf16 rounds cos/sin to bf16 and rounds after each multiply and add; we round once, which is closer
// to the fp32 result.)
//
//   rope:          out = rope(x);  `out` may alias `x` (each lane reads its values before writing them).
//   qk_norm_rope:  in place on the packed QKV GEMM output: q heads get head-RMSNorm(q_weight) then RoPE, k heads
//                  head-RMSNorm(k_weight) then RoPE, v heads are not touched. The normalised value is rounded to
//                  bf16 before RoPE, as HF's q_norm/k_norm return bf16. (Qwen3)
//   qk_rope:       the same without the head norms: RoPE on the q and k heads of the packed QKV. (Llama)
//
// Positions are read on the device and cannot be checked by the launcher: a position outside [0, max_pos) does not
// read the table; the kernel writes NaN into that head row instead, so the bug shows.
//
// One warp per head row (layout in norm.cuh), kRowsPerWarp rows per warp with all loads issued before any math.
// The row index is warp-uniform, so bounds checks keep whole warps together (warp_sum needs all 32 lanes).
#include "rope.cuh"
#include "kv_format.cuh"

namespace {

constexpr int kRowsPerWarp = 2;  // head rows per warp (qk_norm_rope; 8 measured 2x slower: 29% vs 56% of copy bandwidth)

template <int D>
__device__ __forceinline__ void rope_regs(xserv::HeadRow<D>& r, const float* __restrict__ cs_row, int lane) {
    constexpr int EH = xserv::HeadRow<D>::EH;
    const int i = lane * EH;
#pragma unroll
    for (int e = 0; e < EH; ++e) {
        const float c = cs_row[i + e], s = cs_row[D / 2 + i + e];
        const float lo = r.lo[e], hi = r.hi[e];
        r.lo[e] = lo * c - hi * s;
        r.hi[e] = hi * c + lo * s;
    }
}

template <int D, bool PAIRED>
__device__ __forceinline__ void rope_rows(const __nv_bfloat16* x, const int* __restrict__ positions,
                                          const float* __restrict__ cos_sin, __nv_bfloat16* out, long long rows,
                                          int num_heads, int max_pos) {
    const int lane = threadIdx.x & 31;
    const long long first = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kRowsPerWarp;
    xserv::HeadRow<D> r[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k)
        if (first + k < rows) xserv::head_load<D, PAIRED>(x + (first + k) * D, r[k], lane);
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
        const long long row = first + k;
        if (row < rows) {
            const int pos = positions[row / num_heads];
            if (pos >= 0 && pos < max_pos)
                rope_regs<D>(r[k], cos_sin + (long long)pos * D, lane);
            else
                xserv::head_fill<D>(r[k], xserv::quiet_nan());
            xserv::head_store<D, PAIRED>(out + row * D, r[k], lane);
        }
    }
}

// NORM: head-RMSNorm each q/k row (q_weight / k_weight) before the rotation; without it the weights are not read.
template <int D, bool PAIRED, bool NORM>
__device__ __forceinline__ void qk_rope_rows(__nv_bfloat16* qkv, const __nv_bfloat16* __restrict__ q_weight,
                                             const __nv_bfloat16* __restrict__ k_weight,
                                             const int* __restrict__ positions, const float* __restrict__ cos_sin,
                                             int num_tokens, int num_q_heads, int num_kv_heads, int max_pos,
                                             float eps) {
    const int lane = threadIdx.x & 31;
    const int qk_heads = num_q_heads + num_kv_heads;        // heads this kernel rewrites, per token
    const int all_heads = num_q_heads + 2 * num_kv_heads;   // heads per token in the packed buffer
    const long long rows = (long long)num_tokens * qk_heads;
    const long long first = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * kRowsPerWarp;
    xserv::HeadRow<D> r[kRowsPerWarp];
    long long offset[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
        const long long row = first + k;
        const long long token = row / qk_heads;
        offset[k] = (token * all_heads + (row - token * qk_heads)) * D;
        if (row < rows) xserv::head_load<D, PAIRED>(qkv + offset[k], r[k], lane);
    }
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
        const long long row = first + k;
        if (row < rows) {
            const long long token = row / qk_heads;
            const int head = (int)(row - token * qk_heads);
            if constexpr (NORM) xserv::head_rmsnorm_regs<D>(r[k], head < num_q_heads ? q_weight : k_weight, eps, lane);
            const int pos = positions[token];
            if (pos >= 0 && pos < max_pos)
                rope_regs<D>(r[k], cos_sin + (long long)pos * D, lane);
            else
                xserv::head_fill<D>(r[k], xserv::quiet_nan());
            xserv::head_store<D, PAIRED>(qkv + offset[k], r[k], lane);
        }
    }
}


// v3 plain RoPE: D/16 threads per head row, each owning 8 consecutive values of each half, so every access is
// 16 bytes wide: two bf16x8 loads of x, four float4 loads of the table (cos for its 8 lo values, sin likewise),
// two bf16x8 stores. (v2, a warp per row with 4-byte accesses, reached 72% of copy bandwidth: too many
// instructions per byte.) The launcher guarantees 16-byte aligned x, out and cos_sin.
template <int D>
__device__ __forceinline__ void rope_rows_vec16(const __nv_bfloat16* x, const int* __restrict__ positions,
                                                const float* __restrict__ cos_sin, __nv_bfloat16* out,
                                                long long rows, int num_heads, int max_pos) {
    constexpr int kThreadsPerRow = D / 16;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long row = gid / kThreadsPerRow;
    const int t = (int)(gid % kThreadsPerRow);
    if (row >= rows) return;
    const int pos = positions[row / num_heads];
    float lo[8], hi[8];
    xserv::load8(x + row * D + 8 * t, lo);
    xserv::load8(x + row * D + D / 2 + 8 * t, hi);
    if (pos >= 0 && pos < max_pos) {
        const float4* cs = reinterpret_cast<const float4*>(cos_sin + (long long)pos * D);
        const float4 c0 = cs[2 * t], c1 = cs[2 * t + 1], s0 = cs[D / 8 + 2 * t], s1 = cs[D / 8 + 2 * t + 1];
        const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        const float s[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float l = lo[e], h = hi[e];
            lo[e] = l * c[e] - h * s[e];
            hi[e] = h * c[e] + l * s[e];
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) lo[e] = hi[e] = xserv::quiet_nan();
    }
    xserv::store8(out + row * D + 8 * t, lo);
    xserv::store8(out + row * D + D / 2 + 8 * t, hi);
}

}  // namespace

// x, out: [num_tokens, num_heads, D] bf16 (rows = num_tokens * num_heads); positions: [num_tokens] int32;
// cos_sin: [max_pos, D] fp32. grid = ceil(rows / (kRowsPerWarp * blockDim.x / 32)).
// The D=128 non-_scalar kernel needs x and out 4-byte aligned.
#define XSERV_ROPE(NAME, D, PAIRED)                                                                                  \
    extern "C" __global__ void NAME(const __nv_bfloat16* x, const int* positions, const float* cos_sin,              \
                                    __nv_bfloat16* out, long long rows, int num_heads, int max_pos) {                \
        rope_rows<D, PAIRED>(x, positions, cos_sin, out, rows, num_heads, max_pos);                                  \
    }
XSERV_ROPE(rope_d64_bf16, 64, false)
XSERV_ROPE(rope_d128_bf16, 128, true)
XSERV_ROPE(rope_d128_bf16_scalar, 128, false)
#undef XSERV_ROPE

// Same arguments; one thread per 8 values of each half: grid = ceil(rows * D / 16 / blockDim.x).
#define XSERV_ROPE_VEC16(NAME, D)                                                                                    \
    extern "C" __global__ void NAME(const __nv_bfloat16* x, const int* positions, const float* cos_sin,              \
                                    __nv_bfloat16* out, long long rows, int num_heads, int max_pos) {                \
        rope_rows_vec16<D>(x, positions, cos_sin, out, rows, num_heads, max_pos);                                    \
    }
XSERV_ROPE_VEC16(rope_d64_bf16_vec16, 64)
XSERV_ROPE_VEC16(rope_d128_bf16_vec16, 128)
#undef XSERV_ROPE_VEC16

// qkv: [num_tokens, num_q_heads + 2 * num_kv_heads, D] bf16, in place; q_weight, k_weight: [D] bf16;
// positions: [num_tokens] int32; cos_sin: [max_pos, D] fp32.
// grid = ceil(num_tokens * (num_q_heads + num_kv_heads) / (kRowsPerWarp * blockDim.x / 32)).
#define XSERV_QK_NORM_ROPE(NAME, D, PAIRED)                                                                          \
    extern "C" __global__ void NAME(__nv_bfloat16* qkv, const __nv_bfloat16* q_weight,                               \
                                    const __nv_bfloat16* k_weight, const int* positions, const float* cos_sin,       \
                                    int num_tokens, int num_q_heads, int num_kv_heads, int max_pos, float eps) {     \
        qk_rope_rows<D, PAIRED, true>(qkv, q_weight, k_weight, positions, cos_sin, num_tokens, num_q_heads,          \
                                      num_kv_heads, max_pos, eps);                                                   \
    }
XSERV_QK_NORM_ROPE(qk_norm_rope_d64_bf16, 64, false)
XSERV_QK_NORM_ROPE(qk_norm_rope_d128_bf16, 128, true)
XSERV_QK_NORM_ROPE(qk_norm_rope_d128_bf16_scalar, 128, false)
#undef XSERV_QK_NORM_ROPE

// qkv: [num_tokens, num_q_heads + 2 * num_kv_heads, D] bf16, in place; positions: [num_tokens] int32;
// cos_sin: [max_pos, D] fp32. Same grid as qk_norm_rope.
#define XSERV_QK_ROPE(NAME, D, PAIRED)                                                                               \
    extern "C" __global__ void NAME(__nv_bfloat16* qkv, const int* positions, const float* cos_sin, int num_tokens,  \
                                    int num_q_heads, int num_kv_heads, int max_pos) {                                \
        qk_rope_rows<D, PAIRED, false>(qkv, nullptr, nullptr, positions, cos_sin, num_tokens, num_q_heads,          \
                                       num_kv_heads, max_pos, 0.0f);                                                 \
    }
XSERV_QK_ROPE(qk_rope_d64_bf16, 64, false)
XSERV_QK_ROPE(qk_rope_d128_bf16, 128, true)
XSERV_QK_ROPE(qk_rope_d128_bf16_scalar, 128, false)
#undef XSERV_QK_ROPE

// ---------------------------------------------------------------------------------------------------------------
// qk_norm_rope_write_kv / qk_rope_write_kv: qk_norm_rope (or qk_rope) and the paged KV-cache write of the packed
// qkv (write_kv_bf16 in kv_cache.cu) in one launch, with results bit-identical to the two kernels run one after the
// other. The rotated k row is stored to qkv and, for slot >= 0, the same bf16 bits to k_cache; v rows are copied to
// v_cache bit for bit (slot >= 0); qkv's v heads are not written.
//
// Layout: 16-byte accesses (v1, a warp per row with the 4-byte accesses of qk_norm_rope and the weights picked by
// reference, i.e. from local memory, ran at 64% of copy bandwidth at 8192 tokens, slower than the two ops; this
// layout with the weights in registers runs at 88%): a (token, head) row of D values is held by LPR = D/16 lanes
// (rope.cuh: the layout, the head norm and RoPE of one row, and why they give qk_norm_rope's bits; the fused decode
// attention entry in attention_decode.cu uses the same pieces); a warp holds 32/LPR rows at a time, STEPS such groups
// per warp with all loads issued before any math.
//
// Programmatic dependent launch: the q/k weights are loaded before pdl_wait() (no earlier kernel writes them);
// qkv, positions, slot_mapping and the caches are touched only after it (the table row depends on the position).
// ---------------------------------------------------------------------------------------------------------------
namespace {

using namespace xserv::rope16;

// The KV element formats of the cache write (KV: the template parameter of qk_rope_write_kv_rows). store() puts a
// lane's two 8-element chunks of a row (elements 8t.. and D/2 + 8t.., as bf16 bits) at row pointer dst of the cache.
// KvBf16: the bf16 bits as they are (16-byte stores). KvE4m3: write_kv_fp8's conversion (kv_cache.cu): bf16 -> float
// (exact), IEEE division by the kv head's scale, one rounding to e4m3 (e4m3.cuh), 8-byte stores; the same bits as
// qk_norm_rope followed by write_kv_fp8. The chunks are passed by value: taken by reference, NVRTC scheduled the bf16
// kernels differently (their machine code is unchanged this way: every .text section compared, sm_80 and sm_90a).
struct KvBf16 {
    using T = __nv_bfloat16;
    template <int D>
    __device__ __forceinline__ void store_k(T* dst, int t, uint4 lo, uint4 hi, int) const {
        *reinterpret_cast<uint4*>(dst + 8 * t) = lo;
        *reinterpret_cast<uint4*>(dst + D / 2 + 8 * t) = hi;
    }
    template <int D>
    __device__ __forceinline__ void store_v(T* dst, int t, uint4 lo, uint4 hi, int h) const {
        store_k<D>(dst, t, lo, hi, h);
    }
};
struct KvE4m3 {
    using T = unsigned char;
    static __device__ __forceinline__ uint2 quantize(const uint4& bits, float scale) {
        return xserv::e4m3::quantize_bf16x8(bits, scale);  // kv_format.cuh: the fused FP8 decode entry's too
    }
    const float* __restrict__ k_scale;  // [num_kv_heads] float32
    const float* __restrict__ v_scale;
    template <int D>
    static __device__ __forceinline__ void store(T* dst, int t, uint4 lo, uint4 hi, float scale) {
        *reinterpret_cast<uint2*>(dst + 8 * t) = quantize(lo, scale);
        *reinterpret_cast<uint2*>(dst + D / 2 + 8 * t) = quantize(hi, scale);
    }
    template <int D>
    __device__ __forceinline__ void store_k(T* dst, int t, uint4 lo, uint4 hi, int h) const {
        store<D>(dst, t, lo, hi, k_scale[h]);
    }
    template <int D>
    __device__ __forceinline__ void store_v(T* dst, int t, uint4 lo, uint4 hi, int h) const {
        store<D>(dst, t, lo, hi, v_scale[h]);
    }
};

// kv: the cache's element format (KvBf16: nothing; KvE4m3: this layer's scales).
// ROT < D (partial RoPE, Qwen3.5's gated attention): only elements [0, ROT) of a q/k row rotate, as pairs (i, i + ROT/2)
// with cos_sin [max_pos, ROT] (rope.cuh, rope_partial); the rest pass through (normalised). gate_heads (read where
// ROT < D): heads a token's row carries after its v heads (the output gate's, qkvg), skipped: never read or written.
template <int D, bool NORM, int STEPS, class KV = KvBf16, int ROT = D>
__device__ __forceinline__ void qk_rope_write_kv_rows(__nv_bfloat16* qkv, const __nv_bfloat16* __restrict__ q_weight,
                                                      const __nv_bfloat16* __restrict__ k_weight,
                                                      const int* __restrict__ positions,
                                                      const float* __restrict__ cos_sin,
                                                      typename KV::T* __restrict__ k_cache,
                                                      typename KV::T* __restrict__ v_cache,
                                                      const int* __restrict__ slot_mapping, int num_tokens,
                                                      int num_q_heads, int num_kv_heads, int max_pos, float eps,
                                                      KV kv = KV(), int gate_heads = 0) {
    constexpr int LPR = D / 16;    // lanes per row
    constexpr int RPW = 32 / LPR;  // rows a warp holds at a time
    const int lane = threadIdx.x & 31, t = lane % LPR, grp = lane / LPR;
    const int all_heads = num_q_heads + 2 * num_kv_heads;
    const int qk_heads = num_q_heads + num_kv_heads;
    const long long rows = (long long)num_tokens * all_heads;
    const long long warp_first = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * STEPS * RPW;
    if (warp_first >= rows) return;  // warp-uniform
    NormWeights w;
    if constexpr (NORM) load_norm_weights<D>(w, q_weight, k_weight, t);
    xserv::pdl_wait();  // qkv, positions and slot_mapping come from earlier kernels
    xserv::pdl_launch_dependents();  // the attention kernel may start its prologue (it waits for this grid)
    uint4 raw_lo[STEPS], raw_hi[STEPS];
    int head[STEPS], pos[STEPS], slot[STEPS];
    long long at[STEPS];  // the row's first element in qkv (ROT < D: past the gate heads of earlier tokens)
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const long long row = warp_first + k * RPW + grp;
        raw_lo[k] = raw_hi[k] = make_uint4(0u, 0u, 0u, 0u);
        head[k] = -1;  // no row
        pos[k] = 0;
        slot[k] = -1;
        at[k] = 0;
        if (row < rows) {
            const long long token = row / all_heads;
            head[k] = (int)(row - token * all_heads);
            at[k] = ROT < D ? (token * (all_heads + gate_heads) + head[k]) * D : row * D;
            raw_lo[k] = *reinterpret_cast<const uint4*>(qkv + at[k] + 8 * t);
            raw_hi[k] = *reinterpret_cast<const uint4*>(qkv + at[k] + D / 2 + 8 * t);
            if (head[k] < qk_heads) pos[k] = positions[token];
            if (head[k] >= num_q_heads) slot[k] = slot_mapping[token];
        }
    }
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const long long row = warp_first + k * RPW + grp;
        const bool is_q = head[k] < num_q_heads, is_qk = head[k] >= 0 && head[k] < qk_heads;
        float lo[8], hi[8];
        xserv::bf16x8_to_float(raw_lo[k], lo);
        xserv::bf16x8_to_float(raw_hi[k], hi);
        // every lane takes part in the norm's shuffles; v rows and missing rows discard the result
        if constexpr (NORM) row_rmsnorm16<D>(lo, hi, is_q, w, eps);
        if constexpr (ROT < D) {  // every lane takes part in the pair exchange (a shuffle); v rows discard it
            float cv[8], sv[8];
            const bool in_range = load_cos_sin_partial<D, ROT>(cos_sin, pos[k], max_pos, t, cv, sv);
            rope_partial<D, ROT>(lo, hi, in_range, t, cv, sv);
        }
        if (is_qk) {
            if constexpr (ROT == D) {
                float cv[8], sv[8];
                rope_apply(lo, hi, load_cos_sin<D>(cos_sin, pos[k], max_pos, t, cv, sv), cv, sv);
            }
            const uint4 out_lo = float8_to_bf16_bits(lo), out_hi = float8_to_bf16_bits(hi);
            const long long base = ROT < D ? at[k] : row * D;
            *reinterpret_cast<uint4*>(qkv + base + 8 * t) = out_lo;
            *reinterpret_cast<uint4*>(qkv + base + D / 2 + 8 * t) = out_hi;
            if (slot[k] >= 0) {
                typename KV::T* dst = k_cache + ((long long)slot[k] * num_kv_heads + (head[k] - num_q_heads)) * D;
                kv.template store_k<D>(dst, t, out_lo, out_hi, head[k] - num_q_heads);
            }
        } else if (head[k] >= qk_heads && slot[k] >= 0) {
            typename KV::T* dst = v_cache + ((long long)slot[k] * num_kv_heads + (head[k] - qk_heads)) * D;
            kv.template store_v<D>(dst, t, raw_lo[k], raw_hi[k], head[k] - qk_heads);
        }
    }
}

}  // namespace

// qkv: [num_tokens, num_q_heads + 2 * num_kv_heads, D] bf16, 16-byte aligned, q and k heads rewritten in place;
// q_weight, k_weight: [D] bf16 (qk_norm_rope_write_kv only); positions: [num_tokens] int32; cos_sin: [max_pos, D]
// fp32, 16-byte aligned; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, D] bf16, 16-byte aligned;
// slot_mapping: [num_tokens] int32 (slot < 0: the token's K/V are not written).
// _s{STEPS}: STEPS groups of 32 / (D / 16) rows per warp; grid = ceil(rows / (STEPS * 32 / (D / 16) * blockDim.x / 32))
// for rows = num_tokens * (num_q_heads + 2 * num_kv_heads).
#define XSERV_QK_NORM_ROPE_WRITE_KV(D, STEPS)                                                                        \
    extern "C" __global__ void qk_norm_rope_write_kv_d##D##_s##STEPS(                                               \
        __nv_bfloat16* qkv, const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight, const int* positions,      \
        const float* cos_sin, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int* slot_mapping,               \
        int num_tokens, int num_q_heads, int num_kv_heads, int max_pos, float eps) {                                 \
        qk_rope_write_kv_rows<D, true, STEPS>(qkv, q_weight, k_weight, positions, cos_sin, k_cache, v_cache,         \
                                              slot_mapping, num_tokens, num_q_heads, num_kv_heads, max_pos, eps);    \
    }
// Same without the head norms (Llama): qk_rope then the KV-cache write.
#define XSERV_QK_ROPE_WRITE_KV(D, STEPS)                                                                             \
    extern "C" __global__ void qk_rope_write_kv_d##D##_s##STEPS(                                                    \
        __nv_bfloat16* qkv, const int* positions, const float* cos_sin, __nv_bfloat16* k_cache,                      \
        __nv_bfloat16* v_cache, const int* slot_mapping, int num_tokens, int num_q_heads, int num_kv_heads,          \
        int max_pos) {                                                                                               \
        qk_rope_write_kv_rows<D, false, STEPS>(qkv, nullptr, nullptr, positions, cos_sin, k_cache, v_cache,          \
                                               slot_mapping, num_tokens, num_q_heads, num_kv_heads, max_pos, 0.0f);  \
    }
// STEPS = 1 ships: on an H100 (graph replays) 1 x 16/8 heads 2.57 us, 64 x 32/8 2.86 us, 8192 x 32/8 89.8 us;
// STEPS = 2: 2.73, 3.38, 100.5 us; STEPS = 4: 3.75, 4.78, 90.8 us (docs/kernels/pointwise-and-norms.md).
XSERV_QK_NORM_ROPE_WRITE_KV(64, 1)
XSERV_QK_NORM_ROPE_WRITE_KV(128, 1)
XSERV_QK_ROPE_WRITE_KV(64, 1)
XSERV_QK_ROPE_WRITE_KV(128, 1)
#undef XSERV_QK_NORM_ROPE_WRITE_KV
#undef XSERV_QK_ROPE_WRITE_KV

// Qwen3.5's gated attention (head_dim 256, partial RoPE on the first ROT dims, the packed qkvg with gate_heads trailing
// gate heads per token, left untouched): qk_norm_rope_write_kv_d256_r64_s1, the arguments above then gate_heads;
// cos_sin: [max_pos, ROT] fp32 (ROT / 2 frequencies).
#define XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL(D, ROT, STEPS)                                                          \
    extern "C" __global__ void qk_norm_rope_write_kv_d##D##_r##ROT##_s##STEPS(                                     \
        __nv_bfloat16* qkv, const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight, const int* positions,      \
        const float* cos_sin, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int* slot_mapping,               \
        int num_tokens, int num_q_heads, int num_kv_heads, int max_pos, float eps, int gate_heads) {                 \
        qk_rope_write_kv_rows<D, true, STEPS, KvBf16, ROT>(qkv, q_weight, k_weight, positions, cos_sin, k_cache,     \
                                                           v_cache, slot_mapping, num_tokens, num_q_heads,           \
                                                           num_kv_heads, max_pos, eps, KvBf16(), gate_heads);        \
    }
XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL(256, 64, 1)
#undef XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL

// FP8 KV cache (docs/kernels/attention.md, "FP8 KV cache"): the same kernels writing an e4m3 cache (KvE4m3), one launch
// instead of qk_norm_rope + write_kv_fp8; k_cache, v_cache: [num_blocks * block_size, num_kv_heads, D] e4m3 codes,
// 8-byte aligned; k_scale, v_scale: [num_kv_heads] float32 (this layer's). Arguments otherwise as above.
#define XSERV_QK_NORM_ROPE_WRITE_KV_FP8(D, STEPS)                                                                    \
    extern "C" __global__ void qk_norm_rope_write_kv_fp8_d##D##_s##STEPS(                                           \
        __nv_bfloat16* qkv, const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight, const int* positions,      \
        const float* cos_sin, unsigned char* k_cache, unsigned char* v_cache, const int* slot_mapping,               \
        int num_tokens, int num_q_heads, int num_kv_heads, int max_pos, float eps, const float* k_scale,             \
        const float* v_scale) {                                                                                      \
        qk_rope_write_kv_rows<D, true, STEPS, KvE4m3>(qkv, q_weight, k_weight, positions, cos_sin, k_cache, v_cache, \
                                                      slot_mapping, num_tokens, num_q_heads, num_kv_heads, max_pos,  \
                                                      eps, KvE4m3{k_scale, v_scale});                       \
    }
#define XSERV_QK_ROPE_WRITE_KV_FP8(D, STEPS)                                                                         \
    extern "C" __global__ void qk_rope_write_kv_fp8_d##D##_s##STEPS(                                                \
        __nv_bfloat16* qkv, const int* positions, const float* cos_sin, unsigned char* k_cache,                      \
        unsigned char* v_cache, const int* slot_mapping, int num_tokens, int num_q_heads, int num_kv_heads,          \
        int max_pos, const float* k_scale, const float* v_scale) {                                                   \
        qk_rope_write_kv_rows<D, false, STEPS, KvE4m3>(qkv, nullptr, nullptr, positions, cos_sin, k_cache, v_cache,  \
                                                       slot_mapping, num_tokens, num_q_heads, num_kv_heads, max_pos, \
                                                       0.0f, KvE4m3{k_scale, v_scale});                      \
    }
XSERV_QK_NORM_ROPE_WRITE_KV_FP8(64, 1)
XSERV_QK_NORM_ROPE_WRITE_KV_FP8(128, 1)
XSERV_QK_ROPE_WRITE_KV_FP8(64, 1)
XSERV_QK_ROPE_WRITE_KV_FP8(128, 1)
#undef XSERV_QK_NORM_ROPE_WRITE_KV_FP8
#undef XSERV_QK_ROPE_WRITE_KV_FP8
// The gated-attention kernel above writing an e4m3 cache: the FP8 arguments (scales last) then gate_heads.
#define XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL_FP8(D, ROT, STEPS)                                                      \
    extern "C" __global__ void qk_norm_rope_write_kv_fp8_d##D##_r##ROT##_s##STEPS(                                 \
        __nv_bfloat16* qkv, const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight, const int* positions,      \
        const float* cos_sin, unsigned char* k_cache, unsigned char* v_cache, const int* slot_mapping,               \
        int num_tokens, int num_q_heads, int num_kv_heads, int max_pos, float eps, const float* k_scale,             \
        const float* v_scale, int gate_heads) {                                                                      \
        qk_rope_write_kv_rows<D, true, STEPS, KvE4m3, ROT>(qkv, q_weight, k_weight, positions, cos_sin, k_cache,     \
                                                           v_cache, slot_mapping, num_tokens, num_q_heads,           \
                                                           num_kv_heads, max_pos, eps, KvE4m3{k_scale, v_scale},     \
                                                           gate_heads);                                              \
    }
XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL_FP8(256, 64, 1)
#undef XSERV_QK_NORM_ROPE_WRITE_KV_PARTIAL_FP8
