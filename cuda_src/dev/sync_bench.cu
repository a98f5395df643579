// What a hand-off between dependent steps costs on this GPU (a batch-1 decoder layer is a chain of
// all-to-all dependencies, so a persistent kernel only pays if its grid-wide hand-off is cheaper than a kernel
// boundary). Two forms of the same tiny dependent step, "CTA b reads what CTA b + 1 wrote in the step before":
//   sync_chain_step     one kernel per step; the order comes from the stream (or, launched with programmatic
//                       dependent launch, from pdl_wait)
//   sync_grid_barrier   one persistent kernel, a software grid barrier between the steps; four barrier forms
// tools/dev/bench_sync.py times them; tests/test_runtime.py checks that every form orders the data. Not a production
// family (cuda_src/dev/: compiled on request).
#include "common.cuh"

namespace {

constexpr unsigned kLine = 32;   // unsigned values per 128-byte line: each counter and flag on its own line
constexpr unsigned kGroup = 8;   // CTAs per first-level counter of the two-level barrier
constexpr int kMaxLoads = 16;    // 16-byte weight loads per thread and round, at most (gemv_row keeps 16 in flight)
constexpr int kNoBarrier = 4;    // form: the loads alone, no barrier (what they cost without one)

__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
    unsigned before;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(before) : "l"(p), "r"(v) : "memory");
    return before;
}

__device__ __forceinline__ void red_add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

}  // namespace

// One step of the chain: next[b] = prev[(b + 1) % G] + 1, read after pdl_wait (a no-op in a plain launch). Before
// the wait every thread loads `loads` 16-byte chunks of `weights` (a GEMV's pre-wait weights; the launch's `step`
// picks a fresh part) and folds them into sink[0] if they ever match a constant (they do not: it keeps the loads).
// The caller may pad the dynamic shared memory so that the next step's CTAs cannot be resident beside these ones.
// prev, next: [G] uint32 (G = gridDim.x); block: any size, thread 0 does the chain's work; weights:
// [weight_chunks] 16-byte chunks, a power of two.
extern "C" __global__ void sync_chain_step(const unsigned* __restrict__ prev, unsigned* __restrict__ next,
                                           const uint4* __restrict__ weights, long long weight_chunks, int loads,
                                           int step, unsigned* sink) {
    uint4 w[kMaxLoads];
    const long long first = ((long long)step * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
#pragma unroll
    for (int i = 0; i < kMaxLoads; ++i)
        if (i < loads) w[i] = weights[(first * kMaxLoads + i) & (weight_chunks - 1)];
    xserv::pdl_wait();
    xserv::pdl_launch_dependents();
    if (threadIdx.x == 0) next[blockIdx.x] = prev[(blockIdx.x + 1) % gridDim.x] + 1;
    unsigned v = 0;
#pragma unroll
    for (int i = 0; i < kMaxLoads; ++i)
        if (i < loads) v ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
    if (v == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// `rounds` steps in one launch. In round r, thread 0 of CTA b writes r + 1 into slot (r & 1) of b, passes the
// barrier, reads the slot of CTA b + 1 and counts a mismatch in errors[0]; the CTA's other threads wait at
// __syncthreads, as a persistent kernel's would. (A slot is written again two rounds later, after every CTA has
// passed the barrier in between, so after every read of it.) Barrier forms (thread 0 of each CTA):
//   0  atomic counter: atom.add.acq_rel on one counter, then ld.acquire polls of that counter until it reaches
//      (r + 1) * G
//   1  the same with a reduction (red.release: no value comes back) for the arrival
//   2  last arriver releases a flag: the atom's old value tells the last CTA, which st.release-es the generation into
//      a flag on another line; the others poll the flag (arrivals and polls on different lines)
//   3  two levels: groups of kGroup CTAs count on their own lines, each group's last arriver counts on the top
//      counter, whose last arriver releases the flag (fewer arrivals on one address)
//   4  no barrier (the neighbour check is skipped): what the loads below cost alone
// Before each barrier every thread (warp0_loads = 0: all but warp 0, so the arriving thread has none in flight)
// issues `loads` (<= kMaxLoads) 16-byte loads of `weights` and uses them after it: does the arrival's release wait
// for them? All CTAs must be resident at once (the caller launches at most what fits). data: [2 * G] uint32; sync:
// [kLine * (2 + ceil(G / kGroup))] uint32, zero at launch; errors: [2] uint32 (mismatches; [1] never written);
// weights: [weight_chunks] 16-byte chunks, a power of two.
extern "C" __global__ void sync_grid_barrier(unsigned* data, unsigned* sync, unsigned* errors, int rounds, int form,
                                             const uint4* __restrict__ weights, long long weight_chunks, int loads,
                                             int warp0_loads) {
    const unsigned grid = gridDim.x, b = blockIdx.x;
    const unsigned groups = (grid + kGroup - 1) / kGroup, group = b / kGroup;
    const unsigned group_size = min(kGroup, grid - group * kGroup);
    unsigned* counter = sync;
    unsigned* flag = sync + kLine;
    unsigned* group_counter = sync + (2 + group) * kLine;
    const bool loader = loads > 0 && (warp0_loads || threadIdx.x >= 32);
    unsigned sink = 0;
    for (int r = 0; r < rounds; ++r) {
        unsigned* slot = data + (r & 1) * grid;
        const unsigned gen = r + 1;
        // The next phase's weights, loaded before the barrier and used after it (a persistent GEMV's pattern): each
        // loading thread's chunks of this round, a fresh part of `weights` every round (cold: past L2).
        uint4 w[kMaxLoads];
        if (loader) {
            const long long first = ((long long)r * grid + b) * blockDim.x + threadIdx.x;
#pragma unroll
            for (int i = 0; i < kMaxLoads; ++i)
                if (i < loads) w[i] = weights[(first * kMaxLoads + i) & (weight_chunks - 1)];
        }
        if (threadIdx.x == 0 && form != kNoBarrier) {
            slot[b] = gen;
            if (form == 0) {
                atom_add_acq_rel(counter, 1);
                while (ld_acquire(counter) < gen * grid) {
                }
            } else if (form == 1) {
                red_add_release(counter, 1);
                while (ld_acquire(counter) < gen * grid) {
                }
            } else {
                const bool last = form == 2 ? atom_add_acq_rel(counter, 1) == gen * grid - 1
                                            : atom_add_acq_rel(group_counter, 1) == gen * group_size - 1 &&
                                                  atom_add_acq_rel(counter, 1) == gen * groups - 1;
                if (last) {
                    st_release(flag, gen);
                } else {
                    while (ld_acquire(flag) < gen) {
                    }
                }
            }
            if (slot[(b + 1) % grid] != gen) atomicAdd(errors, 1u);
        }
        if (loader) {
#pragma unroll
            for (int i = 0; i < kMaxLoads; ++i)
                if (i < loads) sink ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
        }
        __syncthreads();
    }
    if (sink == 0x9e3779b9u) atomicAdd(errors + 1, 1u);  // keeps the loads (never expected to happen)
}
