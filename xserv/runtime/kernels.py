"""Kernels: (family, name) -> a launchable callable. The family's cubin is compiled (or read from the disk
cache) and loaded on first use; nothing else is registered anywhere."""
from __future__ import annotations

from cuda.bindings import driver

from .compiler import compile_family, family_source
from .errors import CudaError, check_driver

_SMEM_DEFAULT_LIMIT = 48 * 1024


class Kernel:
    """A loaded kernel. Call it as `kernel(grid, block, *args, smem=0)`.

    Arguments are passed as the kernel declares them: a Tensor or a Python int is a device pointer (the int is
    taken as an address); scalars must be fixed-width NumPy scalars (np.int32, np.float32, ...), since an
    untyped Python float would be passed as a double.
    """

    __slots__ = ("family", "name", "_kernel", "_stream", "_configs", "_smem_limit", "_launch", "_device")

    def __init__(self, family: str, name: str, core_kernel, device):
        from cuda.core import launch

        self.family, self.name = family, name
        self._kernel = core_kernel
        self._device = device
        self._stream = device.stream
        self._configs: dict = {}
        self._smem_limit = _SMEM_DEFAULT_LIMIT
        self._launch = launch

    def _config(self, grid, block, smem):
        key = (grid, block, smem)
        config = self._configs.get(key)
        if config is None:
            from cuda.core import LaunchConfig

            if smem > self._smem_limit:
                self._raise_smem_limit(smem)
            config = LaunchConfig(grid=grid, block=block, shmem_size=smem)
            self._configs[key] = config
        return config

    def _raise_smem_limit(self, smem: int) -> None:
        limit = self._device.info.max_shared_memory_per_block_optin
        if smem > limit:
            raise ValueError(f"{self.name}: {smem} bytes of dynamic shared memory asked, the device allows {limit}")
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = self._kernel.handle
        if isinstance(handle, driver.CUkernel):
            check_driver(driver.cuKernelSetAttribute(attr, smem, handle, self._device.info.index), "cuKernelSetAttribute")
        else:
            check_driver(driver.cuFuncSetAttribute(handle, attr, smem), "cuFuncSetAttribute")
        self._smem_limit = smem

    def __call__(self, grid, block, *args, smem: int = 0):
        config = self._config(grid, block, smem)
        try:
            self._launch(self._stream, config, self._kernel, *[getattr(a, "ptr", a) for a in args])
        except Exception as exc:  # re-raised through our one error path for the driver
            raise CudaError(f"launch of {self.family}/{self.name} grid={grid} block={block} smem={smem} failed: {exc}") from exc

    @property
    def registers(self) -> int:
        regs = self._kernel.attributes.num_regs  # a property in cuda-core >= 1.0, a method before
        return regs() if callable(regs) else int(regs)

    def __repr__(self):
        return f"Kernel({self.family}/{self.name})"


class KernelCache:
    def __init__(self, device):
        self._device = device
        self._modules: dict[str, object] = {}
        self._kernels: dict[tuple[str, str], Kernel] = {}

    def get(self, family: str, name: str) -> Kernel:
        kernel = self._kernels.get((family, name))
        if kernel is None:
            module = self.load_family(family)
            try:
                core = module.get_kernel(name)
            except Exception as exc:
                raise ValueError(f"kernel {name!r} not found in {family_source(family).name} (family {family!r})") from exc
            kernel = self._kernels[(family, name)] = Kernel(family, name, core, self._device)
        return kernel

    def load_family(self, family: str):
        module = self._modules.get(family)
        if module is None:
            from cuda.core import ObjectCode  # cuda.core costs 0.4 s to import: only where kernels load

            cubin = compile_family(family, self._device.arch)
            module = self._modules[family] = ObjectCode.from_cubin(cubin)
        return module
