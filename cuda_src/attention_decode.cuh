// Decode attention: what the split kernels share (attention_decode.cu = v4, the default; attention_decode_v2.cu =
// v2, its fallback; cuda_src/dev/attention_decode_dev.cu): the kernel arguments, bf16 unpacking, the merge of
// online-softmax states, the write of a split's result and the split combine folded into the split kernel.
//
// Arguments of every split kernel (XSERV_DECODE_ARGS):
//
//   q:            sequence s's head h at q + s * q_row_stride + h * D   (q or the packed qkv tensor)
//   k_cache/v_cache: [num_blocks, block_size, num_kv_heads, D] bf16
//   kv_lens:      [num_seqs] int32 (0 gives a zero output row)
//   block_tables: [num_seqs, max_blocks_per_seq] int32
//   out:          [num_seqs, num_q_heads, D] bf16
//   part_o:       [num_seqs, num_q_heads, num_splits, D] fp32    (unused when num_splits == 1)
//   part_lse:     [num_seqs, num_q_heads, num_splits] fp32, log2 domain (scores already scaled by scale*log2 e)
// Splits that start at or past kv_len write nothing; the combine kernel reads only the ceil(kv_len / chunk_len)
// splits that hold keys.
#pragma once

#include "attention.cuh"
#include "kv_format.cuh"

// Shape pieces. attention_decode.cu and attention_decode_v2.cu declare `// xserv-shapes: head_dim=... group=...`:
// compiled as they are (the harness, CI) they instantiate every kernel; the runtime compiles them per model shape,
// with -DXSERV_HEAD_DIM=D -DXSERV_GROUP=Q (the piece "<family>:d<D>_g<Q>", xserv/runtime/compiler.py), and then
// instantiates only the kernels that a model with head dim D and Q query heads per kv head launches. Each
// instantiation stands under `#if XSERV_PIECE(D, Q)`; a kernel's code is the same in every piece that has it.
#if defined(XSERV_HEAD_DIM) != defined(XSERV_GROUP)
#error "a shape piece defines both XSERV_HEAD_DIM and XSERV_GROUP"
#endif
#if defined(XSERV_HEAD_DIM)
#define XSERV_PIECE(D, Q) ((D) == XSERV_HEAD_DIM && (Q) == XSERV_GROUP)
#else
#define XSERV_PIECE(D, Q) 1
#endif

namespace xserv {
namespace decode {

// G empty online-softmax states (m = -inf, l = 0, acc = 0), one per query head of the group.
template <int G>
__device__ __forceinline__ void empty_states(float (&m)[G], float (&l)[G], float (&acc)[G][8]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
}

// Merge online-softmax state (m, l, acc) with another (log2 domain); an empty state has m = -inf, l = 0.
__device__ __forceinline__ void merge_state(float& m, float& l, float (&acc)[8], float m_o, float l_o,
                                            const float (&acc_o)[8]) {
    const float m_new = fmaxf(m, m_o);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    const float a = exp2f(m - m_use), b = exp2f(m_o - m_use);
    l = l * a + l_o * b;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + acc_o[e] * b;
    m = m_new;
}

// The v2 split combine (attention_decode_combine in attention_decode_v2.cu and attention_decode_d256.cu):
// out[s, h, :] = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over the ceil(kv_len / chunk_len) splits holding
// keys (M = their max lse). grid (Hq, num_seqs), block D.
//   part_o: [num_seqs, Hq, num_splits, D] fp32, part_lse: [num_seqs, Hq, num_splits] fp32, out: [num_seqs, Hq, D]
__device__ __forceinline__ void combine_partials(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                                 const int* __restrict__ kv_lens, int chunk_len, int num_splits,
                                                 int head_dim, __nv_bfloat16* __restrict__ out) {
    const int h = blockIdx.x, s = blockIdx.y, d = threadIdx.x;
    const long long row = (long long)s * gridDim.x + h;
    const int n = min(num_splits, (kv_lens[s] + chunk_len - 1) / chunk_len);
    const float* lse = part_lse + row * num_splits;
    float mm = neg_inf();
    for (int i = 0; i < n; ++i) mm = fmaxf(mm, lse[i]);
    float den = 0.f, num = 0.f;
    for (int i = 0; i < n; ++i) {
        const float w = exp2f(lse[i] - mm);
        den += w;
        num += w * part_o[(row * num_splits + i) * head_dim + d];
    }
    out[row * head_dim + d] = __float2bfloat16(n > 0 ? num / den : 0.f);  // kv_len == 0: zeros
}

// The end of every split kernel: merge the WARPS per-warp online-softmax states of the CTA's G heads (shared
// memory, flat: m, l [WARPS][G], acc [WARPS][G][D]) and write the normalised bf16 output (num_splits == 1) or the
// fp32 partial and the log2-sum-exp2 of this split. row0 = s * num_q_heads + first head of the group.
template <int D, int G, int WARPS>
__device__ __forceinline__ void write_split_result(const float* sm_m, const float* sm_l, const float* sm_acc,
                                                   long long row0, int split, int num_splits,
                                                   __nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
                                                   float* __restrict__ part_lse) {
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D, d = idx % D;
        float mm = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w * G + g]);  // finite: warp 0 saw key `start`
        float ll = 0.f, aa = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float wgt = exp2f(sm_m[w * G + g] - mm);  // 0 for a warp that saw no key
            ll += sm_l[w * G + g] * wgt;
            aa += sm_acc[(w * G + g) * D + d] * wgt;
        }
        const long long row = row0 + g;
        if (num_splits == 1) {
            out[row * D + d] = __float2bfloat16(aa / ll);
        } else {
            part_o[(row * num_splits + split) * D + d] = aa / ll;
            if (d == 0) part_lse[row * num_splits + split] = mm + log2f(ll);
        }
    }
}

// Split-KV combine folded into the split kernel (threadfence-reduction pattern): after write_split_result, the last
// CTA of a (sequence, kv head) to finish merges the `active` splits' partials of its G heads into `out` and resets
// the counter (graph replays reuse it). sm_w: shared scratch of G * active floats; sm_last: a shared int.
template <int D, int G, int WARPS>
__device__ __forceinline__ void combine_splits_if_last(int* counter, int active, long long row0, int num_splits,
                                                       const float* __restrict__ part_o,
                                                       const float* __restrict__ part_lse,
                                                       __nv_bfloat16* __restrict__ out, float* sm_w, int& sm_last) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!last_to_arrive(counter, active, sm_last)) return;
    // split weights 2^(lse_i - M) / sum per head, one warp per head
    for (int g = warp; g < G; g += WARPS) {
        const float* lse = part_lse + (row0 + g) * num_splits;
        float mm = neg_inf();
        for (int i = lane; i < active; i += 32) mm = fmaxf(mm, __ldcg(lse + i));
        mm = warp_max(mm);  // finite: split 0 holds keys
        float den = 0.f;
        for (int i = lane; i < active; i += 32) {
            const float w = exp2f(__ldcg(lse + i) - mm);
            sm_w[g * active + i] = w;
            den += w;
        }
        den = warp_sum(den);
        __syncwarp();  // the lanes' weights are written before they are rescaled by other lanes
        for (int i = lane; i < active; i += 32) sm_w[g * active + i] /= den;
    }
    __syncthreads();  // all heads' weights are in shared memory
    for (int idx = threadIdx.x; idx < G * D / 4; idx += WARPS * 32) {
        const int g = idx / (D / 4), d4 = idx % (D / 4);
        const long long row = row0 + g;
        const float4* src = reinterpret_cast<const float4*>(part_o + row * num_splits * D) + d4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int i = 0; i < active; ++i) {
            const float w = sm_w[g * active + i];
            const float4 x = __ldcg(src + i * (D / 4));
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
        __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + row * D + 4 * d4);
        dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
        dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
    }
    if (threadIdx.x == 0) *counter = 0;
}


// cp.async with a "memory" clobber: the per-lane pipeline has no __syncthreads, so the compiler must not move a
// shared-memory read of a stage above the wait for it, nor a write into a stage above the reads of its last use.
// The K/V bytes are marked first in line for eviction from L2: a decode step reads each of them once, and at long
// contexts the stream (131 MB per layer for a 0.6B-shaped model at 32k) would otherwise push out of L2 what the
// next kernels need, their code among it (docs/kernels/gemv.md: 0.6B at 32k +2%). One createpolicy per copy site (17 in
// the v4 kernel's PTX; +0.4 KB of code).
__device__ __forceinline__ void cp_async16_m(unsigned smem_addr, const void* gptr, bool valid) {
    const int src_size = valid ? 16 : 0;
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr), "l"(gptr),
                 "r"(src_size), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit_m() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_m() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint4 lds128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

__device__ __forceinline__ void sts128(unsigned addr, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// cp.async of an 8-byte chunk (an e4m3 chunk: 8 codes), as cp_async16_m otherwise (.ca: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async8_m(unsigned smem_addr, const void* gptr, bool valid) {
    const int src_size = valid ? 8 : 0;
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2, %3;\n" ::"r"(smem_addr), "l"(gptr),
                 "r"(src_size), "l"(policy)
                 : "memory");
}

__device__ __forceinline__ uint2 lds64(unsigned addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void sts64(unsigned addr, const uint2& v) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

// bf16 -> fp32 is a shift or a mask (one instruction per value; the generic conversion takes 1.5).
__device__ __forceinline__ void bf16x8_to_float_fast(const uint4& v, float (&f)[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// ---- KV formats: the decode kernels' bodies (v4: attention_decode_v4.cuh, v2: attention_decode_v2.cuh) are
// templated on one of these read policies; a lane holds a chunk of 8 elements of a key's K (or V) row.
//   T, Chunk, kChunkBytes      the cache element; a chunk in registers (uint4 / uint2); its bytes
//   kUnrollV2<G>, kUnrollV4<G> keys per lane and step (v2: loads in flight; v4: ring slots per stage). An e4m3 chunk
//                              is half the bytes, so where registers allow it a lane takes twice the keys, keeping
//                              the bf16 kernels' bytes in flight (v2: 128 bytes a lane; v4: the same ring bytes).
//   load(kv_head)              reads the kv head's scales (v4: before pdl_wait; no kernel of a decode step writes them)
//   q_scale(scale_log2)        the query's multiplier: score = q . (code * k_scale) = (q * k_scale) . code, so the K
//                              scale is folded into the query once, with softmax's scale * log2 e
//   out_v(acc)                 an accumulator as the cross-warp merge takes it: sum p (code * v_scale) = v_scale *
//                              sum p code, so the V scale is applied once (the merge and the combine are linear)
//   encode_k(bits), encode_v   the new token's chunk (bf16 bits) as the cache stores it (the fused entry):
//                              e4m3::quantize_bf16x8 (kv_format.cuh), the quantizing writes' bits
//   to_float / to_float_fast   a chunk -> 8 exact floats (v2 / v4; bf16: the generic widening / shifts and masks)
//   copy(smem, g, valid)       cp.async of one chunk, evict-first in L2, zero-filled where !valid
//   lds(addr), sts(addr, c)    a chunk from / to shared memory
// KvChunksBf16's members are the bf16 kernels' own expressions (identities where bf16 has no scale), so their
// machine code is what it was before the formats were split out (every .text section compared, sm_80 and sm_90a).
struct KvChunksBf16 {
    using T = __nv_bfloat16;
    using Chunk = uint4;
    static constexpr unsigned kChunkBytes = 16;
    template <int G>
    static constexpr int kUnrollV2 = 4;
    template <int G>
    static constexpr int kUnrollV4 = 4;
    __device__ __forceinline__ void load(int) {}
    __device__ __forceinline__ float q_scale(float scale_log2) const { return scale_log2; }
    __device__ __forceinline__ float out_v(float acc) const { return acc; }
    __device__ __forceinline__ Chunk encode_k(const uint4& bits) const { return bits; }
    __device__ __forceinline__ Chunk encode_v(const uint4& bits) const { return bits; }
    static __device__ __forceinline__ void to_float(const Chunk& v, float (&f)[8]) { bf16x8_to_float(v, f); }
    static __device__ __forceinline__ void to_float_fast(const Chunk& v, float (&f)[8]) { bf16x8_to_float_fast(v, f); }
    static __device__ __forceinline__ void copy(unsigned smem, const void* g, bool valid) { cp_async16_m(smem, g, valid); }
    static __device__ __forceinline__ Chunk lds(unsigned addr) { return lds128(addr); }
    static __device__ __forceinline__ void sts(unsigned addr, const Chunk& v) { sts128(addr, v); }
};

struct KvChunksE4m3 {
    using T = unsigned char;
    using Chunk = uint2;
    static constexpr unsigned kChunkBytes = 8;
    template <int G>
    static constexpr int kUnrollV2 = G <= 4 ? 8 : 4;  // above 4, registers: q and acc alone are 16 G
    template <int G>
    static constexpr int kUnrollV4 = G <= 4 ? 8 : 4;  // ptxas: <= 128 registers, no spills (attention.md)
    const float* __restrict__ k_scale;  // [num_kv_heads] float32, this layer's
    const float* __restrict__ v_scale;
    float ks = 1.f, vs = 1.f;
    __device__ __forceinline__ void load(int kv_head) {
        ks = k_scale[kv_head];
        vs = v_scale[kv_head];
    }
    __device__ __forceinline__ float q_scale(float scale_log2) const { return scale_log2 * ks; }
    __device__ __forceinline__ float out_v(float acc) const { return acc * vs; }
    __device__ __forceinline__ Chunk encode_k(const uint4& bits) const { return e4m3::quantize_bf16x8(bits, ks); }
    __device__ __forceinline__ Chunk encode_v(const uint4& bits) const { return e4m3::quantize_bf16x8(bits, vs); }
    static __device__ __forceinline__ void to_float(const Chunk& v, float (&f)[8]) { e4m3::e4m3x8_to_float(v, f); }
    static __device__ __forceinline__ void to_float_fast(const Chunk& v, float (&f)[8]) { e4m3::e4m3x8_to_float(v, f); }
    static __device__ __forceinline__ void copy(unsigned smem, const void* g, bool valid) { cp_async8_m(smem, g, valid); }
    static __device__ __forceinline__ Chunk lds(unsigned addr) { return lds64(addr); }
    static __device__ __forceinline__ void sts(unsigned addr, const Chunk& v) { sts64(addr, v); }
};

}  // namespace decode
}  // namespace xserv

// T: the cache element (__nv_bfloat16; unsigned char for e4m3 codes, whose kernels take k_scale, v_scale after these).
#define XSERV_DECODE_ARGS_OF(T)                                                                                  \
    const __nv_bfloat16 *__restrict__ q, long long q_row_stride, const T *__restrict__ k_cache,                  \
        const T *__restrict__ v_cache, const int *__restrict__ kv_lens, const int *__restrict__ block_tables,   \
        int max_blocks_per_seq, int block_size, int num_q_heads, int num_kv_heads, float scale_log2,            \
        int chunk_len, int num_splits, __nv_bfloat16 *__restrict__ out, float *__restrict__ part_o,             \
        float *__restrict__ part_lse
#define XSERV_DECODE_ARGS XSERV_DECODE_ARGS_OF(__nv_bfloat16)
#define XSERV_DECODE_PASS                                                                                        \
    q, q_row_stride, k_cache, v_cache, kv_lens, block_tables, max_blocks_per_seq, block_size, num_q_heads,       \
        num_kv_heads, scale_log2, chunk_len, num_splits, out, part_o, part_lse
// The KV formats' entry macros (the FMT argument of the v2 / v4 entry macros: BF16 or FP8): the cache element, the
// entry names' prefix, the arguments after XSERV_DECODE_ARGS_OF / XSERV_DECODE_V4_ARGS_OF, the policy object.
#define XSERV_PASTE_(a, b) a##b
#define XSERV_PASTE(a, b) XSERV_PASTE_(a, b)
#define XSERV_KV_T_BF16 __nv_bfloat16
#define XSERV_KV_T_FP8 unsigned char
#define XSERV_KV_PREFIX_BF16 attention_decode_
#define XSERV_KV_PREFIX_FP8 attention_decode_fp8_
#define XSERV_KV_SCALE_ARGS_BF16
#define XSERV_KV_SCALE_ARGS_FP8 , const float *__restrict__ k_scale, const float *__restrict__ v_scale
#define XSERV_KV_POLICY_BF16 xserv::decode::KvChunksBf16()
#define XSERV_KV_POLICY_FP8 xserv::decode::KvChunksE4m3{k_scale, v_scale}
