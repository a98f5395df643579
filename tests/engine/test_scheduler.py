"""The scheduling policy and the block manager, without a model: decodes first, prefill chunks under the token
budget, admission headroom, preemption, prefix caching with reference counts and LRU eviction."""
import pytest

from xserv.engine.block_manager import BlockManager
from xserv.engine.scheduler import KVCacheTooSmall, Scheduler
from xserv.engine.sequence import FINISHED, RUNNING, WAITING, Sequence
from xserv.sampling import SamplingParams

P = SamplingParams(max_tokens=100)


def seq(i, n_prompt, start=0):
    return Sequence(i, list(range(start, start + n_prompt)), P, seed=i, stop_ids=frozenset())


def run_step(sched, scheduled, new_token=7):
    """What the engine does after a step: advance, register blocks, append a token to completed rows."""
    for s, n in scheduled:
        s.num_computed += n
        sched.postprocess(s, s.num_computed)
        if s.num_computed == s.num_tokens:
            s.token_ids.append(new_token)


# ---- block manager --------------------------------------------------------------------------------------------
def test_allocate_free_and_double_free():
    bm = BlockManager(4, 4)
    x = bm.allocate(3)
    assert x == [0, 1, 2] and bm.num_free == 1 and not bm.can_allocate(2)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(2)
    bm.free(x)
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="twice"):
        bm.free([1])


def test_prefix_match_is_exact_refcounted_and_lru_evicted():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    k0 = bm.register(a[0], 0, (1, 2))
    bm.register(a[1], k0, (3, 4))
    blocks, keys = bm.match_prefix([1, 2, 3, 4, 5], max_tokens=5)
    assert blocks == a and len(keys) == 2 and bm.ref_count[a[0]] == 2
    assert bm.match_prefix([1, 2, 9, 9], 4)[0] == [a[0]]  # diverges in the second block
    assert bm.match_prefix([9, 2, 3, 4], 4)[0] == []  # same second block, other parent: no match
    assert bm.match_prefix([1, 2, 3, 4], 3)[0] == [a[0]]  # capped at max_tokens
    bm.free([a[0]]), bm.free([a[0]]), bm.free(blocks), bm.free(a)
    assert all(r == 0 for r in bm.ref_count) and bm.num_free == 4 and bm.num_cached == 2
    # the two never-registered blocks go first, then the least recently used cached block: a[1] (the last
    # `free(a)` let go of a[1] before a[0], since a sequence's blocks are freed from its end)
    fresh = bm.allocate(3)
    assert set(fresh[:2]) == {2, 3} and fresh[2] == a[1] and bm.num_cached == 1
    assert bm.match_prefix([1, 2, 3, 4], 4)[0] == [a[0]]  # a[1]'s key is gone: the chain stops after a[0]


def test_disabled_prefix_cache_never_matches():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = bm.allocate(1)
    bm.register(a[0], 0, (1, 2))
    assert bm.match_prefix([1, 2, 3], 3) == ([], []) and bm.num_cached == 0


# ---- scheduler ------------------------------------------------------------------------------------------------
def test_decodes_run_in_the_same_step_as_a_prefill_chunk():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a, b = seq(0, 6), seq(1, 40, start=100)
    sched.add(a)
    first = sched.schedule()
    assert first == [(a, 6)]
    run_step(sched, first)
    sched.add(b)
    second = sched.schedule()
    # a decodes one token, b's prompt fills the rest of the budget; b is not done, so a keeps decoding
    assert second == [(a, 1), (b, 15)]
    run_step(sched, second)
    third = sched.schedule()
    assert third == [(a, 1), (b, 15)] and b.num_computed == 15


def test_admission_keeps_headroom_and_preemption_frees_the_newest():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(0, 8), seq(1, 8, start=50)
    sched.add(a), sched.add(b)
    step = sched.schedule()
    assert step == [(a, 8), (b, 8)] and bm.num_free == 2
    run_step(sched, step)  # both hold 9 tokens now: each needs a third block to decode
    c = seq(2, 4, start=200)
    sched.add(c)
    step = sched.schedule()
    assert step == [(a, 1), (b, 1)] and c.status == WAITING  # c would eat the decodes' headroom
    run_step(sched, step)
    for _ in range(3):  # 4 tokens per block: a and b fill their third blocks
        run_step(sched, sched.schedule())
    assert bm.num_free == 0
    step = sched.schedule()  # a needs a fourth block: b, the newest, is preempted
    assert step == [(a, 1)] and b.status == WAITING and sched.waiting[0] is b and sched.num_preemptions == 1
    assert b.num_computed == 0 and b.block_table == [] and bm.num_free == 2


def test_prefix_cache_shares_blocks_and_finish_returns_them():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq(0, 10)
    sched.add(a)
    run_step(sched, sched.schedule())
    assert len(a.block_keys) == 2  # two full blocks registered
    b = seq(1, 10)  # same prompt
    sched.add(b)
    step = sched.schedule()
    assert (b, 2) in step and b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2
    free_before = bm.num_free
    sched.finish(a, "stop")
    assert a.status == FINISHED and bm.ref_count[b.block_table[0]] == 1 and bm.num_free == free_before + 1
    sched.finish(b, "abort")
    assert bm.num_free == 16 and not sched.has_unfinished()
    c = seq(2, 9)  # the prefix survives in the cache after both holders ended
    sched.add(c)
    sched.schedule()
    assert c.num_cached_tokens == 8 and bm.hit_tokens == 16 and bm.query_tokens == 29


def test_whole_prompt_cached_still_computes_the_last_token():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq(0, 8)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.finish(a, "stop")
    b = seq(1, 8)
    sched.add(b)
    assert sched.schedule() == [(b, 4)] and b.num_cached_tokens == 4  # block 2 is recomputed for the logits


def test_too_small_cache_raises_instead_of_hanging():
    sched = Scheduler(BlockManager(2, 4), max_num_seqs=4, max_num_batched_tokens=64)
    s = seq(0, 9)
    sched.add(s)
    with pytest.raises(KVCacheTooSmall):
        sched.schedule()


def test_running_count_and_slots_are_bounded():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [seq(i, 3, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert [s for s, _ in step] == seqs[:2] and seqs[2].status == WAITING
    assert sorted(s.slot for s in seqs[:2]) == [0, 1] and all(s.status == RUNNING for s in seqs[:2])
    sched.finish(seqs[0], "stop")
    run_step(sched, [(seqs[1], 3)])
    step = sched.schedule()
    assert (seqs[2], 3) in step and seqs[2].slot == 0
