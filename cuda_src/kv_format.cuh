// The FP8 KV cache's write-side conversion (docs/kernels/attention.md, "FP8 KV cache"), one chunk (8 elements of a
// head row) at a time:
//   quantize_bf16x8: a chunk of 8 bf16 values -> 8 e4m3 codes, value / scale (IEEE division), one rounding to e4m3
//     (e4m3.cuh: round to nearest even, saturating). The cache writes' conversion: write_kv_fp8 (kv_cache.cu), the
//     quantizing rope kernels (rope.cu, KvE4m3) and the fused FP8 decode entry (attention_decode_v4.cuh) give the
//     same bits because they all round here (write_kv_fp8 spells out the same three steps).
//   The decode kernels' read side of both formats: KvChunksBf16 / KvChunksE4m3 in attention_decode.cuh.
#pragma once
#include "common.cuh"
#include "e4m3.cuh"

namespace xserv {
namespace e4m3 {

__device__ __forceinline__ uint2 quantize_bf16x8(const uint4& bits, float scale) {
    float f[8];
    xserv::bf16x8_to_float(bits, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = __fdiv_rn(f[e], scale);
    return float8_to_e4m3x8(f);
}

}  // namespace e4m3
}  // namespace xserv
