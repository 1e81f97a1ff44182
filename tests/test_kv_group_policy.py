"""kv_group_policy: full-attention and sliding-window groups answer the same four questions, each checked against
brute force over the keys that queries read (a query at position q reads keys 0..q, or q - W + 1..q in a window W)."""

from __future__ import annotations

import pytest

from rollout.engine.kv.block_pool import NULL_BLOCK, BlockManager, group_root, hash_block
from rollout.engine.kv.group_policy import FullAttentionPolicy, GroupPolicy, SlidingWindowPolicy, group_policies

BS = 4
WINDOWS = [None, 1, 5, 8, 9]


def policy_of(window: int | None, group: int = 0) -> GroupPolicy:
    return FullAttentionPolicy(group, BS) if window is None else SlidingWindowPolicy(group, BS, window)


def first_key_read(window: int | None, position: int) -> int:
    """The first key a query at ``position`` reads."""
    return 0 if window is None else max(0, position - window + 1)


@pytest.mark.parametrize("window", WINDOWS)
def test_window_start_is_the_first_block_that_any_later_query_reads(window: int | None) -> None:
    policy = policy_of(window)
    for c in range(80):
        assert policy.window_start(c) == min(first_key_read(window, q) for q in range(c, c + 40)) // BS


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("chunk", [1, 3, 10])
def test_max_blocks_held_is_the_most_a_request_holds_over_every_chunk(window: int | None, chunk: int) -> None:
    # Every position a chunk of n <= chunk tokens can start at: the blocks of positions [window start, c + n).
    policy = policy_of(window)
    for num_tokens in (6, 200):
        held = max(
            -(-(c + n) // BS) - policy.window_start(c) for c in range(num_tokens) for n in range(1, chunk + 1)
            if c + n <= num_tokens
        )  # fmt: skip
        assert policy.max_blocks_held(num_tokens, chunk) == held


@pytest.mark.parametrize("window", WINDOWS)
def test_drop_skipped_gives_back_exactly_the_blocks_no_later_query_reads(window: int | None) -> None:
    policy = policy_of(window)
    table = list(range(100, 110))
    dropped_so_far: list[int] = []
    for c in (3, 13, 22, 22, 39):
        dropped = policy.drop_skipped(table, c)
        start = policy.window_start(c)
        assert dropped == [b for b in range(100, 100 + start) if b not in dropped_so_far]  # in sequence order
        assert table == [NULL_BLOCK] * start + list(range(100 + start, 110))
        dropped_so_far += dropped
    assert (dropped_so_far == []) == (window is None)


def cache_sequence(bm: BlockManager, token_ids: list[int], group: int, missing: set[int]) -> list[int]:
    """Register each full block of the sequence in the prefix cache, except the block indices in ``missing``."""
    blocks = bm.allocate(len(token_ids) // BS)
    parent = group_root(group)
    for i, block in enumerate(blocks):
        chunk = token_ids[i * BS : (i + 1) * BS]
        if i not in missing:
            bm.cache_block(block, parent, chunk, 0)
        parent = hash_block(parent, chunk, 0)
    return blocks


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("missing", [set(), {0}, {2}, {5}, {1, 6}])
def test_find_hit_is_the_longest_prefix_whose_read_blocks_are_all_cached(window: int | None, missing: set[int]) -> None:
    bm = BlockManager(32, BS)
    token_ids = list(range(40, 72))  # 8 full blocks
    policy = policy_of(window, group=1)
    blocks = cache_sequence(bm, token_ids, 1, missing)
    for max_blocks in range(9):
        # A hit of p blocks is servable when every block the queries after it read is cached.
        p = next(
            p for p in range(max_blocks, -1, -1)
            if not any(i in missing for i in range(policy.window_start(p * BS), p))
        )  # fmt: skip
        start = policy.window_start(p * BS)
        expected = [NULL_BLOCK] * start + blocks[start:p] if p else []
        assert policy.find_hit(bm, token_ids, 0, max_blocks) == expected
    assert policy.find_hit(bm, token_ids, 1, 8) == ([NULL_BLOCK] * 8 if window == 1 else [])  # another version
    assert policy_of(window, group=0).find_hit(bm, token_ids, 0, 8) == ([NULL_BLOCK] * 8 if window == 1 else [])


def test_group_policies_one_per_window_and_bad_windows_refused() -> None:
    policies = group_policies([8, None], BS)
    assert [type(p) for p in policies] == [SlidingWindowPolicy, FullAttentionPolicy]
    assert [p.group for p in policies] == [0, 1] and [p.sliding_window for p in policies] == [8, None]
    for bad in ([], [0], [None, -3]):
        with pytest.raises(ValueError, match="sliding_windows must hold one window >= 1"):
            group_policies(bad, BS)
