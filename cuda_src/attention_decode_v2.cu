// Decode attention v2: the fallback of v4 (attention_decode.cu) where a split's pages would overflow v4's shared page
// table (a block size below 8 with a very long context). The body and the entries: attention_decode_v2.cuh (shared
// with the FP8 cache's attention_decode_fp8.cu); here the bf16 cache's, and the split combine of both formats.
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 (compiled per model shape: XSERV_PIECE in attention_decode.cuh)
#include "attention_decode.cuh"

using namespace xserv;
using namespace xserv::decode;

#define XSERV_KV_FMT BF16
#include "attention_decode_v2.cuh"


// The split combine of both formats' v2 grids (combine_partials, attention_decode.cuh); grid (Hq, num_seqs), block D.
extern "C" __global__ void attention_decode_combine(const float* __restrict__ part_o,
                                                    const float* __restrict__ part_lse,
                                                    const int* __restrict__ kv_lens, int chunk_len, int num_splits,
                                                    int head_dim, __nv_bfloat16* __restrict__ out) {
    combine_partials(part_o, part_lse, kv_lens, chunk_len, num_splits, head_dim, out);
}
