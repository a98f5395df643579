// Writing new tokens' K and V into the paged KV cache (see attention.cuh for the layout).
#include "attention.cuh"
#include "e4m3.cuh"

// The chunk thread i of a KV write moves: token t, chunk `within` of its row (h * (head_dim / 8) + chunk), and the
// element offsets of that chunk in the source and in the cache. False past the last token or for a padding token
// (slot < 0).
struct KvWriteChunk {
    int t, within;
    long long src, dst;
};

__device__ __forceinline__ bool locate_kv_write_chunk(long long src_row_stride, const int* __restrict__ slot_mapping,
                                                      int num_tokens, int num_kv_heads, int head_dim,
                                                      KvWriteChunk& c) {
    const int chunks_per_token = num_kv_heads * (head_dim / 8);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_tokens * chunks_per_token) return false;
    c.t = (int)(i / chunks_per_token);
    c.within = (int)(i % chunks_per_token);
    const int slot = slot_mapping[c.t];
    if (slot < 0) return false;
    c.src = c.t * src_row_stride + (long long)c.within * 8;
    c.dst = (long long)slot * num_kv_heads * head_dim + (long long)c.within * 8;
    return true;
}

// k_cache[slot, h, :] = k[t, h, :], v_cache[slot, h, :] = v[t, h, :] for slot = slot_mapping[t] >= 0
// (slot = block * block_size + offset; a negative slot marks a padding token and is skipped).
// One thread moves one 16-byte chunk (8 bf16) of K and the same chunk of V.
// k, v:      token t's head h starts at (k|v) + t * src_row_stride + h * head_dim (the packed qkv tensor passes
//            pointers to its first K / V head and its full row stride; separate [T, Hkv, D] tensors pass Hkv*D)
// k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim]
// slot_mapping: [num_tokens] int32
// Assumes head_dim % 8 == 0 and 16-byte aligned rows (checked by the launcher).
extern "C" __global__ void write_kv_bf16(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                         long long src_row_stride, __nv_bfloat16* __restrict__ k_cache,
                                         __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ slot_mapping,
                                         int num_tokens, int num_kv_heads, int head_dim) {
    KvWriteChunk c;
    if (!locate_kv_write_chunk(src_row_stride, slot_mapping, num_tokens, num_kv_heads, head_dim, c)) return;
    *reinterpret_cast<uint4*>(k_cache + c.dst) = *reinterpret_cast<const uint4*>(k + c.src);
    *reinterpret_cast<uint4*>(v_cache + c.dst) = *reinterpret_cast<const uint4*>(v + c.src);
}

// ---- FP8 KV cache (EngineConfig.kv_cache_dtype = "fp8_e4m3"; docs/kernels/attention.md, "FP8 KV cache") ----------
// Cache: [num_blocks * block_size, num_kv_heads, head_dim] e4m3 codes (1 byte), one float32 scale per kv head and
// per K / V of the layer: value = float(code) * scale.

// k_cache[slot, h, :] = e4m3(k[t, h, :] / k_scale[h]), v likewise (round to nearest even, saturating at +-448:
// e4m3.cuh), for slot = slot_mapping[t] >= 0. One thread converts one 8-element chunk of K and the same of V: a
// 16-byte bf16 load, an 8-byte store. x / scale is an IEEE division (__fdiv_rn), then one rounding to e4m3: the
// NumPy reference (xserv/ops/attention/fp8_kv.py, quantize_kv_reference) rounds the same two times.
// k, v: as write_kv_bf16 (pointers to head 0 of token 0, src_row_stride elements between tokens)
// k_scale, v_scale: [num_kv_heads] float32 (this layer's)
// Assumes head_dim % 8 == 0, 16-byte aligned source rows, 8-byte aligned cache (checked by the launcher).
extern "C" __global__ void write_kv_fp8(const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                                        long long src_row_stride, unsigned char* __restrict__ k_cache,
                                        unsigned char* __restrict__ v_cache, const int* __restrict__ slot_mapping,
                                        const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                        int num_tokens, int num_kv_heads, int head_dim) {
    KvWriteChunk c;
    if (!locate_kv_write_chunk(src_row_stride, slot_mapping, num_tokens, num_kv_heads, head_dim, c)) return;
    const long long src = c.src, dst = c.dst;
    const int h = c.within / (head_dim / 8);
    const float ks = k_scale[h], vs = v_scale[h];
    float kf[8], vf[8];
    xserv::bf16x8_to_float(*reinterpret_cast<const uint4*>(k + src), kf);
    xserv::bf16x8_to_float(*reinterpret_cast<const uint4*>(v + src), vf);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        kf[e] = __fdiv_rn(kf[e], ks);
        vf[e] = __fdiv_rn(vf[e], vs);
    }
    *reinterpret_cast<uint2*>(k_cache + dst) = xserv::e4m3::float8_to_e4m3x8(kf);
    *reinterpret_cast<uint2*>(v_cache + dst) = xserv::e4m3::float8_to_e4m3x8(vf);
}

// Prefill over an FP8 cache: the bf16 prefill kernels read a bf16 copy of the blocks the batch attends to.
// k_out/v_out[b] = bf16(float(k_cache/v_cache[b]) * scale[h]) for every block b = block_tables[s, j] with
// j * block_size < kv_lens[s]; the copy has the cache's shape and block indices, so the prefill kernels take the
// batch's own block tables. A block shared by two sequences (prefix caching) is written twice with the same bits.
// grid (max_blocks_per_seq, num_seqs), any block size of threads; a CTA converts one cache block, 8 elements a
// thread step (an 8-byte load, a 16-byte store).
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] e4m3; k_out, v_out: the same shape, bf16
// k_scale, v_scale: [num_kv_heads] float32; kv_lens: [num_seqs]; block_tables: [num_seqs, max_blocks_per_seq]
extern "C" __global__ void dequantize_kv_blocks_fp8(const unsigned char* __restrict__ k_cache,
                                                    const unsigned char* __restrict__ v_cache,
                                                    const float* __restrict__ k_scale,
                                                    const float* __restrict__ v_scale, const int* __restrict__ kv_lens,
                                                    const int* __restrict__ block_tables, int max_blocks_per_seq,
                                                    int block_size, int num_kv_heads, int head_dim,
                                                    __nv_bfloat16* __restrict__ k_out,
                                                    __nv_bfloat16* __restrict__ v_out) {
    const int j = blockIdx.x, s = blockIdx.y;
    if ((long long)j * block_size >= kv_lens[s]) return;  // past the sequence: the table entry is not read
    const long long block = block_tables[(long long)s * max_blocks_per_seq + j];
    const int row = num_kv_heads * head_dim;
    const long long base = block * block_size * row;
    const int chunks = block_size * row / 8;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int h = (c * 8 % row) / head_dim;
        const long long off = base + (long long)c * 8;
        float kf[8], vf[8];
        xserv::e4m3::e4m3x8_to_float(*reinterpret_cast<const uint2*>(k_cache + off), kf);
        xserv::e4m3::e4m3x8_to_float(*reinterpret_cast<const uint2*>(v_cache + off), vf);
        const float ks = k_scale[h], vs = v_scale[h];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            kf[e] *= ks;
            vf[e] *= vs;
        }
        xserv::store8(k_out + off, kf);
        xserv::store8(v_out + off, vf);
    }
}
