// Thin inline-PTX wrappers for the sm_80+ tensor-core path, shared by the attention and moe families: cp.async
// (global -> shared without registers), ldmatrix, mma.sync m16n8k16 bf16 -> fp32, and the XOR swizzle of 128-byte
// shared rows. Everything here runs on every arch xserv supports (sm_80 and later).
#pragma once
#include "common.cuh"

namespace xserv {

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
// Two 8x8 matrices (lanes 0..15 give the row addresses; lanes 16..31's are ignored but must be valid addresses).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr));
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

// The same with f16 inputs (the FP8 KV cache's decode: e4m3 codes are exact in f16).
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two f16 (round to nearest even), the low half first.
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
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

// silu(g) = g / (1 + 2^(-g * log2 e)) with ex2.approx and an IEEE division, exactly as activation.ptx: the SwiGLU
// epilogues (gemv.cu, moe.cu) round as silu_and_mul does.
__device__ __forceinline__ float silu(float g) {
    float e;
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(-g * 1.4426950408889634f));
    return __fdiv_rn(g, 1.f + e);
}

}  // namespace xserv
