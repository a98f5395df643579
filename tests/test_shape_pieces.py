"""Shape pieces (runtime/compiler.py): attention_decode, attention_decode_v2 and gemv are compiled per shape, the
runtime loading the piece of the shape it launches ("attention_decode:d128_g4", "gemv:m1"), a start-up compiling the
model's pieces only. CPU tests: names, options, what a start-up compiles, and that every kernel a launcher can pick
for a shape is instantiated in that shape's piece (read from the sources' `#if XSERV_PIECE(D, Q)` /
`#if XSERV_ROWS_HAS(M)` blocks); one real NVRTC compile of a tiny family with a shapes line. The pieces of the
shipped families are compiled for sm_90a in tests/test_compile_all.py."""
import dataclasses
import re

import pytest

import xserv.ops.attention as A
import xserv.ops.attention.decode as D
import xserv.ops.gemv as G
from xserv.runtime import CompileError
from xserv.runtime import compiler
from xserv.runtime.compiler import (family_pieces, family_shapes, family_source, kernel_code_sizes, kernel_shapes,
                                    piece, piece_options, startup_families)


class Config:
    def __init__(self, heads, kv_heads, head_dim=128):
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim


def test_names_and_options():
    assert family_shapes("attention_decode") == {"head_dim": (64, 128), "group": tuple(range(1, 9))}
    assert family_shapes("attention_decode_v2") == family_shapes("attention_decode")
    assert family_shapes("gemv") == {"rows": (1, 8, 16)}
    assert family_shapes("rope") is None and family_shapes("dev/attention_decode_dev") is None
    assert piece("attention_decode", head_dim=128, group=4) == "attention_decode:d128_g4"
    assert piece("rope", head_dim=128, group=4) == "rope"  # not compiled per shape: the family itself
    assert piece("gemv", rows=16, head_dim=128) == "gemv:m16"  # keys a family does not declare are ignored
    assert piece_options("attention_decode:d64_g8") == ("-DXSERV_HEAD_DIM=64", "-DXSERV_GROUP=8")
    assert piece_options("gemv:m8") == ("-DXSERV_ROWS=8",) and piece_options("gemv") == ()
    assert family_source("attention_decode:d64_g8") == family_source("attention_decode")
    assert len(family_pieces("attention_decode")) == 16 and family_pieces("rope") == ["rope"]
    for bad, match in [("attention_decode:d96_g4", "head_dim 96"), ("attention_decode:d128_g9", "group 9"),
                       ("attention_decode:g4_d128", "expected attention_decode:d<n>_g<n>"),
                       ("attention_decode:d128", "expected"), ("rope:d128_g4", "not compiled per shape")]:
        with pytest.raises(CompileError, match=match):
            piece_options(bad)
    with pytest.raises(CompileError, match="no group given"):
        piece("attention_decode", head_dim=128)


def test_startup_compiles_the_models_pieces_only():
    assert kernel_shapes(Config(16, 8)) == {"head_dim": 128, "group": 2}  # Qwen3-0.6B
    assert kernel_shapes(Config(32, 8)) == {"head_dim": 128, "group": 4}  # Qwen3-8B
    for target in ("sm_90a", "sm_80@sm_90a", "sm_89", "sm_120a"):
        names = startup_families(target, kernel_shapes(Config(32, 8)))
        pieces = [n for n in names if ":" in n]
        assert pieces == ["attention_decode:d128_g4", "attention_decode_v2:d128_g4", "gemv:m1", "gemv:m8", "gemv:m16"]
        # without shapes: the same less the model's pieces (left to first use)
        assert set(names) - set(startup_families(target)) == {"attention_decode:d128_g4", "attention_decode_v2:d128_g4"}
        assert not any(n.startswith("attention_decode") for n in startup_families(target))
    # a head dim with no kernels: nothing compiled at start-up (the launch then names the missing piece)
    assert not any(n.startswith("attention_decode") for n in startup_families("sm_90a", {"head_dim": 96, "group": 4}))


def _blocks(family: str, guard: str, once: bool = True) -> dict[tuple[int, ...], str]:
    """`#if <guard>(a, b)` ... `#endif` blocks of a family's source: the guard's arguments -> the blocks' text
    (once: each key in one block)."""
    src = family_source(family).read_text()
    found = {}
    for args, body in re.findall(rf"^#if {guard}\(([\d, ]+)\)\n(.*?)^#endif", src, re.M | re.S):
        key = tuple(int(a) for a in args.split(","))
        assert not (once and key in found), (family, key)
        found[key] = found.get(key, "") + body
    return found


def _instantiations(text: str) -> list[str]:
    return re.findall(r"^XSERV_(?:DECODE|GEMV)\w*\([^)]*\)$", text, re.M)


@pytest.mark.parametrize("family", ["attention_decode", "attention_decode_v2"])
def test_every_instantiation_is_in_one_piece(family):
    blocks = _blocks(family, "XSERV_PIECE")
    assert set(blocks) == {(d, g) for d in A.HEAD_DIMS for g in range(1, A.MAX_GQA_GROUP + 1)}
    inside = [line for body in blocks.values() for line in _instantiations(body)]
    assert sorted(inside) == sorted(_instantiations(family_source(family).read_text())), "an unguarded instantiation"


def _piece_names(family: str, key) -> set[str]:
    """The kernel names of a piece's block (the instantiation macros expanded as the source names them)."""
    names = set()
    for line in _instantiations(_blocks(family, "XSERV_PIECE")[key]):
        macro, args = re.match(r"XSERV_(\w+)\(([^)]*)\)", line).groups()
        a = [int(x) for x in args.split(",")]
        names.add({"DECODE_KERNEL": lambda: f"attention_decode_d{a[0]}_g{a[1]}",
                   "DECODE_V4_KERNEL": lambda: f"attention_decode_v4_d{a[0]}_g{a[1]}_s{a[2]}",
                   "DECODE_V4_WIDE_KERNEL": lambda: f"attention_decode_v4_d{a[0]}_g{a[1]}_s{a[2]}_w{a[3]}",
                   "DECODE_V4_WIDE_SUBGROUPS_KERNEL":
                       lambda: f"attention_decode_v4_d{a[0]}_g{a[1]}_s{a[2]}_w{a[3]}_r{a[4]}",
                   "DECODE_V4_LEAN_KERNEL": lambda: f"attention_decode_v4_d{a[0]}_g{a[1]}_s2_w8_lean"}[macro]())
    return names


def launched_decode_kernels(head_dim: int, group: int) -> dict[str, set[str]]:
    """family -> every kernel the decode launchers can launch for a model of this shape (production variants)."""
    out = {}
    for variant in ("v4", "v4w4", "v4w8", "v2"):
        k = D.DECODE_KERNELS[variant]
        names = out.setdefault(k.family, set())
        if k.shapes is None or (head_dim, group) in k.shapes:
            names.add(k.name(head_dim, group))
            if (head_dim, group) in k.lean:
                names.add(k.name(head_dim, group) + "_lean")
        if k.wide:
            wide = D.DECODE_KERNELS[k.wide]
            for r in D._subgroup_counts(group, head_dim, wide)[:-1]:
                names.add(dataclasses.replace(wide, subgroups=r).name(head_dim, group))
    return out


def test_each_piece_has_the_kernels_its_shape_launches():
    for d in A.HEAD_DIMS:
        for g in range(1, A.MAX_GQA_GROUP + 1):
            for family, names in launched_decode_kernels(d, g).items():
                assert D._module(family, d, g) == f"{family}:d{d}_g{g}"
                assert _piece_names(family, (d, g)) == names, (family, d, g)
    src = family_source("attention_decode_v2").read_text()
    assert "attention_decode_combine" in src.split("#if XSERV_PIECE")[-1].split("#endif", 1)[1]  # in every piece
    assert D._module("dev/attention_decode_dev", 128, 4) == "dev/attention_decode_dev"


def test_gemv_pieces_by_rows():
    blocks = _blocks("gemv", "XSERV_ROWS_HAS", once=False)
    assert sorted(blocks) == [(1,), (8,), (16,)]
    assert all(line.startswith("XSERV_GEMV_ROW(") for line in _instantiations(blocks[1,]))
    assert sorted(_instantiations(blocks[8,])) == ["XSERV_GEMV_MMA(8, 1)", "XSERV_GEMV_MMA_PLAIN(8, 1)"]
    assert sorted(_instantiations(blocks[16,])) == ["XSERV_GEMV_MMA(16, 2)", "XSERV_GEMV_MMA_PLAIN(16, 2)"]
    inside = sum((_instantiations(b) for b in blocks.values()), [])
    assert sorted(inside) == sorted(_instantiations(family_source("gemv").read_text()))
    assert G._PIECES == {(True, True): "gemv:m1", (False, True): "gemv:m8", (False, False): "gemv:m16"}
    for m in (1, 2, 8, 9, 16):  # the launcher's key for m rows -> the piece holding plan()'s kernel
        name = G.plan(m, 4096, 132, k=4096)[0]
        assert G._PIECES[m == 1, m <= 8] == {"gemv_row": "gemv:m1", "gemv_mma_m8": "gemv:m8",
                                              "gemv_mma_m16": "gemv:m16"}[name]


TINY = """// xserv-shapes: head_dim=64,128 group=1,2 (a test family)
#if defined(XSERV_HEAD_DIM)
#define HAS(D, Q) ((D) == XSERV_HEAD_DIM && (Q) == XSERV_GROUP)
#else
#define HAS(D, Q) 1
#endif
#if HAS(64, 1)
extern "C" __global__ void k_d64_g1(float* p) { p[0] = 1.f; }
#endif
#if HAS(128, 2)
extern "C" __global__ void k_d128_g2(float* p) { p[0] = 2.f; }
#endif
extern "C" __global__ void k_every(float* p) { p[0] = 3.f; }
"""


def test_pieces_compile_and_cache_separately(tmp_path, monkeypatch):
    (tmp_path / "tiny.cu").write_text(TINY)
    (tmp_path / "plain.cu").write_text('extern "C" __global__ void k(float* p) { p[0] = 0.f; }\n')
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: tmp_path)
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path / "cache"))
    assert set(kernel_code_sizes(compiler.compile_family("tiny", "sm_90a"))) == {"k_d64_g1", "k_d128_g2", "k_every"}
    assert set(kernel_code_sizes(compiler.compile_family("tiny:d128_g2", "sm_90a"))) == {"k_d128_g2", "k_every"}
    assert compiler.startup_families("sm_90a", {"head_dim": 64, "group": 1}) == ["plain", "tiny:d64_g1"]
    assert compiler.missing_families("sm_90a", shapes={"head_dim": 64, "group": 1}) == ["plain", "tiny:d64_g1"]
    assert compiler.ensure_compiled("sm_90a", progress=False, shapes={"head_dim": 64, "group": 1}) \
        == ["plain", "tiny:d64_g1"]
    assert compiler.is_cached("tiny:d64_g1", "sm_90a") and not compiler.is_cached("tiny:d64_g2", "sm_90a")
    names = sorted(p.name.rsplit("-", 2)[0] for p in (tmp_path / "cache").rglob("*.cubin"))
    assert names == ["plain", "tiny", "tiny.d128_g2", "tiny.d64_g1"]
    assert compiler.cache_key("tiny:d64_g1", "sm_90a", compiler._options_for(tmp_path / "tiny.cu", (), "tiny:d64_g1")) \
        != compiler.cache_key("tiny", "sm_90a", compiler._options_for(tmp_path / "tiny.cu", ()))
    assert set(kernel_code_sizes(compiler.compile_family("tiny:d64_g2", "sm_90a"))) == {"k_every"}  # declared, empty
