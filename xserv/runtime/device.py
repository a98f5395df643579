"""The device context: which GPU, its properties, the default stream."""
from __future__ import annotations

from dataclasses import dataclass

from cuda.bindings import driver

from .arch import SHARED_MEMORY, arch_for, forced_shared_memory, target_from_env
from .errors import CudaError, check_driver


# Shared memory of sm_90 (H100, H200; B200's sm_100 has the same): the per-CTA opt-in limit and an SM's total. The
# planning functions of xserv/ops take a device's numbers as arguments and default to these (the arch the kernels
# were tuned on); the launchers pass the live device's (DeviceInfo). Every CTA also takes CTA_SMEM_RESERVED bytes of
# its SM's shared memory (the runtime's reservation: cudaDevAttrReservedSharedMemoryPerBlock, 1 KB from sm_80 on).
SM90_SMEM_PER_BLOCK_OPTIN, SM90_SMEM_PER_MULTIPROCESSOR = SHARED_MEMORY[(9, 0)]
CTA_SMEM_RESERVED = 1024


def device_count() -> int:
    """Number of CUDA devices; 0 when there is no driver or no GPU (never raises)."""
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, n = driver.cuDeviceGetCount()
        return n if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # a missing libcuda.so surfaces as various loader errors
        return 0


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    arch: str
    multiprocessor_count: int
    l2_cache_bytes: int
    max_shared_memory_per_block_optin: int
    # shared memory of one SM, all resident CTAs together (each CTA also takes 1 KB the runtime reserves): sizes
    # resident-CTA counts (decode's v4 plan, gemv's CTAs per SM). The default is sm_90's (228 KB), for callers that
    # build a DeviceInfo by hand; a live Device reads it from the driver.
    max_shared_memory_per_multiprocessor: int = SM90_SMEM_PER_MULTIPROCESSOR


class Device:
    """Owns the primary context of one GPU and the stream xserv launches on."""

    def __init__(self, index: int = 0):
        n = device_count()
        if n == 0:
            raise RuntimeError("no CUDA device found; use --device cpu")
        if not 0 <= index < n:
            raise RuntimeError(f"CUDA device {index} does not exist; this machine has {n} device(s)")
        from cuda.core import Device as CoreDevice

        self._core = CoreDevice(index)
        self._core.set_current()
        self.stream = self._core.create_stream()
        self.stream_handle = int(self.stream.handle)
        self._copy_stream = None
        attr = driver.CUdevice_attribute

        def get(a):
            return check_driver(driver.cuDeviceGetAttribute(a, index), "cuDeviceGetAttribute")

        major = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        name = self._core.name
        # the compile target: the device's own arch, or XSERV_ARCH's code on it ("sm_80@sm_90a"); a GPU below sm_80
        # or a bad XSERV_ARCH raises here, before anything compiles (runtime/arch.py)
        target = target_from_env((major, minor), name)
        # a forced arch plans its launches within that arch's shared memory too (XSERV_ARCH=sm_89: 99 KB per CTA)
        smem_per_block, smem_per_sm = forced_shared_memory(
            target, get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR))
        self.info = DeviceInfo(
            index=index,
            name=name,
            compute_capability=(major, minor),
            arch=target,
            multiprocessor_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            l2_cache_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            max_shared_memory_per_block_optin=smem_per_block,
            max_shared_memory_per_multiprocessor=smem_per_sm,
        )

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def arch(self) -> str:
        return self.info.arch

    @property
    def multiprocessor_count(self) -> int:
        return self.info.multiprocessor_count

    @property
    def copy_stream_handle(self) -> int:
        """A second stream, for copies that must not wait in line behind xserv's kernels (the sampled tokens'
        read-back, which runs beside the next step's first kernels). Created on first use."""
        if self._copy_stream is None:
            self._copy_stream = self._core.create_stream()
        return int(self._copy_stream.handle)

    def bind_to_thread(self) -> None:
        """Make this GPU's primary context current on the calling thread (CUDA contexts are per thread: a thread
        other than the one that created the Device must bind it before its first launch, or get
        CUDA_ERROR_INVALID_CONTEXT)."""
        self._core.set_current()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = check_driver(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        check_driver(driver.cuStreamSynchronize(self.stream_handle), "cuStreamSynchronize")


__all__ = ["Device", "DeviceInfo", "device_count", "arch_for", "CudaError"]
