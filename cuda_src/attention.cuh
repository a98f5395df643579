// Shared helpers for the attention kernel families (attention_prefill.cu, attention_decode.cu, kv_cache.cu):
// paged-KV addressing, and thin inline-PTX wrappers for the sm_80+ tensor-core path (cp.async, ldmatrix,
// mma.sync m16n8k16 bf16 -> fp32).
//
// Paged KV cache layout (one layer):
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] bf16
//   block_tables:     [num_seqs, max_blocks_per_seq] int32; token t of sequence s lives in block
//                     block_tables[s, t / block_size] at offset t % block_size. Entries past the sequence's
//                     length are never read.
#pragma once
#include "common.cuh"

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

// ---- shared-memory addresses ------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Traps unless the launch gave at least `end_bytes` of dynamic shared memory (counted from its start). The launchers'
// shared-memory sizes (xserv/ops/attention/) are host copies of each kernel's layout; one that fell out of step
// would otherwise let the kernel write past its allocation unseen. One special-register read per thread.
__device__ __forceinline__ void require_dynamic_smem(unsigned end_bytes) {
    unsigned size;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(size));
    if (size < end_bytes) __trap();
}

// ---- cp.async: 16 bytes global -> shared without passing through registers (sm_80+) ------------------------
// With `valid` false the source size is 0 and the 16 destination bytes are zero-filled: out-of-range rows become
// zeros, never whatever (possibly NaN) data lies at the address. .cg bypasses L1 (each byte is used once per CTA).
__device__ __forceinline__ void cp_async16(unsigned smem_addr, const void* gptr, bool valid) {
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gptr), "r"(src_size));
}
// Close the group of cp.async issued so far by this thread.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight (a __syncthreads after it makes
// every thread's copies visible to the whole CTA).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- ldmatrix: four 8x8 b16 matrices from shared memory into the mma fragment layout -----------------------
// Lanes 8i..8i+7 give the row addresses (16 bytes each) of matrix i; afterwards lane l holds, in r[i], the two
// elements (row l/4, cols 2*(l%4), +1) of matrix i. The .trans form delivers the transposed matrices.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

// ---- mma.sync m16n8k16: C[16x8] += A[16x16] * B[16x8], bf16 inputs, fp32 accumulators ----------------------
// Fragments (g = lane / 4, c = 2 * (lane % 4)):
//   A: a[0] = A[g][c..c+1], a[1] = A[g+8][c..c+1], a[2] = A[g][c+8..c+9], a[3] = A[g+8][c+8..c+9]
//   B: b0 = B[c..c+1][g], b1 = B[c+8..c+9][g]            (k pairs of one column n = g)
//   C: c[0..1] = C[g][c..c+1], c[2..3] = C[g+8][c..c+1]
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two bf16 (round to nearest even), the low half first.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// 16-byte chunk `chunk` of row `row` in a shared tile whose rows are `chunks_per_row` 16-byte chunks long,
// XOR-swizzled: the 8 rows that one ldmatrix phase reads at the same logical chunk land in 8 different
// 16-byte bank groups (row stride 128 or 256 bytes would otherwise put them all in the same banks).
__device__ __forceinline__ int swizzled_chunk(int row, int chunk) { return chunk ^ (row & 7); }

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
