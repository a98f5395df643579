// Shared helpers for the attention kernel families (attention_prefill.cu, attention_decode.cu, kv_cache.cu):
// paged-KV addressing and softmax helpers; the tensor-core wrappers (cp.async, ldmatrix, mma.sync) are in mma.cuh.
//
// Paged KV cache layout (one layer):
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] bf16
//   block_tables:     [num_seqs, max_blocks_per_seq] int32; token t of sequence s lives in block
//                     block_tables[s, t / block_size] at offset t % block_size. Entries past the sequence's
//                     length are never read.
#pragma once
#include "mma.cuh"

namespace xserv {

// log2(e): softmax is computed as exp2(x * scale * log2(e) - m), the multiply folded into one constant.
constexpr float kLog2e = 1.4426950408889634f;

// -inf without <cmath> (NVRTC has no INFINITY macro).
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// Element offset of (token t, kv head h, dim 0) of a sequence whose block-table row is `table`.
// 64-bit: a large cache exceeds 2^31 elements.
__device__ __forceinline__ long long paged_row_offset(const int* __restrict__ table, int t, int block_size,
                                                      int num_kv_heads, int head_dim, int kv_head) {
    const int block = __ldg(table + t / block_size);
    const long long slot = (long long)block * block_size + (t % block_size);
    return (slot * num_kv_heads + kv_head) * head_dim;
}

// 2^x on the SFU (exp2(-inf) = 0; no denormal fix-up code).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---- prefill: the query tile of one CTA ------------------------------------------------------------------------
// Query rows [i0, i0 + BQ) of sequence s's chunk for head h, and the keys [0, kv_end) that some row of the tile
// sees (all kv_len without causal), in n_tiles tiles of BKV keys. Query i sits at position offset + i.
struct PrefillTile {
    int h, q_start, q_len, i0, kv_len, offset, kv_head, kv_end, n_tiles;
    const int* table;  // the sequence's block-table row
};

// Fills `t`; false when the tile starts past the sequence's chunk (the CTA has nothing to do).
__device__ __forceinline__ bool prefill_tile(PrefillTile& t, int h, int s, int i0, int bq, int bkv,
                                             const int* __restrict__ cu_seqlens_q, const int* __restrict__ kv_lens,
                                             const int* __restrict__ block_tables, int max_blocks_per_seq,
                                             int num_q_heads, int num_kv_heads, int causal) {
    t.h = h;
    t.q_start = cu_seqlens_q[s];
    t.q_len = cu_seqlens_q[s + 1] - t.q_start;
    t.i0 = i0;
    if (i0 >= t.q_len) return false;
    t.kv_len = kv_lens[s];
    t.offset = t.kv_len - t.q_len;
    t.kv_head = h / (num_q_heads / num_kv_heads);
    t.table = block_tables + (long long)s * max_blocks_per_seq;
    t.kv_end = causal ? min(t.kv_len, t.offset + min(i0 + bq, t.q_len)) : t.kv_len;
    t.n_tiles = (t.kv_end + bkv - 1) / bkv;
    return true;
}

// cp.async of the tile's query rows [row_begin, row_end) (rows past the chunk zero-filled), spread over the
// `threads` threads numbered from `thread`; dst(row, chunk) is the shared address of 16-byte chunk `chunk` of a row.
template <int D, class Dst>
__device__ __forceinline__ void load_q_rows(const __nv_bfloat16* __restrict__ q, long long q_row_stride,
                                            const PrefillTile& t, int row_begin, int row_end, int thread, int threads,
                                            Dst dst) {
    constexpr int CH = D / 8;
    for (int c = row_begin * CH + thread; c < row_end * CH; c += threads) {
        const int row = c / CH, ch = c % CH;
        const bool valid = t.i0 + row < t.q_len;
        const __nv_bfloat16* src =
            valid ? q + (long long)(t.q_start + t.i0 + row) * q_row_stride + (long long)t.h * D + ch * 8 : q;
        cp_async16(dst(row, ch), src, valid);
    }
}

}  // namespace xserv

// Arguments shared by every prefill kernel (attention_prefill.cu, attention_prefill_sm90.cu); meanings at the top
// of attention_prefill.cu.
#define XSERV_PREFILL_ARGS                                                                                        \
    const __nv_bfloat16 *__restrict__ q, long long q_row_stride, const __nv_bfloat16 *__restrict__ k_cache,      \
        const __nv_bfloat16 *__restrict__ v_cache, const int *__restrict__ cu_seqlens_q,                         \
        const int *__restrict__ kv_lens, const int *__restrict__ block_tables, int max_blocks_per_seq,           \
        int block_size, int num_q_heads, int num_kv_heads, float scale_log2, __nv_bfloat16 *__restrict__ out,     \
        int causal
// The arguments of prefill_tile that come straight from XSERV_PREFILL_ARGS.
#define XSERV_PREFILL_TABLES \
    cu_seqlens_q, kv_lens, block_tables, max_blocks_per_seq, num_q_heads, num_kv_heads, causal
#define XSERV_PREFILL_PASS                                                                                        \
    q, q_row_stride, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, max_blocks_per_seq, block_size,       \
        num_q_heads, num_kv_heads, scale_log2, out, causal
