// Embedding gather: out[t, :] = table[ids[t], :]. An id outside [0, vocab) writes a zero row (the engine validates
// ids before this point; the kernel never reads outside the table). bf16 rows copied bit-exactly.
// grid = num_tokens (one CTA per row), block = launcher's thread count.
// Token feedback (feed_index non-null): row t's id is feed_src[feed_index[t]] where feed_index[t] >= 0, else ids[t]:
// a decode step launched before the previous step's sampled tokens are back on the host takes them from the device
// here, in the step's first kernel (xserv/engine/model_runner.py).
// Programmatic dependent launch: the step's first projection may start (and load its weights) at once; the ids are
// read after pdl_wait (an earlier kernel or copy wrote them).
#include "common.cuh"

__device__ __forceinline__ int token_id(long long t, const int* ids, const int* feed_src, const int* feed_index) {
    xserv::pdl_launch_dependents();
    xserv::pdl_wait();
    if (feed_index != nullptr) {
        const int j = feed_index[t];
        if (j >= 0) return feed_src[j];
    }
    return ids[t];
}

// The table row of token id `id` (row 0 when the id is outside [0, vocab): the caller then writes zeros).
__device__ __forceinline__ const uint4* table_row(int id, const uint4* table, int vocab, int chunks, bool& valid) {
    valid = id >= 0 && id < vocab;
    return table + (long long)(valid ? id : 0) * chunks;
}

// ids: [num_tokens] int32; table: [vocab, hidden] as uint4 (8 bf16 each), chunks = hidden / 8;
// out: [num_tokens, hidden] as uint4. Needs hidden % 8 == 0 and 16-byte aligned table and out (launcher checks).
// feed_src, feed_index: the token feedback (above), or null.
extern "C" __global__ void embedding_bf16_vec(const int* __restrict__ ids, const uint4* __restrict__ table,
                                              uint4* __restrict__ out, int vocab, int chunks,
                                              const int* __restrict__ feed_src, const int* __restrict__ feed_index) {
    const long long t = blockIdx.x;
    bool valid;
    const uint4* src = table_row(token_id(t, ids, feed_src, feed_index), table, vocab, chunks, valid);
    uint4* dst = out + t * chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = valid ? src[c] : make_uint4(0u, 0u, 0u, 0u);
}

// As embedding_bf16_vec with a float32 out (exact: bf16 widens to fp32), the decoder's fp32 residual stream starting
// from the embeddings in one kernel. out: [num_tokens, hidden] fp32, 16-byte aligned.
extern "C" __global__ void embedding_bf16_to_f32_vec(const int* __restrict__ ids, const uint4* __restrict__ table,
                                                     float* __restrict__ out, int vocab, int chunks,
                                                     const int* __restrict__ feed_src,
                                                     const int* __restrict__ feed_index) {
    const long long t = blockIdx.x;
    bool valid;
    const uint4* src = table_row(token_id(t, ids, feed_src, feed_index), table, vocab, chunks, valid);
    float* dst = out + t * chunks * 8;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float v[8];
        xserv::load8(reinterpret_cast<const __nv_bfloat16*>(src + c), v);
        if (!valid)
            for (int j = 0; j < 8; ++j) v[j] = 0.f;
        xserv::store8(dst + c * 8, v);
    }
}

// ids: [num_tokens] int32; table: [vocab, hidden] bf16 bits; out: [num_tokens, hidden] bf16 bits. Any alignment.
extern "C" __global__ void embedding_bf16_scalar(const int* __restrict__ ids, const unsigned short* __restrict__ table,
                                                 unsigned short* __restrict__ out, int vocab, int hidden,
                                                 const int* __restrict__ feed_src, const int* __restrict__ feed_index) {
    const long long t = blockIdx.x;
    const int id = token_id(t, ids, feed_src, feed_index);
    const bool valid = id >= 0 && id < vocab;
    const unsigned short* src = table + (long long)(valid ? id : 0) * hidden;
    unsigned short* dst = out + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = valid ? src[i] : (unsigned short)0;
}
