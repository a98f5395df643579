"""Kernel families -> cubins for one arch, cached on disk.

A family is one file in cuda_src/: `<family>.cu` (CUDA C++, compiled by NVRTC) or `<family>.ptx` (PTX written by
hand or by another compiler, assembled by nvJitLink). Families in cuda_src/dev/ (named "dev/<name>") are
development kernels: compiled only when asked for by name, never by list_families / ensure_compiled.

The cache key covers everything that changes the binary: the family's source and every header it includes
(followed recursively), the options, the target and the compiler's version (NVRTC for .cu; for .ptx nvJitLink's,
or the driver's where its JIT linker assembles).  Compiling needs no GPU, so CI compiles every family for every
arch it supports (tests/test_compile_all.py).

Targets (runtime/arch.py): "sm_90a" compiles for that arch; "sm_80@sm_90a" (XSERV_ARCH=sm_80 on an H100) compiles
the source as for sm_80 (NVRTC to compute_80 PTX; a PTX family's sm_80 form) and assembles that PTX for sm_90a.
A family restricted to some archs says so in a line of its source, `// xserv-arch: sm_90a (why)`; it is compiled
for those code archs only (families_for), and asking for another raises a CompileError naming the family.

Shape pieces: a family whose kernels are template instantiations per model shape declares them in a line of its
source, `// xserv-shapes: head_dim=64,128 group=1,2,3,4,5,6,7,8` (SHAPE_KEYS: head dim, query heads per kv head). It
is then compiled per shape as a *piece*, "attention_decode:d128_g4" = the family's one source with
-DXSERV_HEAD_DIM=128 -DXSERV_GROUP=4, holding only the kernels a model of that shape launches (its own module and
cache entry); the launcher names the piece from the shapes it launches for (piece()), so another shape compiles on
first use. The family compiled by its own name still instantiates everything (the harness, CI). A start-up
compiles the pieces of the loaded model's shapes only (startup_families(target, shapes)). A family may also be split
by keys that are not the model's (gemv's rows and part, sampling's vec: by the entries its launcher picks); a start-up
compiles the pieces its `// xserv-startup: m1_p0 m8_p0 m8_p1` line names (every piece without one), the others
on first use.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from cuda.bindings import driver, nvrtc

from .. import settings
from .arch import arch_path, families_of, parse_arch, split_target
from .device import device_count
from .errors import CompileError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_SUFFIXES = (".cu", ".ptx")
DEV_DIR = "dev"

# -lineinfo keeps source lines for profilers at no run-time cost. Fast math is applied per kernel through
# intrinsics (exp2f, __expf, rsqrtf) where it is safe, not globally, so that reductions keep IEEE division.
DEFAULT_OPTIONS = ("--std=c++17", "-lineinfo", "--fmad=true", "-default-device")
PTX_OPTIONS = ()  # .ptx families: ptxas at its default optimisation level


def kernel_source_dir() -> Path:
    """cuda_src/ of a source checkout, else the copy shipped in the wheel as the package xserv.cuda_src."""
    repo = Path(__file__).resolve().parents[2] / "cuda_src"
    if repo.is_dir() and any(repo.glob("*.cu")):
        return repo
    import xserv.cuda_src as shipped  # only in an installed wheel: a checkout never gets here

    return Path(shipped.__file__).parent


def cache_dir() -> Path:
    return settings.CACHE_DIR.get() / "cubin"


def _families_in(folder: Path, prefix: str = "") -> list[str]:
    return sorted({prefix + p.stem for suffix in _SUFFIXES for p in folder.glob(f"*{suffix}")})


def list_families() -> list[str]:
    """The production families (what a first start compiles): every .cu and .ptx directly in cuda_src/."""
    return _families_in(kernel_source_dir())


def list_dev_families() -> list[str]:
    """The development families in cuda_src/dev/, as "dev/<name>" (compiled on request only)."""
    return _families_in(kernel_source_dir() / DEV_DIR, f"{DEV_DIR}/")


_ARCH_LINE = re.compile(r"^//\s*xserv-arch:\s*((?:sm_\d+a?[ ,]*)+)(.*)$", re.MULTILINE)


def _family_archs(path: Path) -> tuple[tuple[str, ...], str] | None:
    m = _ARCH_LINE.search(path.read_text(errors="replace"))
    if m is None:
        return None
    return tuple(a for a in re.split(r"[ ,]+", m.group(1)) if a), m.group(2).strip()


def family_archs(family: str) -> tuple[str, ...] | None:
    """The code archs a family is compiled for when its source restricts them (`// xserv-arch: sm_90a (...)`), else
    None: every arch from sm_80 on."""
    found = _family_archs(family_source(family))
    return None if found is None else found[0]


def family_supports(family: str, target: str) -> bool:
    archs = family_archs(family)
    return archs is None or split_target(target)[0] in archs


def families_for(target: str) -> list[str]:
    """The production families a device of this target loads: every family whose source admits its code arch
    (on sm_90a all of them; elsewhere all but the sm_90a-only ones)."""
    return [f for f in list_families() if family_supports(f, target)]


def _check_family_arch(family: str, path: Path, target: str) -> None:
    found = _family_archs(path)
    if found is not None and split_target(target)[0] not in found[0]:
        archs, why = found
        raise CompileError(f"kernel family {family!r} is for {', '.join(archs)} only{' ' + why if why else ''}: it "
                           f"is not compiled for {target}, whose ops run other kernels (runtime/arch.py KERNEL_PATHS)")


def family_source(family: str) -> Path:
    """The source file of a family ("rope", "activation", "dev/attention_decode_dev") or of a piece's family
    ("attention_decode:d128_g4" -> attention_decode.cu)."""
    family = family.partition(PIECE_SEP)[0]
    src_dir = kernel_source_dir()
    found = [src_dir / f"{family}{suffix}" for suffix in _SUFFIXES if (src_dir / f"{family}{suffix}").is_file()]
    if not found:
        raise CompileError(f"unknown kernel family {family!r}: no {src_dir / family}.cu or .ptx")
    if len(found) > 1:
        raise CompileError(f"kernel family {family!r} has both {found[0].name} and {found[1].name}; keep one")
    return found[0]


# ---- shape pieces ------------------------------------------------------------------------------------------------
# key of `// xserv-shapes:` -> (its letter in a piece name, the macro a piece defines). head_dim and group are the
# model's (MODEL_KEYS: a start-up compiles the model's piece); any other key splits a family by the entries its
# launcher picks (gemv's rows 1, 8, 16 and part 0, 1; sampling's vec 0, 1): a start-up compiles the pieces its
# `// xserv-startup:` line names by these keys (family_startup; every one without a line), so that the entries a
# model's steps launch compile, in parallel, and the rest on first use. Every family is bf16 only, so the model's
# dtype picks nothing (a float16/float32 checkpoint is cast to bf16 on load).
SHAPE_KEYS = {"head_dim": ("d", "XSERV_HEAD_DIM"), "group": ("g", "XSERV_GROUP"), "rows": ("m", "XSERV_ROWS"),
              "part": ("p", "XSERV_PART"), "vec": ("v", "XSERV_VEC"), "moe": ("e", "XSERV_MOE"),
              "fp8": ("f", "XSERV_FP8"), "moe_fp8": ("x", "XSERV_MOE_FP8"),
              "kvfp8": ("k", "XSERV_KV_FP8")}
# moe=1: a mixture-of-experts model (the moe family's pieces: moe_fp8=1 the FP8 experts' GEMMs, moe_fp8=0 the bf16
# ones, what a model without moe_fp8 takes); fp8=1: an FP8-quantized model (the gemv_fp8 and fp8 families' one piece
# each: the FP8 GEMV, the activation quantization and the weight dequantization); kvfp8=1:
# an engine with an FP8 KV cache (EngineConfig.kv_cache_dtype "fp8_e4m3": the attention_decode_fp8 piece of the shape)
MODEL_KEYS = ("head_dim", "group", "moe", "fp8", "moe_fp8", "kvfp8")
PIECE_SEP = ":"
_SHAPES_LINE = re.compile(r"^//\s*xserv-shapes:((?:[ \t]+\w+=\S+)+)(.*)$", re.MULTILINE)  # then a why
_STARTUP_LINE = re.compile(r"^//\s*xserv-startup:((?:[ \t]+[a-z]\d+(?:_[a-z]\d+)*)+)(.*)$", re.MULTILINE)  # a why
_PIECE_PART = re.compile(r"([a-z])(\d+)")


@lru_cache(maxsize=None)
def _declared_shapes(path: Path, mtime_ns: int) -> dict[str, tuple[int, ...]] | None:
    m = _SHAPES_LINE.search(path.read_text(errors="replace"))
    if m is None:
        return None
    shapes = {}
    for item in m.group(1).split():
        key, _, values = item.partition("=")
        if key not in SHAPE_KEYS or not re.fullmatch(r"\d+(,\d+)*", values):
            raise CompileError(f"{path.name}: bad `// xserv-shapes:` item {item!r}: expected <key>=<n>[,<n>...] with "
                               f"a key among {', '.join(SHAPE_KEYS)}")
        shapes[key] = tuple(int(v) for v in values.split(","))
    return shapes


@lru_cache(maxsize=None)
def _declared_startup(path: Path, mtime_ns: int) -> tuple[dict[str, int], ...] | None:
    m = _STARTUP_LINE.search(path.read_text(errors="replace"))
    if m is None:
        return None
    declared = _declared_shapes(path, mtime_ns) or {}
    others = [k for k in declared if k not in MODEL_KEYS]
    by_letter = {letter: key for key, (letter, _) in SHAPE_KEYS.items()}
    combos = []
    for label in m.group(1).split():
        combo = {by_letter.get(letter, letter): int(v) for letter, v in _PIECE_PART.findall(label)}
        if "_".join(f"{SHAPE_KEYS[k][0]}{combo[k]}" for k in others if k in combo) != label or \
                any(combo[k] not in declared[k] for k in others):
            raise CompileError(f"{path.name}: `// xserv-startup:` names {label!r}: expected a piece label of the "
                               f"keys {', '.join(others) or '(none)'} of its `// xserv-shapes:` line and their values")
        combos.append(combo)
    return tuple(combos)


def family_shapes(family: str) -> dict[str, tuple[int, ...]] | None:
    """The shapes a family is compiled per (its `// xserv-shapes:` line: key -> the values it has kernels for), or
    None for a family compiled whole."""
    path = family_source(family)
    return _declared_shapes(path, path.stat().st_mtime_ns)


def family_startup(family: str) -> tuple[dict[str, int], ...] | None:
    """The values of a family's non-model keys (gemv's rows and part) a start-up compiles, one dict per piece (its
    `// xserv-startup: m1_p0 m8_p0` line), or None: every combination (no such line)."""
    path = family_source(family)
    return _declared_startup(path, path.stat().st_mtime_ns)


@lru_cache(maxsize=None)
def _piece(family: str, items: tuple) -> str:
    declared = family_shapes(family)
    if declared is None:
        return family
    shape = dict(items)
    missing = [k for k in declared if k not in shape]
    if missing:
        raise CompileError(f"kernel family {family!r} is compiled per {', '.join(declared)}: "
                           f"no {', '.join(missing)} given")
    return family + PIECE_SEP + "_".join(f"{SHAPE_KEYS[k][0]}{shape[k]}" for k in declared)


def piece(family: str, **shape: int) -> str:
    """What a launcher asks the kernel cache for: the family itself, or for a family compiled per shape its piece
    for these shapes (piece("attention_decode", head_dim=128, group=4) -> "attention_decode:d128_g4"). Keys the
    family does not declare are ignored."""
    return _piece(family, tuple(sorted(shape.items())))


def family_pieces(family: str) -> list[str]:
    """Every piece of a family compiled per shape (every combination of its declared values); [family] else."""
    declared = family_shapes(family)
    if declared is None:
        return [family]
    import itertools

    keys = list(declared)
    return [piece(family, **dict(zip(keys, combo))) for combo in itertools.product(*(declared[k] for k in keys))]


def piece_options(name: str) -> tuple[str, ...]:
    """The -D options that make a piece of its family's source ("attention_decode:d128_g4" -> -DXSERV_HEAD_DIM=128
    -DXSERV_GROUP=4); () for a family's own name. A shape the family has no kernels for raises a CompileError."""
    family, sep, label = name.partition(PIECE_SEP)
    if not sep:
        return ()
    declared = family_shapes(family)
    if declared is None:
        raise CompileError(f"kernel family {family!r} is not compiled per shape (no `// xserv-shapes:` line): "
                           f"no piece {name!r}")
    by_letter = {letter: key for key, (letter, _) in SHAPE_KEYS.items()}
    found = dict((by_letter.get(letter, letter), int(v)) for letter, v in _PIECE_PART.findall(label))
    if "_".join(f"{SHAPE_KEYS[k][0]}{found[k]}" for k in declared if k in found) != label or set(found) != set(declared):
        raise CompileError(f"{name!r}: expected {family}:" + "_".join(f"{SHAPE_KEYS[k][0]}<n>" for k in declared))
    for key, value in found.items():
        if value not in declared[key]:
            raise CompileError(f"kernel family {family!r} has no kernels for {key} {value} (it has "
                               f"{', '.join(map(str, declared[key]))}): no piece {name!r}")
    return tuple(f"-D{SHAPE_KEYS[k][1]}={found[k]}" for k in declared)


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


def _sources_of(path: Path, seen: dict[Path, bytes]) -> None:
    """Collect the file and the local headers it includes, recursively, into `seen`. A quoted include is looked up
    beside the including file, then in cuda_src/ (the compiler's search order, see _nvrtc_compile)."""
    if path in seen:
        return
    text = path.read_bytes()
    seen[path] = text
    for name in _INCLUDE.findall(text.decode("utf-8", "replace")):
        for folder in (path.parent, kernel_source_dir()):
            header = (folder / name).resolve()
            if header.is_file():
                _sources_of(header, seen)
                break


def _options_for(path: Path, extra_options: tuple[str, ...], name: str = "") -> tuple[str, ...]:
    """The compile options of a family or piece (`name`: its piece options come after the defaults)."""
    return (PTX_OPTIONS if path.suffix == ".ptx" else DEFAULT_OPTIONS) + piece_options(name) + tuple(extra_options)


def cache_key(family: str, arch: str, options: tuple[str, ...]) -> str:
    path = family_source(family)
    files: dict[Path, bytes] = {}
    _sources_of(path.resolve(), files)
    src_dir = kernel_source_dir().resolve()
    h = hashlib.sha256()
    for file in sorted(files):
        h.update(str(file.relative_to(src_dir) if file.is_relative_to(src_dir) else file.name).encode() + b"\0")
        h.update(files[file] + b"\0")
    code, sass = split_target(arch)
    if path.suffix == ".ptx":
        compiler = ptx_assembler()
    else:  # a forced target's PTX is assembled by nvJitLink (or the driver) too
        compiler = ("nvrtc", nvrtc_version()) + ((ptx_assembler(),) if code != sass else ())
    h.update(repr((arch, options, compiler)).encode())
    return h.hexdigest()[:32]


def _cached_path(family: str, arch: str, key: str) -> Path:
    # "dev/x" families land in cache_dir()/dev/; a piece "x:d128_g4" is the file x.d128_g4-<arch>-<key>.cubin
    return cache_dir() / f"{family.replace(PIECE_SEP, '.')}-{arch}-{key}.cubin"


def compile_family(family: str, arch: str, extra_options: tuple[str, ...] = (), use_cache: bool = True) -> bytes:
    """Return the cubin of family `family` for the target `arch` ("sm_90a", or "sm_80@sm_90a": see the module
    docstring), compiling it on a cache miss. `family` may be a piece ("attention_decode:d128_g4": the module
    docstring). A family restricted to other archs raises CompileError."""
    path = family_source(family)
    _check_family_arch(family, path, arch)
    options = _options_for(path, extra_options, family)
    cached = _cached_path(family, arch, cache_key(family, arch, options))
    if use_cache and cached.is_file():
        return cached.read_bytes()
    cubin = (_ptx_assemble if path.suffix == ".ptx" else _nvrtc_compile)(path, arch, options)
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:  # atomic against racing writers
            tmp.write(cubin)
        os.replace(tmp.name, cached)
    return cubin


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
                f"-I{kernel_source_dir()}".encode(), f"-I{cuda_include_dir()}".encode()]
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
    tests/test_compile_all.py once several families assembled PTX at once)."""
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


# ---- a first start: every family, in parallel -------------------------------------------------------------------

def startup_families(target: str, shapes: dict[str, int] | None = None) -> list[str]:
    """What a start-up compiles: the families that compile for the target (families_for) less those the ops launch
    on the other path only (arch.KERNEL_PATHS; on sm_90a attention_prefill, whose v3 and simple kernels then compile
    on first use, when a test or benchmark names them). A family the table does not name is compiled. A family
    compiled per shape (`// xserv-shapes:`) contributes its piece for the model's `shapes` (Model.kernel_shapes);
    without shapes, or for a shape it has no kernels for, nothing: its pieces compile on first use. A family
    split by another key (gemv's rows and part, sampling's vec) contributes the pieces its `// xserv-startup:` line
    names (family_startup: the entries a model's steps launch), every piece without one."""
    path = arch_path(target)
    elsewhere = set().union(*(families_of(p) for p in type(path) if p is not path)) - families_of(path)
    import itertools

    names = []
    for f in families_for(target):
        if f in elsewhere:
            continue
        declared = family_shapes(f)
        if declared is None:
            names.append(f)
            continue
        # a model key the shapes leave out is the model's 0 where the family has a 0 piece (moe_fp8=0: bf16 experts)
        model = {k: (shapes or {}).get(k, 0 if 0 in declared[k] else None) for k in declared if k in MODEL_KEYS}
        if any(value not in declared[k] for k, value in model.items()):
            continue
        others = [k for k in declared if k not in MODEL_KEYS]
        combos = family_startup(f)
        if combos is None:
            combos = [dict(zip(others, c)) for c in itertools.product(*(declared[k] for k in others))]
        names += [piece(f, **model, **combo) for combo in combos]
    return names


def is_cached(family: str, arch: str, extra_options: tuple[str, ...] = ()) -> bool:
    """Is the cubin of this family or piece for `arch` in the disk cache?"""
    path = family_source(family)
    return _cached_path(family, arch, cache_key(family, arch, _options_for(path, extra_options, family))).is_file()


def missing_families(arch: str, extra_options: tuple[str, ...] = (), shapes: dict[str, int] | None = None) -> list[str]:
    """The families and pieces a start-up on target `arch` compiles (startup_families) whose cubin is not in the
    disk cache."""
    return [f for f in startup_families(arch, shapes) if not is_cached(f, arch, extra_options)]


def compile_families(families: list[str], arch: str, use_cache: bool = True, workers: int | None = None,
                     on_done=None, extra_options: tuple[str, ...] = ()) -> dict[str, float]:
    """Compile `families` on parallel threads (NVRTC and nvJitLink release the GIL: measured, two families on two
    cores take the time of the longer one) and return each family's compile seconds. By default one thread per
    core, the largest sources first (longest-first scheduling, with source size standing in for compile time): on
    a 2-core machine every production family compiled in 20.8 s this way, against 23.7 s with one thread per family.
    on_done(family, seconds, error) is called as each finishes (error: None, or the exception); the first failure
    is raised after all ran."""
    if not families:
        return {}
    workers = workers or max(1, min(len(families), os.cpu_count() or 1))
    families = sorted(families, key=lambda f: -family_source(f).stat().st_size)

    def build(family: str) -> float:
        t0 = time.perf_counter()
        error = None
        try:
            compile_family(family, arch, extra_options=extra_options, use_cache=use_cache)
        except Exception as exc:
            error = exc
        seconds = time.perf_counter() - t0
        if on_done is not None:
            on_done(family, seconds, error)
        if error is not None:
            raise error
        return seconds

    times: dict[str, float] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {f: pool.submit(build, f) for f in families}
        errors = []
        for family, future in futures.items():
            try:
                times[family] = future.result()
            except Exception as exc:
                errors.append(exc)
    if errors:
        raise errors[0]
    return times


def ensure_compiled(arch: str, progress: bool = True, shapes: dict[str, int] | None = None) -> list[str]:
    """Compile every family the ops launch on the target's kernel path (startup_families: on sm_90a all but
    attention_prefill, whose v3 and simple kernels run there only when a test or benchmark asks; elsewhere all but
    the sm_90a-only attention_prefill_sm90), the families compiled per shape as their pieces for the model's
    `shapes` (Model.kernel_shapes; other shapes compile on first use), that are missing from the disk cache (a
    first run takes seconds; later starts load the cubins in milliseconds), on parallel threads, with a progress
    bar when stderr is a terminal. Returns the families and pieces compiled."""
    todo = missing_families(arch, shapes=shapes)
    if not todo:
        return []
    from ..progress import progress_bar  # only a first start on a terminal draws a bar

    bar = progress_bar(len(todo), f"compiling CUDA kernels for {arch} (first run; cached in {cache_dir()})",
                       enabled=progress, unit="family", leave=False)
    try:
        compile_families(todo, arch, on_done=None if bar is None else lambda *done: bar.update(1))
    finally:
        if bar is not None:
            bar.close()
    return todo


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
