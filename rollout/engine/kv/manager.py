"""The one owner of every request's KV blocks, in every layer group of the cache.

The scheduler reasons in tokens and asks this manager for the blocks behind them (vLLM v1's ``KVCacheManager``).
Only this module writes ``request.block_tables``, ``request.group_block_hashes`` and ``request.offloaded``:
``get_computed_blocks`` (prefix-cache hits, or the tokens of KV offloaded to CPU), ``allocate_slots`` (the blocks
for n more tokens, or a refusal that changes nothing but the return of blocks that left a sliding window),
``cache_blocks``, ``free``, ``uncache``, ``fork`` (prompt forking), and ``offload``, ``finish_restore``,
``drop_offloaded`` (the CPU pool's blocks).

Layer groups (``cache.CacheLayout``; vLLM v1's hybrid KV cache manager): each group has its own block table per
request, all drawing on one block pool, and a policy of its kind (``group_policy``: full attention or sliding
window) that says which blocks its queries read and which prefix hits it can serve. A request holds the same
positions in every group, except that a sliding group keeps only the blocks its next queries read, from the policy's
``window_start(c)`` on (c the tokens computed); earlier blocks go back to the pool at ``allocate_slots`` and their
entries become ``NULL_BLOCK``. A prefix-cache hit that nobody holds costs a free block when taken; one another request
holds costs nothing. The hit is the longest prefix every group can serve (each group's ``find_hit``). Recompute frees
every group's blocks; offload copies, per group, the blocks the next queries read and restores them to the same
positions; a fork shares every table.

Copy-on-write (vLLM v0's ``fork``): a block that the step writes and that another request also holds costs one fresh
block more, which the request takes in its place; when the shared block already holds some of its tokens, the step
copies it first (``take_block_copies``). After a fork only each group's partial last block is written while shared:
of G requests sharing it, the first G - 1 to write copy it and the last writes it in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.engine.kv.block_pool import NULL_BLOCK, BlockManager, group_root, hash_block
from rollout.engine.kv.group_policy import group_policies
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.requests import Request


class KVCacheManager:
    """Allocates, shares, caches and frees the blocks of requests, one block table per layer group.

    Args:
        block_manager: the block pool (ref counts, free queue, prefix hashes) of every group.
        safety_margin: fraction [0, 1) of the cache's blocks that ``allocate_slots(...,
            keep_margin=True)`` leaves free: admissions keep room for running requests to decode.
        offload_pool: CPU memory for the KV of preempted requests (``preemption_mode="offload"``),
            or None to recompute them.
        sliding_windows: the sliding window of each layer group, in group order (None for full
            attention; ``CacheLayout.sliding_windows``). None: one full-attention group.

    Raises:
        ValueError: ``sliding_windows`` is empty or holds a window below 1.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        safety_margin: float = 0.0,
        offload_pool: CPUOffloadPool | None = None,
        sliding_windows: Sequence[int | None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.groups = group_policies([None] if sliding_windows is None else sliding_windows, self.block_size)
        self.num_groups = len(self.groups)
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
        """Blocks that hold ``num_tokens`` tokens in one full-attention group: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def max_blocks_needed(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, over all groups, when it is
        computed in chunks of at most ``max_chunk`` tokens (each group's ``max_blocks_held``)."""
        return sum(policy.max_blocks_held(num_tokens, max_chunk) for policy in self.groups)

    def _tables(self, request: Request) -> list[list[int]]:
        """The request's block tables, one per group (a new request has one empty table)."""
        tables = request.block_tables
        while len(tables) < self.num_groups:
            tables.append([])
            request.group_block_hashes.append([])
        return tables

    # ------------------------------------------------------------------ admission
    def get_computed_blocks(self, request: Request, weight_version: int) -> tuple[list[int], int]:
        """The blocks whose KV a waiting request can reuse, and the tokens they cover.

        A request whose KV was offloaded gets none from the prefix cache: its offloaded tokens are restored
        instead (``request.offloaded``). Otherwise the hits are capped so that at least the last token is
        computed (there must be logits to sample from) and, for a scoring request, the first scored
        position (its logits are the score). With several groups (or a sliding one) the hit is the longest
        prefix of p blocks that every group can serve (see the module docstring).

        Args:
            request: a waiting request (no blocks).
            weight_version: only blocks computed under this version match (and under the request's LoRA adapter,
                ``request.lora_id``).

        Returns:
            (the hits, nothing acquired yet: p block ids per group, groups in order, ``NULL_BLOCK``
            where a sliding group needs no block; a single full group's are simply its p blocks), and
            the tokens they cover, ``p * block_size``.
        """
        if request.offloaded is not None:
            return [], request.offloaded[1]
        max_hit = request.num_tokens - 1
        if request.score_from is not None:
            max_hit = min(max_hit, request.score_from - 1)
        # Each group answers its longest hit up to the bound; a shorter answer lowers the bound for every group (a
        # sliding group's window moves with it) until all answer the same length, the longest they share.
        bm, p = self.block_manager, max_hit // self.block_size
        while True:
            found = [
                policy.find_hit(bm, request.token_ids, weight_version, p, request.lora_id) for policy in self.groups
            ]
            shortest = min(len(hits) for hits in found)
            if all(len(hits) == shortest for hits in found):
                break
            p = shortest
        return [b for hits in found for b in hits], shortest * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
        keep_margin: bool = False,
    ) -> bool:
        """Give a request the slots of its next tokens, or refuse.

        After success the request holds, in each full group, ``blocks_needed(num_computed_tokens +
        num_new_computed_tokens + num_new_tokens)`` blocks: its old ones, then ``new_computed_blocks`` (shared
        prefix-cache hits), then fresh ones; a sliding group those from its window start on (``NULL_BLOCK``
        before it). A sliding group's blocks that fell out of the window (before its policy's
        ``window_start(num_computed_tokens)``) go back to the pool first, refusal or not: no query reads them again. An
        old block that the new tokens write and that another request holds too is replaced by a fresh one
        (copy-on-write, see the module docstring); the copy is queued for ``take_block_copies``.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already in its blocks.
            num_new_tokens: tokens it will compute this step (>= 0).
            new_computed_blocks: prefix-cache hits of a request being admitted (see
                ``get_computed_blocks``).
            num_new_computed_tokens: tokens those hits (or an offloaded KV being restored) cover.
            keep_margin: leave ``safety_margin_blocks`` free after the allocation (admissions while
                other requests run).

        Returns:
            True when the slots are allocated; False, changing nothing else, when the free blocks
            cannot hold them.
        """
        tables = self._tables(request)
        bs = self.block_size
        start = request.num_computed_tokens + num_new_computed_tokens  # computed before this step's queries
        need = -(-(start + num_new_tokens) // bs)
        per_group = len(new_computed_blocks) // self.num_groups
        hits = [list(new_computed_blocks[g * per_group : (g + 1) * per_group]) for g in range(self.num_groups)]
        fresh: list[int] = []
        shared: list[list[int]] = []
        for g, policy in enumerate(self.groups):
            self._drop_skipped(request, g)
            held = len(tables[g]) + len(hits[g])
            fresh.append(need - max(held, policy.window_start(start)))
            # Hits and restores go to a request that holds no block yet: only a running request can
            # write into blocks it shares.
            shared.append([] if new_computed_blocks else self._shared_blocks_written(request, g, num_new_tokens))
        if all(f <= 0 for f in fresh) and not new_computed_blocks and not any(shared):
            return True  # the blocks it holds suffice: most decode steps
        bm = self.block_manager
        # A hit nobody holds sits in the free queue: taking it costs a free block too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b != NULL_BLOCK and bm.blocks[b].ref_count == 0)
        margin = self.safety_margin_blocks if keep_margin else 0
        num_fresh = sum(max(f, 0) for f in fresh)
        wanted = num_evictable_hits + num_fresh + sum(len(s) for s in shared)
        if bm.num_free_blocks - wanted < margin:
            return False
        # Every group's hits first: a fresh block comes from the head of the free queue, which may hold
        # another group's hit that nobody has acquired yet.
        for g in range(self.num_groups):
            if hits[g]:
                bm.acquire([b for b in hits[g] if b != NULL_BLOCK])
                tables[g].extend(hits[g])
                request.group_block_hashes[g].extend(
                    bm.blocks[b].block_hash if b != NULL_BLOCK else None for b in hits[g]
                )
        for g in range(self.num_groups):
            table = tables[g]
            if shared[g]:
                self._copy_on_write(request, g, shared[g])
            window_start = self.groups[g].window_start(start)
            if len(table) < window_start:  # a restore into a sliding group: its window only
                table.extend([NULL_BLOCK] * (window_start - len(table)))
            if fresh[g] > 0:
                table.extend(bm.allocate(fresh[g]))
        return True

    def _drop_skipped(self, request: Request, group: int) -> None:
        """Give back a group's blocks that the request's next queries do not read (a sliding window's only)."""
        dropped = self.groups[group].drop_skipped(request.block_tables[group], request.num_computed_tokens)
        if dropped:
            # Cached ones stay findable until reused: another request's window may start there.
            self.block_manager.free(dropped)

    def _shared_blocks_written(self, request: Request, group: int, num_new_tokens: int) -> list[int]:
        """Indices into a group's block table of the blocks that the next tokens write and others hold too."""
        if num_new_tokens <= 0:
            return []
        bs = self.block_size
        c = request.num_computed_tokens
        table = request.block_tables[group]
        blocks = self.block_manager.blocks
        last = min(len(table), -(-(c + num_new_tokens) // bs))
        return [i for i in range(c // bs, last) if table[i] != NULL_BLOCK and blocks[table[i]].ref_count > 1]

    def _copy_on_write(self, request: Request, group: int, indices: list[int]) -> None:
        """Replace the shared blocks at ``indices`` of a group's table by fresh ones (enough are free)."""
        bm = self.block_manager
        table = request.block_tables[group]
        fresh = bm.allocate(len(indices))
        for i, dst in zip(indices, fresh):
            src = table[i]
            if i * self.block_size < request.num_computed_tokens:
                # The block holds some of the request's computed tokens: their KV moves with it.
                self._block_copies.append((src, dst))
                self.num_block_copies += 1
            bm.free([src])  # the other holders keep it
            table[i] = dst

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies queued since the last call, in order; the queue empties.

        The model runner makes them before the step's forward (``PagedKVCache.copy_blocks``; a block id
        belongs to one group, so one copy per pair covers that group's layers). A source block stays intact
        until then: it is held by another request, or was freed in this same scheduling pass, and nothing
        writes a block before the forward but these copies (in order) and offload restores (after).
        """
        copies, self._block_copies = self._block_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` every block of ``parent`` (same tokens, prefill done), in every group: shared, ref count + 1.

        The idea is vLLM v0's ``n`` sampling: the prompt of a sequence group is prefilled once and its
        sequence forked into the other samples after the first token is sampled. The full blocks stay
        shared for good; the partial last block is copied when a holder writes into it (``allocate_slots``).

        Raises:
            RuntimeError: ``child`` already holds blocks.
        """
        if any(child.block_tables):
            raise RuntimeError(f"request {child.request_id!r} holds blocks and cannot be forked")
        parent_tables = self._tables(parent)
        for table in parent_tables:
            self.block_manager.share([b for b in table if b != NULL_BLOCK])
        child.block_tables = [list(table) for table in parent_tables]
        child.group_block_hashes = [list(hashes) for hashes in parent.group_block_hashes]

    # ------------------------------------------------------------------ prefix cache
    def cache_blocks(self, request: Request, num_tokens: int, weight_version: int | None) -> None:
        """Hash the full blocks among the request's first ``num_tokens`` tokens that are not hashed yet, per group.

        Called at schedule time with the tokens the step will have computed: within each layer the
        step writes every new key and value before any attention reads the cache, so the G samples
        of a prompt admitted in the same step already share its blocks. A ``NULL_BLOCK`` position of a
        sliding group gets its hash (the chain goes on through it) but registers nothing.

        Args:
            request: the request.
            num_tokens: its tokens whose KV is (or, within this step, will be) in its blocks.
            weight_version: the version that computed all of that KV (``Request.kv_version``); None when it mixes
                versions: nothing is hashed, since no version names the blocks. The request's LoRA adapter
                (``request.lora_id``) is part of every hash.
        """
        if weight_version is None:
            return
        bm = self.block_manager
        bs = self.block_size
        for g, table in enumerate(self._tables(request)):
            hashes = request.group_block_hashes[g]
            for i in range(len(hashes), num_tokens // bs):
                parent = self._parent_hash(request, g, i, weight_version)
                tokens = request.token_ids[i * bs : (i + 1) * bs]
                if table[i] == NULL_BLOCK:
                    hashes.append(hash_block(parent, tokens, weight_version, request.lora_id))
                else:
                    hashes.append(bm.cache_block(table[i], parent, tokens, weight_version, request.lora_id))

    def _parent_hash(self, request: Request, group: int, index: int, weight_version: int) -> bytes | None:
        """The hash of block ``index - 1`` of a group (its root for block 0), computed from the tokens
        when a prefix hit left it unknown (a ``NULL_BLOCK``)."""
        hashes = request.group_block_hashes[group]
        parent = hashes[index - 1] if index > 0 else group_root(group)
        if index > 0 and parent is None:
            bs = self.block_size
            parent = group_root(group)
            for i in range(index):
                parent = hash_block(parent, request.token_ids[i * bs : (i + 1) * bs], weight_version, request.lora_id)
                hashes[i] = parent
        return parent

    def uncache(self, request: Request, first_block: int = 0) -> None:
        """Drop every group's ``block_tables[g][first_block:]`` from the prefix cache (their KV is not valid)."""
        for table in request.block_tables:
            self.block_manager.uncache([b for b in table[first_block:] if b != NULL_BLOCK])

    def free(self, request: Request) -> None:
        """Release the request's device blocks in every group (cached ones stay findable until reused)."""
        for table in request.block_tables:
            held = [b for b in table if b != NULL_BLOCK]
            if held:
                self.block_manager.free(held)
        request.block_tables = [[] for _ in range(self.num_groups)]
        request.group_block_hashes = [[] for _ in range(self.num_groups)]

    # ------------------------------------------------------------------ CPU offload
    def _computed_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """The blocks holding the KV that queries after ``num_tokens`` tokens read, groups in order: in a
        full group the first ``ceil(num_tokens / block_size)``, in a sliding group those from its window start."""
        end = self.blocks_needed(num_tokens)
        out: list[int] = []
        for policy, table in zip(self.groups, request.block_tables):
            out += table[policy.window_start(num_tokens) : end]
        return out

    def offload(self, request: Request) -> tuple[list[int], list[int]] | None:
        """Reserve CPU pool blocks for the computed KV of a request being preempted.

        Call before ``free``: the returned device blocks are the request's, and their contents stay
        intact until the step's forward, before which the model runner copies them out. A sliding
        group offloads only its window's blocks.

        Returns:
            (device blocks, pool blocks) to copy, in order; None when there is no pool, nothing is
            computed, or the pool is full (the request is then recomputed).
        """
        pool = self.offload_pool
        num_tokens = request.num_computed_tokens
        if pool is None or num_tokens == 0:
            return None
        blocks = self._computed_blocks(request, num_tokens)
        if not pool.can_hold(len(blocks)):
            return None
        pool_ids = pool.allocate(len(blocks))
        request.offloaded = (pool_ids, num_tokens)
        self.num_offloads += 1
        return list(blocks), pool_ids

    def restore_blocks(self, request: Request) -> list[int]:
        """The device blocks that receive an admitted request's offloaded KV, in the order ``offload`` stored it."""
        assert request.offloaded is not None
        return self._computed_blocks(request, request.offloaded[1])

    def finish_restore(self, request: Request) -> None:
        """After the step that copied a request's KV back: free its pool blocks."""
        self.drop_offloaded(request)

    def drop_offloaded(self, request: Request) -> None:
        """Forget a request's offloaded KV (finished, cancelled, or to be recomputed)."""
        if request.offloaded is not None and self.offload_pool is not None:
            self.offload_pool.free(request.offloaded[0])
        request.offloaded = None
