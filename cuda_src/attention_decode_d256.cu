// Decode attention for head_dim 256 (Qwen3.5's gated full-attention layers: 8:2, 16:4, 24:4, 16:2, 32:2 heads): the
// v2 split kernel (attention_decode_v2.cuh; the v4 ring and the wgmma prefill are sized for head dims up to 128) on
// the bf16 and the e4m3 cache, and the split combine its grids finish with. A CTA runs at most 8 query heads: above
// that the query and accumulator registers (16 per head a lane) spill, so a group of 16 runs as 2 subgroups of 8
// (XSERV_V2_SUBGROUPS_ENTRY: R CTAs per kv head and split, the second reading K/V from L2). Its own family, so that a
// model of head dim 64 or 128 never compiles these (nor CI's per-shape pieces of attention_decode_v2 more shapes).
//   attention_decode_d256_g{G}, attention_decode_fp8_d256_g{G}: XSERV_DECODE_ARGS_OF(the cache element) (FP8: then
//   k_scale, v_scale); grid (num_splits, Hkv * R, num_seqs), block 128; decode.py's plan_decode (V2_SUBGROUPS).
// xserv-shapes: head_dim=256 group=4,6,8,16 kvfp8=0,1 (a piece per model shape; kvfp8=1: an FP8 KV cache's kernels)
#include "attention_decode.cuh"

using namespace xserv;
using namespace xserv::decode;

#define XSERV_KV_FMT BF16
#define XSERV_V2_BODY_ONLY
#include "attention_decode_v2.cuh"

// A piece holds one format's kernels (XSERV_KV_FP8 0: bf16 cache, 1: e4m3); the family compiled whole holds both.
#if defined(XSERV_KV_FP8)
#define XSERV_D256_FMT(F) ((F) == XSERV_KV_FP8)
#else
#define XSERV_D256_FMT(F) 1
#endif

#if XSERV_PIECE(256, 4) && XSERV_D256_FMT(0)
XSERV_V2_SUBGROUPS_ENTRY(BF16, 256, 4, 1)
#endif
#if XSERV_PIECE(256, 6) && XSERV_D256_FMT(0)
XSERV_V2_SUBGROUPS_ENTRY(BF16, 256, 6, 1)
#endif
#if XSERV_PIECE(256, 8) && XSERV_D256_FMT(0)
XSERV_V2_SUBGROUPS_ENTRY(BF16, 256, 8, 1)
#endif
#if XSERV_PIECE(256, 16) && XSERV_D256_FMT(0)
XSERV_V2_SUBGROUPS_ENTRY(BF16, 256, 16, 2)
#endif
#if XSERV_PIECE(256, 4) && XSERV_D256_FMT(1)
XSERV_V2_SUBGROUPS_ENTRY(FP8, 256, 4, 1)
#endif
#if XSERV_PIECE(256, 6) && XSERV_D256_FMT(1)
XSERV_V2_SUBGROUPS_ENTRY(FP8, 256, 6, 1)
#endif
#if XSERV_PIECE(256, 8) && XSERV_D256_FMT(1)
XSERV_V2_SUBGROUPS_ENTRY(FP8, 256, 8, 1)
#endif
#if XSERV_PIECE(256, 16) && XSERV_D256_FMT(1)
XSERV_V2_SUBGROUPS_ENTRY(FP8, 256, 16, 2)
#endif

// The v2 split combine (combine_partials, attention_decode.cuh) of both formats; grid (Hq, num_seqs), block 256.
extern "C" __global__ void attention_decode_combine(const float* __restrict__ part_o,
                                                    const float* __restrict__ part_lse,
                                                    const int* __restrict__ kv_lens, int chunk_len, int num_splits,
                                                    int head_dim, __nv_bfloat16* __restrict__ out) {
    combine_partials(part_o, part_lse, kv_lens, chunk_len, num_splits, head_dim, out);
}
