"""What two CPU-backend runs of the same request share when they differ only in batch shape (alone or among others,
a prefix computed or served from the cache, preempted and recomputed), for any BLAS.

The CPU backend rounds activations to bf16 where the GPU kernels do. A BLAS may sum a GEMM row's products in an order
that depends on the shape (OpenBLAS picks its kernel by the row count), so a float32 sum can move by an ulp and the
bf16 value rounded from it by one bf16 ulp (2^-8 relative). Through the tiny test models that moved a logprob by up
to 4.0e-3: measured with float64 sums for half the row counts (`XSERV_TEST_OTHER_BLAS=1`, tests/conftest.py), and
the same 4.0e-3 was reported with OpenBLAS 0.3.31 on an AMD EPYC. So two such runs agree:

- on every logit and logprob to ROUNDING_ATOL, five times the largest move measured;
- on every greedy token up to the first step whose two best logprobs are within 2 * ROUNDING_ATOL of each other (a
  near tie may go either way, and after a different token the two continuations are different texts).

A cached block served after the wrong prefix moves them by far more (planted in test_engine_invariants: 0.54, and
other tokens), so the bound still catches what these tests exist for."""
from __future__ import annotations

from xserv.testing import agree_until_near_tie

ROUNDING_ATOL = 2e-2


def assert_same_greedy_run(got, want, context=None) -> None:
    """`got` and `want` (RequestOutputs of the same greedy request with `logprobs` set) agree as the module says."""
    assert want.logprobs is not None and got.logprobs is not None, "ask for logprobs to compare runs"
    assert agree_until_near_tie(want, got, 2 * ROUNDING_ATOL), context
    for g, w in zip(got.logprobs, want.logprobs):
        assert abs(g["logprob"] - w["logprob"]) <= ROUNDING_ATOL, (context, g["logprob"], w["logprob"])
        # the top lists' ids may swap at a near tie inside the list: compare each id's logprob where both list it
        gl, wl = dict(g["top"]), dict(w["top"])
        assert gl.keys() & wl.keys(), context
        for token in gl.keys() & wl.keys():
            assert abs(gl[token] - wl[token]) <= ROUNDING_ATOL, (context, token, gl[token], wl[token])
        top = [lp for _, lp in w["top"]]
        if len(top) >= 2 and top[0] - top[1] < 2 * ROUNDING_ATOL:
            break  # a near tie: the tokens from here on may differ, and their logprobs with them
