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

// The 4-warp v4 kernel with the scores and the values on tensor cores (decode_split_v4's MMA branch; decode.py's
// has_fp8_mma: every 4-warp launch it serves takes it): attention_decode_fp8_v4_d128_g{G}_s2_mma, head_dim 128 (one
// 16-key block a warp and stage: 8 keys a lane and stage at every group size, G <= 8). The CUDA-core loop read K/V
// at ~55% of copy bandwidth at large batches (docs/kernels/history/attention.md, "FP8 KV cache on tensor cores").
#define XSERV_V4_MMA_ENTRY(FMT, D, G) XSERV_V4_MMA_ENTRY_(FMT, D, G)
#define XSERV_V4_MMA_ENTRY_(FMT, D, G)                                                                           \
    extern "C" __global__ void __launch_bounds__(128, XSERV_V4_MINB(G))                                          \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s2_mma)(XSERV_V4_ENTRY_ARGS(FMT)) {                 \
        decode_split_v4<D, G, 2, kV4Warps, 1, false, KvChunksE4m3, true>(XSERV_DECODE_V4_PASS,                  \
                                                                        XSERV_KV_POLICY_##FMT);                 \
    }
#if XSERV_PIECE(128, 1)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 1)
#endif
#if XSERV_PIECE(128, 2)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 2)
#endif
#if XSERV_PIECE(128, 3)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 3)
#endif
#if XSERV_PIECE(128, 4)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 4)
#endif
#if XSERV_PIECE(128, 5)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 5)
#endif
#if XSERV_PIECE(128, 6)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 6)
#endif
#if XSERV_PIECE(128, 7)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 7)
#endif
#if XSERV_PIECE(128, 8)
XSERV_V4_MMA_ENTRY(XSERV_KV_FMT, 128, 8)
#endif
