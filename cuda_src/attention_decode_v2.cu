// Decode attention v2: the fallback of v4 (attention_decode.cu) where a split's pages would overflow v4's shared page
// table (a block size below 8 with a very long context). The body and the entries: attention_decode_v2.cuh (shared
// with the FP8 cache's attention_decode_fp8.cu); here the bf16 cache's, and the split combine of both formats.
// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8 (compiled per model shape: XSERV_PIECE in attention_decode.cuh)
#include "attention_decode.cuh"

using namespace xserv;
using namespace xserv::decode;

#define XSERV_KV_FMT BF16
#include "attention_decode_v2.cuh"


// out[s, h, :] = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M) over the ceil(kv_len / chunk_len) splits holding
// keys (M = their max lse). grid (Hq, num_seqs), block D.
//   part_o: [num_seqs, Hq, num_splits, D] fp32, part_lse: [num_seqs, Hq, num_splits] fp32, out: [num_seqs, Hq, D]
extern "C" __global__ void attention_decode_combine(const float* __restrict__ part_o,
                                                    const float* __restrict__ part_lse,
                                                    const int* __restrict__ kv_lens, int chunk_len, int num_splits,
                                                    int head_dim, __nv_bfloat16* __restrict__ out) {
    const int h = blockIdx.x, s = blockIdx.y, d = threadIdx.x;
    const long long row = (long long)s * gridDim.x + h;
    const int n = min(num_splits, (kv_lens[s] + chunk_len - 1) / chunk_len);
    const float* lse = part_lse + row * num_splits;
    float mm = neg_inf();
    for (int i = 0; i < n; ++i) mm = fmaxf(mm, lse[i]);
    float den = 0.f, num = 0.f;
    for (int i = 0; i < n; ++i) {
        const float w = exp2f(lse[i] - mm);
        den += w;
        num += w * part_o[(row * num_splits + i) * head_dim + d];
    }
    out[row * head_dim + d] = __float2bfloat16(n > 0 ? num / den : 0.f);  // kv_len == 0: zeros
}
