import numpy as np
import pytest

from xserv.ops.embedding import embedding, embedding_reference, fed_ids
from xserv.tensor import Tensor, bfloat16, float32
from xserv.testing import misaligned, poisoned, random_array


def _inputs(rng, t, v, h):
    return rng.integers(0, v, t).astype(np.int32), random_array(rng, (v, h), bfloat16)


def test_reference_gathers_rows_and_zeroes_bad_ids(rng):
    ids, table = _inputs(rng, 9, 50, 24)
    ids[2], ids[5] = -1, 50
    ref = embedding_reference(ids, table)
    expect = np.zeros((9, 24))
    for i, j in enumerate(ids):
        if 0 <= j < 50:
            expect[i] = table[j].astype(np.float64)
    assert ref.dtype == bfloat16
    np.testing.assert_array_equal(ref.astype(np.float64), expect)


def test_cpu_dispatch(rng):
    ids, table = _inputs(rng, 7, 30, 16)
    out = embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"))
    assert out.device == "cpu" and out.shape == (7, 16) and out.dtype == bfloat16
    np.testing.assert_array_equal(out.array, table[ids])


def test_cpu_float32_out_widens_exactly(rng):
    ids, table = _inputs(rng, 5, 30, 16)
    ids[3] = 30  # out of range: a zero row
    out = embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"),
                    out=Tensor.empty((5, 16), float32, "cpu"))
    np.testing.assert_array_equal(out.array, embedding_reference(ids, table).astype(np.float32))
    with pytest.raises(ValueError, match="out"):
        embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"),
                  out=Tensor.empty((5, 16), np.int32, "cpu"))


def _feed(rng, t, v):
    """A token feedback: sources of m sampled tokens, an index with kept rows (-1) and repeats."""
    src = rng.integers(0, v, 6).astype(np.int32)
    index = rng.integers(-1, 6, t).astype(np.int32)
    index[0] = -1
    return src, index


def test_feed_replaces_the_indexed_rows(rng):
    ids, table = _inputs(rng, 9, 50, 16)
    src, index = _feed(rng, 9, 50)
    fed = fed_ids(ids, src, index)
    np.testing.assert_array_equal(fed, np.where(index >= 0, src[np.maximum(index, 0)], ids))
    out = embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"),
                    feed=(Tensor.from_numpy(src, "cpu"), Tensor.from_numpy(index, "cpu")))
    np.testing.assert_array_equal(out.array, table[fed])
    for bad, name in ((np.array([6] * 9, np.int32), "feed_index"), (np.array([-2] * 9, np.int32), "feed_index"),
                      (index[:4], "feed_index"), (index.astype(np.int64), "feed_index")):
        with pytest.raises(ValueError, match=name):
            embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"),
                      feed=(Tensor.from_numpy(src, "cpu"), Tensor.from_numpy(bad, "cpu")))


@pytest.mark.parametrize("bad, name", [("ids_dtype", "ids"), ("table_dtype", "table"), ("out_shape", "out"),
                                       ("ids_ndim", "ids")])
def test_errors_name_the_argument(rng, bad, name):
    ids, table = _inputs(rng, 4, 10, 8)
    kw = {}
    if bad == "ids_dtype":
        ids = ids.astype(np.int64)
    elif bad == "table_dtype":
        table = table.astype(np.float32)
    elif bad == "out_shape":
        kw["out"] = Tensor.empty((4, 9), bfloat16, "cpu")
    elif bad == "ids_ndim":
        ids = ids.reshape(2, 2)
    with pytest.raises(ValueError, match=name):
        embedding(Tensor.from_numpy(ids, "cpu"), Tensor.from_numpy(table, "cpu"), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t, v, h", [(1, 100, 128), (7, 1000, 1024), (1023, 3000, 4096), (5, 50, 1000), (3, 40, 5120)])
def test_cuda_matches_reference(rng, t, v, h):
    ids, table = _inputs(rng, t, v, h)
    ids[0] = v - 1
    if t > 2:
        ids[1], ids[2] = -3, v  # out of range -> zero rows
    out = poisoned((t, h), bfloat16)
    embedding(Tensor.from_numpy(ids), Tensor.from_numpy(table), out=out)
    np.testing.assert_array_equal(out.numpy().view(np.uint16), embedding_reference(ids, table).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("t, v, h", [(1, 100, 1024), (9, 3000, 4096), (4, 50, 1000)])
def test_cuda_float32_out(rng, t, v, h):
    ids, table = _inputs(rng, t, v, h)
    ids[-1], ids[0] = v, v - 1  # an out-of-range id gives a zero row
    out = poisoned((t, h), float32)
    embedding(Tensor.from_numpy(ids), Tensor.from_numpy(table), out=out)
    np.testing.assert_array_equal(out.numpy(), embedding_reference(ids, table).astype(np.float32))


@pytest.mark.gpu
def test_cuda_unaligned_table_uses_scalar_path(rng):
    ids, table = _inputs(rng, 6, 20, 64)
    table_dev = misaligned(table)  # 2 bytes past a 16-byte boundary
    out = poisoned((6, 64), bfloat16)
    embedding(Tensor.from_numpy(ids), table_dev, out=out)
    np.testing.assert_array_equal(out.numpy().view(np.uint16), table[ids].view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype, t, h", [(float32, 1, 1024), (float32, 9, 4096), (bfloat16, 9, 4096),
                                             (bfloat16, 4, 1004)])
def test_cuda_feed(rng, out_dtype, t, h):
    """The token feedback on the device: the indexed rows take the source's tokens, the others their ids (the three
    kernels: h = 1004 takes the scalar one)."""
    ids, table = _inputs(rng, t, 3000, h)
    src, index = _feed(rng, t, 3000)
    out = poisoned((t, h), out_dtype)
    embedding(Tensor.from_numpy(ids), Tensor.from_numpy(table), out=out,
              feed=(Tensor.from_numpy(src), Tensor.from_numpy(index)))
    want = embedding_reference(fed_ids(ids, src, index), table).astype(out_dtype)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), want.view(np.uint8))
