"""The one owner of every request's KV blocks.

The scheduler reasons in tokens; it asks this manager for the blocks behind them (vLLM v1's
``KVCacheManager``). Only this module writes ``request.block_table``, ``request.block_hashes`` and
``request.offloaded``:

- ``get_computed_blocks``: the prefix-cache hits of a request being admitted (or the tokens of its
  KV offloaded to CPU memory);
- ``allocate_slots``: the blocks for n more tokens, or a refusal (False) when the free blocks, less
  the safety margin where asked, cannot hold them; nothing changes on a refusal;
- ``cache_blocks``: hash the blocks a step fills, so later requests can share them;
- ``free`` and ``uncache``: give blocks back, drop blocks whose KV is not (or no longer) valid;
- ``fork``: a request takes every block of another with the same tokens (prompt forking);
- ``offload``, ``finish_restore``, ``drop_offloaded``: the CPU pool's blocks of preempted requests.

The arithmetic of one step, for a request with c computed tokens that is given n more: it holds
``ceil((c + n) / block_size)`` blocks afterwards; of those it lacks ``ceil((c + n) / block_size) -
len(block_table)``. A prefix-cache hit that nobody holds sits in the free queue and costs a free
block when it is taken; a hit that another request holds costs nothing.

Copy-on-write (vLLM v0's block manager, whose ``fork`` shares a sequence's blocks with its ``n``
sibling samples and copies a shared last block on the first append): a block that the step writes
and that another request also holds costs one fresh block more; the request takes the fresh block
in its place and, when the shared block already holds some of its tokens, the step copies it first
(``take_block_copies``). After a fork only the partial last block is ever written while shared: of
G requests sharing it, the first G - 1 to write copy it and the last writes it in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_manager import BlockManager
from .kv_cache import CPUOffloadPool
from .requests import Request


class KVCacheManager:
    """Allocates, shares, caches and frees the blocks of requests.

    Args:
        block_manager: the block pool (ref counts, free queue, prefix hashes).
        safety_margin: fraction [0, 1) of the cache's blocks that ``allocate_slots(...,
            keep_margin=True)`` leaves free: admissions keep room for running requests to decode.
        offload_pool: CPU memory for the KV of preempted requests (``preemption_mode="offload"``),
            or None to recompute them.
    """

    def __init__(
        self, block_manager: BlockManager, safety_margin: float = 0.0, offload_pool: CPUOffloadPool | None = None
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.num_blocks = block_manager.num_blocks
        self.safety_margin_blocks = int(safety_margin * block_manager.num_blocks)
        self.offload_pool = offload_pool
        self.num_offloads = 0  # preempted requests whose KV went to the CPU pool
        self.num_block_copies = 0  # copy-on-write copies of shared blocks
        # (source block, destination block) of this step's copy-on-write, in the order decided.
        self._block_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (cached ones included: they can be evicted)."""
        return self.block_manager.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ admission
    def get_computed_blocks(self, request: Request, weight_version: int) -> tuple[list[int], int]:
        """The blocks whose KV a waiting request can reuse, and the tokens they cover.

        A request whose KV was offloaded gets none from the prefix cache: its offloaded tokens are
        restored instead (``request.offloaded``). Otherwise the hits are capped so that at least the
        last token is computed (there must be logits to sample from) and, for a scoring request, so
        that the first scored position is computed (its logits are the score).

        Args:
            request: a waiting request (no blocks).
            weight_version: only blocks computed under this version match.

        Returns:
            (block ids of the hits, in order; nothing is acquired yet), and the tokens they cover.
        """
        if request.offloaded is not None:
            return [], request.offloaded[1]
        max_hit = request.num_tokens - 1
        if request.score_from is not None:
            max_hit = min(max_hit, request.score_from - 1)
        hits = self.block_manager.find_cached_prefix(request.token_ids, weight_version, max_hit)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
        keep_margin: bool = False,
        reversible: bool = False,
    ) -> bool:
        """Give a request the slots of its next tokens, or refuse.

        After success the request holds ``blocks_needed(num_computed_tokens +
        num_new_computed_tokens + num_new_tokens)`` blocks: its old ones, then
        ``new_computed_blocks`` (shared prefix-cache hits), then fresh ones. An old block that the
        new tokens write and that another request holds too is replaced by a fresh one
        (copy-on-write, see the module docstring); the copy is queued for ``take_block_copies``.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already in its blocks.
            num_new_tokens: tokens it will compute this step (>= 0).
            new_computed_blocks: prefix-cache hits of a request being admitted (see
                ``get_computed_blocks``).
            num_new_computed_tokens: tokens those hits (or an offloaded KV being restored) cover.
            keep_margin: leave ``safety_margin_blocks`` free after the allocation (admissions while
                other requests run).
            reversible: refuse, too, what ``release_tail`` could not undo exactly: a copy-on-write of a
                shared block, or a fresh block that carries a prefix-cache hash (its hash would be
                lost). The scheduler allocates so when it schedules a step ahead (async batching), a
                step it may have to take back.

        Returns:
            True when the slots are allocated; False, changing nothing, when the free blocks cannot
            hold them.
        """
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_fresh = -(-total // self.block_size) - len(request.block_table) - len(new_computed_blocks)
        # Hits and restores go to a request that holds no block yet: only a running request can
        # write into blocks it shares.
        shared = [] if new_computed_blocks else self._shared_blocks_written(request, num_new_tokens)
        if num_fresh <= 0 and not new_computed_blocks and not shared:
            return True  # the blocks it holds suffice: most decode steps
        bm = self.block_manager
        # A hit nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable_hits = 0
        if new_computed_blocks:
            num_evictable_hits = sum(1 for b in new_computed_blocks if bm.blocks[b].ref_count == 0)
        margin = self.safety_margin_blocks if keep_margin else 0
        if bm.num_free_blocks - num_evictable_hits - max(num_fresh, 0) - len(shared) < margin:
            return False
        if reversible and (shared or new_computed_blocks or bm.allocation_evicts_cached(max(num_fresh, 0))):
            return False
        if shared:
            self._copy_on_write(request, shared)
        if new_computed_blocks:
            bm.acquire(new_computed_blocks)
            request.block_table.extend(new_computed_blocks)
            request.block_hashes.extend(bm.blocks[b].block_hash for b in new_computed_blocks)  # type: ignore[misc]
        if num_fresh > 0:
            request.block_table.extend(bm.allocate(num_fresh))
        return True

    def _shared_blocks_written(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices into the block table of the blocks that the next tokens write and others hold too."""
        if num_new_tokens <= 0:
            return []
        bs = self.block_size
        c = request.num_computed_tokens
        table = request.block_table
        blocks = self.block_manager.blocks
        last = min(len(table), -(-(c + num_new_tokens) // bs))
        return [i for i in range(c // bs, last) if blocks[table[i]].ref_count > 1]

    def _copy_on_write(self, request: Request, indices: list[int]) -> None:
        """Replace the shared blocks at ``indices`` of the request's table by fresh ones (enough are free)."""
        bm = self.block_manager
        table = request.block_table
        fresh = bm.allocate(len(indices))
        for i, dst in zip(indices, fresh):
            src = table[i]
            if i * self.block_size < request.num_computed_tokens:
                # The block holds some of the request's computed tokens: their KV moves with it.
                self._block_copies.append((src, dst))
                self.num_block_copies += 1
            bm.free([src])  # the other holders keep it
            table[i] = dst

    def release_tail(self, request: Request, num_blocks: int) -> None:
        """Give back the blocks of ``request.block_table[num_blocks:]``: undo a ``reversible`` allocation.

        Several requests' allocations are undone in the reverse order they were made, so that the free
        queue is left exactly as before them (see ``BlockManager.allocation_evicts_cached``).
        """
        tail = request.block_table[num_blocks:]
        if tail:
            self.block_manager.free(tail)
            del request.block_table[num_blocks:]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies queued since the last call, in order; the queue empties.

        The model runner makes them before the step's forward. A source block stays intact until
        then: it is held by another request, or was freed in this same scheduling pass, and nothing
        writes a block before the forward but these copies (in order) and offload restores (after).
        """
        copies, self._block_copies = self._block_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` every block of ``parent`` (same tokens, prefill done): shared, ref count + 1.

        The idea is vLLM v0's ``n`` sampling: the prompt of a sequence group is prefilled once and
        its sequence forked into the other samples after the first token is sampled. The full
        blocks stay shared for good; the partial last block is copied when a holder writes into it
        (``allocate_slots``).

        Raises:
            RuntimeError: ``child`` already holds blocks.
        """
        if child.block_table:
            raise RuntimeError(f"request {child.request_id!r} holds blocks and cannot be forked")
        self.block_manager.share(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    # ------------------------------------------------------------------ prefix cache
    def cache_blocks(self, request: Request, num_tokens: int, weight_version: int) -> None:
        """Hash the full blocks among the request's first ``num_tokens`` tokens that are not hashed yet.

        Called at schedule time with the tokens the step will have computed: within each layer the
        step writes every new key and value before any attention reads the cache, so the G samples
        of a prompt admitted in the same step already share its blocks.
        """
        bm = self.block_manager
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            tokens = request.token_ids[i * bs : (i + 1) * bs]
            hashes.append(bm.cache_block(request.block_table[i], parent, tokens, weight_version))

    def uncache(self, request: Request, first_block: int = 0) -> None:
        """Drop ``request.block_table[first_block:]`` from the prefix cache (their KV is not valid)."""
        self.block_manager.uncache(request.block_table[first_block:])

    def free(self, request: Request) -> None:
        """Release the request's device blocks (cached ones stay findable until reused)."""
        if request.block_table:
            self.block_manager.free(request.block_table)
        request.block_table = []
        request.block_hashes = []

    # ------------------------------------------------------------------ CPU offload
    def offload(self, request: Request) -> tuple[list[int], list[int]] | None:
        """Reserve CPU pool blocks for the computed KV of a request being preempted.

        Call before ``free``: the returned device blocks are the request's, and their contents stay
        intact until the step's forward, before which the model runner copies them out.

        Returns:
            (device blocks, pool blocks) to copy, in order; None when there is no pool, nothing is
            computed, or the pool is full (the request is then recomputed).
        """
        pool = self.offload_pool
        num_tokens = request.num_computed_tokens
        if pool is None or num_tokens == 0:
            return None
        blocks = request.block_table[: self.blocks_needed(num_tokens)]
        if not pool.can_hold(len(blocks)):
            return None
        pool_ids = pool.allocate(len(blocks))
        request.offloaded = (pool_ids, num_tokens)
        self.num_offloads += 1
        return list(blocks), pool_ids

    def restore_blocks(self, request: Request) -> list[int]:
        """The device blocks that receive an admitted request's offloaded KV (its first blocks)."""
        assert request.offloaded is not None
        return request.block_table[: self.blocks_needed(request.offloaded[1])]

    def finish_restore(self, request: Request) -> None:
        """After the step that copied a request's KV back: free its pool blocks."""
        self.drop_offloaded(request)

    def drop_offloaded(self, request: Request) -> None:
        """Forget a request's offloaded KV (finished, cancelled, or to be recomputed)."""
        if request.offloaded is not None and self.offload_pool is not None:
            self.offload_pool.free(request.offloaded[0])
        request.offloaded = None
