"""What differs between kinds of layer groups of the KV cache: full attention and sliding window, one class each.

vLLM v1 gives each kind of attention its own manager (``single_type_kv_cache_manager.py``: ``FullAttentionManager``,
``SlidingWindowManager``) under one ``KVCacheManager``; here a group's policy answers the questions whose answer
depends on its kind, and ``manager.KVCacheManager`` applies them to every group alike:
- ``window_start``: the first block that a request's next queries read (0 in a full group);
- ``find_hit``: the longest prefix-cache hit the group can serve, up to a bound (a full group needs every block
  of the prefix; a sliding one only those of the window before its end);
- ``drop_skipped``: the blocks a request gives back because no later query reads them (none in a full group);
- ``max_blocks_held``: the most blocks a request holds at once (the cache's sizing).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from rollout.engine.kv.block_pool import NULL_BLOCK, BlockManager


class GroupPolicy(ABC):
    """The kind-specific rules of one layer group.

    Args:
        group: the group's index (its blocks' hashes are chained from ``block_pool.group_root(group)``).
        block_size: tokens per block.
    """

    sliding_window: int | None = None

    def __init__(self, group: int, block_size: int) -> None:
        self.group = group
        self.block_size = block_size

    @abstractmethod
    def window_start(self, num_computed_tokens: int) -> int:
        """The first block that queries from position ``num_computed_tokens`` on read."""

    @abstractmethod
    def find_hit(
        self, bm: BlockManager, token_ids: Sequence[int], weight_version: int, max_blocks: int, lora_id: int = 0
    ) -> list[int]:
        """The longest prefix of at most ``max_blocks`` full blocks that this group can serve from the prefix cache.

        Args:
            bm: the block pool.
            token_ids: the request's tokens.
            weight_version: only blocks computed under this version match.
            max_blocks: the bound (>= 0).
            lora_id: only blocks computed under this LoRA adapter match (0: the base model).

        Returns:
            p entries for the longest servable prefix of p blocks: the cached block of each, ``NULL_BLOCK`` where the
            group needs none. Nothing is acquired.
        """

    @abstractmethod
    def drop_skipped(self, table: list[int], num_computed_tokens: int) -> list[int]:
        """Replace by ``NULL_BLOCK`` the entries of a request's table that no query after ``num_computed_tokens``
        reads, and return their block ids in sequence order (the caller frees them)."""

    @abstractmethod
    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once when computed in chunks of at most
        ``max_chunk`` tokens."""


class FullAttentionPolicy(GroupPolicy):
    """Full attention: every query reads every block before it, so a request keeps all its blocks and a prefix hit is
    a run of cached blocks from the first."""

    def window_start(self, num_computed_tokens: int) -> int:
        return 0

    def find_hit(
        self, bm: BlockManager, token_ids: Sequence[int], weight_version: int, max_blocks: int, lora_id: int = 0
    ) -> list[int]:
        return bm.find_cached_prefix(
            token_ids, weight_version, max_blocks * self.block_size, group=self.group, lora_id=lora_id
        )

    def drop_skipped(self, table: list[int], num_computed_tokens: int) -> list[int]:
        return []

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)


class SlidingWindowPolicy(GroupPolicy):
    """A sliding window of W tokens: a query at position p reads keys p - W + 1 .. p.

    A request keeps only the blocks its next queries read; a prefix hit of p blocks needs only blocks
    ``window_start(p * block_size)`` .. p - 1 (vLLM v1's ``SlidingWindowManager.find_longest_cache_hit``). Block hashes
    are chained over the tokens, not the blocks, so the window's blocks are found whatever was evicted before them.

    Args:
        group: the group's index.
        block_size: tokens per block.
        sliding_window: W (>= 1).
    """

    def __init__(self, group: int, block_size: int, sliding_window: int) -> None:
        super().__init__(group, block_size)
        self.sliding_window = sliding_window

    def window_start(self, num_computed_tokens: int) -> int:
        """``max(0, num_computed_tokens - W + 1) // block_size``: every block before it is read by no later query (vLLM
        v1's ``SlidingWindowManager.get_num_skipped_tokens``)."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def find_hit(
        self, bm: BlockManager, token_ids: Sequence[int], weight_version: int, max_blocks: int, lora_id: int = 0
    ) -> list[int]:
        # A lookup goes on past a miss and returns fewer entries than asked for when the sequence is shorter, and
        # none at all with prefix caching off: a missing entry is a miss.
        found = bm.lookup(token_ids, weight_version, max_blocks, group=self.group, lora_id=lora_id)
        for p in range(max_blocks, 0, -1):
            start = self.window_start(p * self.block_size)
            window = found[start:p]
            if len(window) == p - start and all(b is not None for b in window):
                return [NULL_BLOCK] * start + window  # type: ignore[list-item]
        return []

    def drop_skipped(self, table: list[int], num_computed_tokens: int) -> list[int]:
        i = min(self.window_start(num_computed_tokens), len(table)) - 1
        dropped: list[int] = []
        while i >= 0 and table[i] != NULL_BLOCK:  # everything before a NULL_BLOCK was dropped earlier
            dropped.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        return dropped[::-1]

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The blocks of positions [c - W + 1, c + n) for a chunk of n tokens from position c: at most
        ``1 + ceil((W + max_chunk - 2) / block_size)``, and never more than full attention's."""
        full = -(-num_tokens // self.block_size)
        return min(full, 1 + -(-(self.sliding_window + max_chunk - 2) // self.block_size))


def group_policies(sliding_windows: Sequence[int | None], block_size: int) -> list[GroupPolicy]:
    """One policy per layer group, in group order: full attention where the window is None.

    Raises:
        ValueError: ``sliding_windows`` is empty or holds a window below 1.
    """
    if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
        raise ValueError(f"sliding_windows must hold one window >= 1 (or None) per group, got {list(sliding_windows)}")
    return [
        FullAttentionPolicy(g, block_size) if w is None else SlidingWindowPolicy(g, block_size, w)
        for g, w in enumerate(sliding_windows)
    ]
