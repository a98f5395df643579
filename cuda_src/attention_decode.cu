// Decode attention, the default kernel (v4): one query token per sequence over the paged KV cache (layout in
// attention.cuh), split-KV ("flash-decoding") with GQA grouping and the split combine folded in. Shared pieces and
// the arguments: attention_decode.cuh; the body (shared with the FP8 cache's attention_decode_fp8.cu) and the
// entries: attention_decode_v4.cuh; the fallback (v2): attention_decode_v2.cu.
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 (compiled per model shape: XSERV_PIECE in attention_decode.cuh)
#include "attention_decode.cuh"
#include "rope.cuh"

using namespace xserv;
using namespace xserv::decode;

#define XSERV_KV_FMT BF16
#include "attention_decode_v4.cuh"
