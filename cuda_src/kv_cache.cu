// Writing new tokens' K and V into the paged KV cache (see attention.cuh for the layout).
#include "attention.cuh"

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
    const int chunks_per_token = num_kv_heads * (head_dim / 8);
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_tokens * chunks_per_token) return;
    const int t = (int)(i / chunks_per_token);
    const int within = (int)(i % chunks_per_token);  // = h * (head_dim / 8) + chunk
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const long long src = t * src_row_stride + (long long)within * 8;
    const long long dst = (long long)slot * num_kv_heads * head_dim + (long long)within * 8;
    *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + src);
    *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + src);
}
