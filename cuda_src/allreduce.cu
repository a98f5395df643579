// One-shot all-reduce of a small bf16 message over CUDA IPC peer memory (tensor parallelism, xserv/parallel/ipc.py).
//
// Every rank owns one buffer, opened by every peer through cuIpcOpenMemHandle; `bases[q]` is rank q's buffer as
// mapped in this process (bases[rank] is our own). Layout of one rank's buffer (xserv/parallel/ipc.py IpcLayout):
//   flags    uint32 [2][MAX_BLOCKS][MAX_WORLD]   written by the peers: flags[p][b][q] = epoch when rank q's block b
//                                                 has pushed its data for that epoch into our data[p][q]
//   counters uint32 [MAX_BLOCKS]                 private: the last epoch block b of this rank ran (never read by peers)
//   data     bf16   [2][world][cap]              rank q's partial of epoch e lands in data[e & 1][q] (at DATA_OFFSET)
// The abort word is not in it: a host-mapped pinned word of this process (`abort_flag`), set when a peer died.
//
// Call k on every rank (same n, same grid: the caller guarantees both):
//   e = counters[b] + 1 (a device-side counter: a CUDA graph replays the launch with the same arguments, so the epoch
//   cannot come from the host), p = e & 1.
//   1. push: each thread writes its chunks of the local partial `in` into data[p][rank] of every rank's buffer
//      (remote stores over NVLink are posted writes: cheaper than every rank pulling with remote loads).
//   2. signal: one thread per destination q stores flags[p][b][rank] = e into q's buffer with release semantics.
//   3. wait: one thread per source q spins (acquire) on our flags[p][b][q] until it reads e.
//   4. sum: each thread adds its chunks of data[p][0..world) in rank order in float32 and rounds to bf16 once, so
//      every rank computes the same bits (the same operands in the same order).
//   5. counters[b] = e.
//
// Why two halves (p) suffice: rank r writes data[p][r] of a peer q again at call k + 2. Before that, at call k + 1,
// r's block b waited for q's block b flag of epoch e + 1, which q's kernel of call k + 1 stored, and that kernel ran
// only after q's kernel of call k ended (stream order), i.e. after q finished reading data[p] of call k. The same
// argument covers the flag word flags[p][b][r] (rewritten at call k + 2 only): the waiter compares with ==.
// Every block participates in every call (the grid is fixed by the caller, blocks with no elements still signal
// and wait), so all blocks' counters stay equal and a block only ever waits for the same block index of its peers.
//
// Assumptions: world <= MAX_WORLD, gridDim.x <= MAX_BLOCKS, n <= cap, `in`, `out` and the data arrays 16-byte
// aligned (the launcher checks). `in` may equal `out` (each element is read and written by the same thread).
#include "common.cuh"

namespace {

constexpr int MAX_WORLD = 8;
constexpr int MAX_BLOCKS = 32;
constexpr long long FLAGS_BYTES = 2LL * MAX_BLOCKS * MAX_WORLD * 4;
constexpr long long COUNTERS_OFFSET = FLAGS_BYTES;
constexpr long long DATA_OFFSET = 4096;  // xserv/parallel/ipc.py IpcLayout.data_offset

// Release store at system scope: every write this thread has observed before it (its own, and through the
// preceding bar.sync those of the whole CTA: PTX release is cumulative) is visible to whoever acquires this value,
// on any GPU or the host. This is what makes the pushed data visible before the peer sees the flag.
__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Acquire load at system scope: once it returns the peer's epoch, every write the peer made before its release
// store is visible to this thread, and (through the bar.sync that follows) to the rest of the CTA.
__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A relaxed volatile read of the host-mapped abort word: no ordering needed, only that each poll really reads it.
__device__ __forceinline__ unsigned int load_volatile(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

}  // namespace

// One call's place in the protocol for this block: its epoch, data half, own buffer, and its range of 8-element
// (16-byte) chunks. Begins with the programmatic-dependent-launch wait (the launcher sets the attribute from sm_90
// on): everything after it reads what earlier kernels wrote (the input, the residual, this block's counter), and it
// also orders this call after the previous one on this stream, which the two-halves argument above relies on.
// It then releases the next kernel at once: its CTAs start beside ours and stream their weights (a GEMV's pre-wait
// prefetch) during the NVLink round trip, and its own pdl_wait still waits for this grid to complete.
struct IpcCall {
    char* own;
    unsigned int epoch;
    int p;
    long long half;    // elements of one half of the data array
    long long c0, c1;  // this block's chunks [c0, c1)
};

__device__ __forceinline__ IpcCall ipc_begin(const unsigned long long* __restrict__ bases, int rank, int world,
                                             long long n, long long cap) {
    xserv::pdl_wait();
    xserv::pdl_launch_dependents();
    IpcCall c;
    c.own = reinterpret_cast<char*>(bases[rank]);
    // Plain load: the previous writer of counters[b] is this block's thread 0 in an earlier kernel on this stream,
    // ordered before us by the kernel boundary (and the wait above).
    c.epoch = reinterpret_cast<unsigned int*>(c.own + COUNTERS_OFFSET)[blockIdx.x] + 1u;
    c.p = c.epoch & 1u;
    c.half = (long long)world * cap;
    const long long chunks = (n + 7) / 8;  // the last chunk possibly partial
    const long long per_block = (chunks + gridDim.x - 1) / gridDim.x;
    c.c0 = blockIdx.x * per_block;
    c.c1 = min(chunks, c.c0 + per_block);
    return c;
}

// 1. push this block's chunks of `in` into slot `rank` of half p of every rank's data (our own buffer included).
// Weak stores: their ordering before the flag comes from the bar.sync + release store in ipc_signal_wait.
__device__ __forceinline__ void ipc_push(const IpcCall& c, const __nv_bfloat16* in,
                                         const unsigned long long* __restrict__ bases, int rank, int world,
                                         long long n, long long cap) {
    for (long long k = c.c0 + threadIdx.x; k < c.c1; k += blockDim.x) {
        const long long i = k * 8;
        if (i + 8 <= n) {
            const uint4 v = *reinterpret_cast<const uint4*>(in + i);
            for (int q = 0; q < world; ++q) {
                __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(bases[q]) + DATA_OFFSET)
                                     + c.p * c.half + (long long)rank * cap + i;
                *reinterpret_cast<uint4*>(dst) = v;
            }
        } else {
            for (long long j = i; j < n; ++j) {
                const __nv_bfloat16 v = in[j];
                for (int q = 0; q < world; ++q) {
                    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(bases[q]) +
                                                                          DATA_OFFSET) + c.p * c.half + (long long)rank * cap;
                    dst[j] = v;
                }
            }
        }
    }
}

// 2-3. signal every rank that our block's data of this epoch is in its buffer, then wait for every rank's block b.
__device__ __forceinline__ void ipc_signal_wait(const IpcCall& c, const unsigned long long* __restrict__ bases,
                                                const unsigned int* abort_flag, int rank, int world) {
    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    // Every thread's pushes happen-before thread q's release below (CTA-scope barrier; the release is cumulative).
    __syncthreads();
    if (tid < world) {
        unsigned int* flags = reinterpret_cast<unsigned int*>(bases[tid]);
        store_release_sys(flags + ((c.p * MAX_BLOCKS + b) * MAX_WORLD + rank), c.epoch);
    }
    // The abort word is polled every 1024 spins (a host-mapped read crosses PCIe).
    if (tid < world) {
        const unsigned int* flag =
            reinterpret_cast<const unsigned int*>(c.own) + ((c.p * MAX_BLOCKS + b) * MAX_WORLD + tid);
        unsigned int spins = 0;
        while (load_acquire_sys(flag) != c.epoch) {
            if ((++spins & 1023u) == 0 && load_volatile(abort_flag) != 0) break;
        }
    }
    // The waiting threads' acquires happen-before every thread's reads after this (CTA-scope barrier).
    __syncthreads();
}

// 5. the next call on this stream starts from this epoch. Plain store: read back only by this block in the next
// kernel on this stream (kernel boundary). Every thread read the epoch before the first bar.sync.
__device__ __forceinline__ void ipc_end(const IpcCall& c) {
    if (threadIdx.x == 0) reinterpret_cast<unsigned int*>(c.own + COUNTERS_OFFSET)[blockIdx.x] = c.epoch;
}

// residual: [n] float32 or null (ADD_RESIDUAL only): residual += the rounded sum, element by element, by the thread
// that computed it (no other thread or rank touches it: the tensor-parallel fused one-token path's residual add).
template <bool ADD_RESIDUAL>
__device__ __forceinline__ void allreduce_oneshot(
    const __nv_bfloat16* in, __nv_bfloat16* out, float* residual, const unsigned long long* __restrict__ bases,
    const unsigned int* abort_flag, int rank, int world, long long n, long long cap) {
    const IpcCall c = ipc_begin(bases, rank, world, n, cap);
    ipc_push(c, in, bases, rank, world, n, cap);
    ipc_signal_wait(c, bases, abort_flag, rank, world);

    // 4. sum the world partials in rank order, float32, one rounding. ld.global.cg reads at L2, the point of
    // coherence for the NVLink writes into our memory: no L1 line of an earlier epoch can be returned (the acquire
    // already orders this; the .cg is belt and braces at no cost, each address is read once).
    const __nv_bfloat16* data = reinterpret_cast<const __nv_bfloat16*>(c.own + DATA_OFFSET) + c.p * c.half;
    for (long long k = c.c0 + threadIdx.x; k < c.c1; k += blockDim.x) {
        const long long i = k * 8;
        if (i + 8 <= n) {
            float acc[8], part[8];
            xserv::bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(data + i)), acc);
            for (int q = 1; q < world; ++q) {
                xserv::bf16x8_to_float(__ldcg(reinterpret_cast<const uint4*>(data + (long long)q * cap + i)), part);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] += part[e];
            }
            xserv::bf16x8 r;
#pragma unroll
            for (int e = 0; e < 4; ++e) r.h[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
            *reinterpret_cast<xserv::bf16x8*>(out + i) = r;
            if constexpr (ADD_RESIDUAL) {
                // the rounded bf16 sum, as fused_add_rmsnorm would add the stored all-reduce output
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(r.h[e]);
                    residual[i + 2 * e] += f.x;
                    residual[i + 2 * e + 1] += f.y;
                }
            }
        } else {
            for (long long j = i; j < n; ++j) {
                float acc = __bfloat162float(__ldcg(data + j));
                for (int q = 1; q < world; ++q) acc += __bfloat162float(__ldcg(data + (long long)q * cap + j));
                out[j] = __float2bfloat16_rn(acc);
                if constexpr (ADD_RESIDUAL) residual[j] += __bfloat162float(out[j]);
            }
        }
    }
    ipc_end(c);
}

// in, out: [n] bf16 (may alias); bases: [world] device addresses of every rank's IPC buffer in this process;
// abort_flag: [1] uint32, host-mapped (nonzero: the host gave up on a dead peer; the waits end, the output is garbage).
extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_bf16(
    const __nv_bfloat16* in, __nv_bfloat16* out, const unsigned long long* __restrict__ bases,
    const unsigned int* abort_flag, int rank, int world, long long n, long long cap) {
    allreduce_oneshot<false>(in, out, nullptr, bases, abort_flag, rank, world, n, cap);
}

// The same, then residual += out (float32 [n]): the all-reduce of a row-parallel o / down projection's partial and
// the residual add of the fused one-token path in one launch (xserv/models/dense.py, docs/engine.md).
extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_add_bf16(
    const __nv_bfloat16* in, __nv_bfloat16* out, float* residual, const unsigned long long* __restrict__ bases,
    const unsigned int* abort_flag, int rank, int world, long long n, long long cap) {
    allreduce_oneshot<true>(in, out, residual, bases, abort_flag, rank, world, n, cap);
}

// Rank 0's int32 tokens to every rank, through the same protocol (one more call in every rank's sequence of calls:
// the epochs stay equal): rank 0 pushes its `tokens` (bits, as 2 x count bf16 elements) into slot 0 of every rank's
// data, every rank signals and waits as for a sum, then copies slot 0 into its `tokens`, minus `offset` (this rank's
// first vocab-parallel token id: the embedding's row numbering). A decode step launched before the previous step's
// tokens reached the host (xserv/engine/model_runner.py) starts with this on every rank: the other ranks have no
// sampler. Rank 0's `tokens` are only read (its offset is 0: nothing to copy back).
extern "C" __global__ void __launch_bounds__(512) ipc_broadcast_tokens(
    int* tokens, const unsigned long long* __restrict__ bases, const unsigned int* abort_flag, int rank, int world,
    long long count, long long cap, int offset) {
    const long long n = 2 * count;  // bf16 elements
    const IpcCall c = ipc_begin(bases, rank, world, n, cap);
    if (rank == 0) ipc_push(c, reinterpret_cast<const __nv_bfloat16*>(tokens), bases, rank, world, n, cap);
    ipc_signal_wait(c, bases, abort_flag, rank, world);
    const int* data = reinterpret_cast<const int*>(
        reinterpret_cast<const __nv_bfloat16*>(c.own + DATA_OFFSET) + c.p * c.half);  // slot 0
    // this block's chunks cover tokens [4 * c0, 4 * c1) (a chunk is 8 bf16 = 4 tokens)
    if (rank != 0)
        for (long long t = 4 * c.c0 + threadIdx.x; t < min(count, 4 * c.c1); t += blockDim.x)
            tokens[t] = __ldcg(data + t) - offset;
    ipc_end(c);
}
