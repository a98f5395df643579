"""One error path per library: the CUDA driver, NVRTC and cuBLAS each raise their own exception type whose
message names the failing call and the library's status name."""
from __future__ import annotations

from cuda.bindings import driver


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compile log (file:line: error)."""


class CublasError(RuntimeError):
    """A cuBLAS / cuBLASLt call failed."""


class DeviceOutOfMemory(MemoryError):
    """The caching allocator could not get the bytes it was asked for, even after emptying its cache."""


def check_driver(result, what: str = "CUDA driver call"):
    """Unwrap a cuda.bindings.driver return tuple `(CUresult, *values)`; raise CudaError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        text = text.decode() if isinstance(text, bytes) else ""
        raise CudaError(f"{what} failed: {name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
