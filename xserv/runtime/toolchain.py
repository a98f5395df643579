"""The compilers: a CUDA C++ family through NVRTC, a PTX family through nvJitLink (or the driver's JIT linker), to a
cubin for one target ("sm_90a", or "sm_80@sm_90a": runtime/compiler.py's docstring). No cache and no discovery here:
runtime/kernel_cache.py decides what to compile and keeps the result; runtime/sources.py finds the files.
"""
from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path

from cuda.bindings import driver, nvrtc

from . import sources
from .arch import parse_arch, split_target
from .device import device_count
from .errors import CompileError

# -lineinfo keeps source lines for profilers at no run-time cost. Fast math is applied per kernel through
# intrinsics (exp2f, __expf, rsqrtf) where it is safe, not globally, so that reductions keep IEEE division.
DEFAULT_OPTIONS = ("--std=c++17", "-lineinfo", "--fmad=true", "-default-device")
PTX_OPTIONS = ()  # .ptx families: ptxas at its default optimisation level


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


@lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    from cuda import pathfinder  # looked up once, only when a .cu family is compiled

    found = pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("CUDA headers not found: install the nvidia-cuda-runtime wheel (pip install xserv does)")
    return str(found)


# ---- CUDA C++ through NVRTC ------------------------------------------------------------------------------------

def _nvrtc_compile(path: Path, target: str, options: tuple[str, ...]) -> bytes:
    """NVRTC: the cubin for a native target; for "code@sass" PTX of the code arch (compute_XY, __CUDA_ARCH__ = XY0),
    assembled for the sass arch."""
    code, sass = split_target(target)
    arch = code if code == sass else "compute_" + code[len("sm_"):]
    source = path.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(source, str(path).encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram", path)
    try:
        opts = [f"--gpu-architecture={arch}".encode(), f"-I{path.parent}".encode(),
                f"-I{sources.kernel_source_dir()}".encode(), f"-I{cuda_include_dir()}".encode()]
        opts += [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {path.name} for {target}:\n{log}")
        if code != sass:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _check(err, "nvrtcGetPTXSize", path)
            ptx = bytearray(size)
            (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
            _check(err, "nvrtcGetPTX", path)
            return ptx_to_cubin(bytes(ptx).rstrip(b"\0"), sass, f"{path.name} ({code} PTX)")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize", path)
        cubin = bytearray(size)  # a fresh buffer: NVRTC writes into it
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN", path)
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # A fresh bytearray, never `b" " * size`: for size 1 that is CPython's shared one-byte b" " object, and
    # NVRTC writing its NUL into it turns every later b" " in the process into b"\x00".
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return bytes(log).decode("utf-8", "replace").rstrip("\0 \n")


def _check(err, what: str, path: Path) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed for {path.name}: {msg.decode() if isinstance(msg, bytes) else err}")


# ---- PTX through nvJitLink (or the driver's linker) ---------------------------------------------------------------

_PTXAS_LINE = re.compile(r"ptxas[^,\n]*, line (\d+); (\w+)\s*: ([^\n]*)")


@lru_cache(maxsize=None)
def ptx_assembler() -> tuple[str, tuple[int, ...]]:
    """Who assembles PTX here, with its version (part of the cache key): nvJitLink (the nvidia-nvjitlink wheel; no
    GPU needed), else the CUDA driver's JIT linker (a GPU machine without the wheel)."""
    try:
        from cuda.bindings import nvjitlink  # its library is a separate wheel: may be missing on a GPU machine

        return "nvjitlink", tuple(int(v) for v in nvjitlink.version())
    except Exception:
        pass
    if device_count() == 0:
        raise CompileError("PTX kernel families need nvJitLink (pip install nvidia-nvjitlink) or a CUDA GPU")
    err, version = driver.cuDriverGetVersion()
    return "driver", (int(version),)


_import_lock = threading.Lock()


def _cuda_core():
    """cuda.core's Device, Program, ProgramOptions, imported on first use (0.4 s: PTX only) under a lock: compile
    threads that reach it together would otherwise see a partly initialised module (an ImportError, seen in
    tests/runtime/test_compile_all.py once several families assembled PTX at once)."""
    with _import_lock:
        from cuda.core import Device, Program, ProgramOptions

    return Device, Program, ProgramOptions


def ptx_to_cubin(ptx: bytes, arch: str, name: str = "<ptx>") -> bytes:
    """Assemble PTX text for `arch` into a cubin. A PTX error raises CompileError with `name:line: error: ...`
    lines (ptxas's messages, re-addressed to the file)."""
    Device, Program, ProgramOptions = _cuda_core()

    if ptx_assembler()[0] == "driver":
        Device(0).set_current()  # the driver's linker works in a context (this thread may have none yet)
    try:
        program = Program(ptx.decode("utf-8"), code_type="ptx", options=ProgramOptions(arch=arch))
        return bytes(program.compile("cubin").code)
    except Exception as exc:  # the linker's own error type, with ptxas's log in its message
        raise CompileError(f"failed to assemble {name} for {arch}:\n{_ptx_error_lines(str(exc), name)}") from None


def _ptx_error_lines(log: str, name: str) -> str:
    """ptxas says "ptxas application ptx input, line 9; error   : ..."; make it "name:9: error: ..." (the other
    lines of the log as they are)."""
    return _PTXAS_LINE.sub(lambda m: f"{name}:{m.group(1)}: {m.group(2)}: {m.group(3)}", log)


_PTX_TARGET = re.compile(r"^(\s*\.target\s+)(sm_\d+a?)\b", re.MULTILINE)
_PDL_LINE = re.compile(r"^\s*griddepcontrol\.\w+\s*;[^\n]*\n", re.MULTILINE)


def ptx_for_arch(ptx: str, arch: str, name: str = "<ptx>") -> str:
    """A PTX family's text for code arch `arch`. The file's `.target` is the lowest arch its instructions need and
    assembles as it is for that arch and every later one. The one rewrite: a file at `.target sm_90` (what
    griddepcontrol, programmatic dependent launch, needs) is given for an arch below sm_90 with its griddepcontrol
    lines left out and `.target sm_80`. That is what the kernel means there: PDL launches exist from sm_90 on, so
    below it nothing launches these kernels with the attribute, and without it griddepcontrol.wait returns at once
    (every earlier kernel in the stream has finished) and launch_dependents has nothing to release. Any other
    instruction the sm_80 form cannot have is ptxas's error, as usual."""
    m = _PTX_TARGET.search(ptx)
    if m is None:
        raise CompileError(f"{name}: no .target line")
    declared = m.group(2)
    have, want = parse_arch(declared), parse_arch(arch)
    if have[2] and declared != arch:
        raise CompileError(f"{name} declares .target {declared}, an arch-specific target: it assembles for {declared} "
                           f"only, not {arch}; declare the lowest arch its instructions need")
    if have[:2] <= want[:2]:
        return ptx
    if have[:2] == (9, 0) and want[:2] >= (8, 0):
        return _PTX_TARGET.sub(r"\g<1>sm_80", _PDL_LINE.sub("", ptx), count=1)
    raise CompileError(f"{name} declares .target {declared}: it cannot be assembled for {arch}")


def _ptx_assemble(path: Path, target: str, options: tuple[str, ...]) -> bytes:
    code, sass = split_target(target)
    text = ptx_for_arch(path.read_text(), code, str(path))
    return ptx_to_cubin(text.encode(), sass, str(path))



def kernel_code_sizes(cubin: bytes) -> dict[str, int]:
    """Bytes of machine code of each kernel entry in a cubin (its `.text.<name>` ELF section). In a chain of short
    kernels each launch runs its code from a cold instruction cache, so code size is a cost (docs/kernels/gemv.md);
    `python -m tools.kernel_harness sizes` prints these."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF image (a cubin)")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # Elf64_Shdr: name, type (u32), flags, addr, offset, size (u64), ...
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sizes = {}
    for name_off, _type, _flags, _addr, _offset, size in headers:
        start = names_at + name_off
        name = cubin[start:cubin.index(b"\0", start)].decode()
        if name.startswith(".text."):
            sizes[name[len(".text."):]] = size
    return sizes
