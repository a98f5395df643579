"""Shape pieces (runtime/compiler.py): attention_decode, attention_decode_v2, gemv and sampling are compiled per
shape or per entry set, the runtime loading the piece of what it launches ("attention_decode:d128_g4", "gemv:m1_p0",
"sampling:v1"), a start-up compiling the model's pieces and the `// xserv-startup:` ones only. CPU tests: names,
options, what a start-up compiles, that every kernel a launcher can pick is instantiated in the piece it names (read
from the sources' `#if XSERV_PIECE(D, Q)` / `#if XSERV_GEMV_PIECE(M, P)` / `#if XSERV_SAMPLE_PIECE(V)` blocks) and
in exactly one, and that the GEMV entries a Qwen3 step launches are in start-up pieces; one real NVRTC compile of a
tiny family with a shapes line. The pieces of the shipped families are compiled for sm_90a in
tests/runtime/test_compile_all.py."""
import dataclasses
import re

import pytest

import xserv.ops.attention as A
import xserv.ops.attention.decode as D
import xserv.ops.gemv as G
import xserv.ops.sampling as S
from xserv.runtime import CompileError
from xserv.runtime import compiler
from xserv.models.dense import DenseModel
from xserv.runtime.compiler import (family_pieces, family_shapes, family_source, family_startup, kernel_code_sizes,
                                    piece, piece_options, startup_families)


class Config:
    def __init__(self, heads, kv_heads, head_dim=128):
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim


def test_names_and_options():
    assert family_shapes("attention_decode") == {"head_dim": (64, 128), "group": tuple(range(1, 9))}
    assert family_shapes("attention_decode_v2") == family_shapes("attention_decode")
    assert family_shapes("gemv") == {"rows": (1, 8, 16), "part": (0, 1)}
    assert family_startup("gemv") == ({"rows": 1, "part": 0}, {"rows": 8, "part": 0}, {"rows": 8, "part": 1})
    assert family_shapes("sampling") == {"vec": (0, 1)} and family_startup("sampling") == ({"vec": 1},)
    assert family_startup("attention_decode") is None  # model keys only: the model's piece
    assert family_shapes("rope") is None and family_shapes("dev/attention_decode_dev") is None
    assert piece("attention_decode", head_dim=128, group=4) == "attention_decode:d128_g4"
    assert piece("rope", head_dim=128, group=4) == "rope"  # not compiled per shape: the family itself
    assert piece("gemv", rows=16, part=0, head_dim=128) == "gemv:m16_p0"  # keys a family does not declare: ignored
    assert piece_options("attention_decode:d64_g8") == ("-DXSERV_HEAD_DIM=64", "-DXSERV_GROUP=8")
    assert piece_options("gemv:m8_p1") == ("-DXSERV_ROWS=8", "-DXSERV_PART=1") and piece_options("gemv") == ()
    assert piece_options("sampling:v0") == ("-DXSERV_VEC=0",) and len(family_pieces("gemv")) == 6
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
    assert DenseModel.kernel_shapes(Config(16, 8)) == {"head_dim": 128, "group": 2}  # Qwen3-0.6B
    assert DenseModel.kernel_shapes(Config(32, 8)) == {"head_dim": 128, "group": 4}  # Qwen3-8B
    for target in ("sm_90a", "sm_80@sm_90a", "sm_89", "sm_120a"):
        names = startup_families(target, DenseModel.kernel_shapes(Config(32, 8)))
        pieces = [n for n in names if ":" in n]
        assert pieces == ["attention_decode:d128_g4", "attention_decode_v2:d128_g4", "gemv:m1_p0", "gemv:m8_p0",
                          "gemv:m8_p1", "sampling:v1"]
        # without shapes: the same less the model's pieces (left to first use)
        assert set(names) - set(startup_families(target)) == {"attention_decode:d128_g4", "attention_decode_v2:d128_g4"}
        assert not any(n.startswith("attention_decode") for n in startup_families(target))
    # a head dim with no kernels: nothing compiled at start-up (the launch then names the missing piece)
    assert not any(n.startswith("attention_decode") for n in startup_families("sm_90a", {"head_dim": 96, "group": 4}))


def _source(family: str) -> str:
    """A family's source with the decode headers that hold its entries inlined (attention_decode_v4.cuh / _v2.cuh:
    the bodies and entry lists the bf16 files share with attention_decode_fp8.cu)."""
    path = family_source(family)
    return re.sub(r'^#include "(attention_decode_v\d\.cuh)"$', lambda m: (path.parent / m.group(1)).read_text(),
                  path.read_text(), flags=re.M)


def _blocks(family: str, guard: str, once: bool = True) -> dict[tuple[int, ...], str]:
    """`#if <guard>(a, b)` ... `#endif` blocks of a family's source: the guard's arguments -> the blocks' text
    (once: each key in one block)."""
    src = _source(family)
    found = {}
    for args, body in re.findall(rf"^#if {guard}\(([\d, ]+)\)\n(.*?)^#endif", src, re.M | re.S):
        key = tuple(int(a) for a in args.split(","))
        assert not (once and key in found), (family, key)
        found[key] = found.get(key, "") + body
    return found


def _instantiations(text: str) -> list[str]:
    return re.findall(r"^(XSERV_(?:DECODE|GEMV|V4|V2)\w*\([^)]*\))(?:\s*//.*)?$", text, re.M)  # a comment may follow


@pytest.mark.parametrize("family", ["attention_decode", "attention_decode_v2", D.FP8_FAMILY])
def test_every_instantiation_is_in_one_piece(family):
    blocks = _blocks(family, "XSERV_PIECE", once=family != D.FP8_FAMILY)  # FP8: a v4 and a v2 block a shape
    assert set(blocks) == {(d, g) for d in A.HEAD_DIMS for g in range(1, A.MAX_GQA_GROUP + 1)}
    inside = [line for body in blocks.values() for line in _instantiations(body)]
    assert sorted(inside) == sorted(_instantiations(_source(family))), "an unguarded instantiation"


def _piece_names(family: str, key) -> set[str]:
    """The kernel names of a piece's block (the instantiation macros expanded as the source names them)."""
    names = set()
    # the entries of the file's KV format (its `#define XSERV_KV_FMT`), named with that format's prefix
    fmt = re.search(r"^#define XSERV_KV_FMT (\w+)$", family_source(family).read_text(), re.M).group(1)
    prefix = re.search(rf"^#define XSERV_KV_PREFIX_{fmt} (\w+)$",
                       (family_source(family).parent / "attention_decode.cuh").read_text(), re.M).group(1)
    for line in _instantiations(_blocks(family, "XSERV_PIECE", once=family != D.FP8_FAMILY)[key]):
        macro, args = re.match(r"XSERV_(\w+)\(XSERV_KV_FMT, ([^)]*)\)", line).groups()
        a = [int(x) for x in args.split(",")]
        names.add(prefix + {"V2_ENTRY": lambda: f"d{a[0]}_g{a[1]}",
                            "V4_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s{a[2]}",
                            "V4_WIDE_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s{a[2]}_w{a[3]}",
                            "V4_WIDE_SUBGROUPS_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s{a[2]}_w{a[3]}_r{a[4]}",
                            "V4_LEAN_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s2_w8_lean",
                            "V4_LEAN_SUBGROUPS_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s2_w8_r{a[2]}_lean",
                            "V4_MMA_ENTRY": lambda: f"v4_d{a[0]}_g{a[1]}_s2_mma"}[macro]())
    return names


def launched_decode_kernels(head_dim: int, group: int) -> dict[str, set[str]]:
    """family -> every kernel the decode launchers can launch for a model of this shape (production variants), on a
    bf16 cache (the kernels' families) and on an FP8 one (D.FP8_FAMILY: their e4m3 names)."""
    out = {}
    for variant in ("v4", "v4w8", "v2"):
        k = D.DECODE_KERNELS[variant]
        kernels = []
        if k.shapes is None or (head_dim, group) in k.shapes:
            kernels.append(k)
        if k.wide:
            wide = D.DECODE_KERNELS[k.wide]
            kernels += [dataclasses.replace(wide, subgroups=r) for r in D._subgroup_counts(group, head_dim, wide)[:-1]]
        for fp8 in (False, True):
            names = out.setdefault(D.FP8_FAMILY if fp8 else k.family, set())
            for sub in kernels:
                name = (sub.fp8_name if fp8 else sub.name)(head_dim, group)
                names |= {name, name + "_lean"} if sub.has_lean(head_dim, group) else {name}
                if fp8 and D.has_fp8_mma(sub, head_dim, group):  # the 4-warp kernel's tensor-core form
                    names.add(dataclasses.replace(sub, suffix="_mma").fp8_name(head_dim, group))
    return out


def test_each_piece_has_the_kernels_its_shape_launches():
    for d in A.HEAD_DIMS:
        for g in range(1, A.MAX_GQA_GROUP + 1):
            for family, names in launched_decode_kernels(d, g).items():
                assert D._module(family, d, g) == f"{family}:d{d}_g{g}" + ("_k1" if family == D.FP8_FAMILY else "")
                assert _piece_names(family, (d, g)) == names, (family, d, g)
    src = family_source("attention_decode_v2").read_text()
    assert "#if" not in src and "attention_decode_combine" in src  # in every piece (both formats' split grids)
    assert D._module("dev/attention_decode_dev", 128, 4) == "dev/attention_decode_dev"


def _entries(text: str) -> set[str]:
    """The kernel entries of gemv.cu's instantiation lines in `text` (the macros expanded as gemv.cu names them)."""
    names = set()
    for macro, args in re.findall(r"^XSERV_GEMV(\w*)\(([^)]*)\)(?:\s*//.*)?$", text, re.M):
        a = [x.strip() for x in args.split(",")]
        names |= {"_ROW": {f"gemv_row_{a[0]}", f"gemv_row_{a[0]}_1step"},
                  "_MMA": {f"gemv_mma_m{a[0]}", f"gemv_mma_m{a[0]}_sliced"},
                  "_MMA_PLAIN": {f"gemv_mma_m{a[0]}_bf16_bf16"}}[macro]
    return names


def test_gemv_pieces_hold_what_the_launcher_picks():
    blocks = _blocks("gemv", "XSERV_GEMV_PIECE")
    assert sorted(blocks) == [(m, p) for m in (1, 8, 16) for p in (0, 1)]
    inside = sum((_instantiations(b) for b in blocks.values()), [])
    assert sorted(inside) == sorted(_instantiations(family_source("gemv").read_text())), "an unguarded instantiation"
    # G._PIECES names every entry the launcher can form (_launch: plan()'s base name + the row entry's suffix and
    # _1step, or the mma entry's _bf16_bf16 / _sliced / nothing), each in the piece that instantiates it
    launchable = {f"gemv_row_{e}{s}" for e in G._ROW_ENTRY.values() for s in ("", "_1step")}
    launchable |= {f"gemv_mma_m{m}{s}" for m in (8, 16) for s in ("", "_sliced", "_bf16_bf16")}
    fp8_rows = {f"gemv_fp8_row_{e}{s}" for e in G._FP8_ROW_ENTRIES for s in ("", "_1step")}  # gemv_fp8.cu's one piece
    assert set(G._PIECES) == launchable | fp8_rows and all(G._PIECES[n] == "gemv_fp8:f1" for n in fp8_rows)
    for (m, p), body in blocks.items():
        assert {n for n, name in G._PIECES.items() if name == f"gemv:m{m}_p{p}"} == _entries(body), (m, p)
    for m in (1, 2, 8, 9, 16):  # plan()'s kernel for m rows lies in a piece of that row count
        name = G.plan(m, 4096, 132, k=4096)[0]
        assert {G._PIECES[n] for n in launchable if n.startswith(name + "_") or n == name} <= \
            {f"gemv:m{1 if m == 1 else 8 if m <= 8 else 16}_p{p}" for p in (0, 1)}


QWEN3 = {  # hidden, heads, kv heads, intermediate (head_dim 128, vocab 151936)
    "0.6B": (1024, 16, 8, 3072), "1.7B": (2048, 16, 8, 6144), "4B": (2560, 32, 8, 9728), "8B": (4096, 32, 8, 12288),
    "14B": (5120, 40, 8, 17408), "32B": (5120, 64, 8, 25600)}


def qwen3_gemv_entries(hidden: int, heads: int, kv_heads: int, inter: int, sms: int = 132) -> set[str]:
    """Every GEMV entry a Qwen3 forward launches (models/dense.py): the fused one-token step's four one-row entries
    (either form), and for 2..16 tokens (decode batches, short prefills) the projections prefer_gemv gives the mma
    kernel, as _launch names them (bf16 out; the lm_head's fp32 logits)."""
    q, vocab = heads * 128, 151936
    names = {f"gemv_row_{e}{s}" for e in G._FUSED_ROW_ENTRIES for s in ("", "_1step")}
    for m in range(2, G.MAX_M + 1):
        for n, k, fp32 in ((q + 2 * kv_heads * 128, hidden, False), (hidden, q, False), (2 * inter, hidden, False),
                           (hidden, inter, False), (vocab, hidden, True)):
            if G.prefer_gemv(m, n, k):
                name, *_, slices = G.plan(m, n, sms, k=k)
                names.add(name + ("_sliced" if slices > 1 else "" if fp32 else "_bf16_bf16"))
    return names


@pytest.mark.parametrize("model", list(QWEN3))
def test_a_qwen3_step_launches_startup_pieces_only(model):
    hidden, heads, kv_heads, inter = QWEN3[model]
    startup = startup_families("sm_90a", DenseModel.kernel_shapes(Config(heads, kv_heads)))
    assert {G._PIECES[n] for n in qwen3_gemv_entries(hidden, heads, kv_heads, inter)} <= set(startup)
    assert S._PIECES[True] in startup  # Qwen3's vocab is a multiple of 4: the _vec entry


def test_sampling_pieces():
    blocks = _blocks("sampling", "XSERV_SAMPLE_PIECE")
    entries = {key: re.findall(r"^(sample_\w+)\(", body, re.M) for key, body in blocks.items()}
    assert entries == {(1,): ["sample_f32_vec"], (0,): ["sample_f32"]}
    src = family_source("sampling").read_text()
    assert sorted(re.findall(r'__global__[^\n]*\n(\w+)\(', src)) == ["sample_f32", "sample_f32_vec"]  # all guarded
    assert S._PIECES == {True: "sampling:v1", False: "sampling:v0"}  # the launcher: vec -> sample_f32_vec's piece


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
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
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


def test_startup_line_names_pieces_of_the_other_keys(tmp_path, monkeypatch):
    monkeypatch.setattr("xserv.runtime.sources.kernel_source_dir", lambda: tmp_path)
    (tmp_path / "split.cu").write_text("// xserv-shapes: rows=1,8 part=0,1\n// xserv-startup: m1_p0 m8_p1 (why)\n")
    (tmp_path / "whole.cu").write_text("// xserv-shapes: vec=0,1\n")
    assert compiler.startup_families("sm_90a") == ["split:m1_p0", "split:m8_p1", "whole:v0", "whole:v1"]
    (tmp_path / "whole.cu").write_text("// xserv-shapes: vec=0,1\n// xserv-startup: m1\n")
    with pytest.raises(CompileError, match="names 'm1'"):
        compiler.startup_families("sm_90a")

