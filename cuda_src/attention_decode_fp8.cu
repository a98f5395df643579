// Decode attention over an FP8 (e4m3) paged KV cache (xserv/ops/attention/decode.py on a float8_e4m3fn cache;
// docs/kernels/attention.md, "FP8 KV cache"): the bf16 cache's kernels with the body instantiated for KvChunksE4m3
// (attention_decode.cuh): each lane holds a chunk of 8 codes (8 bytes) of a key's K and V row, dequantized in
// registers; k_scale[kv_head] folded into the query (with softmax's scale * log2 e), v_scale[kv_head] applied to the
// accumulators once before the merge.
//   v4 (attention_decode_v4.cuh): attention_decode_fp8_v4_d{D}_g{G}_s2[_w8[_r{R}]][_lean], the plan and the grids of
//   the bf16 kernels (decode.py's plan_decode, the same shared memory), the ring's chunk slots 8 bytes (cp.async.ca),
//   twice the keys a stage where registers allow (KvChunksE4m3::kUnrollV4): the same ring bytes in flight. The fused
//   entry (positions given: attention_decode_rope) quantizes the new token's K/V with the quantizing writes'
//   conversion (kv_format.cuh) and writes the codes to the cache and its ring slot: one launch a layer.
//   v2 (attention_decode_v2.cuh): attention_decode_fp8_d{D}_g{G}, where the plan falls back to v2; split grids finish
//   with attention_decode_v2.cu's attention_decode_combine.
// Arguments: the bf16 kernels' (XSERV_DECODE_V4_ARGS / XSERV_DECODE_ARGS with e4m3 bytes for the caches), then k_scale,
// v_scale [num_kv_heads] float32.
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 kvfp8=1 (compiled per model shape, for an FP8 KV cache only)
#include "attention_decode.cuh"
#include "rope.cuh"

using namespace xserv;
using namespace xserv::decode;

#define XSERV_KV_FMT FP8
#include "attention_decode_v4.cuh"
#include "attention_decode_v2.cuh"
