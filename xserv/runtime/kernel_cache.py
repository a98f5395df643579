"""The disk cache of cubins: one file per family or piece, target and key, where the key covers everything that
changes the binary (the family's source and every local header it includes, followed recursively; the options; the
target; the compiler and its version). compile_family is the one way to a cubin: the cached file, else the
compilers' output written there atomically.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from .. import settings
from . import sources
from .arch import split_target
from .sources import PIECE_SEP, _check_family_arch, family_source, piece_options
from .toolchain import DEFAULT_OPTIONS, PTX_OPTIONS, _nvrtc_compile, _ptx_assemble, nvrtc_version, ptx_assembler

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cache_dir() -> Path:
    return settings.CACHE_DIR.get() / "cubin"



def _sources_of(path: Path, seen: dict[Path, bytes]) -> None:
    """Collect the file and the local headers it includes, recursively, into `seen`. A quoted include is looked up
    beside the including file, then in cuda_src/ (the compiler's search order, see _nvrtc_compile)."""
    if path in seen:
        return
    text = path.read_bytes()
    seen[path] = text
    for name in _INCLUDE.findall(text.decode("utf-8", "replace")):
        for folder in (path.parent, sources.kernel_source_dir()):
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
    src_dir = sources.kernel_source_dir().resolve()
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
    """Return the cubin of family `family` for the target `arch` ("sm_90a", or "sm_80@sm_90a": see runtime/compiler.py's
    docstring), compiling it on a cache miss. `family` may be a piece ("attention_decode:d128_g4": the same
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


def is_cached(family: str, arch: str, extra_options: tuple[str, ...] = ()) -> bool:
    """Is the cubin of this family or piece for `arch` in the disk cache?"""
    path = family_source(family)
    return _cached_path(family, arch, cache_key(family, arch, _options_for(path, extra_options, family))).is_file()
