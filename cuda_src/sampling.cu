// Batched token sampling: one CTA per row of logits, every row with its own parameters (xserv/ops/sampling.py
// packs them; the column layout below mirrors it). Per row b:
//   0. the row's logit bias (bias_row >= 0: logit_bias[bias_row] added, one float add per token) and token mask
//      (mask_row >= 0: tokens whose bit in token_mask[mask_row] is 0 get -inf); the adjusted logits are the row's
//      "raw" logits for everything below, log-probs included. Rows without either read neither;
//   1. penalties (row has a penalty slot): repetition penalty on tokens marked in seen[slot] (logit > 0 -> l / r,
//      else l * r), then l -= presence * (count > 0) + frequency * count with counts[slot];
//   2. temperature 0 -> greedy argmax (lowest index on ties);
//   3. z = l * (1 / T); every filter keeps an upper set of z, so the kept set is {z >= theta} with
//      theta = max(top-k's k-th largest z, top-p's nucleus boundary over the top-k set, zmax + log(min_p));
//   4. the token is argmax over the kept set of z_i + Gumbel_i, with Gumbel_i = -log(-log(u_i)) and u_i from
//      Philox4x32-10 (key = the row's 64-bit seed, counter = (i / 4, step, 0, 0), word i % 4): an exact draw from
//      the renormalised distribution, and the same token for the same (seed, step) whatever else is in the batch;
//   5. counts[slot, token] += 1, seen[slot, token] = 1;
//   6. optional log-softmax of the RAW logits at the token, and the top-N raw log-probs (ties: lowest id first).
//
// How theta is found without sorting the vocabulary (docs/kernels/sampling.md has the argument):
//   pass 1 reads the row once: z max/argmax, the sum of exp(z - zmax), the raw log-sum-exp, and a candidate
//   buffer in shared memory holding every token with z >= a floor. The floor only rises (to the KEEP-th largest
//   candidate when the buffer fills, and to zmax_so_far - WINDOW), so at the end the buffer is EXACTLY
//   {z >= final floor}: an upper set of the row. If the kept set lies inside it (top-k with k <= its size, or a
//   nucleus whose mass it holds, or min-p above the floor), theta comes from radix selects over the buffer
//   (8-bit digits of the order-preserving float key, counting tokens for top-k and summing exp(z - zmax) for
//   top-p) and the draw runs over the buffer. Otherwise the same radix selects and the draw run over the row in
//   global memory (more passes; exact, only slower).
// Assumptions: logits are finite or -inf (a NaN logit gives an unspecified but in-range token); a row whose every
// logit is -inf returns token 0. Two rows of one batch must not share a penalty slot. Thresholds sum float32
// masses with atomics, so a token exactly at a top-p boundary may flip between runs (a float near-tie only).
#include "common.cuh"

// xserv-shapes: vec=0,1 (compiled as two pieces: sampling:v1 = sample_f32_vec, sampling:v0 = sample_f32; compiled
// whole, as the harness and CI do, it has both)
// xserv-startup: v1 (the entry for a vocab % 4 == 0 and aligned logits: every Qwen3; sample_f32 on first use)
#if !defined(XSERV_VEC)
#define XSERV_SAMPLE_PIECE(V) 1
#else
#define XSERV_SAMPLE_PIECE(V) ((V) == XSERV_VEC)
#endif

namespace {

constexpr int BLOCK = 512;                 // threads per CTA (one row)
constexpr int GROUP = 4;                   // tokens per float4 load and per Philox call
constexpr int TILE = BLOCK * GROUP;        // tokens read per pass-1 step
constexpr int CAND_CAP = 3 * 1024;         // candidate buffer (z, token) entries
constexpr int CAND_LIMIT = CAND_CAP - TILE;  // compact once more than this many: a whole tile must still fit
constexpr int CAND_KEEP = CAND_LIMIT / 2;  // a compaction keeps at least this many (k for top-k rows with k <= it):
                                           // half the room stays free, so compactions stay rare
constexpr int RAW_CAP = TILE + BLOCK;      // raw-logit buffer for the top-N log-probs
constexpr int RAW_LIMIT = RAW_CAP - TILE;
constexpr int RAW_KEEP = 64;               // >= MAX_TOP_LOGPROBS
constexpr float WINDOW = 30.f;             // tokens 30 below the max weigh < 1e-13 of it: never needed in the buffer
constexpr float GUMBEL_MAX = 16.7f;        // > -log(-log(1 - 2^-24)) = 16.64, the largest noise gumbel() returns
#define NEG_INF (-__int_as_float(0x7f800000))

// Parameter columns: keep in step with xserv/ops/sampling.py.
enum { F_TEMPERATURE = 0, F_TOP_P = 1, F_MIN_P = 2, F_REPETITION = 3, F_PRESENCE = 4, F_FREQUENCY = 5, NUM_F = 8 };
enum { I_TOP_K = 0, I_SEED_LO = 1, I_SEED_HI = 2, I_STEP = 3, I_PENALTY_SLOT = 4, I_MASK_ROW = 5, I_BIAS_ROW = 6,
       NUM_I = 8 };

// ---- Philox4x32-10 (Salmon et al., SC'11) and the Gumbel noise ------------------------------------------------
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ unsigned word(const uint4& r, int lane) {
    return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
}

// u = (2 * (bits >> 9) + 1) / 2^24 lies in (0, 1) and is exact in float32 (24 significant bits), so the NumPy
// reference computes the same u. Accurate logf (not __logf): the reference's float32 log agrees to an ulp.
__device__ __forceinline__ float gumbel(unsigned bits) {
    const float u = __uint2float_rn((bits >> 9) * 2u + 1u) * 0x1p-24f;
    return -logf(-logf(u));
}

// ---- small helpers ---------------------------------------------------------------------------------------------
// Float -> unsigned with the same order (negative floats flipped entirely, positive ones get the sign bit set).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Best {
    float v;
    int i;
};
// Larger value wins, the lower index on ties; NaN never wins.
__device__ __forceinline__ bool better(float v, int i, const Best& b) { return v > b.v || (v == b.v && i < b.i); }

// Running (max, sum of exp(v - max)) of one thread's values (online softmax).
struct Online {
    float m = NEG_INF, s = 0.f;
    __device__ __forceinline__ void add(float v) {
        if (v == NEG_INF) return;
        if (v > m) {
            s = s * __expf(m - v) + 1.f;
            m = v;
        } else {
            s += __expf(v - m);
        }
    }
};

struct Shared {
    float cand_v[CAND_CAP];  // candidate z values (an upper set of the row's z once pass 1 ends)
    int cand_i[CAND_CAP];    // their token ids
    float raw_v[RAW_CAP];    // candidate raw logits for the top-N log-probs
    int raw_i[RAW_CAP];
    float hist[256];         // radix-select histogram (counts or masses)
    float red_v[32];         // per-warp partials of block reductions
    int red_i[32];
    int scan[32];
    int count_c, count_r;    // entries in the two buffers
    float floor_c, floor_r;  // every token at or above the floor is in the buffer
    int overflow_c, overflow_r;  // the buffer could not be compacted below its limit (masses of exact ties)
    unsigned runmax_key;     // order_key of the largest z seen so far
    int sel_bin;
    float sel_above;
};

__device__ __forceinline__ Best block_argmax(Best b, Shared& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const Best o{__shfl_xor_sync(0xffffffffu, b.v, off), __shfl_xor_sync(0xffffffffu, b.i, off)};
        if (better(o.v, o.i, b)) b = o;
    }
    if (lane == 0) {
        sm.red_v[warp] = b.v;
        sm.red_i[warp] = b.i;
    }
    // The per-warp winners are visible before every thread reduces them.
    __syncthreads();
    b = Best{sm.red_v[0], sm.red_i[0]};
    for (int w = 1; w < BLOCK / 32; ++w)
        if (better(sm.red_v[w], sm.red_i[w], b)) b = Best{sm.red_v[w], sm.red_i[w]};
    // Nobody overwrites red_v/red_i (next reduction) before every thread has read them.
    __syncthreads();
    return b;
}

__device__ __forceinline__ float block_max(float v, Shared& sm) {
    return block_argmax(Best{v, 0}, sm).v;
}

// Merge every thread's Online into log(sum over the block of exp(v)) (-inf when empty).
__device__ __forceinline__ float block_logsumexp(const Online& o, Shared& sm) {
    const float m = block_max(o.m, sm);
    if (m == NEG_INF) return NEG_INF;
    const float s = xserv::block_sum(o.m == NEG_INF ? 0.f : o.s * __expf(o.m - m), sm.red_v);
    return m + logf(s);
}

// Exclusive prefix sum over the block; `total` gets the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int& total, Shared& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += t;
    }
    if (lane == 31) sm.scan[warp] = incl;
    // Warp totals are visible before each thread adds up the ones before its warp.
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < BLOCK / 32; ++w) {
        before += w < warp ? sm.scan[w] : 0;
        total += sm.scan[w];
    }
    // scan[] is free for the next call only once every thread has read it.
    __syncthreads();
    return before + incl - v;
}

// ---- one row's parameters and values ------------------------------------------------------------------------
struct RowParams {
    float inv_temp, top_p, min_p, rep, presence, freq;
    int top_k;  // 0 = off
    int slot;   // -1 = no penalty state
    int mask_row, bias_row;  // -1 = none
    uint2 key;
    unsigned step;
    bool greedy, use_seen, use_counts;
};

__device__ __forceinline__ RowParams load_params(const float* __restrict__ fparams, const int* __restrict__ iparams,
                                                 int row, int vocab, int num_slots, int num_mask_rows,
                                                 int num_bias_rows) {
    const float* f = fparams + (long long)row * NUM_F;
    const int* ip = iparams + (long long)row * NUM_I;
    RowParams p;
    const float t = f[F_TEMPERATURE];
    p.greedy = !(t > 0.f);
    p.inv_temp = p.greedy ? 1.f : __fdiv_rn(1.f, t);  // IEEE division: NumPy's float32(1) / float32(T)
    p.top_p = f[F_TOP_P];
    p.min_p = f[F_MIN_P];
    p.rep = f[F_REPETITION];
    p.presence = f[F_PRESENCE];
    p.freq = f[F_FREQUENCY];
    p.top_k = ip[I_TOP_K];
    if (p.top_k <= 0 || p.top_k >= vocab) p.top_k = 0;
    p.slot = ip[I_PENALTY_SLOT];
    if (p.slot < 0 || p.slot >= num_slots) p.slot = -1;
    p.mask_row = ip[I_MASK_ROW];
    if (p.mask_row < 0 || p.mask_row >= num_mask_rows) p.mask_row = -1;
    p.bias_row = ip[I_BIAS_ROW];
    if (p.bias_row < 0 || p.bias_row >= num_bias_rows) p.bias_row = -1;
    p.key = make_uint2((unsigned)ip[I_SEED_LO], (unsigned)ip[I_SEED_HI]);
    p.step = (unsigned)ip[I_STEP];
    p.use_seen = p.slot >= 0 && p.rep != 1.f;
    p.use_counts = p.slot >= 0 && (p.presence != 0.f || p.freq != 0.f);
    return p;
}

template <bool VEC>
struct Row {
    const float* logits;         // [vocab] this row's raw logits
    const int* counts;           // [vocab] this row's slot of the output-token counts (when p.use_counts)
    const unsigned char* seen;   // [vocab] this row's slot of the seen flags (when p.use_seen)
    const int* mask;             // [ceil(vocab / 32)] this row's token bitmask, or null
    const float* bias;           // [vocab] this row's logit bias, or null
    int vocab;
    RowParams p;

    __device__ __forceinline__ int groups() const { return (vocab + GROUP - 1) / GROUP; }

    // Raw logits of tokens 4g .. 4g+3 (bias added, masked tokens -inf); -inf past the end (callers also test
    // i < vocab).
    __device__ __forceinline__ float4 load(int g) const {
        const int i = g * GROUP;
        float4 q;
        if (VEC)
            q = __ldg(reinterpret_cast<const float4*>(logits) + g);
        else
            q = make_float4(i < vocab ? logits[i] : NEG_INF, i + 1 < vocab ? logits[i + 1] : NEG_INF,
                            i + 2 < vocab ? logits[i + 2] : NEG_INF, i + 3 < vocab ? logits[i + 3] : NEG_INF);
        if (bias) {  // -inf + bias stays -inf
            if (VEC) {
                const float4 b = __ldg(reinterpret_cast<const float4*>(bias) + g);
                q = make_float4(__fadd_rn(q.x, b.x), __fadd_rn(q.y, b.y), __fadd_rn(q.z, b.z), __fadd_rn(q.w, b.w));
            } else {
                if (i < vocab) q.x = __fadd_rn(q.x, bias[i]);
                if (i + 1 < vocab) q.y = __fadd_rn(q.y, bias[i + 1]);
                if (i + 2 < vocab) q.z = __fadd_rn(q.z, bias[i + 2]);
                if (i + 3 < vocab) q.w = __fadd_rn(q.w, bias[i + 3]);
            }
        }
        if (mask) {  // the 4 tokens of a group share one word (4g is a multiple of 4), bits 4(g % 8) .. +3
            const unsigned bits = (unsigned)__ldg(mask + (g >> 3)) >> ((g & 7) * GROUP);
            if (!(bits & 1u)) q.x = NEG_INF;
            if (!(bits & 2u)) q.y = NEG_INF;
            if (!(bits & 4u)) q.z = NEG_INF;
            if (!(bits & 8u)) q.w = NEG_INF;
        }
        return q;
    }

    // Raw logit of one token (as load() gives it).
    __device__ __forceinline__ float raw(int i) const {
        float l = logits[i];
        if (bias) l = __fadd_rn(l, bias[i]);
        if (mask && !(((unsigned)mask[i >> 5] >> (i & 31)) & 1u)) l = NEG_INF;
        return l;
    }

    // Penalties, then temperature. Explicit _rn operations: no FMA contraction, so that the NumPy reference,
    // doing the same float32 operations one by one, gets the same bits.
    __device__ __forceinline__ float z(float l, int i) const {
        if (p.use_seen && seen[i]) l = l > 0.f ? __fdiv_rn(l, p.rep) : __fmul_rn(l, p.rep);
        if (p.use_counts) {
            const int c = counts[i];
            l = __fsub_rn(l, __fadd_rn(__fmul_rn(p.presence, c > 0 ? 1.f : 0.f), __fmul_rn(p.freq, (float)c)));
        }
        return p.greedy ? l : __fmul_rn(l, p.inv_temp);
    }
};

__device__ __forceinline__ float comp(const float4& q, int j) { return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w; }

// Sources of (value, token) pairs that the selects, sums and draws iterate over, each thread its share.
struct BufferSource {  // a shared-memory buffer
    const float* v;
    const int* idx;
    int n;
    template <class F>
    __device__ __forceinline__ void for_each(F f) const {
        for (int j = threadIdx.x; j < n; j += BLOCK) f(v[j], idx[j]);
    }
};

template <bool VEC, bool RAW>
struct RowSource {  // the whole row in global memory: z values, or raw logits when RAW
    Row<VEC> row;
    template <class F>
    __device__ __forceinline__ void for_each(F f) const {
        for (int g = threadIdx.x; g < row.groups(); g += BLOCK) {
            const float4 q = row.load(g);
#pragma unroll
            for (int j = 0; j < GROUP; ++j) {
                const int i = g * GROUP + j;
                if (i < row.vocab) f(RAW ? comp(q, j) : row.z(comp(q, j), i), i);
            }
        }
    }
};

// ---- radix select --------------------------------------------------------------------------------------------
// Among the source's values >= lo: the largest value v such that measure{x >= v} >= target, where the measure
// counts values (MASS = false: v is the target-th largest, ties all at or above it) or sums exp(x - vmax)
// (MASS = true: v is the top-p boundary). Four passes over the source, one per 8-bit digit of order_key, most
// significant first; each pass histograms the values whose key matches the digits chosen so far. If rounding
// leaves the whole measure below target, the result is the smallest value (everything kept).
template <bool MASS, class Src>
__device__ float select_threshold(const Src& src, float lo, float vmax, float target, Shared& sm) {
    unsigned prefix = 0, mask = 0;
    float above = 0.f;  // measure of the values whose key is above the current prefix range
    const int lane = threadIdx.x & 31;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += BLOCK) sm.hist[j] = 0.f;
        // The histogram is clear before anyone adds to it.
        __syncthreads();
        src.for_each([&](float v, int) {
            const unsigned k = order_key(v);
            if (v >= lo && (k & mask) == prefix) atomicAdd(&sm.hist[(k >> shift) & 255u], MASS ? __expf(v - vmax) : 1.f);
        });
        // Every value is counted before warp 0 scans.
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l owns bins 255 - 8l down to 248 - 8l: lanes in order walk the bins from the largest values.
            float h[8], sum = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                h[j] = sm.hist[255 - 8 * lane - j];
                sum += h[j];
            }
            float incl = sum;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const float t = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += t;
            }
            float run = above + incl - sum;
            int hit = -1, low = -1;
            float hit_before = 0.f, low_before = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (h[j] > 0.f) {
                    if (hit < 0 && run + h[j] >= target) {
                        hit = j;
                        hit_before = run;
                    }
                    low = j;
                    low_before = run;
                }
                run += h[j];
            }
            const unsigned hits = __ballot_sync(0xffffffffu, hit >= 0);
            const unsigned lows = __ballot_sync(0xffffffffu, low >= 0);
            if (hits) {
                if (lane == __ffs(hits) - 1) {
                    sm.sel_bin = 255 - 8 * lane - hit;
                    sm.sel_above = hit_before;
                }
            } else if (lows) {  // short of target: keep everything down to the lowest non-empty bin
                if (lane == 31 - __clz(lows)) {
                    sm.sel_bin = 255 - 8 * lane - low;
                    sm.sel_above = low_before;
                }
            } else if (lane == 0) {  // empty source: callers never ask
                sm.sel_bin = 0;
                sm.sel_above = above;
            }
        }
        // The chosen digit is visible to every thread.
        __syncthreads();
        prefix |= (unsigned)sm.sel_bin << shift;
        mask |= 0xffu << shift;
        above = sm.sel_above;
    }
    return key_value(prefix);
}

// Sum over the source of exp(v - vmax) for v >= lo.
template <class Src>
__device__ float mass_at_or_above(const Src& src, float lo, float vmax, Shared& sm) {
    float s = 0.f;
    src.for_each([&](float v, int) { if (v >= lo) s += __expf(v - vmax); });
    return xserv::block_sum(s, sm.red_v);
}

template <class Src>
__device__ int count_at_or_above(const Src& src, float lo, Shared& sm) {
    float s = 0.f;
    src.for_each([&](float v, int) { s += v >= lo ? 1.f : 0.f; });
    return (int)xserv::block_sum(s, sm.red_v);
}

// ---- candidate buffers -------------------------------------------------------------------------------------
// The warp appends its lanes' (v, i) where pred holds; true when the buffer passed `limit`.
__device__ __forceinline__ bool warp_append(float* vals, int* idxs, int* count, bool pred, float v, int i, int limit) {
    const unsigned m = __ballot_sync(0xffffffffu, pred);
    if (!m) return false;
    const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
    int base = 0;
    if (lane == leader) base = atomicAdd(count, __popc(m));
    base = __shfl_sync(0xffffffffu, base, leader);
    if (pred) {
        const int pos = base + __popc(m & ((1u << lane) - 1u));
        vals[pos] = v;
        idxs[pos] = i;
    }
    return base + __popc(m) > limit;
}

// Raise the buffer's floor to max(its floor, the keep-th largest entry, min_floor) and drop the entries below
// it, keeping their order. Called by the whole block while nobody appends. If ties keep the buffer above its
// limit, it is marked overflowed (callers then use the row in global memory).
template <int ITEMS>
__device__ void compact(float* vals, int* idxs, int& count, float& floor, int& overflow, int keep, float min_floor,
                        int limit, Shared& sm) {
    const int n = count;
    if (n <= limit || overflow) return;
    const float kth = select_threshold<false>(BufferSource{vals, idxs, n}, NEG_INF, 0.f, (float)keep, sm);
    const float new_floor = fmaxf(fmaxf(floor, kth), min_floor);
    float v[ITEMS];
    int id[ITEMS], kept = 0;
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int j = threadIdx.x * ITEMS + k;
        if (j < n && vals[j] >= new_floor) {
            v[kept] = vals[j];
            id[kept] = idxs[j];
            ++kept;
        }
    }
    int total;
    // The scan's barriers also order every read above before the writes below.
    const int at = block_exclusive_scan(kept, total, sm);
    for (int k = 0; k < kept; ++k) {
        vals[at + k] = v[k];
        idxs[at + k] = id[k];
    }
    if (threadIdx.x == 0) {
        count = total;
        floor = new_floor;
        overflow = total > limit;
    }
    // The new count, floor and entries are visible before anyone reads or appends.
    __syncthreads();
}

// ---- the draw ------------------------------------------------------------------------------------------------
__device__ Best draw_from_buffer(const BufferSource& c, float theta, const RowParams& p, Shared& sm) {
    Best b{NEG_INF, 0x7fffffff};
    c.for_each([&](float v, int i) {
        if (v >= theta && v + GUMBEL_MAX >= b.v) {  // else even the largest noise cannot reach the best
            const uint4 r = philox4x32_10(make_uint4((unsigned)i / GROUP, p.step, 0u, 0u), p.key);
            const float x = __fadd_rn(v, gumbel(word(r, i % GROUP)));
            if (better(x, i, b)) b = Best{x, i};
        }
    });
    return block_argmax(b, sm);
}

template <bool VEC>
__device__ Best draw_from_row(const Row<VEC>& row, float theta, Shared& sm) {
    Best b{NEG_INF, 0x7fffffff};
    for (int g = threadIdx.x; g < row.groups(); g += BLOCK) {
        const float4 q = row.load(g);
        float zs[GROUP];
        bool any = false;
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int i = g * GROUP + j;
            zs[j] = i < row.vocab ? row.z(comp(q, j), i) : NEG_INF;
            // A token below theta is filtered out; one more than GUMBEL_MAX below this thread's best cannot win.
            any |= i < row.vocab && zs[j] >= theta && zs[j] + GUMBEL_MAX >= b.v;
        }
        if (!any) continue;
        const uint4 r = philox4x32_10(make_uint4((unsigned)g, row.p.step, 0u, 0u), row.p.key);  // one call, 4 tokens
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int i = g * GROUP + j;
            if (i < row.vocab && zs[j] >= theta) {
                const float x = __fadd_rn(zs[j], gumbel(word(r, j)));
                if (better(x, i, b)) b = Best{x, i};
            }
        }
    }
    return block_argmax(b, sm);
}

// Step 3 and 4 for a sampled row after pass 1. zsum = sum of exp(z - zmax) over the row (0 when not computed).
template <bool VEC>
__device__ int sample_token(const Row<VEC>& row, float zmax, float zsum, Shared& sm) {
    const RowParams& p = row.p;
    const RowSource<VEC, false> all{row};
    const bool buffer_ok = !sm.overflow_c;
    const float floor = fmaxf(sm.floor_c, zmax - WINDOW);  // the buffer holds exactly {z >= floor}
    const BufferSource buf{sm.cand_v, sm.cand_i, sm.count_c};
    const int in_buffer = buffer_ok ? count_at_or_above(buf, floor, sm) : 0;

    float theta = NEG_INF, total = zsum;
    bool inside = false;  // the kept set lies inside the buffer
    if (p.top_k > 0) {
        if (buffer_ok && in_buffer >= p.top_k) {
            theta = select_threshold<false>(buf, floor, zmax, (float)p.top_k, sm);
            inside = true;
        } else {
            theta = select_threshold<false>(all, NEG_INF, zmax, (float)p.top_k, sm);
        }
        total = inside ? mass_at_or_above(buf, theta, zmax, sm) : mass_at_or_above(all, theta, zmax, sm);
    }
    if (p.top_p < 1.f) {
        const float target = p.top_p * total;
        // Without top-k inside, the nucleus is inside when the buffer (an upper set) holds its mass.
        if (!inside && buffer_ok) inside = mass_at_or_above(buf, fmaxf(floor, theta), zmax, sm) >= target;
        const float tp = inside ? select_threshold<true>(buf, fmaxf(floor, theta), zmax, target, sm)
                                : select_threshold<true>(all, theta, zmax, target, sm);
        theta = fmaxf(theta, tp);
    }
    if (p.min_p > 0.f) theta = fmaxf(theta, zmax + logf(p.min_p));
    inside = buffer_ok && (inside || theta >= floor);
    const Best b = inside ? draw_from_buffer(buf, theta, p, sm) : draw_from_row(row, theta, sm);
    return b.i;
}

// Top-N (value desc, id asc) of the source, written as (id, value - lse): N block argmaxes, each over the values
// after the previous pick in that order.
template <class Src>
__device__ void write_top_n(const Src& src, int top_n, float lse, int* ids, float* logprobs, Shared& sm) {
    Best prev{__int_as_float(0x7f800000), -1};
    for (int r = 0; r < top_n; ++r) {
        Best b{NEG_INF, 0x7fffffff};
        src.for_each([&](float v, int i) {
            const bool after = v < prev.v || (v == prev.v && i > prev.i);
            if (after && better(v, i, b)) b = Best{v, i};
        });
        b = block_argmax(b, sm);
        if (threadIdx.x == 0) {
            ids[r] = b.i;
            logprobs[r] = b.v - lse;
        }
        prev = b;
    }
}

template <bool VEC>
__device__ void sample_row(const float* __restrict__ logits, const float* __restrict__ fparams,
                           const int* __restrict__ iparams, int* counts, unsigned char* seen, int* __restrict__ out,
                           float* __restrict__ logprobs, int* __restrict__ top_ids, float* __restrict__ top_logprobs,
                           const int* __restrict__ token_mask, const float* __restrict__ logit_bias, int vocab,
                           int top_n, int num_slots, int num_mask_rows, int num_bias_rows) {
    __shared__ Shared sm;
    const int b = blockIdx.x;
    const RowParams p = load_params(fparams, iparams, b, vocab, counts != nullptr && seen != nullptr ? num_slots : 0,
                                    token_mask != nullptr ? num_mask_rows : 0,
                                    logit_bias != nullptr ? num_bias_rows : 0);
    const long long slot_base = (long long)(p.slot < 0 ? 0 : p.slot) * vocab;
    const int* mask = p.mask_row < 0 ? nullptr : token_mask + (long long)p.mask_row * ((vocab + 31) / 32);
    const float* bias = p.bias_row < 0 ? nullptr : logit_bias + (long long)p.bias_row * vocab;
    const Row<VEC> row{logits + (long long)b * vocab, counts + slot_base, seen + slot_base, mask, bias, vocab, p};
    // The z buffer serves rows with a filter (temperature alone keeps every token: its draw reads the row).
    const bool collect_c = !p.greedy && (p.top_k > 0 || p.top_p < 1.f || p.min_p > 0.f);
    const bool collect_r = top_n > 0;
    const bool collecting = collect_c || collect_r;  // uniform: greedy rows run pass 1 without barriers
    const bool want_lse = logprobs != nullptr || top_n > 0;
    const bool want_zsum = !p.greedy && p.top_p < 1.f && p.top_k == 0;
    const int keep_c = p.top_k > 0 && p.top_k <= CAND_KEEP ? p.top_k : CAND_KEEP;
    if (threadIdx.x == 0) {
        sm.count_c = sm.count_r = 0;
        sm.floor_c = sm.floor_r = NEG_INF;
        sm.overflow_c = sm.overflow_r = 0;
        sm.runmax_key = order_key(NEG_INF);
    }
    __syncthreads();

    // ---- pass 1: one read of the row --------------------------------------------------------------------------
    Best best{NEG_INF, 0x7fffffff};
    Online zs, raw;
    float floor_c = NEG_INF, floor_r = NEG_INF;
    bool append_c = collect_c, append_r = collect_r;
    const int groups = row.groups();
    // Two tiles of prefetch: two 16-byte loads per thread in flight while a tile is processed (with a barrier per
    // tile, one in flight leaves the memory system idle half the time).
    const float4 none = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
    float4 next0 = threadIdx.x < groups ? row.load(threadIdx.x) : none;
    float4 next1 = threadIdx.x + BLOCK < groups ? row.load(threadIdx.x + BLOCK) : none;
    for (int base = 0; base < groups; base += BLOCK) {
        const int g = base + threadIdx.x;
        const float4 q = next0;
        next0 = next1;
        if (g + 2 * BLOCK < groups) next1 = row.load(g + 2 * BLOCK);
        bool full = false;
        float tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < GROUP; ++j) {
            const int i = g * GROUP + j;
            const bool valid = g < groups && i < vocab;
            const float l = comp(q, j);
            const float z = valid ? row.z(l, i) : NEG_INF;
            if (valid) {
                if (better(z, i, best)) best = Best{z, i};
                if (want_zsum) zs.add(z);
                if (want_lse) raw.add(l);
                tile_max = fmaxf(tile_max, z);
            }
            if (collecting) {
                full |= warp_append(sm.cand_v, sm.cand_i, &sm.count_c, append_c && valid && z >= floor_c, z, i,
                                    CAND_LIMIT);
                full |= warp_append(sm.raw_v, sm.raw_i, &sm.count_r, append_r && valid && l >= floor_r, l, i,
                                    RAW_LIMIT);
            }
        }
        if (!collecting) continue;
        if (collect_c) {
            tile_max = xserv::warp_max(tile_max);
            if ((threadIdx.x & 31) == 0 && tile_max > NEG_INF) atomicMax(&sm.runmax_key, order_key(tile_max));
        }
        // Every append of this tile is done before a buffer is compacted (all threads agree whether to).
        if (__syncthreads_or(full)) {
            const float min_floor = key_value(sm.runmax_key) - WINDOW;
            compact<CAND_CAP / BLOCK>(sm.cand_v, sm.cand_i, sm.count_c, sm.floor_c, sm.overflow_c, keep_c, min_floor,
                                      CAND_LIMIT, sm);
            compact<RAW_CAP / BLOCK>(sm.raw_v, sm.raw_i, sm.count_r, sm.floor_r, sm.overflow_r, RAW_KEEP, NEG_INF,
                                     RAW_LIMIT, sm);
        }
        // Floors only rise, and a floor read late (after a faster thread's next-tile atomicMax) is still <= the
        // final one: the buffer stays exactly {z >= final floor}.
        floor_c = fmaxf(sm.floor_c, key_value(sm.runmax_key) - WINDOW);
        floor_r = sm.floor_r;
        append_c = collect_c && !sm.overflow_c;
        append_r = collect_r && !sm.overflow_r;
    }

    const Best zbest = block_argmax(best, sm);
    const float zsum = want_zsum ? __expf(block_logsumexp(zs, sm) - zbest.v) : 0.f;
    const float lse = want_lse ? block_logsumexp(raw, sm) : 0.f;
    int token = zbest.i == 0x7fffffff ? 0 : zbest.i;
    if (!p.greedy && zbest.v > NEG_INF) token = sample_token(row, zbest.v, zsum, sm);

    if (threadIdx.x == 0) {
        out[b] = token;
        if (logprobs) logprobs[b] = row.raw(token) - lse;
        if (p.slot >= 0) {  // after every read of this slot (the draw ended with a barrier)
            atomicAdd(counts + slot_base + token, 1);
            seen[slot_base + token] = 1;
        }
    }
    if (top_n > 0) {
        int* ids = top_ids + (long long)b * top_n;
        float* lps = top_logprobs + (long long)b * top_n;
        if (sm.overflow_r)
            write_top_n(RowSource<VEC, true>{row}, top_n, lse, ids, lps, sm);
        else
            write_top_n(BufferSource{sm.raw_v, sm.raw_i, sm.count_r}, top_n, lse, ids, lps, sm);
    }
}

}  // namespace

// logits: [batch, vocab] fp32; fparams: [batch, 8] fp32; iparams: [batch, 8] int32; counts: [num_slots, vocab]
// int32 or null; seen: [num_slots, vocab] uint8 or null; out: [batch] int32; logprobs: [batch] fp32 or null;
// top_ids: [batch, top_n] int32 and top_logprobs: [batch, top_n] fp32, or null when top_n == 0;
// token_mask: [num_mask_rows, ceil(vocab / 32)] int32 or null; logit_bias: [num_bias_rows, vocab] fp32 or null.
// grid = batch, block = 512. _vec: 16-byte loads, needs vocab % 4 == 0 and logits (and logit_bias) 16-byte aligned.
#if XSERV_SAMPLE_PIECE(1)
extern "C" __global__ void __launch_bounds__(BLOCK, 2)
sample_f32_vec(const float* logits, const float* fparams, const int* iparams, int* counts, unsigned char* seen, int* out,
               float* logprobs, int* top_ids, float* top_logprobs, const int* token_mask, const float* logit_bias,
               int vocab, int top_n, int num_slots, int num_mask_rows, int num_bias_rows) {
    sample_row<true>(logits, fparams, iparams, counts, seen, out, logprobs, top_ids, top_logprobs, token_mask,
                     logit_bias, vocab, top_n, num_slots, num_mask_rows, num_bias_rows);
}
#endif

#if XSERV_SAMPLE_PIECE(0)
extern "C" __global__ void __launch_bounds__(BLOCK, 2)
sample_f32(const float* logits, const float* fparams, const int* iparams, int* counts, unsigned char* seen, int* out,
           float* logprobs, int* top_ids, float* top_logprobs, const int* token_mask, const float* logit_bias,
           int vocab, int top_n, int num_slots, int num_mask_rows, int num_bias_rows) {
    sample_row<false>(logits, fparams, iparams, counts, seen, out, logprobs, top_ids, top_logprobs, token_mask,
                      logit_bias, vocab, top_n, num_slots, num_mask_rows, num_bias_rows);
}
#endif
