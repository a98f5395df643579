"""NVRTC: a cuda_src family (one .cu file) -> a cubin for one arch, cached on disk.

The cache key covers everything that changes the binary: the family's source and every header it includes
(followed recursively), the compile options, the target arch and the NVRTC version. Compiling needs no GPU,
so CI compiles every family for sm_90a.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

from .errors import CompileError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# -lineinfo keeps source lines for profilers at no run-time cost. Fast math is applied per kernel through
# intrinsics (exp2f, __expf, rsqrtf) where it is safe, not globally, so that reductions keep IEEE division.
DEFAULT_OPTIONS = ("--std=c++17", "-lineinfo", "--fmad=true", "-default-device")


def kernel_source_dir() -> Path:
    """cuda_src/ of a source checkout, else the copy shipped in the wheel as the package xserv.cuda_src."""
    repo = Path(__file__).resolve().parents[2] / "cuda_src"
    if repo.is_dir() and any(repo.glob("*.cu")):
        return repo
    import xserv.cuda_src as shipped

    return Path(shipped.__file__).parent


def cache_dir() -> Path:
    return Path(os.environ.get("XSERV_CACHE_DIR", Path.home() / ".cache" / "xserv")) / "cubin"


def list_families() -> list[str]:
    return sorted(p.stem for p in kernel_source_dir().glob("*.cu"))


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


@lru_cache(maxsize=None)
def cuda_include_dir() -> str:
    from cuda import pathfinder

    found = pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("CUDA headers not found: install the nvidia-cuda-runtime wheel (pip install xserv does)")
    return str(found)


def _sources_of(path: Path, seen: dict[Path, bytes]) -> None:
    """Collect the file and the local headers it includes, recursively, into `seen`."""
    if path in seen:
        return
    text = path.read_bytes()
    seen[path] = text
    for name in _INCLUDE.findall(text.decode("utf-8", "replace")):
        header = path.parent / name
        if header.is_file():
            _sources_of(header, seen)


def cache_key(family: str, arch: str, options: tuple[str, ...]) -> str:
    src_dir = kernel_source_dir()
    files: dict[Path, bytes] = {}
    _sources_of(src_dir / f"{family}.cu", files)
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.name.encode() + b"\0" + files[path] + b"\0")
    h.update(repr((arch, options, nvrtc_version())).encode())
    return h.hexdigest()[:32]


def compile_family(family: str, arch: str, extra_options: tuple[str, ...] = (), use_cache: bool = True) -> bytes:
    """Return the cubin of cuda_src/<family>.cu for `arch` (e.g. "sm_90a"), compiling it on a cache miss."""
    src_dir = kernel_source_dir()
    path = src_dir / f"{family}.cu"
    if not path.is_file():
        raise CompileError(f"unknown kernel family {family!r}: no {path}")
    options = DEFAULT_OPTIONS + tuple(extra_options)
    key = cache_key(family, arch, options)
    cached = cache_dir() / f"{family}-{arch}-{key}.cubin"
    if use_cache and cached.is_file():
        return cached.read_bytes()
    cubin = _nvrtc_compile(path, arch, options)
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:  # atomic against racing writers
            tmp.write(cubin)
        os.replace(tmp.name, cached)
    return cubin


def _nvrtc_compile(path: Path, arch: str, options: tuple[str, ...]) -> bytes:
    from cuda.bindings import nvrtc

    source = path.read_bytes()
    err, prog = nvrtc.nvrtcCreateProgram(source, str(path).encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram", path)
    try:
        opts = [f"--gpu-architecture={arch}".encode(), f"-I{path.parent}".encode(), f"-I{cuda_include_dir()}".encode()]
        opts += [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {path.name} for {arch}:\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize", path)
        cubin = bytearray(size)  # a fresh buffer: NVRTC writes into it
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN", path)
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(prog) -> str:
    from cuda.bindings import nvrtc

    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # A fresh bytearray, never `b" " * size`: for size 1 that is CPython's shared one-byte b" " object, and
    # NVRTC writing its NUL into it turns every later b" " in the process into b"\x00".
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return bytes(log).decode("utf-8", "replace").rstrip("\0 \n")


def _check(err, what: str, path: Path) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed for {path.name}: {msg.decode() if isinstance(msg, bytes) else err}")


def missing_families(arch: str, extra_options: tuple[str, ...] = ()) -> list[str]:
    """Families whose cubin for `arch` is not in the disk cache yet."""
    options = DEFAULT_OPTIONS + tuple(extra_options)
    return [f for f in list_families()
            if not (cache_dir() / f"{f}-{arch}-{cache_key(f, arch, options)}.cubin").is_file()]


def ensure_compiled(arch: str, progress: bool = True) -> list[str]:
    """Compile every family missing from the disk cache (a first run takes tens of seconds; later starts load
    the cubins in milliseconds), with a progress bar. NVRTC runs outside the GIL, so families compile in
    parallel threads. Returns the families compiled."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    todo = missing_families(arch)
    if not todo:
        return []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"compiling CUDA kernels for {arch} (first run; cached in {cache_dir()})",
                   unit="family", leave=False)

    def build(family):
        compile_family(family, arch)
        if bar is not None:
            bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, len(todo))) as pool:
            list(pool.map(build, todo))
    finally:
        if bar is not None:
            bar.close()
    return todo
