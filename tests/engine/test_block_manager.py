"""engine/block_manager.py on its own: allocation and free with reference counts, prefix registration and matching,
and the eviction order of cached blocks. Pure host bookkeeping: no device, no model."""
import pytest

from xserv.engine.block_manager import NO_PARENT, BlockManager, block_key


def register_chain(bm, blocks, tokens):
    """Register `blocks` as the consecutive full blocks of `tokens`; returns their keys."""
    keys, parent = [], NO_PARENT
    for i, b in enumerate(blocks):
        parent = bm.register(b, parent, tuple(tokens[i * bm.block_size:(i + 1) * bm.block_size]))
        keys.append(parent)
    return keys


def test_allocate_hands_out_distinct_blocks_lowest_first_and_refuses_past_the_pool():
    """Planted bug seen red: allocate() popping from the wrong end of the free list (highest id first)."""
    bm = BlockManager(num_blocks=5, block_size=4)
    assert bm.num_free == 5 and bm.blocks_for(0) == 0 and bm.blocks_for(4) == 1 and bm.blocks_for(5) == 2
    a = bm.allocate(3)
    assert a == [0, 1, 2] and [bm.ref_count[b] for b in a] == [1, 1, 1]
    assert bm.num_free == 2 and bm.can_allocate(2) and not bm.can_allocate(3)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(3)
    assert bm.num_free == 2  # a refused request takes nothing
    assert bm.allocate(2) == [3, 4] and bm.num_free == 0


def test_free_drops_one_hold_and_a_double_free_raises():
    """Planted bug seen red: free() returning a block to the free list while another sequence still holds it
    (ref_count set to 0 instead of decremented)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    [b] = bm.allocate(1)
    bm.ref_count[b] += 1  # a second holder (as match_prefix makes)
    bm.free([b])
    assert bm.ref_count[b] == 1 and bm.num_free == 3  # still held once: not free
    bm.free([b])
    assert bm.ref_count[b] == 0 and bm.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free([b])
    assert bm.allocate(1) == [b]  # a freed, never-registered block is handed out again


def test_bad_sizes_are_refused():
    """Planted bug seen red: dropping the block_size check (a 0-token block divides by zero later)."""
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_a_registered_prefix_is_matched_block_by_block_and_held_again():
    """Planted bug seen red: match_prefix not raising the ref count of the blocks it returns (a freed owner then
    released blocks the new request reads)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 111))  # 11 tokens: two full blocks and 3 tokens over
    owned = bm.allocate(bm.blocks_for(len(prompt)))
    keys = register_chain(bm, owned[:2], prompt)
    assert bm.num_cached == 2
    assert keys[0] == block_key(NO_PARENT, tuple(prompt[:4])) and keys[1] == block_key(keys[0], tuple(prompt[4:8]))

    blocks, got_keys = bm.match_prefix(prompt + [7, 7], max_tokens=len(prompt))
    assert blocks == owned[:2] and got_keys == keys
    assert [bm.ref_count[b] for b in owned] == [2, 2, 1]
    # max_tokens bounds the match to whole blocks inside it
    assert bm.match_prefix(prompt, max_tokens=7)[0] == owned[:1]
    bm.free(owned[:1])
    # a different first block matches nothing, even when a later block's tokens are the same
    assert bm.match_prefix([0, 0, 0, 0] + prompt[4:8], max_tokens=8) == ([], [])


def test_matching_compares_tokens_not_only_the_hash(monkeypatch):
    """Planted bug seen red: match_prefix trusting the key alone (a hash collision served another prompt's KV)."""
    import xserv.engine.block_manager as M

    monkeypatch.setattr(M, "block_key", lambda parent, tokens: 42)  # every block collides
    bm = M.BlockManager(num_blocks=4, block_size=2)
    [b] = bm.allocate(1)
    bm.register(b, M.NO_PARENT, (1, 2))
    assert bm.match_prefix([3, 4], max_tokens=2) == ([], [])
    assert bm.match_prefix([1, 2], max_tokens=2)[0] == [b]


def test_a_second_block_with_the_same_prefix_stays_unregistered():
    """Planted bug seen red: register() overwriting the key's block (the first block's key then pointed at a
    block that could be freed and reused under it)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.allocate(2)
    ka = bm.register(a, NO_PARENT, (5, 6))
    kb = bm.register(b, NO_PARENT, (5, 6))
    assert ka == kb and bm.num_cached == 1  # the key still chains for b's successors
    bm.free([b])
    assert bm.num_free == 3 and bm.match_prefix([5, 6], max_tokens=2)[0] == [a]


def test_unheld_cached_blocks_are_evicted_last_and_least_recently_used_first():
    """Planted bug seen red: allocate() taking cached blocks before never-registered ones (the prefix cache
    emptied while plain blocks were free); and popping the newest cached block instead of the oldest."""
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.allocate(2)
    bm.register(a, NO_PARENT, (1, 1))
    bm.register(b, NO_PARENT, (2, 2))
    bm.free([a])  # a leaves first: the older cached block
    bm.free([b])
    assert bm.num_free == 4 and bm.num_cached == 2
    assert sorted(bm.allocate(2)) == [2, 3]  # the plain blocks go first; both prefixes survive
    assert bm.num_cached == 2
    assert bm.allocate(1) == [a] and bm.num_cached == 1  # then the least recently freed cached block
    assert bm.match_prefix([1, 1], max_tokens=2) == ([], [])  # its key is forgotten
    assert bm.match_prefix([2, 2], max_tokens=2)[0] == [b]  # b, matched, is held and no longer evictable
    assert bm.num_free == 0


def test_a_matched_cached_block_leaves_the_eviction_list():
    """Planted bug seen red: match_prefix leaving a revived block in the LRU list (allocate then handed a held
    block to a second sequence)."""
    bm = BlockManager(num_blocks=2, block_size=2)
    [a] = bm.allocate(1)
    bm.register(a, NO_PARENT, (9, 9))
    bm.free([a])
    assert bm.match_prefix([9, 9], max_tokens=2)[0] == [a]
    assert bm.num_free == 1 and bm.allocate(1) != [a]


def test_prefix_caching_off_and_reset():
    """Planted bug seen red: reset_prefix_cache() clearing the cached list without returning its blocks to the
    free list (the pool shrank by every cached block)."""
    off = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=False)
    [a] = off.allocate(1)
    off.register(a, NO_PARENT, (1, 2))
    assert off.num_cached == 0 and off.match_prefix([1, 2], max_tokens=2) == ([], [])

    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = bm.allocate(2)
    bm.register(a, NO_PARENT, (1, 2))
    bm.register(b, NO_PARENT, (3, 4))
    bm.free([a])  # a cached and free, b cached and held
    bm.reset_prefix_cache()
    assert bm.num_cached == 0 and bm.num_free == 2 and bm.ref_count[b] == 1
    assert bm.match_prefix([1, 2], max_tokens=2) == ([], [])
    assert sorted(bm.allocate(2)) == sorted([a, 2])
