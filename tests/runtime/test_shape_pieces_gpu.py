"""Shape pieces on the GPU: a start-up with a model's shapes compiles that shape's pieces (they load), and a decode
of another shape compiles its piece on first use and matches the reference."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_startup_pieces_load_and_another_shape_compiles_on_first_use(tmp_path, monkeypatch):
    from tests.ops.test_attention import dense_expected, make_case, run_decode
    from xserv.runtime import get_device, get_runtime
    from xserv.runtime.compiler import ensure_compiled, is_cached, piece, startup_families
    from xserv.testing import rel_error

    dev = get_device()
    shapes = {"head_dim": 128, "group": 2}  # Qwen3-0.6B
    ensure_compiled(dev.arch, progress=False, shapes=shapes)
    pieces = [name for name in startup_families(dev.arch, shapes) if ":" in name]
    assert {"attention_decode:d128_g2", "gemv:m1_p0", "sampling:v1"} <= set(pieces)
    for name in pieces:
        assert is_cached(name, dev.arch), name
        get_runtime().kernels.load_family(name)  # loads on this device
    monkeypatch.setenv("XSERV_CACHE_DIR", str(tmp_path))  # a fresh cache: the next shape compiles here
    other = piece("attention_decode", head_dim=64, group=7)
    loaded = other in get_runtime().kernels._modules  # an earlier test in this process may have launched it
    rng = np.random.default_rng(7)
    case = make_case(rng, [1, 1, 1], [5, 300, 1000], 14, 2, 64, 16)
    out = run_decode(case, 1000)
    assert rel_error(out, dense_expected(case)) < 2e-2
    assert other in get_runtime().kernels._modules and (loaded or is_cached(other, dev.arch))
