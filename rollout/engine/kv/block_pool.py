"""Block pool of the paged KV cache: ref counts, free queue and prefix caching.

Prefix caching follows vLLM's: a full block is identified by a hash chained over (parent hash, the block's token
ids, the weight version); hits compare the stored token ids, so a collision never hands out the KV of other tokens.
Freed hashed blocks go to the tail of an LRU free queue and keep their hash until handed out again, so a later turn
or prompt finds them. Only full blocks are hashed; the G samples of one prompt share every block, the partial last one
included, by forking (``share``; the KV cache manager copies a shared partial block before a request writes it).

One pool serves every layer group of the cache: a block id belongs to one group at a time, and a block's hash chain
starts from a root naming its group (vLLM v1 keys its prefix cache by block hash and group id).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# The block-table entry of a block that a request no longer holds: a sliding-window group's blocks that
# fell out of the window (see ``manager``). Never a block id.
NULL_BLOCK = -1


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], weight_version: int, lora_id: int = 0) -> bytes:
    """Stable hash of a full block.

    Args:
        parent_hash: hash of the previous block of the sequence, or None for the first block (of
            layer group 0; another group's first block is chained from ``group_root(group)``).
        token_ids: the block's token ids (block_size of them).
        weight_version: version of the weights the block's KV is computed under.
        lora_id: the LoRA adapter it is computed under (``Request.lora_id``; 0 the base model).

    Returns:
        32-byte SHA-256 digest. Python's ``hash()`` is salted per process and is not used.
    """
    h = hashlib.sha256()
    h.update(parent_hash or b"root")
    h.update(struct.pack(f"<qq{len(token_ids)}q", weight_version, lora_id, *token_ids))
    return h.digest()


def group_root(group: int) -> bytes | None:
    """The parent hash of a layer group's first block: None for group 0 (a cache with one group hashes as
    it always did), a 32-byte digest naming the group for the others."""
    return None if group == 0 else hashlib.sha256(b"rollout layer group %d" % group).digest()


@dataclass
class Block:
    """One physical block: ref count and, when cached, its hash and token ids."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Allocates, shares and frees the blocks of the paged KV cache.

    Args:
        num_blocks: blocks in the cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: hash full blocks and reuse them across requests.

    Invariants: a block is in the free queue if and only if its ref count is 0;
    ``hash_to_block`` maps a hash to the one block holding it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the eviction order: head is evicted first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.num_prefix_cache_hit_blocks = 0  # blocks handed out from the prefix cache (EngineStats reads it)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    def find_cached_prefix(
        self, token_ids: Sequence[int], weight_version: int, max_tokens: int, group: int = 0, lora_id: int = 0
    ) -> list[int]:
        """Longest run of cached full blocks that starts the sequence.

        Args:
            token_ids: the sequence's tokens.
            weight_version: only blocks computed under this version match.
            max_tokens: most tokens that may be covered (the caller keeps at least
                the last token to compute, so there are logits to sample from).
            group: the layer group whose blocks are looked up.
            lora_id: only blocks computed under this LoRA adapter match (0: the base model).

        Returns:
            Block ids of the hit blocks, in order (possibly empty). Nothing is acquired.
        """
        hits: list[int] = []
        for block_id in self._lookup(token_ids, weight_version, max_tokens // self.block_size, group, lora_id):
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup(
        self, token_ids: Sequence[int], weight_version: int, num_blocks: int, group: int = 0, lora_id: int = 0
    ) -> list[int | None]:
        """The cached block of each of the sequence's first ``num_blocks`` full blocks, None where none is.

        Unlike ``find_cached_prefix`` this goes on past a miss: a block's hash is chained over the tokens before
        it, not over the blocks, so a sliding-window group finds the blocks of its window when those before it
        were evicted.

        Returns:
            ``num_blocks`` entries (fewer when the sequence has fewer full blocks). Nothing is acquired.
        """
        return list(self._lookup(token_ids, weight_version, num_blocks, group, lora_id))

    def _lookup(
        self, token_ids: Sequence[int], weight_version: int, num_blocks: int, group: int, lora_id: int = 0
    ) -> Iterator[int | None]:
        if not self.enable_prefix_caching:
            return
        parent = group_root(group)
        bs = self.block_size
        for i in range(min(num_blocks, len(token_ids) // bs)):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block(parent, chunk, weight_version, lora_id)
            block_id = self.hash_to_block.get(parent)
            yield block_id if block_id is not None and self.blocks[block_id].token_ids == chunk else None

    # ------------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (evicting cached ones).

        Raises:
            RuntimeError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._forget_hash(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Share already-computed blocks (prefix-cache hits): ref count + 1 each."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        self.num_prefix_cache_hit_blocks += len(block_ids)

    def share(self, block_ids: Sequence[int]) -> None:
        """Give blocks that a request holds to one more request (a fork): ref count + 1 each.

        Unlike ``acquire`` this takes held blocks only, cached or not (a fork also shares the
        partial last block, which no hash names), and counts no prefix-cache hit.

        Raises:
            RuntimeError: a block is free (ref count 0); nothing is changed then.
        """
        for block_id in block_ids:
            if self.blocks[block_id].ref_count <= 0:
                raise RuntimeError(f"block {block_id} is free and cannot be shared")
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Release a request's blocks. Blocks whose ref count drops to 0 join the free queue.

        The blocks are given in sequence order; they are queued last block first, so
        that the tail of a sequence is evicted before its (more shareable) prefix.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:  # an uncached block has nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(block_id, last=False)

    def cache_block(
        self,
        block_id: int,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        weight_version: int,
        lora_id: int = 0,
    ) -> bytes:
        """Register a full block in the prefix cache and return its hash.

        If another block already holds the same hash, the table keeps that one and this block stays private to
        its request. ``parent_hash`` of a group's first block is ``group_root(group)``.
        """
        h = hash_block(parent_hash, token_ids, weight_version, lora_id)
        if not self.enable_prefix_caching:
            return h
        block = self.blocks[block_id]
        if block.block_hash is None and h not in self.hash_to_block:
            block.block_hash = h
            block.token_ids = tuple(token_ids)
            self.hash_to_block[h] = block_id
        return h

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Drop blocks from the prefix cache (their KV may be wrong, e.g. after a failed step)."""
        for block_id in block_ids:
            self._forget_hash(self.blocks[block_id])

    def _forget_hash(self, block: Block) -> None:
        """Take a block out of the prefix cache (the table keeps another block holding the same hash)."""
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block.block_id:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.hash_to_block.clear()
