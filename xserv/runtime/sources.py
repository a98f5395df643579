"""Kernel families in cuda_src/: which exist, where their source is, and what their source says about itself.

A family declares in comment lines of its source the code archs it is for (`// xserv-arch:`), the shapes it is
compiled per (`// xserv-shapes:`) and the pieces a start-up compiles (`// xserv-startup:`); runtime/compiler.py's
docstring describes that language. Everything here reads files only: no compiler, no GPU.

The other runtime modules ask for the source folder through this module's kernel_source_dir (never a copy bound by
`from .sources import`), so that a test pointing it at a folder of its own (monkeypatching
sources.kernel_source_dir) redirects discovery, include lookup and compiling together.
"""
from __future__ import annotations

import itertools
import re
from functools import lru_cache
from pathlib import Path

from .arch import split_target
from .errors import CompileError

_SUFFIXES = (".cu", ".ptx")
DEV_DIR = "dev"


def kernel_source_dir() -> Path:
    """cuda_src/ of a source checkout, else the copy shipped in the wheel as the package xserv.cuda_src."""
    repo = Path(__file__).resolve().parents[2] / "cuda_src"
    if repo.is_dir() and any(repo.glob("*.cu")):
        return repo
    import xserv.cuda_src as shipped  # only in an installed wheel: a checkout never gets here

    return Path(shipped.__file__).parent


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
              "kvfp8": ("k", "XSERV_KV_FP8"), "gdn": ("l", "XSERV_GDN")}
# moe=1: a mixture-of-experts model (the moe family's pieces: moe_fp8=1 the FP8 experts' GEMMs, moe_fp8=0 the bf16
# ones, what a model without moe_fp8 takes); fp8=1: an FP8-quantized model (the gemv_fp8 and fp8 families' one piece
# each: the FP8 GEMV, the activation quantization and the weight dequantization); kvfp8=1:
# an engine with an FP8 KV cache (EngineConfig.kv_cache_dtype "fp8_e4m3": the attention_decode_fp8 piece of the shape);
# gdn=1: a hybrid model with Gated DeltaNet (linear attention) layers (the gdn family)
MODEL_KEYS = ("head_dim", "group", "moe", "fp8", "moe_fp8", "kvfp8", "gdn")
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
