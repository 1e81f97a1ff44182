"""The scheduler: which requests compute how many tokens in the next step.

One rule, vLLM v1's: a request's ``num_computed_tokens`` catches up with its
``num_tokens`` under the step's token budget (``max_batch_tokens``). A new prompt,
a prompt longer than the budget (chunked prefill), a prompt partly found in the
prefix cache, a decode (one token) and a request re-prefilled after preemption are
all this rule; every step may mix them.

Policies:
- ``fifo``: running requests first, in admission order, then waiting requests in
  arrival order. A new request is admitted only if the free blocks left after its
  allocation stay above ``safety_margin`` of the cache, so running requests can
  keep decoding without preemption.
- ``prefill_first``: waiting requests are admitted first, then running requests
  get what is left of the budget. Lowers time to first token.

Preemption (recompute): when a running request needs a block and none is free, the
most recently admitted running request is evicted: its blocks are freed and it goes
back to the head of the queue; its prompt plus generated tokens are computed again
when it is re-admitted (its full blocks may still be found in the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .requests import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_query_tokens: tokens computed this step, starting at ``request.num_computed_tokens``.
        sample: True when the step brings the request level with its tokens, so the
            logits of its last query token are sampled.
    """

    request: Request
    num_query_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What one step computes: the scheduled requests (in batch order) and the requests preempted."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Offload preemption: (request, its former blocks holding computed KV, tokens in them).
    # The blocks are already free; their contents stay intact until this step's forward.
    offloads: list[tuple[Request, list[int], int]] = field(default_factory=list)
    # Restored requests: (request, the new blocks its offloaded KV must be copied into).
    restores: list[tuple[Request, list[int]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Builds each step's batch under the token budget.

    Args:
        block_manager: the block pool.
        max_batch_tokens: token budget of one step (>= 1).
        max_requests_per_batch: most requests in one step, None for no cap.
        scheduler_type: "fifo" or "prefill_first".
        safety_margin: fraction [0, 1) of the blocks kept free at admission.
        offload: on preemption, report the victim's computed blocks in
            ``SchedulerOutput.offloads`` so the engine can copy them to CPU memory; a
            request whose ``offloaded`` KV is set is restored instead of recomputed.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_requests_per_batch: int | None,
        scheduler_type: str,
        safety_margin: float,
        offload: bool = False,
    ) -> None:
        self.offload = offload
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests_per_batch or 1 << 30
        self.scheduler_type = scheduler_type
        self.safety_margin_blocks = int(safety_margin * block_manager.num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.weight_version = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        """Queue a request (PENDING) at the tail."""
        request.status = RequestStatus.PENDING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Remove a request from the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._release_blocks(request)

    def requeue_running(self) -> None:
        """Free the blocks of every running request and put it back at the head of the queue.

        Its tokens are computed again when it is re-admitted (a weight update with recompute).
        """
        for req in reversed(self.running):
            self._release_blocks(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PENDING
            self.waiting.appendleft(req)
        self.running.clear()

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Choose the requests and token counts of the next step, allocating their blocks."""
        out = SchedulerOutput()
        budget = [self.max_batch_tokens]
        chosen: dict[int, ScheduledRequest] = {}  # id(request) -> entry, in batch order
        if self.scheduler_type == "prefill_first":
            self._admit_waiting(chosen, budget, out)
            self._schedule_running(chosen, budget, out)
        else:
            self._schedule_running(chosen, budget, out)
            if not out.preempted:
                self._admit_waiting(chosen, budget, out)
        out.scheduled = list(chosen.values())
        return out

    def _schedule_running(self, chosen: dict[int, ScheduledRequest], budget: list[int], out: SchedulerOutput) -> None:
        i = 0
        while i < len(self.running):
            if budget[0] <= 0 or len(chosen) >= self.max_requests:
                return
            req = self.running[i]
            if id(req) in chosen:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget[0])
            needed = self.block_manager.blocks_needed(req.num_computed_tokens + n) - len(req.block_table)
            while needed > self.block_manager.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim, chosen, budget, out)
                if victim is req:
                    break
            if req.status == RequestStatus.PENDING:  # preempted itself
                return
            if needed > 0:
                req.block_table.extend(self.block_manager.allocate(needed))
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, req.num_computed_tokens + n))
            self._cache_full_blocks(req, req.num_computed_tokens + n)
            budget[0] -= n
            i += 1

    def _admit_waiting(self, chosen: dict[int, ScheduledRequest], budget: list[int], out: SchedulerOutput) -> None:
        bm = self.block_manager
        while self.waiting and budget[0] > 0 and len(chosen) < self.max_requests:
            req = self.waiting[0]
            if req.offloaded is not None:
                hits, num_cached = [], req.offloaded[1]
            else:
                max_hit = req.num_tokens - 1
                if req.score_from is not None:
                    # Positions whose logits are scored must be computed, not found in the cache.
                    max_hit = min(max_hit, req.score_from - 1)
                hits = bm.find_cached_prefix(req.token_ids, self.weight_version, max_hit)
                num_cached = len(hits) * bm.block_size
            n = min(req.num_tokens - num_cached, budget[0])
            new_blocks = bm.blocks_needed(num_cached + n) - len(hits)
            free_hits = sum(1 for b in hits if bm.blocks[b].ref_count == 0)
            free_after = bm.num_free_blocks - free_hits - new_blocks
            margin = self.safety_margin_blocks if self.running else 0
            if free_after < margin:
                return
            self.waiting.popleft()
            bm.acquire(hits)
            req.block_table = list(hits) + bm.allocate(new_blocks)
            if req.offloaded is not None:
                out.restores.append((req, req.block_table[: bm.blocks_needed(num_cached)]))
            req.block_hashes = [bm.blocks[b].block_hash for b in hits]  # type: ignore[misc]
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
            req.status = RequestStatus.PREFILLING
            self.running.append(req)
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, num_cached + n))
            self._cache_full_blocks(req, num_cached + n)
            budget[0] -= n

    @staticmethod
    def _samples(req: Request, num_tokens_after_step: int) -> bool:
        return num_tokens_after_step == req.num_tokens and not req.prefill_only

    def _preempt(self, victim: Request, chosen: dict[int, ScheduledRequest], budget: list[int], out: SchedulerOutput) -> None:
        self.running.remove(victim)
        entry = chosen.pop(id(victim), None)
        if entry is not None:
            budget[0] += entry.num_query_tokens
            # Blocks hashed this step hold no KV yet: nobody may find them later.
            first_uncomputed = victim.num_computed_tokens // self.block_manager.block_size
            self.block_manager.uncache(victim.block_table[first_uncomputed:])
        if victim.offloaded is not None:
            # Admitted for a restore in this same step: its KV is still in the pool.
            out.restores = [(r, b) for r, b in out.restores if r is not victim]
        elif self.offload and victim.num_computed_tokens > 0:
            computed = self.block_manager.blocks_needed(victim.num_computed_tokens)
            out.offloads.append((victim, list(victim.block_table[:computed]), victim.num_computed_tokens))
        self._release_blocks(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PENDING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def _release_blocks(self, req: Request) -> None:
        if req.block_table:
            self.block_manager.free(req.block_table)
        req.block_table = []
        req.block_hashes = []

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        """Hash the blocks that this step fills, so requests admitted from now on can share them.

        Hashing at schedule time lets the G samples of a prompt admitted in the same
        step share its blocks: within each layer the step writes every new key and
        value before any attention reads the cache.
        """
        bm = self.block_manager
        bs = bm.block_size
        num_full = num_tokens_after_step // bs
        for i in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[-1] if req.block_hashes else None
            h = bm.cache_block(req.block_table[i], parent, req.token_ids[i * bs : (i + 1) * bs], self.weight_version)
            req.block_hashes.append(h)
