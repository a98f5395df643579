"""The eager ops' fast paths (add, rmsnorm, fused_add_rmsnorm: the usual call checked in one expression) launch
exactly what their fully checked paths launch, and every call the fast path does not take still raises the checked
path's ValueError. CPU: the runtime runs over a fake driver (tools/dev/host_runtime.py) that records each launch's
kernel, grid, block and parameter bytes; the kernels' parameter sizes come from their CUDA sources, so a call
passing the wrong width (a Python int for an `int`) fails here as it would on the device."""
import re

import numpy as np
import pytest

from tools.dev.host_runtime import install
from xserv.ops import elementwise, rmsnorm as rms
from xserv.runtime.allocator import size_class
from xserv.runtime.compiler import family_source
from xserv.tensor import Tensor, bfloat16, float32


def _param_sizes(family: str) -> dict[str, list[int]]:
    """{kernel: [bytes per parameter]} for the extern "C" kernels of cuda_src/<family>.cu (pointers 8 bytes,
    long long 8, int / float 4); macro-instantiated `name##VPT` kernels for VPT 1, 2, 4, 8."""
    text = family_source(family).read_text().replace("\\\n", "\n")
    sizes = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+(?:##VPT)?)\(([^)]*)\)', text):
        widths = []
        for p in params.split(","):
            p = " ".join(p.split())
            wide = "*" in p or p.startswith("long long")
            widths.append(8 if wide else 4 if re.match(r"(const )?(int|float) ", p) else None)
        assert None not in widths, f"{name}: unknown parameter type in {params!r}"
        for vpt in ((1, 2, 4, 8) if name.endswith("##VPT") else (None,)):
            sizes[name.replace("##VPT", str(vpt)) if vpt else name] = widths
    return sizes


SIZES = {**_param_sizes("elementwise"), **_param_sizes("rmsnorm")}


def test_parameter_sizes_parsed_from_the_sources():
    assert SIZES["add_bf16_vec"] == [8, 8, 8, 8] and SIZES["rmsnorm_bf16_vpt4"] == [8, 8, 8, 4, 4]
    assert SIZES["fused_add_rmsnorm_f32res_scalar"] == [8, 8, 8, 8, 4, 4] and len(SIZES) >= 20


@pytest.fixture
def host(monkeypatch):
    """A runtime over the recording fake driver: (launches, runtime); undone after the test."""
    launches = []
    runtime = install(launches, SIZES, setattr=monkeypatch.setattr)
    return launches, runtime


def _buffer(rng, nbytes):
    """A fresh device block (the fake allocator's addresses are 256-byte aligned), after a random number of others."""
    for _ in range(int(rng.integers(0, 3))):
        Tensor.empty((int(rng.integers(1, 4096)),), np.uint8)
    return Tensor.empty((nbytes + 64,), np.uint8)


def _tensor_at(base: Tensor, offset: int, shape, dtype) -> Tensor:
    """A tensor in `base`'s block, `offset` bytes in (offset % 16 != 0: an unaligned tensor)."""
    return Tensor(tuple(shape), dtype, buffer=base._buffer, offset=base._offset + offset)


def _f32_bits(x) -> int:
    return int(np.float32(x).view(np.uint32))


def _call(launches, fn, *args):
    """Run fn, return (its result, the launches it made)."""
    start = len(launches)
    result = fn(*args)
    return result, launches[start:]


# ---- add -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [bfloat16, float32])
@pytest.mark.parametrize("shape", [(1, 4096), (7,), (3, 5, 128), (1023, 7), (0, 8)])
@pytest.mark.parametrize("offset", [0, 2, 16])
@pytest.mark.parametrize("out_kind", ["new", "given", "given_unaligned", "a", "b"])
def test_add_fast_path_launches_what_the_checked_path_does(host, rng, dtype, shape, offset, out_kind):
    launches, _ = host
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    block = _buffer(rng, 4 * size + 256)
    a = _tensor_at(block, offset, shape, dtype)
    b = _tensor_at(block, size + 64 + offset // 2 * 2, shape, dtype) if size else _tensor_at(block, 64, shape, dtype)
    given = _tensor_at(block, 2 * size + 128 + (4 if out_kind == "given_unaligned" else 0), shape, dtype)
    out = {"new": None, "given": given, "given_unaligned": given, "a": a, "b": b}[out_kind]
    fast, fast_launches = _call(launches, elementwise.add, a, b, out)
    checked, checked_launches = _call(launches, elementwise._add_checked, a, b, out)
    assert fast.shape == shape and fast.dtype is dtype and checked.shape == shape
    if out is not None:
        assert fast is out and checked is out
    n = a.numel
    if n == 0:
        assert fast_launches == checked_launches == []
        return
    ((family, name, grid, blk, smem, slots),) = fast_launches
    ((_, c_name, c_grid, c_blk, _, c_slots),) = checked_launches
    per_vector = 16 // np.dtype(dtype).itemsize
    vec = n % per_vector == 0 and not (a.ptr | b.ptr | fast.ptr) & 15
    count = n // per_vector if vec else n
    suffix = "bf16" if dtype is bfloat16 else "f32"
    assert (family, name) == ("elementwise", f"add_{suffix}_{'vec' if vec else 'scalar'}") and name == c_name
    assert grid == c_grid == (-(-count // 256), 1, 1) and blk == c_blk == (256, 1, 1) and smem == 0
    assert slots == [a.ptr, b.ptr, fast.ptr, count]
    assert c_slots == [a.ptr, b.ptr, checked.ptr, count]


def test_add_errors_are_the_checked_paths(host, rng):
    launches, _ = host
    block = _buffer(rng, 3 * 8192)
    a = _tensor_at(block, 0, (1, 4096), bfloat16)
    b = _tensor_at(block, 8192, (1, 4096), bfloat16)
    with pytest.raises(ValueError, match="out: partially overlaps a"):
        elementwise.add(a, b, _tensor_at(block, 64, (1, 4096), bfloat16))
    with pytest.raises(ValueError, match="out: partially overlaps b"):
        elementwise.add(a, b, _tensor_at(block, 8192 + 2, (1, 4096), bfloat16))
    with pytest.raises(ValueError, match="out: dtype float32, expected bfloat16"):
        elementwise.add(a, b, _tensor_at(block, 16384, (1, 2048), float32))
    with pytest.raises(ValueError, match="out: shape \\[4096\\], expected \\[1, 4096\\]"):
        elementwise.add(a, b, _tensor_at(block, 16384, (4096,), bfloat16))
    with pytest.raises(ValueError, match="b: shape \\[4096, 1\\], expected \\[1, 4096\\]"):
        elementwise.add(a, b.view(4096, 1))
    with pytest.raises(ValueError, match="b: dtype float32, expected bfloat16"):
        elementwise.add(a, _tensor_at(block, 16384, (1, 4096), float32))
    with pytest.raises(ValueError, match="a: dtype int32, expected bfloat16 or float32"):
        elementwise.add(_tensor_at(block, 0, (8,), np.int32), _tensor_at(block, 64, (8,), np.int32))
    with pytest.raises(ValueError, match="tensors on different devices: a on cuda, b on cpu"):
        elementwise.add(a, Tensor.empty((1, 4096), bfloat16, "cpu"))
    with pytest.raises(ValueError, match="out on cpu"):
        elementwise.add(a, b, Tensor.empty((1, 4096), bfloat16, "cpu"))
    with pytest.raises(ValueError, match="a: expected a Tensor, got ndarray"):
        elementwise.add(np.zeros((1, 4096)), b)
    assert launches == []


# ---- rmsnorm, fused_add_rmsnorm --------------------------------------------------------------------------------
ROWS_CONFIGS = [  # hidden, 16-byte aligned pointers -> kernel suffix, threads
    (1024, True, "vpt1", 128), (4096, True, "vpt2", 256), (5120, True, "vpt4", 160), (8200, True, "vpt8", 160),
    (65536, True, "vpt8", 1024), (65544, True, "scalar", 1024), (12, True, "scalar", 32), (1024, False, "scalar", 1024),
    (1, True, "scalar", 32), (40, False, "scalar", 64),
]


@pytest.mark.parametrize("hidden,aligned,suffix,threads", ROWS_CONFIGS)
@pytest.mark.parametrize("rows", [1, 3, 0])
@pytest.mark.parametrize("out_kind", ["new", "given", "x"])
def test_rmsnorm_fast_path_launches_what_the_checked_path_does(host, rng, hidden, aligned, suffix, threads, rows,
                                                              out_kind):
    launches, _ = host
    off = 0 if aligned else 2
    size = rows * hidden * 2
    block = _buffer(rng, 2 * size + 2 * hidden + 512)
    x = _tensor_at(block, off, (rows, hidden), bfloat16)
    w = _tensor_at(block, size + 256, (hidden,), bfloat16)
    out = {"new": None, "given": _tensor_at(block, size + 2 * hidden + 512, (rows, hidden), bfloat16), "x": x}[out_kind]
    eps = float(rng.uniform(1e-7, 1e-4))
    fast, fast_launches = _call(launches, rms.rmsnorm, x, w, eps, out)
    checked, checked_launches = _call(launches, rms._rmsnorm_checked, x, w, eps, out)
    assert fast.shape == (rows, hidden) and fast.dtype is bfloat16 and (out is None or fast is out)
    if rows == 0:
        assert fast_launches == checked_launches == []
        return
    ((family, name, grid, blk, smem, slots),) = fast_launches
    ((_, c_name, c_grid, c_blk, _, c_slots),) = checked_launches
    assert (family, name) == ("rmsnorm", f"rmsnorm_bf16_{suffix}") and c_name == name
    assert grid == c_grid == (rows, 1, 1) and blk == c_blk == (threads, 1, 1) and smem == 0
    want = [x.ptr, w.ptr, fast.ptr, hidden, _f32_bits(eps)]
    assert [s & 0xFFFFFFFF if i >= 3 else s for i, s in enumerate(slots)] == want
    assert [s & 0xFFFFFFFF if i >= 3 else s for i, s in enumerate(c_slots)] == want[:2] + [checked.ptr] + want[3:]


@pytest.mark.parametrize("res_dtype", [bfloat16, float32])
@pytest.mark.parametrize("hidden,aligned,suffix,threads", ROWS_CONFIGS[:3] + ROWS_CONFIGS[6:8])
@pytest.mark.parametrize("out_kind", ["new", "given", "x"])
def test_fused_add_rmsnorm_fast_path_launches_what_the_checked_path_does(host, rng, res_dtype, hidden, aligned,
                                                                        suffix, threads, out_kind):
    launches, _ = host
    rows, off = 3, 0 if aligned else 2
    size = rows * hidden * 2
    block = _buffer(rng, 6 * size + 2 * hidden + 1024)
    x = _tensor_at(block, off, (rows, hidden), bfloat16)
    res = _tensor_at(block, size + 256, (rows, hidden), res_dtype)
    w = _tensor_at(block, 3 * size + 512, (hidden,), bfloat16)
    given = _tensor_at(block, 3 * size + 2 * hidden + 768, (rows, hidden), bfloat16)
    out = {"new": None, "given": given, "x": x}[out_kind]
    fast, fast_launches = _call(launches, rms.fused_add_rmsnorm, x, res, w, 1e-6, out)
    checked, checked_launches = _call(launches, rms._fused_add_rmsnorm_checked, x, res, w, 1e-6, out)
    ((family, name, grid, blk, smem, slots),) = fast_launches
    ((_, c_name, c_grid, c_blk, _, c_slots),) = checked_launches
    op = "fused_add_rmsnorm_bf16" if res_dtype is bfloat16 else "fused_add_rmsnorm_f32res"
    assert name == c_name == f"{op}_{suffix}" and grid == c_grid == (rows, 1, 1) and blk == c_blk == (threads, 1, 1)
    want = [x.ptr, res.ptr, w.ptr, fast.ptr, hidden, _f32_bits(1e-6)]
    assert [s & 0xFFFFFFFF if i >= 4 else s for i, s in enumerate(slots)] == want
    assert [s & 0xFFFFFFFF if i >= 4 else s for i, s in enumerate(c_slots)] == want[:3] + [checked.ptr] + want[4:]


def test_rmsnorm_errors_are_the_checked_paths(host, rng):
    launches, _ = host
    block = _buffer(rng, 4 * 8192 + 4096)
    x = _tensor_at(block, 0, (2, 1024), bfloat16)
    w = _tensor_at(block, 4096, (1024,), bfloat16)
    res = _tensor_at(block, 8192, (2, 1024), bfloat16)
    with pytest.raises(ValueError, match="out: partially overlaps x"):
        rms.rmsnorm(x, w, 1e-6, _tensor_at(block, 2, (2, 1024), bfloat16))
    with pytest.raises(ValueError, match="weight: shape \\[512\\], expected \\[1024\\]"):
        rms.rmsnorm(x, w[:512], 1e-6)
    with pytest.raises(ValueError, match="x: hidden size is 0"):
        rms.rmsnorm(_tensor_at(block, 0, (2, 0), bfloat16), _tensor_at(block, 0, (0,), bfloat16), 1e-6)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        rms.rmsnorm(x.view(2, 1, 1024), w, 1e-6)
    for bad in (-1.0, float("nan"), float("inf"), True, "1e-6", None):
        with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
            rms.rmsnorm(x, w, bad)
        with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
            rms.fused_add_rmsnorm(x, res, w, bad)
    with pytest.raises(ValueError, match="out: overlaps residual"):
        rms.fused_add_rmsnorm(x, res, w, 1e-6, _tensor_at(block, 8192 + 64, (2, 1024), bfloat16))
    with pytest.raises(ValueError, match="out: overlaps residual"):
        rms.fused_add_rmsnorm(x, res, w, 1e-6, res)
    with pytest.raises(ValueError, match="out: partially overlaps x"):
        rms.fused_add_rmsnorm(x, res, w, 1e-6, _tensor_at(block, 32, (2, 1024), bfloat16))
    with pytest.raises(ValueError, match="residual: overlaps x"):
        rms.fused_add_rmsnorm(x, _tensor_at(block, 16, (2, 1024), bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match="residual: dtype float16"):
        rms.fused_add_rmsnorm(x, _tensor_at(block, 8192, (2, 1024), np.float16), w, 1e-6)
    with pytest.raises(ValueError, match="tensors on different devices"):
        rms.rmsnorm(x, Tensor.empty((1024,), bfloat16, "cpu"), 1e-6)
    assert launches == []


def test_eps_is_remembered_only_for_valid_floats(host, rng, monkeypatch):
    launches, _ = host
    monkeypatch.setattr(rms, "_EPS32", {})
    block = _buffer(rng, 8192)
    x, w = _tensor_at(block, 0, (1, 1024), bfloat16), _tensor_at(block, 4096, (1024,), bfloat16)
    rms.rmsnorm(x, w, 1.0)  # 1.0 remembered; True == 1.0 (same hash) must still be refused
    assert list(rms._EPS32) == [1.0]
    with pytest.raises(ValueError, match="eps"):
        rms.rmsnorm(x, w, True)
    rms.rmsnorm(x, w, 0)  # an int eps is valid (the checked conversion)
    rms.rmsnorm(x, w, np.float32(3e-5))
    got = [s[-1] & 0xFFFFFFFF for *_, s in launches]
    assert got == [_f32_bits(1.0), _f32_bits(0.0), _f32_bits(3e-5)]


# ---- Tensor.empty and the allocator ------------------------------------------------------------------------
def test_tensor_empty_fast_path_and_allocator_accounting(host, rng):
    _, runtime = host
    stats = runtime.allocator.stats
    shapes = [(1, 4096), (3, 5, 7), (0, 9), (), (int(rng.integers(1, 3000)),), (1, 1 << 19)]
    live, expect_in_use, peak = [], 0, 0
    for shape in shapes:
        for dtype in (bfloat16, float32, "int32", np.uint8):
            t = Tensor.empty(shape, dtype)
            dt = np.dtype(dtype)
            numel = int(np.prod(shape))
            assert t.shape == shape and t.dtype == dt and t.device == "cuda" and t.numel == numel
            assert t.nbytes == numel * dt.itemsize and t.ptr == t._buffer.ptr and t.ptr % 256 == 0
            assert t.ndim == len(shape) and t.view(-1).shape == (numel,)
            expect_in_use += size_class(t.nbytes)
            peak = max(peak, expect_in_use)
            live.append(t)
            assert stats.bytes_in_use == expect_in_use and stats.peak_bytes_in_use == peak
    cached = stats.bytes_cached
    t = live.pop()
    del t
    expect_in_use -= size_class(1 << 19)  # the last one: (1, 1 << 19) uint8
    assert stats.bytes_in_use == expect_in_use and stats.bytes_cached == cached + size_class(1 << 19)
    allocations = stats.device_allocations
    again = Tensor.empty((1 << 19,), np.uint8)  # same size class: the cached block, no device allocation
    assert stats.bytes_cached == cached and stats.device_allocations == allocations
    assert stats.bytes_in_use == expect_in_use + size_class(1 << 19) and again.ptr % 256 == 0
    # what the fast path does not take keeps its checks and messages
    assert Tensor.empty([2, 3], bfloat16).shape == (2, 3) and Tensor.empty((np.int64(4),), bfloat16).shape == (4,)
    assert Tensor.empty(5, float32).shape == (5,)
    with pytest.raises(ValueError, match="negative dimension"):
        Tensor.empty((2, -1), bfloat16)
    with pytest.raises(ValueError, match="unsupported dtype"):
        Tensor.empty((2,), np.float64)
    with pytest.raises(ValueError, match="unsupported dtype 'bf16'"):
        Tensor.empty((2,), "bf16")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        Tensor.empty((2,), bfloat16, "gpu")


def test_empty_like_is_a_new_block_of_the_same_kind(host, rng):
    _, runtime = host
    stats = runtime.allocator.stats
    block = _buffer(rng, 4096)
    cases = [((1, 4096), bfloat16, 0), ((3, 5, 7), float32, 4), ((0, 3), bfloat16, 2), ((), np.int32, 8)]
    for shape, dtype, offset in cases:
        src = _tensor_at(block, offset, shape, dtype) if np.prod(shape) * np.dtype(dtype).itemsize <= 2048 else \
            Tensor.empty(shape, dtype)
        in_use = stats.bytes_in_use
        t = src.empty_like()
        assert type(t) is Tensor and t.shape == shape and t.dtype is np.dtype(dtype) and t.device == "cuda"
        assert t.numel == src.numel and t.nbytes == src.nbytes and t._offset == 0 and t.ptr == t._buffer.ptr
        assert t._buffer is not src._buffer and stats.bytes_in_use == in_use + size_class(src.nbytes)
        assert not (t.ptr < block.ptr + block.nbytes and block.ptr < t.ptr + max(t.nbytes, 1))
        del t
        assert stats.bytes_in_use == in_use
    c = Tensor.from_numpy(rng.standard_normal((3, 4)).astype(np.float32), "cpu")
    e = c.empty_like()
    assert e.device == "cpu" and e.shape == (3, 4) and e.dtype == np.float32 and not np.shares_memory(e.array, c.array)
