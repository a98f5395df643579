// sm_90 asynchronous copies through the Tensor Memory Accelerator (TMA) and the shared-memory mbarriers that
// track them (PTX ISA "cp.async.bulk.tensor", "mbarrier"). A TMA copy moves a box described by a CUtensorMap
// (built on the host with cuTensorMapEncodeTiled) from global to shared memory without occupying the issuing
// threads or the load/store pipeline, applies the tensor map's shared-memory swizzle on the way, and signals
// completion by counting its bytes on an mbarrier ("complete_tx").
#pragma once

namespace xserv {

// One-time initialisation of an mbarrier expecting `count` arrivals per phase; make it visible to the async proxy
// (the TMA unit) before any copy targets it.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrive once and announce `bytes` more bytes of copies for the current phase (the phase completes when every
// arrival happened and all announced bytes landed).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrive once (no bytes announced).
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Barrier `id` (1..15; 0 is __syncthreads) among `count` threads (a multiple of 32), e.g. one warpgroup.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Block until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Copy the box at coordinates (c0, c1) (innermost first) of a 2-D tensor map to shared memory `dst`; its bytes complete
// on mbarrier `bar` (the whole box's, the zeros filled in past the tensor's edge included).
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* tensor_map, unsigned bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        ::"r"(dst), "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
// The same for a 5-D tensor map (the MoE gate/up weights' interleaved groups: moe_sm90.cu).
__device__ __forceinline__ void tma_load_5d(unsigned dst, const void* tensor_map, unsigned bar, int c0, int c1, int c2,
                                            int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
        "%7}], [%2];\n" ::"r"(dst),
        "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}
// Copy the box at coordinates (c0, c1, c2) (innermost first) of a 3-D tensor map to shared memory `dst`; its bytes
// complete on mbarrier `bar`. `tensor_map` is the generic address of a CUtensorMap in global memory.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const void* tensor_map, unsigned bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(dst),
        "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

}  // namespace xserv
