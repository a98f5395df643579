"""Kernels: (family, name) -> a launchable callable. The family's cubin is compiled (or read from the disk
cache) and loaded on first use; nothing else is registered anywhere.

A launch goes straight to the driver (`cuLaunchKernel`, or `cuLaunchKernelEx` for programmatic dependent launch)
with the kernel's parameters pre-packed: for each call signature (the tuple of argument types) a kernel keeps a
buffer with one 8-byte slot per parameter, the array of the slots' addresses that the driver reads
(`kernelParams`), and a `struct` layout that writes every value into its slot in one call. The first call of a
signature checks it against the kernel's own parameter list (count and sizes, from the cubin); later calls of that
signature pay a dictionary lookup, one pack and the driver call. Launches come from one thread at a time (xserv's
engine thread): the buffers are reused by every call of their signature.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np
from cuda.bindings import driver

from .arch import pdl_enabled
from .compiler import compile_family, family_source
from .errors import CudaError, check_driver

_SMEM_DEFAULT_LIMIT = 48 * 1024  # static + dynamic shared memory a CTA may use without the opt-in attribute
_SLOT = 8  # bytes per parameter slot: every parameter xserv passes is a pointer or a scalar of at most 8 bytes
_SUCCESS = driver.CUresult.CUDA_SUCCESS
_cuLaunchKernel = driver.cuLaunchKernel
_cuLaunchKernelEx = driver.cuLaunchKernelEx

# NumPy scalar type -> struct code (little-endian, standard sizes). A Tensor (or anything with a `ptr`) and a Python
# int are 64-bit device addresses.
_SCALAR_CODES = {
    np.int8: "b", np.uint8: "B", np.int16: "h", np.uint16: "H", np.int32: "i", np.uint32: "I",
    np.int64: "q", np.uint64: "Q", np.float16: "e", np.float32: "f", np.float64: "d", np.bool_: "?",
}


def _kind(arg) -> tuple[str, int, str]:
    """(how the value is read: 'ptr' attribute / the value itself, its size in bytes, its struct code) for one
    argument, or ValueError saying what to pass instead."""
    t = type(arg)
    code = _SCALAR_CODES.get(t)
    if code is not None:
        return "value", struct.calcsize("<" + code), code
    if t is int:
        return "value", 8, "Q"
    if t is bool or isinstance(arg, bool):
        raise ValueError("a bool has no fixed width: pass np.int32 (or np.bool_ for a C++ bool)")
    if isinstance(arg, float):
        raise ValueError("a Python float would be passed as a double: pass np.float32 (or np.float64)")
    if hasattr(type(arg), "ptr"):  # Tensor (its `ptr` is a slot), DeviceBuffer
        return "ptr", 8, "Q"
    raise ValueError(f"cannot pass a {t.__name__}: pass a Tensor, a device address (int) or a NumPy scalar")


class _Packer:
    """The parameters of one call signature of one kernel, in a buffer of 8-byte slots; `params` is the address of
    the void* array of the slots that the driver reads. Two functions are generated for the signature (the values
    go into their slots in one pack_into call, without a per-argument Python loop):
    `pack(*args)`, and `launch(gx, gy, gz, bx, by, bz, smem, args)` (args: the tuple of the call's arguments, as
    many as the signature has) = the argument types checked against the signature's (None when one differs: the
    caller then looks the signature up), pack, cuLaunchKernel on the kernel's stream (its result tuple)."""

    __slots__ = ("pack", "launch", "params", "nargs", "_buffer", "_pointers")

    def __init__(self, kinds: list[tuple[str, int, str]], types: tuple, func, stream):
        n = max(1, len(kinds))
        self.nargs = len(kinds)
        self._buffer = ctypes.create_string_buffer(_SLOT * n)
        base = ctypes.addressof(self._buffer)
        self._pointers = (ctypes.c_void_p * n)(*[base + _SLOT * i for i in range(n)])
        self.params = ctypes.addressof(self._pointers)
        layout = struct.Struct("<" + "".join(code + "x" * (_SLOT - size) for _, size, code in kinds))
        names = ", ".join(f"a{i}" for i in range(len(kinds)))
        values = ", ".join(f"a{i}.ptr" if how == "ptr" else f"a{i}" for i, (how, _, _) in enumerate(kinds))
        same_types = " or ".join(f"type(a{i}) is not _t{i}" for i in range(len(kinds))) or "False"
        sep = ", " if kinds else ""
        source = (
            "def make(_pack_into, _buffer, _params, _func, _stream, _t):\n"
            + "".join(f"    _t{i} = _t[{i}]\n" for i in range(len(kinds)))
            + f"    def pack({names}):\n"
            f"        _pack_into(_buffer, 0{sep}{values})\n"
            # the arguments come as one tuple (a plain call, cheaper than spreading them with *args)
            "    def launch(gx, gy, gz, bx, by, bz, smem, args):\n"
            + (f"        {names}, = args\n" if kinds else "")
            + f"        if {same_types}:\n"
            "            return None\n"
            f"        _pack_into(_buffer, 0{sep}{values})\n"
            "        return _cuLaunchKernel(_func, gx, gy, gz, bx, by, bz, smem, _stream, _params, 0)\n"
            "    return pack, launch\n"
        )
        scope: dict = {}
        # The module's globals: `_cuLaunchKernel` is looked up at call time (tests replace it with a fake driver).
        exec(source, globals(), scope)  # noqa: S102 - the source is built above from argument positions only
        self.pack, self.launch = scope["make"](layout.pack_into, self._buffer, self.params, func, stream, types)


class _NoPacker:
    """Kernel._last before the first call: matches no call."""
    nargs = -1


class Kernel:
    """A loaded kernel. Call it as `kernel(grid, block, *args, smem=0, pdl=False)`; grid and block are an int or a
    tuple of 1-3 ints.

    Arguments are passed as the kernel declares them: a Tensor (anything with a `ptr`) or a Python int is a device
    pointer (the int is taken as an address); scalars must be fixed-width NumPy scalars (np.int32, np.float32, ...),
    since an untyped Python float would be a double. A call whose arguments do not match the kernel's parameters
    (count, sizes) raises ValueError naming the argument; a failed launch raises CudaError naming the kernel.

    pdl=True launches with programmatic stream serialization (Hopper and later; a plain launch where the kernels are
    compiled for an arch before sm_90, XSERV_ARCH=sm_80 on an H100 included: runtime/arch.pdl_enabled): the
    kernel may start while the previous kernel in the stream is still running, so it must call xserv::pdl_wait()
    (cuda_src/common.cuh) before reading anything an earlier kernel wrote. Works under CUDA-graph capture.

    cluster=n (sm_90 and later, n <= 8) launches the grid as thread-block clusters of n CTAs along x (grid x a
    multiple of n): the CTAs of a cluster run at the same time and can read and write each other's shared memory
    (PTX mapa / ld.shared::cluster / barrier.cluster; v4c, a decode kernel that used them, is in the history:
    docs/kernels/attention.md).
    """

    __slots__ = ("family", "name", "_kernel", "_device", "_func", "_hstream", "_smem_limit", "_packers", "_last",
                 "_param_sizes", "_pdl_supported", "_ex_configs")

    def __init__(self, family: str, name: str, core_kernel, device):
        self.family, self.name = family, name
        self._kernel = core_kernel
        self._device = device
        handle = core_kernel.handle
        if isinstance(handle, driver.CUkernel):  # cuda.core >= 0.2 loads libraries: take this context's function
            self._func = check_driver(driver.cuKernelGetFunction(handle), "cuKernelGetFunction")
        else:
            self._func = handle
        self._hstream = driver.CUstream(device.stream_handle)
        self._smem_limit = 0  # dynamic bytes known to launch; the first larger launch reads the kernel's static size
        self._packers: dict[tuple, _Packer] = {}
        self._last: _Packer | _NoPacker = _NoPacker()  # the signature of the last plain launch
        self._param_sizes: list[int] | None | bool = False  # False: not read yet; None: the driver cannot say
        # PDL (and clusters) from sm_90 on, by the code the kernels were compiled as: under XSERV_ARCH=sm_80 on an
        # H100 they carry no griddepcontrol.wait, so a PDL launch would let them read inputs not yet written
        arch = getattr(device, "arch", None)
        self._pdl_supported = pdl_enabled(arch) if arch else device.info.compute_capability[0] >= 9
        self._ex_configs: dict[tuple, object] = {}

    def __call__(self, grid, block, *args, smem: int = 0, pdl: bool = False, cluster: int = 1):
        if type(grid) is int:
            gx = grid
            gy = gz = 1
        else:
            gx, gy, gz = _dims("grid", grid)
        if type(block) is int:
            bx = block
            by = bz = 1
        else:
            bx, by, bz = _dims("block", block)
        if smem > self._smem_limit:
            self._fit_smem(smem)
        if cluster != 1:
            self._check_cluster(cluster, gx)
        if (pdl and self._pdl_supported) or cluster != 1:
            packer = self._packer(args)
            try:
                packer.pack(*args)
                config = self._ex_config(gx, gy, gz, bx, by, bz, smem, pdl and self._pdl_supported, cluster)
                result = _cuLaunchKernelEx(config, self._func, packer.params, 0)
            except Exception as exc:
                self._raise_bad_call(exc, args, grid, block, smem)
        else:
            # The last signature launched, its argument types checked inside its launch (None: they differ); else
            # the signature's own packer, found by the types of the arguments (and checked, the first time).
            last = self._last
            try:
                result = last.launch(gx, gy, gz, bx, by, bz, smem, args) if len(args) == last.nargs else None
            except Exception as exc:
                self._raise_bad_call(exc, args, grid, block, smem)
            if result is None:
                last = self._last = self._packer(args)
                try:
                    result = last.launch(gx, gy, gz, bx, by, bz, smem, args)
                except Exception as exc:
                    self._raise_bad_call(exc, args, grid, block, smem)
        err = result[0]
        if err is not _SUCCESS:  # enum members are singletons; check_driver compares by value before raising
            check_driver((err,), f"launch of {self._where(grid, block, smem)}")

    def _packer(self, args) -> _Packer:
        packer = self._packers.get(tuple(map(type, args)))
        if packer is None:
            packer = self._new_packer(args)  # checked against the kernel's parameters once per signature
        return packer

    def _raise_bad_call(self, exc: Exception, args, grid, block, smem):
        # an argument that cannot be packed (a CPU tensor, a negative address, a value out of its type's range) is
        # named in a ValueError; anything else (a grid the binding cannot convert) failed the launch
        bad = self._bad_argument(args)
        if bad is not None:
            raise bad from exc
        raise CudaError(f"launch of {self._where(grid, block, smem)} failed: {exc}") from exc

    # ---- first call of a signature, errors --------------------------------------------------------------------
    def _new_packer(self, args) -> _Packer:
        kinds = []
        for i, arg in enumerate(args):
            try:
                kinds.append(_kind(arg))
            except ValueError as exc:
                raise ValueError(f"{self.family}/{self.name}: argument {i}: {exc}") from None
        sizes = self.param_sizes
        if sizes is not None:
            if len(args) != len(sizes):
                raise ValueError(f"{self.family}/{self.name}: {len(args)} arguments given, the kernel takes {len(sizes)}")
            for i, ((how, size, code), want) in enumerate(zip(kinds, sizes)):
                if size != want:
                    address = how == "ptr" or type(args[i]) is int
                    what = "a device address (8 bytes)" if address else f"a {type(args[i]).__name__} ({size} bytes)"
                    raise ValueError(f"{self.family}/{self.name}: argument {i} is {what}, the kernel's parameter {i} "
                                     f"takes {want} bytes")
        types = tuple(map(type, args))
        packer = self._packers[types] = _Packer(kinds, types, self._func, self._hstream)
        return packer

    def _bad_argument(self, args) -> ValueError | None:
        """The first argument that cannot be packed, named (a CPU tensor, a negative address, a value out of
        range); None when every argument packs."""
        for i, arg in enumerate(args):
            how, size, code = _kind(arg)
            try:
                struct.pack("<" + code, arg.ptr if how == "ptr" else arg)
            except Exception as exc:
                return ValueError(f"{self.family}/{self.name}: argument {i} ({type(arg).__name__}): {exc}")
        return None

    def _where(self, grid, block, smem) -> str:
        return f"{self.family}/{self.name} grid={grid} block={block} smem={smem}"

    @property
    def param_sizes(self) -> list[int] | None:
        """The size in bytes of each of the kernel's parameters, from the cubin (None where the driver cannot say:
        cuFuncGetParamInfo needs CUDA 12.4)."""
        if self._param_sizes is False:
            self._param_sizes = _param_sizes(self._func)
        return self._param_sizes

    def _ex_config(self, gx, gy, gz, bx, by, bz, smem, pdl: bool, cluster: int):
        """The cuLaunchKernelEx configuration of a launch with attributes (programmatic stream serialization, a
        cluster dimension), built once per shape."""
        key = (gx, gy, gz, bx, by, bz, smem, pdl, cluster)
        config = self._ex_configs.get(key)
        if config is None:
            attrs = []
            if pdl:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                attrs.append(attr)
            if cluster != 1:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
                attrs.append(attr)
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
            config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
            config.sharedMemBytes = smem
            config.hStream = self._hstream
            config.attrs = attrs
            config.numAttrs = len(attrs)
            self._ex_configs[key] = config
        return config

    def _check_cluster(self, cluster, gx) -> None:
        if not self._pdl_supported:  # clusters, like programmatic dependent launch, start with sm_90
            cc = ".".join(map(str, self._device.info.compute_capability))
            raise ValueError(f"{self.name}: a cluster launch needs sm_90 or later, this device is {cc} "
                             f"(kernels for {getattr(self._device, 'arch', cc)})")
        if type(cluster) is not int or not 1 <= cluster <= 8:
            raise ValueError(f"{self.name}: cluster {cluster!r}: expected an int in 1..8 (CTAs per cluster along x)")
        if gx % cluster:
            raise ValueError(f"{self.name}: grid x {gx} is not a multiple of the cluster size {cluster}")

    def _fit_smem(self, smem: int) -> None:
        """Make a launch with `smem` dynamic bytes valid. The driver counts the kernel's static __shared__ arrays
        with the dynamic bytes: past 48 KB together (not the dynamic bytes alone) the opt-in attribute must be
        raised, else the launch fails with CUDA_ERROR_INVALID_VALUE."""
        static = _static_smem(self._func)
        if static + smem <= _SMEM_DEFAULT_LIMIT:
            self._smem_limit = _SMEM_DEFAULT_LIMIT - static
            return
        limit = self._device.info.max_shared_memory_per_block_optin
        if static + smem > limit:
            raise ValueError(f"{self.name}: {smem} bytes of dynamic shared memory asked (and {static} static), the "
                             f"device allows {limit}")
        _allow_dynamic_smem(self._kernel.handle, self._func, self._device.info.index, smem)
        self._smem_limit = smem

    @property
    def registers(self) -> int:
        regs = self._kernel.attributes.num_regs  # a property in cuda-core >= 1.0, a method before
        return regs() if callable(regs) else int(regs)

    def __repr__(self):
        return f"Kernel({self.family}/{self.name})"


def _dims(what: str, dims) -> tuple[int, int, int]:
    """A grid or block given as a tuple of 1-3 ints -> (x, y, z)."""
    n = len(dims) if type(dims) in (tuple, list) else 0
    if n == 3:
        return dims[0], dims[1], dims[2]
    if n == 1:
        return dims[0], 1, 1
    if n == 2:
        return dims[0], dims[1], 1
    if isinstance(dims, (int, np.integer)) and not isinstance(dims, bool):
        return int(dims), 1, 1
    raise ValueError(f"{what}: expected an int or a tuple of 1 to 3 ints, got {dims!r}")


def _param_sizes(func) -> list[int] | None:
    get_info = getattr(driver, "cuFuncGetParamInfo", None)
    if get_info is None:
        return None
    sizes = []
    while True:
        try:
            err, _offset, size = get_info(func, len(sizes))
        except Exception:
            return None
        if err != _SUCCESS:
            # past the last parameter the driver answers CUDA_ERROR_INVALID_VALUE; anything else on the first
            # index means it cannot tell (an old driver)
            return sizes if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE else None
        sizes.append(int(size))


def _static_smem(func) -> int:
    """Bytes of a kernel's static __shared__ arrays."""
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
    return int(check_driver(driver.cuFuncGetAttribute(attr, func), "cuFuncGetAttribute"))


def _allow_dynamic_smem(handle, func, device_index: int, smem: int) -> None:
    """Raise a kernel's dynamic shared memory limit to `smem` bytes (the opt-in past 48 KB)."""
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):
        check_driver(driver.cuKernelSetAttribute(attr, smem, handle, device_index), "cuKernelSetAttribute")
    check_driver(driver.cuFuncSetAttribute(func, attr, smem), "cuFuncSetAttribute")


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
