"""Kernel families -> cubins for one arch, cached on disk.

A family is one file in cuda_src/: `<family>.cu` (CUDA C++, compiled by NVRTC) or `<family>.ptx` (PTX written by
hand or by another compiler, assembled by nvJitLink). Families in cuda_src/dev/ (named "dev/<name>") are
development kernels: compiled only when asked for by name, never by list_families / ensure_compiled.

The cache key covers everything that changes the binary: the family's source and every header it includes
(followed recursively), the options, the target and the compiler's version (NVRTC for .cu; for .ptx nvJitLink's,
or the driver's where its JIT linker assembles).  Compiling needs no GPU, so CI compiles every family for every
arch it supports (tests/runtime/test_compile_all.py).

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

The code lives by concern: runtime/sources.py finds families and reads their comment lines (the arch, shapes and
start-up lines above), runtime/toolchain.py compiles (NVRTC, nvJitLink), runtime/kernel_cache.py keys and keeps the
cubins, and this module plans a start-up (which families and pieces, compiled in parallel). The rest of xserv, the
tools and the tests import these names from here. A test that points the source folder elsewhere patches
sources.kernel_source_dir (and sources.list_families for the family list): the one binding every module reads.
"""
from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

from .arch import arch_path, families_of
from .kernel_cache import _options_for, cache_dir, cache_key, compile_family, is_cached  # noqa: F401 (re-exported)
from .sources import (DEV_DIR, MODEL_KEYS, PIECE_SEP, SHAPE_KEYS, families_for, family_archs,  # noqa: F401
                      family_pieces, family_shapes, family_source, family_startup, family_supports, kernel_source_dir,
                      list_dev_families, list_families, piece, piece_options)
from .toolchain import (DEFAULT_OPTIONS, PTX_OPTIONS, cuda_include_dir, kernel_code_sizes,  # noqa: F401
                        nvrtc_version, ptx_assembler, ptx_for_arch, ptx_to_cubin)


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
