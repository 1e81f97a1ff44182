"""BlockManager: ref counts, the LRU free queue and prefix caching, with free-block counts computed by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import rollout.engine.kv.block_pool as block_manager_module
from rollout.engine.kv.block_pool import BlockManager, hash_block

BS = 4


def cache_sequence(
    bm: BlockManager, block_ids: Sequence[int], token_ids: Sequence[int], weight_version: int = 0
) -> list[bytes]:
    """Register the full blocks of one sequence in the prefix cache, hashes chained as the scheduler does."""
    hashes: list[bytes] = []
    for i, block_id in enumerate(block_ids):
        parent = hashes[-1] if hashes else None
        hashes.append(bm.cache_block(block_id, parent, token_ids[i * BS : (i + 1) * BS], weight_version))
    return hashes


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------------------------ allocation, ref counts


def test_allocate_takes_blocks_in_order_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    assert bm.num_free_blocks == 5
    blocks = bm.allocate(3)
    assert blocks == [0, 1, 2]
    assert bm.num_free_blocks == 2
    assert [bm.blocks[b].ref_count for b in range(5)] == [1, 1, 1, 0, 0]
    bm.free(blocks)
    assert bm.num_free_blocks == 5
    assert [bm.blocks[b].ref_count for b in range(5)] == [0, 0, 0, 0, 0]


def test_acquire_raises_ref_count_and_block_is_free_only_after_last_release() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    [block] = bm.allocate(1)
    bm.acquire([block])
    bm.acquire([block])
    assert bm.blocks[block].ref_count == 3
    assert bm.num_free_blocks == 3
    bm.free([block])
    bm.free([block])
    assert bm.blocks[block].ref_count == 1
    assert bm.num_free_blocks == 3
    bm.free([block])
    assert bm.blocks[block].ref_count == 0
    assert bm.num_free_blocks == 4
    assert bm.num_prefix_cache_hit_blocks == 2


def test_share_raises_ref_counts_of_held_blocks_counts_no_hit_and_refuses_a_free_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    blocks = bm.allocate(2)
    bm.share(blocks)
    assert [bm.blocks[b].ref_count for b in blocks] == [2, 2]
    assert bm.num_free_blocks == 2 and bm.num_prefix_cache_hit_blocks == 0
    with pytest.raises(RuntimeError, match="block 3 is free"):
        bm.share([blocks[0], 3])
    assert [bm.blocks[b].ref_count for b in (*blocks, 3)] == [2, 2, 0]  # nothing changed
    bm.free(blocks)
    assert bm.num_free_blocks == 2
    bm.free(blocks)
    assert bm.num_free_blocks == 4


def test_freeing_a_block_twice_raises_runtime_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(RuntimeError, match="block 0 freed more often than it was allocated"):
        bm.free(blocks)
    with pytest.raises(RuntimeError, match="block 1 freed more often"):
        bm.free([1])  # never allocated
    assert bm.num_free_blocks == 2


def test_allocate_beyond_free_raises_runtime_error_and_takes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    bm.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, only 1 free"):
        bm.allocate(2)
    assert bm.num_free_blocks == 1
    assert bm.allocate(1) == [2]


# ------------------------------------------------------------------------------------ hashing


def test_chained_hash_differs_by_parent_tokens_and_weight_version() -> None:
    block = [5, 6, 7, 8]
    parent = hash_block(None, [1, 2, 3, 4], 0)
    base = hash_block(parent, block, 0)
    assert len(base) == 32
    assert hash_block(parent, list(block), 0) == base  # deterministic
    assert hash_block(parent, tuple(block), 0) == base  # list or tuple alike
    different = {
        "no parent": hash_block(None, block, 0),
        "other parent": hash_block(hash_block(None, [1, 2, 3, 9], 0), block, 0),
        "other tokens": hash_block(parent, [5, 6, 7, 9], 0),
        "token order": hash_block(parent, [6, 5, 7, 8], 0),
        "weight version": hash_block(parent, block, 1),
    }
    assert all(h != base for h in different.values())
    assert len(set(different.values())) == len(different)


def test_same_block_tokens_after_a_different_first_block_do_not_hit() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 8)
    blocks = bm.allocate(2)
    cache_sequence(bm, blocks, seq)
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == blocks
    other_first_block = tokens(100, 4) + seq[4:]
    assert bm.find_cached_prefix(other_first_block, 0, max_tokens=8) == []


def test_weight_version_bump_prevents_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 8)
    blocks = bm.allocate(2)
    cache_sequence(bm, blocks, seq, weight_version=0)
    assert bm.find_cached_prefix(seq, weight_version=0, max_tokens=8) == [0, 1]
    assert bm.find_cached_prefix(seq, weight_version=1, max_tokens=8) == []


def test_hash_collision_never_returns_block_with_other_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        block_manager_module, "hash_block", lambda parent, token_ids, weight_version, lora_id=0: b"\x00" * 32
    )
    bm = BlockManager(num_blocks=4, block_size=BS)
    [first] = bm.allocate(1)
    bm.cache_block(first, None, [1, 2, 3, 4], 0)
    # Same (constant) hash, other tokens: no hit.
    assert bm.find_cached_prefix([9, 9, 9, 9], 0, max_tokens=4) == []
    # The first block matches; the second collides with it but holds other tokens: only one hit.
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8], 0, max_tokens=8) == [first]
    # A second block with the colliding hash stays private: the table keeps the first one.
    [second] = bm.allocate(1)
    bm.cache_block(second, None, [5, 6, 7, 8], 0)
    assert bm.blocks[second].block_hash is None
    assert bm.hash_to_block == {b"\x00" * 32: first}
    assert bm.find_cached_prefix([5, 6, 7, 8], 0, max_tokens=4) == []
    assert bm.find_cached_prefix([1, 2, 3, 4], 0, max_tokens=4) == [first]


def test_cache_block_keeps_first_block_when_hash_already_cached() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = bm.allocate(2)
    h_a = bm.cache_block(a, None, [1, 2, 3, 4], 0)
    h_b = bm.cache_block(b, None, [1, 2, 3, 4], 0)
    assert h_a == h_b == hash_block(None, [1, 2, 3, 4], 0)
    assert bm.hash_to_block == {h_a: a}
    assert bm.blocks[b].block_hash is None
    assert bm.find_cached_prefix([1, 2, 3, 4, 0], 0, max_tokens=5) == [a]


# ------------------------------------------------------------------------------------ find_cached_prefix limits


@pytest.mark.parametrize(
    ("max_tokens", "expected_blocks"),
    [(14, [0, 1, 2]), (12, [0, 1, 2]), (11, [0, 1]), (8, [0, 1]), (7, [0]), (4, [0]), (3, []), (0, [])],
)
def test_find_cached_prefix_returns_only_full_blocks_within_max_tokens(
    max_tokens: int, expected_blocks: list[int]
) -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 14)  # 3 full blocks and a partial one
    cache_sequence(bm, bm.allocate(3), seq)
    assert bm.find_cached_prefix(seq, 0, max_tokens=max_tokens) == expected_blocks


def test_find_cached_prefix_stops_at_first_uncached_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 12)
    blocks = bm.allocate(3)
    cache_sequence(bm, blocks, seq)
    bm.uncache([blocks[1]])
    assert bm.find_cached_prefix(seq, 0, max_tokens=12) == [blocks[0]]


def test_find_cached_prefix_acquires_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 8)
    blocks = bm.allocate(2)
    cache_sequence(bm, blocks, seq)
    bm.free(blocks)
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == blocks
    assert bm.num_free_blocks == 4
    assert bm.num_prefix_cache_hit_blocks == 0


# ------------------------------------------------------------------------------------ free queue (LRU)


def test_freed_cached_block_stays_findable_until_reallocated() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 4)
    [cached] = bm.allocate(1)
    cache_sequence(bm, [cached], seq)
    bm.free([cached])
    assert bm.num_free_blocks == 4
    assert bm.find_cached_prefix(seq, 0, max_tokens=4) == [cached]
    # The three never-used blocks go first; the cached block is still there after them.
    assert bm.allocate(3) == [1, 2, 3]
    assert bm.find_cached_prefix(seq, 0, max_tokens=4) == [cached]
    # Reallocating it evicts its hash.
    assert bm.allocate(1) == [cached]
    assert bm.find_cached_prefix(seq, 0, max_tokens=4) == []
    assert bm.blocks[cached].block_hash is None
    assert bm.blocks[cached].token_ids is None
    assert bm.hash_to_block == {}


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 4)
    cached, plain_a, plain_b, plain_c = bm.allocate(4)
    cache_sequence(bm, [cached], seq)
    bm.free([cached])  # cached: joins the tail
    bm.free([plain_a, plain_b])  # uncached: go to the head
    bm.free([plain_c])
    first_three = bm.allocate(3)
    assert sorted(first_three) == [plain_a, plain_b, plain_c]
    assert bm.find_cached_prefix(seq, 0, max_tokens=4) == [cached]
    assert bm.allocate(1) == [cached]


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq_a, seq_b = tokens(0, 4), tokens(100, 4)
    block_a, block_b = bm.allocate(2)
    cache_sequence(bm, [block_a], seq_a)
    cache_sequence(bm, [block_b], seq_b)
    bm.free([block_a])
    bm.free([block_b])
    assert bm.allocate(1) == [block_a]
    assert bm.find_cached_prefix(seq_a, 0, max_tokens=4) == []
    assert bm.find_cached_prefix(seq_b, 0, max_tokens=4) == [block_b]


def test_reused_cached_block_moves_to_tail_of_free_queue() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq_a, seq_b = tokens(0, 4), tokens(100, 4)
    block_a, block_b = bm.allocate(2)
    cache_sequence(bm, [block_a], seq_a)
    cache_sequence(bm, [block_b], seq_b)
    bm.free([block_a])
    bm.free([block_b])
    # A hit on block_a and its release make it the most recently freed.
    bm.acquire(bm.find_cached_prefix(seq_a, 0, max_tokens=4))
    bm.free([block_a])
    assert bm.allocate(1) == [block_b]
    assert bm.find_cached_prefix(seq_a, 0, max_tokens=4) == [block_a]


def test_tail_blocks_of_a_sequence_are_evicted_before_its_prefix() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = tokens(0, 12)
    blocks = bm.allocate(3)
    cache_sequence(bm, blocks, seq)
    bm.free(blocks)
    assert bm.allocate(1) == [blocks[2]]
    assert bm.find_cached_prefix(seq, 0, max_tokens=12) == blocks[:2]
    assert bm.allocate(1) == [blocks[1]]
    assert bm.find_cached_prefix(seq, 0, max_tokens=12) == blocks[:1]
    assert bm.allocate(1) == [blocks[0]]
    assert bm.find_cached_prefix(seq, 0, max_tokens=12) == []


def test_acquire_of_free_cached_block_removes_it_from_free_queue() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = tokens(0, 4)
    [cached] = bm.allocate(1)
    cache_sequence(bm, [cached], seq)
    bm.free([cached])
    assert bm.num_free_blocks == 3
    bm.acquire([cached])
    assert bm.num_free_blocks == 2
    assert cached not in bm.free_queue
    assert bm.blocks[cached].ref_count == 1
    assert bm.num_prefix_cache_hit_blocks == 1
    assert sorted(bm.allocate(2)) == [1, 2]
    with pytest.raises(RuntimeError):
        bm.allocate(1)
    # Still cached: the hit holds it.
    assert bm.find_cached_prefix(seq, 0, max_tokens=4) == [cached]


# ------------------------------------------------------------------------------------ uncache, reset, disabled


def test_uncache_drops_hash_and_block_becomes_first_to_reuse_when_freed() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = tokens(0, 8)
    blocks = bm.allocate(2)
    hashes = cache_sequence(bm, blocks, seq)
    bm.uncache([blocks[1]])
    assert bm.blocks[blocks[1]].block_hash is None
    assert bm.hash_to_block == {hashes[0]: blocks[0]}
    bm.free(blocks)
    # blocks[1] holds nothing now: it goes to the head, before the never-used block 2.
    assert bm.allocate(1) == [blocks[1]]
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == [blocks[0]]


def test_uncache_of_a_private_duplicate_keeps_the_cached_original() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    original, duplicate = bm.allocate(2)
    h = bm.cache_block(original, None, [1, 2, 3, 4], 0)
    bm.cache_block(duplicate, None, [1, 2, 3, 4], 0)
    bm.uncache([duplicate])
    assert bm.hash_to_block == {h: original}


def test_reset_prefix_cache_forgets_all_hashes_and_keeps_allocations() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = tokens(0, 8)
    held, released = bm.allocate(1), bm.allocate(1)
    cache_sequence(bm, held + released, seq)
    bm.free(released)
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {}
    assert all(b.block_hash is None and b.token_ids is None for b in bm.blocks)
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == []
    assert bm.blocks[held[0]].ref_count == 1
    assert bm.num_free_blocks == 3


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    seq = tokens(0, 8)
    blocks = bm.allocate(2)
    hashes = cache_sequence(bm, blocks, seq)
    # The hash is still returned (the scheduler chains it) but nothing is registered.
    assert hashes[0] == hash_block(None, seq[:4], 0)
    assert hashes[1] == hash_block(hashes[0], seq[4:], 0)
    assert bm.hash_to_block == {}
    assert all(bm.blocks[b].block_hash is None for b in blocks)
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == []
    bm.free(blocks)
    assert bm.find_cached_prefix(seq, 0, max_tokens=8) == []


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_constructor_rejects_empty_pool_or_zero_block_size(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=num_blocks, block_size=block_size)


def test_lookup_goes_on_past_an_evicted_block_and_each_layer_group_has_its_own_chain() -> None:
    # A sliding-window group evicts the start of a sequence and still finds its window's blocks
    # (kv_cache_manager): the hashes chain over the tokens, not over the blocks present.
    bm = BlockManager(num_blocks=6, block_size=BS)
    ids = bm.allocate(3)
    seq = tokens(0, 3 * BS)
    cache_sequence(bm, ids, seq)
    bm.uncache([ids[0]])
    assert bm.find_cached_prefix(seq, 0, max_tokens=3 * BS) == []
    assert bm.lookup(seq, 0, 3) == [None, ids[1], ids[2]]
    assert bm.lookup(seq, 0, 2) == [None, ids[1]]
    # Group 1's first block is chained from its own root: group 0's blocks are not its hits.
    assert bm.lookup(seq, 0, 3, group=1) == [None, None, None]
    other = bm.allocate(1)
    bm.cache_block(other[0], block_manager_module.group_root(1), seq[:BS], 0)
    assert bm.find_cached_prefix(seq, 0, max_tokens=BS, group=1) == other
    roots = [block_manager_module.group_root(g) for g in range(3)]
    assert roots[0] is None and roots[1] != roots[2]
