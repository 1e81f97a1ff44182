"""KVCacheManager: allocate_slots or refuse, prefix hits, caching, freeing and CPU offload, block counts by hand.

Every count below is for ``block_size`` 4: a request holding t tokens has ceil(t / 4) blocks.
"""

from __future__ import annotations

import pytest
import torch

from rollout.engine.kv.block_pool import NULL_BLOCK, BlockManager
from rollout.engine.kv.cache import GIB, CacheShape
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.requests import Request
from rollout.sampling_params import SamplingParams

BS = 4


def make_kv(num_blocks: int = 10, safety_margin: float = 0.0, offload_blocks: int = 0) -> KVCacheManager:
    pool = None
    if offload_blocks:
        shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
        pool = CPUOffloadPool(shape, offload_blocks * shape.bytes_per_token * BS / GIB, BS)
        assert pool.num_blocks == offload_blocks
    return KVCacheManager(BlockManager(num_blocks, BS), safety_margin, pool)


def make_request(request_id: str, prompt: list[int], score_from: int | None = None) -> Request:
    return Request(request_id, prompt, SamplingParams(max_new_tokens=4), score_from=score_from)


def num_held_blocks(request: Request) -> list[int]:
    """The blocks a request holds in each group (``NULL_BLOCK`` entries not counted)."""
    return [sum(1 for b in table if b != NULL_BLOCK) for table in request.block_tables]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def admit(kv: KVCacheManager, req: Request, n: int | None = None, keep_margin: bool = False) -> bool:
    """Admission as the scheduler does it: hits, slots for the rest (or n tokens), cache the filled blocks."""
    hits, num_cached = kv.get_computed_blocks(req, weight_version=0)
    n = req.num_tokens - num_cached if n is None else n
    if not kv.allocate_slots(req, n, hits, num_cached, keep_margin=keep_margin):
        return False
    req.num_computed_tokens = num_cached
    kv.cache_blocks(req, num_cached + n, weight_version=0)
    return True


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (12, 3), (13, 4)])
def test_blocks_needed_is_ceil_of_tokens_over_block_size(num_tokens: int, expected: int) -> None:
    assert make_kv(num_blocks=1).blocks_needed(num_tokens) == expected


def test_allocate_slots_gives_ceil_of_tokens_over_block_size() -> None:
    kv = make_kv(num_blocks=10)
    req = make_request("a", tokens(0, 10))
    assert kv.allocate_slots(req, 10)
    assert len(req.block_table) == 3  # ceil(10 / 4)
    assert kv.num_free_blocks == 7
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2)  # 12 tokens: still 3 blocks
    assert len(req.block_table) == 3 and kv.num_free_blocks == 7
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1)  # 13 tokens: a 4th block
    assert len(req.block_table) == 4 and kv.num_free_blocks == 6


def test_refusal_changes_nothing() -> None:
    kv = make_kv(num_blocks=4)
    a = make_request("a", tokens(0, 12))
    assert kv.allocate_slots(a, 12)  # 3 blocks, 1 free
    b = make_request("b", tokens(100, 8))
    assert not kv.allocate_slots(b, 8)  # needs 2
    assert b.block_table == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4)  # 1 block fits
    assert len(b.block_table) == 1 and kv.num_free_blocks == 0


def test_safety_margin_is_kept_only_when_asked() -> None:
    kv = make_kv(num_blocks=10, safety_margin=0.3)  # 3 blocks kept free
    assert kv.safety_margin_blocks == 3
    a = make_request("a", tokens(0, 28))  # 7 blocks: leaves 3, exactly the margin
    assert kv.allocate_slots(a, 28, keep_margin=True)
    b = make_request("b", tokens(100, 4))  # 1 block would leave 2 < 3
    assert not kv.allocate_slots(b, 4, keep_margin=True)
    assert kv.allocate_slots(b, 4)  # a running request may use the margin
    assert kv.num_free_blocks == 2


def test_prefix_hits_are_shared_and_cost_a_free_block_only_when_nobody_holds_them() -> None:
    kv = make_kv(num_blocks=6)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 12))
    assert admit(kv, a)  # 3 blocks, all full and cached
    a_blocks = list(a.block_table)
    # b has the same 12 tokens: hits capped at 11 tokens -> 2 blocks, shared (a holds them); 1 fresh block.
    b = make_request("b", tokens(0, 12))
    assert kv.get_computed_blocks(b, 0) == (a_blocks[:2], 8)
    assert admit(kv, b)
    assert b.block_table[:2] == a_blocks[:2] and b.block_table[2] not in a_blocks
    assert [bm.blocks[x].ref_count for x in a_blocks] == [2, 2, 1]
    assert kv.num_free_blocks == 6 - 4
    assert bm.num_prefix_cache_hit_blocks == 2
    # Both finish: their 4 blocks are free, a's 3 stay findable.
    kv.free(a)
    kv.free(b)
    assert a.block_table == [] and a.block_hashes == [] and kv.num_free_blocks == 6
    # c hits 2 free cached blocks (each costs a free block) and needs 1 fresh: 3 <= 6.
    c = make_request("c", tokens(0, 12))
    assert admit(kv, c)
    assert c.block_table[:2] == a_blocks[:2]
    assert kv.num_free_blocks == 6 - 3


def test_evictable_hits_count_against_the_free_blocks() -> None:
    kv = make_kv(num_blocks=4)
    a = make_request("a", tokens(0, 12))
    assert admit(kv, a)
    kv.free(a)  # 4 free, 3 of them cached
    filler = make_request("f", tokens(500, 4))
    assert kv.allocate_slots(filler, 4)  # takes the uncached block: 3 free, all cached
    b = make_request("b", tokens(0, 13))  # hits 3 blocks (12 tokens), needs 1 fresh: 4 > 3 free
    hits, num_cached = kv.get_computed_blocks(b, 0)
    assert len(hits) == 3 and num_cached == 12
    assert not kv.allocate_slots(b, 1, hits, num_cached)
    assert b.block_table == [] and kv.num_free_blocks == 3


def test_scoring_request_hits_stop_before_the_first_scored_position() -> None:
    kv = make_kv(num_blocks=8)
    assert admit(kv, make_request("gen", tokens(0, 12)))
    scorer = make_request("s", tokens(0, 12), score_from=6)  # logits of position 5 are needed
    hits, num_cached = kv.get_computed_blocks(scorer, 0)
    assert num_cached == 4 and len(hits) == 1


def test_cache_blocks_hashes_only_full_blocks_and_uncache_drops_them() -> None:
    kv = make_kv(num_blocks=8)
    bm = kv.block_manager
    req = make_request("a", tokens(0, 10))
    assert kv.allocate_slots(req, 10)
    kv.cache_blocks(req, 10, weight_version=0)
    assert len(req.block_hashes) == 2  # 10 tokens: 2 full blocks
    assert bm.find_cached_prefix(req.token_ids, 0, max_tokens=10) == req.block_table[:2]
    assert bm.find_cached_prefix(req.token_ids, 1, max_tokens=10) == []  # another weight version
    kv.uncache(req, first_block=1)
    assert bm.find_cached_prefix(req.token_ids, 0, max_tokens=10) == req.block_table[:1]


def fork_of(kv: KVCacheManager, parent: Request, request_id: str) -> Request:
    """A request with the parent's tokens, forked from it after its prefill, as the scheduler does."""
    child = make_request(request_id, list(parent.token_ids))
    kv.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def test_fork_shares_every_block_and_the_first_write_copies_the_partial_one() -> None:
    kv = make_kv(num_blocks=10)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 10))
    assert admit(kv, a)  # 3 blocks: 2 full (hashed), 2 tokens in the 3rd
    a.num_computed_tokens = 10
    b = fork_of(kv, a, "b")
    assert b.block_table == a.block_table and b.block_hashes == a.block_hashes
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 2]
    assert kv.num_free_blocks == 10 - 3 and bm.num_prefix_cache_hit_blocks == 0
    shared = a.block_table[2]
    # a writes position 10, in the shared 3rd block: it takes a fresh block, the 2 tokens are copied.
    assert kv.allocate_slots(a, 1)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != shared
    assert kv.take_block_copies() == [(shared, a.block_table[2])] and kv.take_block_copies() == []
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1] and bm.blocks[shared].ref_count == 1
    assert kv.num_free_blocks == 10 - 4 and kv.num_block_copies == 1
    # b is the block's last holder: it writes in place.
    assert kv.allocate_slots(b, 1)
    assert b.block_table[2] == shared and kv.take_block_copies() == []
    # 5 tokens from position 10: the 3rd block (now b's own) and a fresh 4th.
    c = fork_of(kv, b, "c")
    assert kv.allocate_slots(c, 5)
    assert len(c.block_table) == 4 and c.block_table[2] != shared
    assert kv.take_block_copies() == [(shared, c.block_table[2])]
    assert kv.num_free_blocks == 10 - 6
    for req in (a, b, c):
        kv.free(req)
    assert kv.num_free_blocks == 10


def test_copy_on_write_is_refused_without_a_free_block_and_changes_nothing() -> None:
    kv = make_kv(num_blocks=4, safety_margin=0.25)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 10))
    assert admit(kv, a)
    a.num_computed_tokens = 10
    b = fork_of(kv, a, "b")
    table = list(a.block_table)
    # 1 block free: the copy fits, but not with the margin of 1 block.
    assert not kv.allocate_slots(a, 1, keep_margin=True)
    assert a.block_table == table and kv.take_block_copies() == []
    assert [bm.blocks[x].ref_count for x in table] == [2, 2, 2] and kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 1)
    d = make_request("d", tokens(500, 4))
    assert not kv.allocate_slots(d, 1)  # the copy took the last free block
    assert not kv.allocate_slots(fork_of(kv, b, "c"), 1)  # b and c share the 3rd block, none is free
    assert kv.take_block_copies() == [(table[2], a.block_table[2])]


def test_fork_refuses_a_request_that_holds_blocks() -> None:
    kv = make_kv(num_blocks=8)
    a = make_request("a", tokens(0, 6))
    b = make_request("b", tokens(0, 6))
    assert admit(kv, a) and admit(kv, b)
    with pytest.raises(RuntimeError, match="'b' holds blocks"):
        kv.fork(a, b)


def test_offload_reserves_pool_blocks_and_finish_restore_returns_them() -> None:
    kv = make_kv(num_blocks=8, offload_blocks=4)
    pool = kv.offload_pool
    req = make_request("a", tokens(0, 10))
    assert kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    device_blocks = list(req.block_table)
    copy = kv.offload(req)
    assert copy is not None
    blocks, pool_ids = copy
    assert blocks == device_blocks and len(pool_ids) == 3  # ceil(10 / 4) computed blocks
    assert req.offloaded == (pool_ids, 10) and len(pool.free_blocks) == 1 and kv.num_offloads == 1
    kv.free(req)
    req.num_computed_tokens = 0
    # Re-admission restores 10 tokens instead of looking up the prefix cache.
    assert kv.get_computed_blocks(req, 0) == ([], 10)
    assert kv.allocate_slots(req, 1, (), 10)
    assert len(req.block_table) == 3  # ceil(11 / 4)
    assert kv.restore_blocks(req) == req.block_table[:3]
    kv.finish_restore(req)
    assert req.offloaded is None and len(pool.free_blocks) == 4


def test_offload_falls_back_to_recompute_when_the_pool_is_full() -> None:
    kv = make_kv(num_blocks=8, offload_blocks=2)
    req = make_request("a", tokens(0, 10))
    assert kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    assert kv.offload(req) is None  # needs 3 pool blocks
    assert req.offloaded is None and kv.num_offloads == 0
    assert make_kv(num_blocks=8).offload(req) is None  # no pool at all


# ---------------------------------------------------------------- layer groups (issue 12, item 3)
# Two groups over one pool: group 0 a sliding window of 8 tokens, group 1 full attention. A query at
# position p reads keys p - 7 .. p, so after c computed tokens the sliding group needs the blocks from
# (c - 7) // 4 on (window_start_block); the ones before it are NULL_BLOCK in its table.
def make_grouped(num_blocks: int = 40, offload_blocks: int = 0) -> KVCacheManager:
    pool = None
    if offload_blocks:
        shape = CacheShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
        pool = CPUOffloadPool(shape, offload_blocks * shape.bytes_per_token * BS / GIB, BS)
    return KVCacheManager(BlockManager(num_blocks, BS), 0.0, pool, sliding_windows=[8, None])


def test_a_sliding_group_gives_back_the_blocks_that_leave_the_window_while_decoding() -> None:
    kv = make_grouped(num_blocks=30)
    req = make_request("a", tokens(0, 10))
    assert kv.allocate_slots(req, 10)  # ceil(10 / 4) = 3 blocks in each group
    assert num_held_blocks(req) == [3, 3] and kv.num_free_blocks == 24
    first = req.block_tables[0][0]
    req.num_computed_tokens = 10  # position 10 reads 3..10: blocks 0..2, all kept
    assert kv.allocate_slots(req, 1)
    assert num_held_blocks(req) == [3, 3] and kv.num_free_blocks == 24
    req.num_computed_tokens = 11  # position 11 reads 4..11: block 0 goes back
    assert kv.allocate_slots(req, 1)
    assert req.block_tables[0][0] == NULL_BLOCK and num_held_blocks(req) == [2, 3] and kv.num_free_blocks == 25
    assert kv.block_manager.blocks[first].ref_count == 0
    req.num_computed_tokens = 12  # position 12 reads 5..12 (blocks 1..3); 13 tokens: a 4th block in each group
    assert kv.allocate_slots(req, 1)
    assert num_held_blocks(req) == [3, 4] and kv.num_free_blocks == 23
    kv.free(req)
    assert kv.num_free_blocks == 30 and req.block_tables == [[], []]


def test_a_sliding_group_gives_back_blocks_as_chunked_prefill_advances() -> None:
    kv = make_grouped(num_blocks=30)
    req = make_request("a", tokens(0, 30))
    assert kv.allocate_slots(req, 12)  # positions 0..11
    assert num_held_blocks(req) == [3, 3]
    req.num_computed_tokens = 12  # the chunk 12..23 reads from 5 on: block 0 goes back; 6 blocks in all
    assert kv.allocate_slots(req, 12)
    assert num_held_blocks(req) == [5, 6] and kv.num_free_blocks == 30 - 11
    req.num_computed_tokens = 24  # the chunk 24..29 reads from 17 on: blocks 1..3 go back; 8 blocks in all
    assert kv.allocate_slots(req, 6)
    assert req.block_tables[0][:4] == [NULL_BLOCK] * 4
    assert num_held_blocks(req) == [4, 8] and kv.num_free_blocks == 30 - 12


def test_out_of_window_blocks_go_back_even_when_the_allocation_is_refused() -> None:
    kv = make_grouped(num_blocks=8)
    req = make_request("a", tokens(0, 16))
    assert kv.allocate_slots(req, 16)  # 4 + 4 blocks: the pool is full
    req.num_computed_tokens = 16
    # The chunk 16..20 reads from 9 on: sliding blocks 0, 1 go back. 21 tokens need 2 more blocks in each
    # group, 4 in all, and only those 2 are free: refused, the rest unchanged.
    assert not kv.allocate_slots(req, 5)
    assert req.block_tables[0][:2] == [NULL_BLOCK] * 2 and [len(t) for t in req.block_tables] == [4, 4]
    assert num_held_blocks(req) == [2, 4] and kv.num_free_blocks == 2
    assert kv.take_block_copies() == []


def test_a_prefix_hit_takes_the_full_prefix_and_only_the_window_of_the_sliding_group() -> None:
    kv = make_grouped(num_blocks=40)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 24))
    assert admit(kv, a)  # 6 full blocks in each group, hashed
    sliding, full = list(a.block_tables[0]), list(a.block_tables[1])
    a.num_computed_tokens = 24
    assert kv.allocate_slots(a, 1)  # decoding at 24 reads 17..24: sliding blocks 0..3 go back (still cached)
    kv.free(a)
    # b: the same 24 tokens and one more. Hit of 6 blocks: the full group's 0..5, the sliding group's 4, 5
    # (position 24 reads 17..24); NULL_BLOCK before them.
    b = make_request("b", tokens(0, 25))
    hits, num_cached = kv.get_computed_blocks(b, 0)
    assert num_cached == 24 and hits == [NULL_BLOCK] * 4 + sliding[4:6] + full[:6]
    # Without sliding block 5 in the cache, the hit is 5 blocks: position 20 reads 13..20, blocks 3, 4.
    bm.uncache([sliding[5]])
    hits, num_cached = kv.get_computed_blocks(b, 0)
    assert num_cached == 20 and hits == [NULL_BLOCK] * 3 + sliding[3:5] + full[:5]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 5, hits, num_cached)  # 25 tokens: 7 blocks per group, 2 fresh in each
    b.num_computed_tokens = num_cached
    assert b.block_tables[0][:5] == [NULL_BLOCK] * 3 + sliding[3:5] and b.block_tables[1][:5] == full[:5]
    assert num_held_blocks(b) == [4, 7]
    assert kv.num_free_blocks == free_before - 7 - 4  # the hits sat in the free queue: they cost a block each
    assert bm.num_prefix_cache_hit_blocks == 7
    kv.cache_blocks(b, 25, weight_version=0)  # the chain goes on through the NULL_BLOCK positions
    assert len(b.group_block_hashes[0]) == len(b.group_block_hashes[1]) == 6
    assert b.group_block_hashes[0][5] == bm.blocks[b.block_tables[0][5]].block_hash is not None


def test_groups_hash_the_same_tokens_apart() -> None:
    kv = make_grouped(num_blocks=20)
    a = make_request("a", tokens(0, 8))
    assert admit(kv, a)
    assert a.group_block_hashes[0] != a.group_block_hashes[1]
    assert kv.block_manager.find_cached_prefix(a.token_ids, 0, 8, group=1) == a.block_tables[1]
    assert kv.block_manager.find_cached_prefix(a.token_ids, 0, 8, group=0) == a.block_tables[0]


def test_offload_of_a_sliding_group_stores_and_restores_its_window_only() -> None:
    kv = make_grouped(num_blocks=40, offload_blocks=10)
    req = make_request("a", tokens(0, 22))
    assert kv.allocate_slots(req, 22)  # 6 blocks in each group
    req.num_computed_tokens = 22
    assert kv.allocate_slots(req, 1)  # reads from 15: sliding blocks 0..2 go back
    req.num_computed_tokens = 23
    sliding, full = list(req.block_tables[0]), list(req.block_tables[1])
    copy = kv.offload(req)
    assert copy is not None
    blocks, pool_ids = copy
    # Queries from 23 on read 16..: sliding blocks 4, 5; the full group's 6 blocks.
    assert blocks == sliding[4:6] + full[:6] and len(pool_ids) == 8 and req.offloaded == (pool_ids, 23)
    kv.free(req)
    req.num_computed_tokens = 0
    assert kv.num_free_blocks == 40
    assert kv.get_computed_blocks(req, 0) == ([], 23)
    assert kv.allocate_slots(req, 1, (), 23)  # 24 tokens: the window's 2 blocks and 6 full ones
    assert req.block_tables[0][:4] == [NULL_BLOCK] * 4 and num_held_blocks(req) == [2, 6]
    assert kv.restore_blocks(req) == req.block_tables[0][4:6] + req.block_tables[1][:6]
    kv.finish_restore(req)
    assert req.offloaded is None and len(kv.offload_pool.free_blocks) == 10


def test_fork_shares_every_group_and_each_group_copies_its_partial_block() -> None:
    kv = make_grouped(num_blocks=40)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 22))
    assert admit(kv, a)  # 6 blocks in each group; 2 tokens in each 6th block
    a.num_computed_tokens = 22
    b = fork_of(kv, a, "b")
    assert b.block_tables == a.block_tables and kv.num_free_blocks == 40 - 12
    s5, f5 = a.block_tables[0][5], a.block_tables[1][5]
    # a decodes at 22: its sliding blocks 0..2 leave its window (b still holds them), and the shared
    # 6th block of each group is copied before a writes into it.
    assert kv.allocate_slots(a, 1)
    assert a.block_tables[0][:3] == [NULL_BLOCK] * 3 and b.block_tables[0][:3] != [NULL_BLOCK] * 3
    assert kv.take_block_copies() == [(s5, a.block_tables[0][5]), (f5, a.block_tables[1][5])]
    assert kv.num_free_blocks == 40 - 14 and kv.num_block_copies == 2
    assert kv.allocate_slots(b, 1)  # b's sliding blocks 0..2 go back to the pool; b writes its 6th blocks in place
    assert b.block_tables[0][5] == s5 and b.block_tables[1][5] == f5 and kv.take_block_copies() == []
    assert kv.num_free_blocks == 40 - 11
    assert [bm.blocks[x].ref_count for x in b.block_tables[1][:5]] == [2] * 5


def test_max_blocks_needed_counts_each_group_s_most() -> None:
    kv = make_grouped()
    # 100 tokens in chunks of 16: the full group 25 blocks; the sliding group 1 + ceil((8 + 16 - 2) / 4) = 7.
    assert kv.max_blocks_needed(100, 16) == 32
    assert make_kv().max_blocks_needed(100, 16) == 25


def test_a_group_s_fresh_block_never_evicts_another_group_s_hit() -> None:
    # Two groups over a pool of 6. a's 8 tokens (2 full blocks per group) are freed first, c's after: the
    # free queue is a's group-0 blocks, a's group-1 blocks, then c's. b = a's tokens and one more hits a's
    # 4 blocks and needs 1 fresh block per group: the fresh ones must be c's, not a group-1 hit still in
    # the queue when group 0 allocates (it was: group 1 then shared its hit with group 0's fresh block).
    kv = KVCacheManager(BlockManager(6, BS), sliding_windows=[None, None])
    a, c = make_request("a", tokens(0, 8)), make_request("c", tokens(100, 4))
    assert admit(kv, a) and admit(kv, c)
    hit_tables = [list(t) for t in a.block_tables]
    kv.free(a)
    kv.free(c)
    b = make_request("b", tokens(0, 9))
    hits, num_cached = kv.get_computed_blocks(b, 0)
    assert hits == hit_tables[0] + hit_tables[1] and num_cached == 8
    assert kv.allocate_slots(b, 1, hits, num_cached)
    assert [t[:2] for t in b.block_tables] == hit_tables
    held = b.block_tables[0] + b.block_tables[1]
    assert len(set(held)) == 6 and all(kv.block_manager.blocks[x].ref_count == 1 for x in held)
