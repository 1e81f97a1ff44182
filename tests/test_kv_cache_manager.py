"""KVCacheManager: allocate_slots or refuse, prefix hits, caching, freeing and CPU offload, block counts by hand.

Every count below is for ``block_size`` 4: a request holding t tokens has ceil(t / 4) blocks.
"""

from __future__ import annotations

import pytest
import torch

from rollout.block_manager import BlockManager
from rollout.kv_cache import GIB, CacheShape, CPUOffloadPool
from rollout.kv_cache_manager import KVCacheManager
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


def test_reversible_allocation_refuses_copy_on_write_and_cached_blocks_and_release_tail_undoes_it() -> None:
    kv = make_kv(num_blocks=6)
    bm = kv.block_manager
    a = make_request("a", tokens(0, 10))
    assert admit(kv, a)  # 3 blocks, 2 full and hashed
    a.num_computed_tokens = 10
    b = fork_of(kv, a, "b")
    # Position 10 is in the shared 3rd block: a copy-on-write, which release_tail could not undo.
    assert not kv.allocate_slots(a, 1, reversible=True) and kv.take_block_copies() == []
    kv.free(b)
    queue = list(bm.free_queue)
    assert kv.allocate_slots(a, 3, reversible=True)  # positions 10-12: a 4th block, fresh and uncached
    assert len(a.block_table) == 4 and a.block_table[3] == queue[0]
    kv.release_tail(a, 3)
    assert len(a.block_table) == 3 and list(bm.free_queue) == queue  # as before, in order
    # Cache a finished request's full block and use up the uncached free blocks: the next fresh block of a
    # would be the cached one, whose hash an undo would lose.
    done = make_request("done", tokens(100, 4))
    assert admit(kv, done)
    cached = done.block_hashes[0]
    kv.free(done)
    filler = make_request("filler", tokens(200, 8))
    assert kv.allocate_slots(filler, 8)
    assert bm.allocation_evicts_cached(1) and kv.num_free_blocks == 1
    assert not kv.allocate_slots(a, 3, reversible=True) and len(a.block_table) == 3
    assert cached in bm.hash_to_block
    assert kv.allocate_slots(a, 3)  # the synchronous allocation evicts it
    assert cached not in bm.hash_to_block


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
