// Decode attention v4, the default kernel: the body, templated on the cache's KV format (KvChunksBf16 / KvChunksE4m3 in
// attention_decode.cuh), its entry macros and the entries of each shape piece, for the format XSERV_KV_FMT (BF16 or
// FP8) that the including file defines: attention_decode.cu (bf16 cache), attention_decode_fp8.cu (e4m3 cache). The
// including file has included attention_decode.cuh and rope.cuh and said `using namespace xserv; using namespace
// xserv::decode;` first.
#pragma once
#ifndef XSERV_KV_FMT
#error "define XSERV_KV_FMT (BF16 or FP8) before including attention_decode_v4.cuh"
#endif

// =================================================================================================================
// v4: v2's CUDA-core math, fed by a per-lane cp.async ring and a per-CTA page table in shared memory, with the
// split combine folded into the kernel.
//
// attention_decode_v4_d{D}_g{G}_s{STAGES}[_w8[_r{R}]] (e4m3 cache: attention_decode_fp8_v4_..., with k_scale, v_scale
// after the arguments; the format's policy in attention_decode.cuh): grid (num_splits, Hkv * R, num_seqs) (R: query-head
// subgroups, below), block 128 (4 warps; _w8: 256, for grids of at most 2 CTAs per SM), dynamic shared memory
// STAGES * 16 KB per 4 warps (the ring) + kV4TabCap * 4 (page table) + 16 + kV4RowBytes (the fused rows). STAGES = 2
// ships (measured best on an H200: docs/kernels/history/attention.md, "v4 decode"; and on an H100 for the
// few-sequence plans of about 2 CTAs per SM, where a third stage was 1-3% slower: "Decode for few sequences"); 3 and
// 4 stages are in cuda_src/dev/.
//   Key layout as v2: D/8 lanes share a key (one chunk of 8 elements of its K and V row each: 16 bytes in bf16, 8 in
//   e4m3), 32/(D/8) keys side by side, U such steps per stage (KV::kUnrollV4: kV4Unroll in bf16; e4m3 twice that
//   where registers allow, the same ring bytes), warps interleaved over the split's keys. Each lane cp.asyncs exactly the chunks
//   it later reads ([warp][stage][chunk][lane], conflict-free), so the STAGES-deep ring needs no barrier: while one
//   stage is computed, STAGES - 1 are in flight, and the registers hold no loads.
//   At CTA start the split's block-table entries (pre-multiplied by block_size) are copied into shared memory, so a
//   refill is a shared load, a multiply-add and two cp.async per key: no global round trip before the K/V loads.
//   The launcher guarantees they fit (ceil(chunk_len / block_size) + 1 <= kV4TabCap), else it runs v2.
//   t / block_size is a multiply-high by a host-computed magic number (bs_magic, bs_shift), not a division.
//   Softmax: ex2.approx; the running max is raised only when a score exceeds it by more than 8 (log2 domain), and
//   the warp rescales only when some lane raised it (p <= 2^8 in between: the same result, fewer multiplies).
//   Scores: the U x G partial dot products of a lane are reduced over the key's D/8 lanes by a transpose-reduce
//   (each step halves the values a lane holds: 15 shuffles for 16 values instead of 64) and gathered back with
//   one indexed shuffle per score.
//   num_splits == 1: bf16 out directly; otherwise fp32 partials, and the last CTA of each (sequence, kv head) to
//   finish (counters, reset by that CTA: graph-replay safe) merges them (combine_splits_v4, <= kV4MaxSplits).
//   kv_len == 0: split 0 writes zeros.
//   Query-head subgroups (_w8_r{R}): a kv head's R G query heads run as R CTAs of G heads each (blockIdx.y =
//   kv_head * R + r), which read the same K/V (the later reads mostly from L2). The plan does this for groups of 5,
//   6 and 8 in few-sequence grids of short splits, so that they run the 8-warp CTAs, whose registers hold at most 4
//   query rows; the first subgroup writes the fused entry's new K/V row. A template parameter, so that the R = 1
//   kernels carry no index arithmetic for it.
//
// Fused entry (positions != nullptr; attention_decode_rope in xserv/ops/attention/decode.py): the same kernel also
// does qk_norm_rope_write_kv's work for a decode batch (one new token per sequence), with the same bits as that
// kernel followed by the plain one. q is the packed qkv, read only. Every split's CTA makes its G query rows itself
// (q head RMSNorm when q_weight is given, RoPE at positions[s]; rope.cuh's pieces, so the same rounding points: the
// rotated row rounded to bf16 as qkv would hold it); head g by warp g % W, through shared memory. The CTA whose split
// holds position kv_len - 1 makes the new token's K row (norm, RoPE) and V row (copied) in warp G % W, writes them
// to the cache at slot_mapping[s] (< 0: nothing) and puts the same bits into its ring slot for that key when the
// loop gets there (no store-then-reload through global memory). If that slot is not where the page table puts position
// kv_len - 1 (not in a batch that xserv builds) or is -1 (a padding row), the key is read from the cache instead, as
// attention_decode would. qkv's q and k heads are not rotated in place: other splits' CTAs still read the raw q.
//
// Programmatic dependent launch. The kernel calls pdl_launch_dependents() first (the o projection may start and load
// its weights) and, before pdl_wait(), reads what no kernel of the decode step writes: kv_lens, the block table,
// positions, slot_mapping, the norm weights, and issues the K/V loads of the first STAGES - 1 stages (all of them
// where the split has at most STAGES) and L2 prefetches of the next kV4PrefetchStages, for every key except the
// newest (position kv_len - 1). Why that is safe:
//   - kv_lens, block_tables, positions and slot_mapping are uploaded by memory copies before the step's first kernel
//     (and the step's graph starts after the copies); a kernel of the chain can only have started once the kernel
//     before it started, so whenever this one runs, the step's first kernel has started: the copies are done.
//   - The cache of this layer is written in this step only by the new-token write: this kernel (fused) or the
//     qk_norm_rope_write_kv kernel right before it (plain), at the slots of the new tokens, which are the newest
//     key of their own sequence; other keys were written by earlier steps, whose kernels have all finished.
//   - Everything else the kernel reads (q / qkv) or writes (out, the partials, the counters, the cache) waits for
//     pdl_wait, which returns when the kernel before has completed and its writes are visible. Every kernel of the
//     chain calls pdl_launch_dependents only after its own pdl_wait, except this one (first, so that the o
//     projection overlaps it; that kernel waits for this grid before it reads `out`), so when this kernel starts,
//     all kernels before the one right before it have completed: only that one (the qkv GEMV, or the rope kernel)
//     may still be running. Every CTA calls pdl_wait, also those that have no keys, so that this grid's completion
//     keeps implying its predecessors' completion for the kernels after it.
// The newest key's K/V are loaded after pdl_wait (the plain kernel: __ldcg, past L1) or taken from this kernel's own
// rows (fused), and written over that key's ring slot in the iteration that reads it, after the slot's copy landed.
// =================================================================================================================
namespace {

constexpr int kV4Warps = 4;
constexpr int kV4Unroll = 4;
constexpr int kV4TabCap = 512;
constexpr int kV4MaxSplits = 256;  // the combine's scratch holds G * num_splits weights (the launcher's limit)
constexpr int kV4FastCombine = 16;  // up to this many splits the combine loads everything in one round trip
constexpr float kV4Thresh = 8.f;
constexpr int kV4PrefetchStages = 2;  // stages after the first STAGES - 1 that go to L2 before pdl_wait
constexpr int kV4RowBytes = (8 + 2) * 128 * 2;  // fused: G <= 8 rotated q rows + the new K and V rows, bf16, D <= 128

// n / d for 0 <= n < 2^31 with (magic, shift) from the host (_fast_div in xserv/ops/attention.py).
__device__ __forceinline__ int fast_div(int n, unsigned magic, int shift) {
    return (int)((__umulhi((unsigned)n, magic) + (unsigned)n) >> shift);
}

// One L2 prefetch of the 128-byte line at p (no register written, nothing waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// The split combine of v4, folded into the split kernel (the threadfence-reduction pattern of
// combine_splits_if_last in attention_decode.cuh, with more loads in flight): after write_split_result, the last CTA
// of a (sequence, kv head) to finish merges the `active` splits' partials of its G heads into `out` and resets the
// counter (graph replays reuse it). It is the kernel's serial tail when a few sequences are split many ways (64
// partials of 4 heads x 128 dims = 64 KB of L2 reads by one CTA at 1 x 32k), so the lse values are read once, every
// thread keeps 8 partial rows in flight (16 measured no faster at 32 splits and 1.3 us slower at 8, whose loads then
// all fall into the loop's remainder), and where G * D / 4 < W * 32 threads the splits are spread over PARTS thread
// groups whose sums are added in a fixed order (deterministic). sm: shared scratch of G * active + W * 32 * 4
// floats; sm_last: a shared int. W: warps per CTA (decode_split_v4's).
template <int D, int G, int W, bool FAST_ONLY = false>
__device__ __forceinline__ void combine_splits_v4(int* counter, int active, long long row0, int num_splits,
                                                  const float* __restrict__ part_o,
                                                  const float* __restrict__ part_lse,
                                                  __nv_bfloat16* __restrict__ out, float* sm, int& sm_last) {
    constexpr int NIDX = G * D / 4;                      // float4 columns of the G output rows
    constexpr int PARTS = NIDX >= W * 32 ? 1 : (W * 32) / NIDX;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!last_to_arrive(counter, active, sm_last)) return;
    if (FAST_ONLY || active <= kV4FastCombine) {  // FAST_ONLY: the launcher guarantees it
        // Few splits (short contexts): one round trip to L2 instead of two. Each thread takes a float4 column of a
        // head and loads that head's lse values with the column's partials, all at once; the threads of a head
        // compute the same weights in the same order.
        for (int idx = threadIdx.x; idx < NIDX; idx += W * 32) {
            const int g = idx / (D / 4), d4 = idx % (D / 4);
            const float* lse = part_lse + (row0 + g) * num_splits;
            const float4* src = reinterpret_cast<const float4*>(part_o + (row0 + g) * num_splits * D) + d4;
            float ls[kV4FastCombine];
            float4 x[kV4FastCombine];
#pragma unroll
            for (int i = 0; i < kV4FastCombine; ++i) {
                if (i < active) {
                    ls[i] = __ldcg(lse + i);
                    x[i] = __ldcg(src + i * (D / 4));
                }
            }
            float mm = ls[0];  // finite: split 0 holds keys
#pragma unroll
            for (int i = 1; i < kV4FastCombine; ++i)
                if (i < active) mm = fmaxf(mm, ls[i]);
            float den = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int i = 0; i < kV4FastCombine; ++i) {
                if (i < active) {
                    const float w = exp2f(ls[i] - mm);
                    den += w;
                    acc.x += w * x[i].x;
                    acc.y += w * x[i].y;
                    acc.z += w * x[i].z;
                    acc.w += w * x[i].w;
                }
            }
            __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (row0 + g) * D + 4 * d4);
            dst[0] = __floats2bfloat162_rn(acc.x / den, acc.y / den);
            dst[1] = __floats2bfloat162_rn(acc.z / den, acc.w / den);
        }
        if (threadIdx.x == 0) *counter = 0;
        return;
    }
    float* sm_w = sm;                    // [G][active] split weights
    float4* sm_red = reinterpret_cast<float4*>(sm + ((G * active + 3) & ~3));  // [PARTS][NIDX] partial sums
    // split weights 2^(lse_i - M) / sum per head, one warp per head; the lse values are read from L2 once (into
    // sm_w, which each lane then rewrites in place: only its own entries)
    for (int g = warp; g < G; g += W) {
        const float* lse = part_lse + (row0 + g) * num_splits;
        float* w = sm_w + g * active;
        float mm = neg_inf();
        for (int i = lane; i < active; i += 32) {
            w[i] = __ldcg(lse + i);
            mm = fmaxf(mm, w[i]);
        }
        mm = warp_max(mm);  // finite: split 0 holds keys
        float den = 0.f;
        for (int i = lane; i < active; i += 32) {
            w[i] = exp2f(w[i] - mm);
            den += w[i];
        }
        den = warp_sum(den);
        for (int i = lane; i < active; i += 32) w[i] /= den;
    }
    __syncthreads();  // all heads' weights are in shared memory
    for (int t = threadIdx.x; t < NIDX * PARTS; t += W * 32) {
        const int idx = t % NIDX, part = t / NIDX;
        const int g = idx / (D / 4), d4 = idx % (D / 4);
        const float4* src = reinterpret_cast<const float4*>(part_o + (row0 + g) * num_splits * D) + d4;
        const float* w = sm_w + g * active;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int i = part; i < active; i += PARTS) {
            const float4 x = __ldcg(src + i * (D / 4));
            acc.x += w[i] * x.x;
            acc.y += w[i] * x.y;
            acc.z += w[i] * x.z;
            acc.w += w[i] * x.w;
        }
        if constexpr (PARTS == 1) {
            __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (row0 + g) * D + 4 * d4);
            dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
            dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
        } else {
            sm_red[part * NIDX + idx] = acc;
        }
    }
    if constexpr (PARTS > 1) {
        __syncthreads();  // every group's sums are in shared memory
        for (int idx = threadIdx.x; idx < NIDX; idx += W * 32) {
            float4 acc = sm_red[idx];
#pragma unroll
            for (int p = 1; p < PARTS; ++p) {
                const float4 x = sm_red[p * NIDX + idx];
                acc.x += x.x;
                acc.y += x.y;
                acc.z += x.z;
                acc.w += x.w;
            }
            const int g = idx / (D / 4), d4 = idx % (D / 4);
            __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(out + (row0 + g) * D + 4 * d4);
            dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
            dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
        }
    }
    if (threadIdx.x == 0) *counter = 0;
}

// The v4 kernel's arguments: XSERV_DECODE_ARGS (attention_decode.cuh) with writable caches, then the folded
// combine's counters and the block-size divisor, then the fused entry's (positions == nullptr: plain attention):
//   counters:     [num_seqs * num_kv_heads * R] int32, zero between calls (the last CTA of a pair resets it)
//   positions:    [num_seqs] int32, the new token's position (RoPE), or nullptr: q is rotated, K/V are in the cache
//   slot_mapping: [num_seqs] int32, where the new token's K/V go (< 0: a padding row, nothing written)
//   cos_sin:      [max_pos, D] fp32, 16-byte aligned
//   q_weight, k_weight: [D] bf16 head-norm weights (Qwen3), or nullptr (Llama: no head norm)
// Fused, q is the packed qkv [num_seqs, num_q_heads + 2 * num_kv_heads, D] (q_row_stride its row), 16-byte aligned.
// T: the cache element (XSERV_DECODE_ARGS_OF); the e4m3 entries take k_scale, v_scale after these.
#define XSERV_DECODE_V4_ARGS_OF(T)                                                                               \
    const __nv_bfloat16 *__restrict__ q, long long q_row_stride, T *k_cache, T *v_cache,                         \
        const int *__restrict__ kv_lens, const int *__restrict__ block_tables, int max_blocks_per_seq,           \
        int block_size, int num_q_heads, int num_kv_heads, float scale_log2, int chunk_len, int num_splits,      \
        __nv_bfloat16 *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_lse,               \
        int *__restrict__ counters, unsigned bs_magic, int bs_shift, const int *__restrict__ positions,          \
        const int *__restrict__ slot_mapping, const float *__restrict__ cos_sin, int max_pos,                    \
        const __nv_bfloat16 *__restrict__ q_weight, const __nv_bfloat16 *__restrict__ k_weight, float eps
#define XSERV_DECODE_V4_ARGS XSERV_DECODE_V4_ARGS_OF(__nv_bfloat16)
#define XSERV_DECODE_V4_PASS                                                                                     \
    q, q_row_stride, k_cache, v_cache, kv_lens, block_tables, max_blocks_per_seq, block_size, num_q_heads,       \
        num_kv_heads, scale_log2, chunk_len, num_splits, out, part_o, part_lse, counters, bs_magic, bs_shift,    \
        positions, slot_mapping, cos_sin, max_pos, q_weight, k_weight, eps

// W: warps per CTA (kV4Warps; the wide kernels 8, the dev file's 16). R: query-head subgroups (below). LEAN (the
// _lean entries): the fused entry only (positions given) and at most kV4FastCombine splits (the launcher guarantees
// both), so that the body holds little but the path a short context runs. KV: the cache's format (KvChunksBf16,
// KvChunksE4m3: attention_decode.cuh), kv its scales.
template <int D, int G, int STAGES, int W = kV4Warps, int R = 1, bool LEAN = false, class KV = KvChunksBf16,
          bool MMA = false>
__device__ void decode_split_v4(XSERV_DECODE_V4_ARGS_OF(typename KV::T), KV kv = KV()) {
    using Chunk = typename KV::Chunk;
    // keys per lane and stage (MMA: one 16-key block a warp, for every G: its registers do not grow with G)
    constexpr int U = MMA ? 16 / (32 / (D / 8)) : KV::template kUnrollV4<G>;
    constexpr int LPK = D / 8;         // lanes per key
    constexpr int KPS = 32 / LPK;      // keys side by side in a warp
    constexpr int KPI = KPS * U;       // keys per warp and stage
    constexpr int CI = W * KPI;        // keys per CTA and stage
    constexpr int NCH = 2 * U;         // chunks per lane and stage (K then V)
    constexpr unsigned CB = KV::kChunkBytes, SLOT = 32 * CB;  // a chunk's bytes; a warp's chunk slot
    constexpr int LPR = D / 16;        // lanes per head row in rope.cuh's layout
    constexpr int RING = W * STAGES * 2 * kV4Unroll * 32 * 16;  // every format: the bf16 ring (the host's smem)
    static_assert(W * STAGES * NCH * 32 * CB <= RING, "the format's stages fit the ring");
    static_assert(W * G * D * 4 + 2 * W * G * 4 <= RING, "merge area fits in the ring");
    static_assert((G + 2) * D * 2 <= kV4RowBytes, "the fused rows fit their shared area");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    int* tab = reinterpret_cast<int*>(smem_raw + RING);
    int& sm_last = *reinterpret_cast<int*>(smem_raw + RING + kV4TabCap * 4);
    // [G][D] bf16: the rotated query rows (fused), then the new key's K row and V row as the loop must see them
    const unsigned sm_rows = smem_u32(smem_raw + RING + kV4TabCap * 4 + 16);
    const unsigned sm_new_k = sm_rows + G * D * 2, sm_new_v = sm_rows + (G + 1) * D * 2;
    require_dynamic_smem(RING + kV4TabCap * 4 + 16 + kV4RowBytes);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane % LPK, sub = lane / LPK, t = lane % LPR;
    // blockIdx.y: subgroup blockIdx.y % R of kv head blockIdx.y / R (R = 1: the kv head itself).
    const int s = blockIdx.z, kv_head = blockIdx.y / R, split = blockIdx.x;
    const int start = split * chunk_len;
    const int h0 = blockIdx.y * G;
    const bool fused = LEAN || positions != nullptr;
    const bool norm = fused && q_weight != nullptr;
    constexpr int kNewWarp = G % W;  // the warp that makes the new key's rows (the next in the q heads' turn)

    // ---- Before pdl_wait: only what no kernel of this decode step writes (see the header). kv_len, the split's
    // page-table entries (for a full chunk, within the table row, before kv_len is known: entries past the
    // sequence's end land in `tab` but are never used), the new token's position and slot and the norm weights go
    // out together: one round trip. The launcher guarantees the entries fit in kV4TabCap.
    xserv::pdl_launch_dependents();  // the o projection may start and load its weights (it waits for this grid)
    const int kv_len = kv_lens[s];
    const int pos = fused ? positions[s] : 0;
    const int slot = fused ? slot_mapping[s] : -1;
    const int* table = block_tables + (long long)s * max_blocks_per_seq;
    const int p0 = fast_div(start, bs_magic, bs_shift);  // pages as first slots (page * block_size)
    const int n_cap = min(fast_div(start + chunk_len - 1, bs_magic, bs_shift) - p0 + 1, max_blocks_per_seq - p0);
    for (int i = threadIdx.x; i < n_cap; i += W * 32)
        tab[i] = (int)((unsigned)__ldg(table + p0 + i) * (unsigned)block_size);  // -1 entries: never read
    rope16::NormWeights w;
    if (norm) rope16::load_norm_weights<D>(w, q_weight, k_weight, t);
    kv.load(kv_head);  // the kv head's scales (e4m3; bf16: nothing)
    __syncthreads();  // the page table is in shared memory

    // The new token's K and V rows, as qk_norm_rope_write_kv makes them (rope.cuh's pieces, its rounding points):
    // this lane's chunk c of each as bf16 bits, written to the cache at `slot` in the cache's format (kv.encode_k /
    // encode_v: e4m3 quantizes as the quantizing writes do) by the lanes of sub 0 (slot < 0: a padding row, nothing
    // written). Every lane of the warp must call it (the norm's shuffles). The bits stay bf16 here and are encoded
    // where they are stored (the cache, the ring) so that the bf16 kernels' code is what it was before the formats.
    const __nv_bfloat16* q_seq = q + (long long)s * q_row_stride;
    auto make_new_kv = [&](uint4& k_bits, uint4& v_bits) {
        const __nv_bfloat16* k_row = q_seq + (long long)(num_q_heads + kv_head) * D;
        const __nv_bfloat16* v_row = k_row + (long long)num_kv_heads * D;
        const uint4 raw_lo = *reinterpret_cast<const uint4*>(k_row + 8 * t);
        const uint4 raw_hi = *reinterpret_cast<const uint4*>(k_row + D / 2 + 8 * t);
        v_bits = *reinterpret_cast<const uint4*>(v_row + 8 * c);
        float cv[8], sv[8], lo[8], hi[8];
        const bool in_range = rope16::load_cos_sin<D>(cos_sin, pos, max_pos, t, cv, sv);
        xserv::bf16x8_to_float(raw_lo, lo);
        xserv::bf16x8_to_float(raw_hi, hi);
        if (norm) rope16::row_rmsnorm16<D>(lo, hi, false, w, eps);
        rope16::rope_apply(lo, hi, in_range, cv, sv);
        const uint4 out_lo = rope16::float8_to_bf16_bits(lo), out_hi = rope16::float8_to_bf16_bits(hi);
        k_bits = c < LPR ? out_lo : out_hi;  // chunk c: elements [8c, 8c + 8)
        if (sub == 0 && slot >= 0 && blockIdx.y % R == 0) {  // (the first query-head subgroup writes it)
            const long long row = ((long long)slot * num_kv_heads + kv_head) * D + 8 * c;
            // as the cache stores it (e4m3: the quantizing writes' conversion; bf16: the bits)
            *reinterpret_cast<Chunk*>(k_cache + row) = kv.encode_k(k_bits);
            *reinterpret_cast<Chunk*>(v_cache + row) = kv.encode_v(v_bits);
        }
    };

    if (start >= kv_len) {  // no keys in this split
        xserv::pdl_wait();  // every CTA waits before it ends or writes (the chain argument in the header)
        if (kv_len == 0 && split == 0) {  // a padding row of a captured batch: a defined zero row
            for (int idx = threadIdx.x; idx < G * D; idx += W * 32)
                out[((long long)s * num_q_heads + h0) * D + idx] = __float2bfloat16(0.f);
            if (fused && slot >= 0 && warp == kNewWarp) {  // no key to attend to, but the new K/V still go in
                uint4 kb, vb;
                make_new_kv(kb, vb);
            }
        }
        return;
    }
    const int end = min(start + chunk_len, kv_len);
    // The newest key (position kv_len - 1): written by the kernel before (qk_norm_rope_write_kv) or by this one
    // (fused), so it is the one K/V load that waits for pdl_wait. Where it sits in the ring: iteration it_n of warp
    // warp_n, lanes of sub_n, chunk u_n (-1: not in this split).
    const int jn = kv_len - 1;
    const bool holds_new = jn < end;  // start <= jn here
    int it_n = -1, warp_n = -1, sub_n = -1, u_n = 0;
    if (holds_new) {
        const int rel = jn - start;
        it_n = rel / CI;
        warp_n = (rel % CI) / KPI;
        u_n = (rel % KPI) / KPS;
        sub_n = rel % KPS;
    }

    const int first = start + warp * KPI;
    const int n_it = end > first ? (end - first + CI - 1) / CI : 0;
    const unsigned row_bytes = (unsigned)(num_kv_heads * D * (int)sizeof(typename KV::T));  // between slots
    const unsigned long long kbase = reinterpret_cast<unsigned long long>(k_cache + (long long)kv_head * D + c * 8);
    const unsigned long long vbase = reinterpret_cast<unsigned long long>(v_cache + (long long)kv_head * D + c * 8);
    const unsigned ring = smem_u32(smem_raw) + (unsigned)(warp * STAGES * NCH * 32 + lane) * CB;
    auto slot_of = [&](int j) {
        const int pidx = fast_div(j, bs_magic, bs_shift);
        return (unsigned)(tab[pidx - p0] + (j - pidx * block_size));
    };
    // Stage `stage` of the ring <- the keys of iteration `it` (zero-filled past the end). The newest key's copy is
    // overwritten once it has landed (the loop, at iteration it_n): it may have been read before pdl_wait, or while
    // this kernel writes it; keeping it here keeps the refill free of per-key tests.
    auto issue = [&](int it, int stage) {
        const int j0 = first + it * CI + sub;
        const unsigned st = ring + (unsigned)(stage * NCH * 32) * CB;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * KPS;
            const bool valid = j < end;
            const unsigned sl = slot_of(valid ? j : start);  // an address inside the sequence either way
            // one IMAD.WIDE.U32 each: base + slot * row_bytes
            const unsigned long long koff = kbase + (unsigned long long)sl * row_bytes;
            const unsigned long long voff = vbase + (unsigned long long)sl * row_bytes;
            KV::copy(st + u * SLOT, reinterpret_cast<const void*>(koff), valid);
            KV::copy(st + (U + u) * SLOT, reinterpret_cast<const void*>(voff), valid);
        }
    };

    // The first STAGES - 1 stages go out before pdl_wait (the newest key's copy is replaced, see issue), and the next
    // kV4PrefetchStages stages of this warp are prefetched into L2 (one lane per 128-byte line of a row; L2 is
    // coherent, so a line of the newest key's old value is harmless).
#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) {
        if (b < n_it) issue(b, b);
        cp_async_commit_m();
    }
    // A split of at most STAGES iterations (short contexts: 64-key chunks are 2) has nothing to refill: its last
    // stage goes out before pdl_wait too, into the slot the loop would have refilled.
    const bool all_ahead = n_it <= STAGES;
    if (all_ahead && STAGES - 1 < n_it) issue(STAGES - 1, STAGES - 1);
    cp_async_commit_m();
    if ((c & (128 / CB - 1)) == 0) {
        for (int it = all_ahead ? n_it : STAGES - 1; it < min(n_it, STAGES - 1 + kV4PrefetchStages); ++it) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = first + it * CI + sub + u * KPS;
                if (j < end) {
                    const unsigned sl = slot_of(j);
                    prefetch_l2(reinterpret_cast<const void*>(kbase + (unsigned long long)sl * row_bytes));
                    prefetch_l2(reinterpret_cast<const void*>(vbase + (unsigned long long)sl * row_bytes));
                }
            }
        }
    }

    // ---- After pdl_wait: q (and the new token's rows) come from the kernel before.
    xserv::pdl_wait();
    uint4 q_raw[G];
    if (!fused) {
#pragma unroll
        for (int g = 0; g < G; ++g)
            q_raw[g] = *reinterpret_cast<const uint4*>(q_seq + (long long)(h0 + g) * D + c * 8);
    } else {
        // q head g = warp, warp + W, ... of the group: head norm and RoPE by this warp (rope.cuh), the bf16 row into
        // sm_rows. Every split's CTA recomputes its G rows (G x D values); qkv is not written (other CTAs still read
        // the raw q).
        float cv[8], sv[8];
        const bool in_range = rope16::load_cos_sin<D>(cos_sin, pos, max_pos, t, cv, sv);
        for (int g = warp; g < G; g += W) {
            const __nv_bfloat16* q_row = q_seq + (long long)(h0 + g) * D;
            float lo[8], hi[8];
            xserv::bf16x8_to_float(*reinterpret_cast<const uint4*>(q_row + 8 * t), lo);
            xserv::bf16x8_to_float(*reinterpret_cast<const uint4*>(q_row + D / 2 + 8 * t), hi);
            if (norm) rope16::row_rmsnorm16<D>(lo, hi, true, w, eps);
            rope16::rope_apply(lo, hi, in_range, cv, sv);
            const uint4 out_lo = rope16::float8_to_bf16_bits(lo), out_hi = rope16::float8_to_bf16_bits(hi);
            if (sub == 0) sts128(sm_rows + (unsigned)(g * D + 8 * c) * 2u, c < LPR ? out_lo : out_hi);
        }
    }
    if (holds_new && warp == kNewWarp) {
        // The newest key as attention_decode after qk_norm_rope_write_kv would read it: this kernel's rows where it
        // wrote them to the slot the page table names for position kv_len - 1 (the usual case), else (not fused, a
        // padding row, a slot elsewhere) the cache's bits at that position, read after pdl_wait and past L1.
        const unsigned slot_t = slot_of(jn);
        uint4 kb = make_uint4(0u, 0u, 0u, 0u), vb = kb;  // bf16 bits
        if (fused) make_new_kv(kb, vb);
        Chunk kc = kv.encode_k(kb), vc = kv.encode_v(vb);  // as the cache holds them (bf16: the same bits)
        if (!fused || slot < 0 || (unsigned)slot != slot_t) {
            kc = __ldcg(reinterpret_cast<const Chunk*>(kbase + (unsigned long long)slot_t * row_bytes));
            vc = __ldcg(reinterpret_cast<const Chunk*>(vbase + (unsigned long long)slot_t * row_bytes));
        }
        if (sub == 0) {
            KV::sts(sm_new_k + c * CB, kc);
            KV::sts(sm_new_v + c * CB, vc);
        }
    }
    if (fused || holds_new) __syncthreads();  // sm_rows is written (CTA-uniform condition)
    if (fused) {
#pragma unroll
        for (int g = 0; g < G; ++g) q_raw[g] = lds128(sm_rows + (unsigned)(g * D + 8 * c) * 2u);
    }
    const float q_mul = kv.q_scale(scale_log2);  // e4m3: times k_scale (attention_decode.cuh)
    float* sm_acc = reinterpret_cast<float*>(smem_raw);  // [W][G][D]
    float* sm_m = sm_acc + W * G * D;                    // [W][G]
    float* sm_l = sm_m + W * G;                          // [W][G]
    if constexpr (MMA) {
        // ---- The scores and the values on tensor cores (the FP8 cache's _mma entries; docs/kernels/attention.md,
        // "FP8 KV cache on tensor cores"). A warp's stage is one block of 16 keys (KPS x U); mma.sync m16n8k16 with
        // f16 inputs (e4m3 codes are exact in f16; q * q_mul rounded to f16) and fp32 accumulators, v3's layout:
        //   S = Q K^T: M = the G query heads (rows >= G zero), N = 8 keys (two n-blocks), K = 16 head dims a k-step.
        //     The head dims are permuted alike in Q and K: lane (gq, tq) = (lane / 4, lane % 4) takes chunks
        //     tq, tq + 4, ... (8 dims each) of its q head gq and of key gq of each n-block; k-step kk reads half
        //     kk % 2 of chunk tq + 4 (kk / 2), whose two f16x2 words are the B registers as they convert.
        //   O = P V: M = the heads, N = 8 output dims, K = the 16 keys; the S accumulators are P's A registers as
        //     they stand. Output column n of n-tile nt is dim 8 (n + 8 (nt / 8)) + nt % 8, so a lane reads chunks gq
        //     and gq + 8 of keys 2tq, 2tq + 1, 2tq + 8, 2tq + 9 and pairs their bytes (byte_perm) into B words.
        // The ring is read across lanes (a lane reads chunks other lanes copied): __syncwarp after each lane's
        // wait, and before a stage is refilled. Per 16 keys a lane runs 16 LDS.64, 64 conversions, 32 mma and
        // 16 byte_perm instead of ~100 instructions a key (the CUDA-core loop's).
        static_assert(KPI == 16 && D % 32 == 0 && G <= 8 && W == kV4Warps, "one 16-key block a warp and stage");
        constexpr int KS = D / 16, QC = D / 32, NT = D / 8;  // k-steps, q/K chunks a lane, output n-tiles
        const int gq = lane >> 2, tq = lane & 3;
        unsigned qa[KS][2];  // A registers a0, a2 of each k-step (a1 = a3 = 0: rows 8..15)
#pragma unroll
        for (int i = 0; i < QC; ++i) {
            const int cc = tq + 4 * i;
            uint4 bits = make_uint4(0u, 0u, 0u, 0u);
            if (gq < G)
                bits = fused ? lds128(sm_rows + (unsigned)(gq * D + 8 * cc) * 2u)
                             : *reinterpret_cast<const uint4*>(q_seq + (long long)(h0 + gq) * D + cc * 8);
            float f[8];
            bf16x8_to_float(bits, f);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qa[2 * i + h][0] = pack_half2(f[4 * h] * q_mul, f[4 * h + 1] * q_mul);
                qa[2 * i + h][1] = pack_half2(f[4 * h + 2] * q_mul, f[4 * h + 3] * q_mul);
            }
        }
        const unsigned ring0 = ring - (unsigned)lane * CB;  // this warp's ring, not this lane's slots
        auto at = [&](unsigned stage_base, int slot, int key, int chunk) {  // a chunk of key `key` in the stage
            return stage_base + (unsigned)slot * SLOT + (unsigned)((key % KPS) * LPK + chunk) * CB;
        };
        float m = neg_inf(), l = 0.f, acc[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = 0.f;
        int rd = 0, wr = STAGES - 1;
        for (int it = 0; it < n_it; ++it) {
            __syncwarp();  // every lane is past its reads of the stage refilled now
            if (!all_ahead && it + STAGES - 1 < n_it) issue(it + STAGES - 1, wr);
            cp_async_commit_m();
            cp_async_wait_m<STAGES - 1>();
            const unsigned stb = ring0 + (unsigned)(rd * NCH * 32) * CB;
            if (it == it_n && warp == warp_n && sub == sub_n) {  // the newest key: its rows from sm_new_k / sm_new_v
                KV::sts(ring + (unsigned)(rd * NCH * 32) * CB + u_n * SLOT, KV::lds(sm_new_k + c * CB));
                KV::sts(ring + (unsigned)(rd * NCH * 32) * CB + (U + u_n) * SLOT, KV::lds(sm_new_v + c * CB));
            }
            __syncwarp();  // every lane's copies (and the newest key's rows) are visible to the warp
            rd = rd + 1 == STAGES ? 0 : rd + 1;
            wr = wr + 1 == STAGES ? 0 : wr + 1;
            // S: two n-blocks of 8 keys (key 8 nb + gq is this lane's B column)
            float sc[2][4];
#pragma unroll
            for (int nb = 0; nb < 2; ++nb) {
                sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.f;
                const int key = 8 * nb + gq;
#pragma unroll
                for (int i = 0; i < QC; ++i) {
                    const uint2 kc = KV::lds(at(stb, key / KPS, key, tq + 4 * i));
                    unsigned k01, k23, k45, k67;
                    e4m3::e4m3x4_to_half2x2(kc.x, k01, k23);
                    e4m3::e4m3x4_to_half2x2(kc.y, k45, k67);
                    const unsigned a0[4] = {qa[2 * i][0], 0u, qa[2 * i][1], 0u};
                    const unsigned a1[4] = {qa[2 * i + 1][0], 0u, qa[2 * i + 1][1], 0u};
                    mma_f16_16816(sc[nb], a0, k01, k23);
                    mma_f16_16816(sc[nb], a1, k45, k67);
                }
            }
            // this lane's scores: head gq, keys 8 nb + 2 tq + e (sc[nb][e], e < 2); mask past the end
            const int j0 = first + it * CI;
            float p[2][2];
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) p[nb][e] = j0 + 8 * nb + 2 * tq + e < end ? sc[nb][e] : neg_inf();
            float mx = fmaxf(fmaxf(p[0][0], p[0][1]), fmaxf(p[1][0], p[1][1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if (__any_sync(0xffffffffu, mx > m + kV4Thresh)) {  // the lazily raised max (see the header)
                const float m_new = fmaxf(m, mx);
                const float alpha = exp2_approx(m - (m_new == neg_inf() ? 0.f : m_new));
                l *= alpha;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) acc[nt][0] *= alpha, acc[nt][1] *= alpha;
                m = m_new;
            }
            const float m_use = m == neg_inf() ? 0.f : m;
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    p[nb][e] = exp2_approx(p[nb][e] - m_use);
                    l += p[nb][e];
                }
            const unsigned pa[4] = {pack_half2(p[0][0], p[0][1]), 0u, pack_half2(p[1][0], p[1][1]), 0u};
            // O += P V over n-tiles: B words pair keys (2tq, 2tq+1) and (2tq+8, 2tq+9) at one dim
#pragma unroll
            for (int half = 0; half < NT / 8; ++half) {
                const int cv = gq + 8 * half;
                uint2 v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int key = 2 * tq + (q & 1) + 8 * (q >> 1);
                    v[q] = KV::lds(at(stb, U + key / KPS, key, cv));
                }
#pragma unroll
                for (int w = 0; w < 2; ++w) {  // the chunk's bytes 0..3 (w = 0) and 4..7
                    const unsigned lo0 = w ? v[0].y : v[0].x, lo1 = w ? v[1].y : v[1].x;
                    const unsigned hi0 = w ? v[2].y : v[2].x, hi1 = w ? v[3].y : v[3].x;
#pragma unroll
                    for (int pr = 0; pr < 2; ++pr) {  // bytes (2 pr, 2 pr + 1) of the word: two n-tiles
                        const unsigned sel = pr ? 0x7362u : 0x5140u;
                        unsigned b0a, b0b, b1a, b1b;
                        e4m3::e4m3x4_to_half2x2(__byte_perm(lo0, lo1, sel), b0a, b0b);
                        e4m3::e4m3x4_to_half2x2(__byte_perm(hi0, hi1, sel), b1a, b1b);
                        const int nt = 8 * half + 4 * w + 2 * pr;
                        float d0[4] = {acc[nt][0], acc[nt][1], 0.f, 0.f};
                        float d1[4] = {acc[nt + 1][0], acc[nt + 1][1], 0.f, 0.f};
                        mma_f16_16816(d0, pa, b0a, b1a);
                        mma_f16_16816(d1, pa, b0b, b1b);
                        acc[nt][0] = d0[0], acc[nt][1] = d0[1];
                        acc[nt + 1][0] = d1[0], acc[nt + 1][1] = d1[1];
                    }
                }
            }
        }
        cp_async_wait_m<0>();
        l += __shfl_xor_sync(0xffffffffu, l, 1);  // the head's sum over its four lanes' keys
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        __syncthreads();  // every warp is past its last ring read: the ring becomes the merge area
        if (gq < G) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    sm_acc[(warp * G + gq) * D + 8 * (2 * tq + e + 8 * (nt / 8)) + nt % 8] = kv.out_v(acc[nt][e]);
            if (tq == 0) {
                sm_m[warp * G + gq] = m;
                sm_l[warp * G + gq] = l;
            }
        }
    } else {
        float qf[G][8];
    #pragma unroll
        for (int g = 0; g < G; ++g) {
            bf16x8_to_float(q_raw[g], qf[g]);
    #pragma unroll
            for (int e = 0; e < 8; ++e) qf[g][e] *= q_mul;
        }
        float m[G], l[G], acc[G][8];
        empty_states(m, l, acc);
        int rd = 0, wr = STAGES - 1;
        for (int it = 0; it < n_it; ++it) {
            if (!all_ahead && it + STAGES - 1 < n_it) issue(it + STAGES - 1, wr);
            cp_async_commit_m();
            cp_async_wait_m<STAGES - 1>();  // this lane's copies of stage `rd` have landed (all_ahead: of every stage)
            const unsigned st = ring + (unsigned)(rd * NCH * 32) * CB;
            if (it == it_n && warp == warp_n && sub == sub_n) {  // the newest key: its rows from sm_new_k / sm_new_v
                KV::sts(st + u_n * SLOT, KV::lds(sm_new_k + c * CB));
                KV::sts(st + (U + u_n) * SLOT, KV::lds(sm_new_v + c * CB));
            }
            rd = rd + 1 == STAGES ? 0 : rd + 1;
            wr = wr + 1 == STAGES ? 0 : wr + 1;
            const int jb = first + it * CI + sub;
            // scores: per-lane partial dot products, then the transpose-reduce (see the header)
            float sc[U][G];
            constexpr int GP = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;  // G padded to a power of two
            constexpr int NP = U * GP;
            constexpr int NF = NP >= LPK ? NP / LPK : 1;  // full scores a lane holds after the reduce
            constexpr int R = NP >= LPK ? 1 : LPK / NP;   // lanes holding the same score
            float v[NP];
    #pragma unroll
            for (int u = 0; u < U; ++u) {
                float kf[8];
                KV::to_float_fast(KV::lds(st + u * SLOT), kf);
    #pragma unroll
                for (int g = 0; g < GP; ++g) {
                    float d = 0.f;
                    if (g < G) {
    #pragma unroll
                        for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
                    }
                    v[u * GP + g] = d;
                }
            }
            // transpose-reduce over the key's lanes: at lane bit `bit`, the lane with the bit set keeps the upper
            // half of its values and sends the lower half, its partner the reverse
    #pragma unroll
            for (int bit = LPK / 2, n = NP; bit >= 1; bit >>= 1) {
                if (n > 1) {
                    const bool hi = (c & bit) != 0;
                    const int half = n / 2;
    #pragma unroll
                    for (int i = 0; i < NP / 2; ++i) {
                        if (i < half) {
                            const float a = v[i], b = v[i + half];
                            const float send = hi ? a : b, keep = hi ? b : a;
                            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
                        }
                    }
                    n = half;
                } else {
                    v[0] += __shfl_xor_sync(0xffffffffu, v[0], bit);
                }
            }
            // lane c now holds the full scores ((c / R) * NF + k), k < NF; gather them all into every lane
    #pragma unroll
            for (int u = 0; u < U; ++u) {
    #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const int i = u * GP + g;
                    sc[u][g] = __shfl_sync(0xffffffffu, v[i % NF], sub * LPK + (i / NF) * R);
                }
            }
            if (first + it * CI + KPI > end) {  // the last stage of the warp: mask keys past the end
    #pragma unroll
                for (int u = 0; u < U; ++u)
    #pragma unroll
                    for (int g = 0; g < G; ++g)
                        if (jb + u * KPS >= end) sc[u][g] = neg_inf();
            }
            // online softmax with a lazily raised max (see the header)
            float mx[G];
            bool grow = false;
    #pragma unroll
            for (int g = 0; g < G; ++g) {
                mx[g] = sc[0][g];
    #pragma unroll
                for (int u = 1; u < U; ++u) mx[g] = fmaxf(mx[g], sc[u][g]);
                grow |= mx[g] > m[g] + kV4Thresh;  // m = -inf: any valid key raises it
            }
            if (__any_sync(0xffffffffu, grow)) {
    #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float m_new = fmaxf(m[g], mx[g]);
                    const float alpha = exp2_approx(m[g] - (m_new == neg_inf() ? 0.f : m_new));  // m = -inf: 0
                    l[g] *= alpha;
    #pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
                    m[g] = m_new;
                }
            }
    #pragma unroll
            for (int g = 0; g < G; ++g) {
                const float m_use = m[g] == neg_inf() ? 0.f : m[g];
    #pragma unroll
                for (int u = 0; u < U; ++u) sc[u][g] = exp2_approx(sc[u][g] - m_use);  // now p (0 for masked keys)
            }
    #pragma unroll
            for (int u = 0; u < U; ++u) {
                float vf[8];
                KV::to_float_fast(KV::lds(st + (U + u) * SLOT), vf);
    #pragma unroll
                for (int g = 0; g < G; ++g) {
                    l[g] += sc[u][g];
    #pragma unroll
                    for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(sc[u][g], vf[e], acc[g][e]);
                }
            }
        }
        cp_async_wait_m<0>();

        // Merge the KPS key groups of this warp (lanes c, c + LPK, ... hold the same columns).
    #pragma unroll
        for (int off = LPK; off < 32; off <<= 1) {
    #pragma unroll
            for (int g = 0; g < G; ++g) {
                float acc_o[8];
    #pragma unroll
                for (int e = 0; e < 8; ++e) acc_o[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
                const float m_o = __shfl_xor_sync(0xffffffffu, m[g], off);
                const float l_o = __shfl_xor_sync(0xffffffffu, l[g], off);
                merge_state(m[g], l[g], acc[g], m_o, l_o, acc_o);
            }
        }
        __syncthreads();  // every warp is past its last ring read: the ring becomes the merge area
        if (sub == 0) {
    #pragma unroll
            for (int g = 0; g < G; ++g) {
    #pragma unroll
                for (int e = 0; e < 8; ++e) sm_acc[(warp * G + g) * D + c * 8 + e] = kv.out_v(acc[g][e]);
                if (c == 0) {
                    sm_m[warp * G + g] = m[g];
                    sm_l[warp * G + g] = l[g];
                }
            }
        }
    }
    __syncthreads();
    const long long row0 = (long long)s * num_q_heads + h0;
    write_split_result<D, G, W>(sm_m, sm_l, sm_acc, row0, split, num_splits, out, part_o, part_lse);
    if (num_splits == 1) return;
    // the merge area is no longer read: it holds the split weights now
    static_assert(((G * kV4MaxSplits + 3) & ~3) * 4 + W * 32 * 16 <= RING, "combine scratch fits in the ring");
    combine_splits_v4<D, G, W, LEAN>(counters + ((long long)s * num_kv_heads + kv_head) * R + blockIdx.y % R,
                                     min(num_splits, (kv_len + chunk_len - 1) / chunk_len), row0, num_splits, part_o,
                                     part_lse, out, reinterpret_cast<float*>(smem_raw), sm_last);
}

}  // namespace

// The entries, per KV format FMT (BF16: attention_decode_v4_..., FP8: attention_decode_fp8_v4_..., which take k_scale,
// v_scale after XSERV_DECODE_V4_ARGS; attention_decode.cuh's XSERV_KV_* macros). Each macro expands its FMT argument
// before the inner one pastes it.
// 4 CTAs per SM for G <= 4 (<= 128 registers; the ring of 2 stages is 32 KB), 2 above (q and acc alone are 16 G
// registers).
#define XSERV_V4_MINB(G) ((G) <= 4 ? 4 : 2)
#define XSERV_V4_ENTRY_ARGS(FMT) XSERV_DECODE_V4_ARGS_OF(XSERV_KV_T_##FMT) XSERV_KV_SCALE_ARGS_##FMT
#define XSERV_V4_ENTRY(FMT, D, G, S) XSERV_V4_ENTRY_(FMT, D, G, S)
#define XSERV_V4_ENTRY_(FMT, D, G, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(128, XSERV_V4_MINB(G))                                          \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s##S)(XSERV_V4_ENTRY_ARGS(FMT)) {                   \
        decode_split_v4<D, G, S>(XSERV_DECODE_V4_PASS, XSERV_KV_POLICY_##FMT);                                  \
    }

// Wide CTAs: the same kernel with W warps (W * 32 threads, a ring of W warps' stages), 16 / W CTAs per SM (the 4-warp
// kernel's register budget). The plan (plan_decode in xserv/ops/attention/decode.py) runs the 8-warp form where its
// grid is one wave of them (at most 2 per SM: few sequences, at any context): the same splits, each CTA's keys in
// half the stages, twice the bytes in flight per SM. Measured on an H200 (docs/kernels/history/attention.md, "Wide
// CTAs"): plain 1 x 32k 60% -> 89% of copy bandwidth; batch-1 steps +0.4% to +2.0%.
#define XSERV_V4_WIDE_ENTRY(FMT, D, G, S, W) XSERV_V4_WIDE_ENTRY_(FMT, D, G, S, W)
#define XSERV_V4_WIDE_ENTRY_(FMT, D, G, S, W)                                                                    \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                                                 \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s##S##_w##W)(XSERV_V4_ENTRY_ARGS(FMT)) {            \
        decode_split_v4<D, G, S, W>(XSERV_DECODE_V4_PASS, XSERV_KV_POLICY_##FMT);                               \
    }
// The same with R query-head subgroups per kv head (groups of R G; decode.py's _subgroup_counts).
#define XSERV_V4_WIDE_SUBGROUPS_ENTRY(FMT, D, G, S, W, R) XSERV_V4_WIDE_SUBGROUPS_ENTRY_(FMT, D, G, S, W, R)
#define XSERV_V4_WIDE_SUBGROUPS_ENTRY_(FMT, D, G, S, W, R)                                                       \
    extern "C" __global__ void __launch_bounds__(W * 32, 16 / W)                                                 \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s##S##_w##W##_r##R)(XSERV_V4_ENTRY_ARGS(FMT)) {     \
        decode_split_v4<D, G, S, W, R>(XSERV_DECODE_V4_PASS, XSERV_KV_POLICY_##FMT);                            \
    }

// The 8-warp kernel compiled LEAN (_w8_lean): what the fused op launches where the plan runs v4w8 with at most
// kV4FastCombine splits (contexts up to ~16 x 64 keys at batch 1). Each launch of the decode chain starts with a cold
// instruction cache, so the code a launch runs through counts: 62.6 KB against 77.1 KB (G = 2), +1% at batch 1
// (docs/kernels/history/attention.md, "A lean fused entry").
#define XSERV_V4_LEAN_ENTRY(FMT, D, G) XSERV_V4_LEAN_ENTRY_(FMT, D, G)
#define XSERV_V4_LEAN_ENTRY_(FMT, D, G)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                         \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s2_w8_lean)(XSERV_V4_ENTRY_ARGS(FMT)) {             \
        decode_split_v4<D, G, 2, 8, 1, true>(XSERV_DECODE_V4_PASS, XSERV_KV_POLICY_##FMT);                      \
    }

// The same for the query-head subgroup kernels (_w8_r{R}_lean): groups of 5, 6 and 8 (Qwen3-14B, 32B, and the
// 30B-A3B's 32 q / 4 kv heads, whose batch-1 fused op at short context runs 2 subgroups of 4 in 8 splits of 64 keys).
#define XSERV_V4_LEAN_SUBGROUPS_ENTRY(FMT, D, G, R) XSERV_V4_LEAN_SUBGROUPS_ENTRY_(FMT, D, G, R)
#define XSERV_V4_LEAN_SUBGROUPS_ENTRY_(FMT, D, G, R)                                                             \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                         \
        XSERV_PASTE(XSERV_KV_PREFIX_##FMT, v4_d##D##_g##G##_s2_w8_r##R##_lean)(XSERV_V4_ENTRY_ARGS(FMT)) {      \
        decode_split_v4<D, G, 2, 8, R, true>(XSERV_DECODE_V4_PASS, XSERV_KV_POLICY_##FMT);                      \
    }

// The bf16 forms under their old names (cuda_src/dev/attention_decode_dev.cu instantiates its experiments with them).
#define XSERV_DECODE_V4_KERNEL(D, G, S) XSERV_V4_ENTRY(BF16, D, G, S)
#define XSERV_DECODE_V4_WIDE_KERNEL(D, G, S, W) XSERV_V4_WIDE_ENTRY(BF16, D, G, S, W)

// The entries of the including file's format XSERV_KV_FMT (BF16 or FP8), per shape piece. // 2 stages, for every head_dim and group size; 8 warps for the groups of at most 4 (the 16 / W bound holds there);
// lean entries for the head_dim of every Qwen3 size (128); groups of 6 and 8 as 2 subgroups (Qwen3-32B's 64/8 heads),
// groups of 5 as 5 of one (Qwen3-14B's 40/8), 7 whole. Grouped by the shape piece that has them (XSERV_PIECE: head
// dim, query heads per kv head; decode.py's _subgroup_counts picks the subgroups).
#if XSERV_PIECE(64, 1)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 1, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 64, 1, 2, 8)
#endif
#if XSERV_PIECE(64, 2)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 2, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 64, 2, 2, 8)
#endif
#if XSERV_PIECE(64, 3)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 3, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 64, 3, 2, 8)
#endif
#if XSERV_PIECE(64, 4)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 4, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 64, 4, 2, 8)
#endif
#if XSERV_PIECE(64, 5)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 5, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 64, 1, 2, 8, 5)
#endif
#if XSERV_PIECE(64, 6)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 6, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 64, 3, 2, 8, 2)
#endif
#if XSERV_PIECE(64, 7)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 7, 2)
#endif
#if XSERV_PIECE(64, 8)
XSERV_V4_ENTRY(XSERV_KV_FMT, 64, 8, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 64, 4, 2, 8, 2)
#endif
#if XSERV_PIECE(128, 1)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 1, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 128, 1, 2, 8)
XSERV_V4_LEAN_ENTRY(XSERV_KV_FMT, 128, 1)
#endif
#if XSERV_PIECE(128, 2)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 2, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 128, 2, 2, 8)
XSERV_V4_LEAN_ENTRY(XSERV_KV_FMT, 128, 2)
#endif
#if XSERV_PIECE(128, 3)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 3, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 128, 3, 2, 8)
XSERV_V4_LEAN_ENTRY(XSERV_KV_FMT, 128, 3)
#endif
#if XSERV_PIECE(128, 4)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 4, 2)
XSERV_V4_WIDE_ENTRY(XSERV_KV_FMT, 128, 4, 2, 8)
XSERV_V4_LEAN_ENTRY(XSERV_KV_FMT, 128, 4)
#endif
#if XSERV_PIECE(128, 5)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 5, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 1, 2, 8, 5)
XSERV_V4_LEAN_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 1, 5)
#endif
#if XSERV_PIECE(128, 6)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 6, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 3, 2, 8, 2)
XSERV_V4_LEAN_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 3, 2)
#endif
#if XSERV_PIECE(128, 7)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 7, 2)
#endif
#if XSERV_PIECE(128, 8)
XSERV_V4_ENTRY(XSERV_KV_FMT, 128, 8, 2)
XSERV_V4_WIDE_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 4, 2, 8, 2)
XSERV_V4_LEAN_SUBGROUPS_ENTRY(XSERV_KV_FMT, 128, 4, 2)
#endif
