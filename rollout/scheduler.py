"""The scheduler: which requests compute how many tokens in the next step, and the state update after it.

One rule, vLLM v1's: a request's ``num_computed_tokens`` catches up with its
``num_tokens`` under the step's token budget (``max_batch_tokens``). A new prompt,
a prompt longer than the budget (chunked prefill), a prompt partly found in the
prefix cache, a decode (one token) and a request re-prefilled after preemption are
all this rule; every step may mix them. The scheduler reasons in tokens; the KV cache
manager gives (or refuses) the blocks behind them.

Policies:
- ``fifo``: running requests first, in admission order, then waiting requests in
  arrival order. A new request is admitted only if the free blocks left after its
  allocation stay above ``safety_margin`` of the cache, so running requests can
  keep decoding without preemption.
- ``prefill_first``: waiting requests are admitted first, then running requests
  get what is left of the budget. Lowers time to first token.

Preemption: when a running request needs a block and none is free, the most recently
admitted running request is evicted: its blocks are freed and it goes back to the head
of the queue. With recompute, its prompt plus generated tokens are computed again when
it is re-admitted (its full blocks may still be found in the prefix cache); with
offload, its KV is copied to a CPU pool and copied back on re-admission.

The scheduler is the one writer of a request's status, tokens and ``num_computed_tokens``:
at admission and preemption in ``schedule``, after the forward in ``update_from_output``,
and in ``finish_request``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .kv_cache_manager import KVCacheManager
from .requests import FINISH_REASON_OF_STATUS, FINISH_SCORED, Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_scheduled_tokens: tokens computed this step, starting at ``request.num_computed_tokens``.
        sample: True when the step brings the request level with its tokens, so the
            logits of its last scheduled token are sampled.
    """

    request: Request
    num_scheduled_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: the scheduled requests, in batch order.
        preempted: the requests preempted while scheduling.
        offloads: (device blocks, CPU pool blocks) to copy out before the forward: the KV of
            preempted requests. The device blocks are already free; nothing writes them before
            the forward.
        restores: (request, device blocks) to copy the request's offloaded KV into
            (from ``request.offloaded``'s pool blocks) before the forward.
        total_num_scheduled_tokens: tokens computed in the step (T).
        num_scheduled_prompt_tokens: how many of those are prompt tokens.
        is_decode_only: every scheduled request computes one token and samples it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    offloads: list[tuple[list[int], list[int]]] = field(default_factory=list)
    restores: list[tuple[Request, list[int]]] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_scheduled_prompt_tokens: int = 0
    is_decode_only: bool = False

    @property
    def is_empty(self) -> bool:
        """True when no request computes anything this step."""
        return not self.scheduled


@dataclass
class RunnerOutput:
    """What the model runner returns for a step, for ``Scheduler.update_from_output`` to apply.

    Attributes:
        sampled_token_ids: one token id per scheduled request with ``sample``, in batch order.
        logprobs: one logprob per sampled token when logprobs are recorded, else None.
        prompt_logprobs: (scoring request, the logprobs of the positions it scored this step).
    """

    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    prompt_logprobs: list[tuple[Request, list[float]]] = field(default_factory=list)


class Scheduler:
    """Builds each step's batch under the token budget and applies each step's results.

    Args:
        kv_cache_manager: the owner of the requests' blocks.
        max_batch_tokens: token budget of one step (>= 1).
        max_requests_per_batch: most requests in one step, None for no cap.
        scheduler_type: "fifo" or "prefill_first".
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_batch_tokens: int,
        max_requests_per_batch: int | None = None,
        scheduler_type: str = "fifo",
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests_per_batch or 1 << 30
        self.scheduler_type = scheduler_type
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.weight_version = 0  # recorded with each sampled token and each cached block
        self.num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled

    @property
    def block_manager(self) -> BlockManager:
        """The block pool behind the KV cache manager (read it; change blocks through the manager)."""
        return self.kv_cache_manager.block_manager

    @property
    def safety_margin_blocks(self) -> int:
        """Blocks kept free when admitting while other requests run."""
        return self.kv_cache_manager.safety_margin_blocks

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        """Queue a request (PENDING) at the tail.

        Raises:
            ValueError: its id is already in use by an unfinished request.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.PENDING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End an unfinished request from outside (cancel, failure), freeing its blocks.

        Args:
            request_id: the request.
            status: its final status (CANCELLED or FAILED).
            error: the message recorded in ``request.error``.

        Returns:
            The request, or None if no unfinished request has that id.
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.error = error
        req.finish_reason = FINISH_REASON_OF_STATUS.get(status, req.finish_reason)
        self._finish(req, status)
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status in (RequestStatus.PREFILLING, RequestStatus.DECODING):
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        del self.requests[req.request_id]
        kv = self.kv_cache_manager
        kv.free(req)
        kv.drop_offloaded(req)
        req.status = status
        req.lifespan = (req.lifespan[0], time.perf_counter())

    def recompute_all(self) -> None:
        """Drop the KV of every unfinished request so it is computed again under the current weights.

        Running requests go back to the head of the queue, in order; waiting requests whose KV
        was offloaded forget it.
        """
        kv = self.kv_cache_manager
        for req in self.waiting:
            if req.offloaded is not None:
                kv.drop_offloaded(req)
                req.num_computed_tokens = 0
        for req in reversed(self.running):
            kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PENDING
            self.waiting.appendleft(req)
        self.running.clear()

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Choose the requests and token counts of the next step; their blocks are allocated."""
        out = SchedulerOutput()
        self._budget = self.max_batch_tokens
        chosen: dict[int, ScheduledRequest] = {}  # id(request) -> entry, in batch order
        if self.scheduler_type == "prefill_first":
            self._admit_waiting(chosen, out)
            self._schedule_running(chosen, out)
        else:
            self._schedule_running(chosen, out)
            if not out.preempted:
                self._admit_waiting(chosen, out)
        out.scheduled = list(chosen.values())
        out.total_num_scheduled_tokens = self.max_batch_tokens - self._budget
        num_prompt = 0
        decode_only = True
        for entry in out.scheduled:
            req, n = entry.request, entry.num_scheduled_tokens
            c = req.num_computed_tokens
            num_prompt += max(0, min(c + n, req.num_prompt_tokens) - c)
            decode_only = decode_only and n == 1 and entry.sample
        out.num_scheduled_prompt_tokens = num_prompt
        out.is_decode_only = decode_only and bool(out.scheduled)
        return out

    def _schedule_running(self, chosen: dict[int, ScheduledRequest], out: SchedulerOutput) -> None:
        """Give each running request, in admission order, the tokens it lacks (up to the budget).

        Request r with c computed of t tokens gets ``n = min(t - c, budget)``. When its blocks cannot
        hold ``c + n`` tokens, the most recently admitted running request is preempted (possibly r
        itself, which then ends the pass) until they can.
        """
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running):
            if self._budget <= 0 or len(chosen) >= self.max_requests:
                return
            req = self.running[i]
            if id(req) in chosen:  # admitted earlier in this step (prefill_first)
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, self._budget)
            while not kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, chosen, out)
                if victim is req:
                    return
            c = req.num_computed_tokens
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, c + n))
            kv.cache_blocks(req, c + n, self.weight_version)
            self._budget -= n
            i += 1

    def _admit_waiting(self, chosen: dict[int, ScheduledRequest], out: SchedulerOutput) -> None:
        """Admit waiting requests in order while the budget, the request cap and the blocks allow.

        Request r of t tokens reuses h computed tokens (prefix-cache hits, or its offloaded KV) and
        gets ``n = min(t - h, budget)`` more. It is admitted when its blocks for ``h + n`` tokens fit
        in the free blocks less the safety margin (no margin when nothing runs, so a big request can
        always start); otherwise admission stops, keeping arrival order.
        """
        kv = self.kv_cache_manager
        while self.waiting and self._budget > 0 and len(chosen) < self.max_requests:
            req = self.waiting[0]
            hits, num_cached = kv.get_computed_blocks(req, self.weight_version)
            n = min(req.num_tokens - num_cached, self._budget)
            if not kv.allocate_slots(req, n, hits, num_cached, keep_margin=bool(self.running)):
                return
            self.waiting.popleft()
            if req.offloaded is not None:
                out.restores.append((req, kv.restore_blocks(req)))
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
            req.status = RequestStatus.PREFILLING
            if req.lifespan[0] < 0:  # first admission (a preempted request keeps its first)
                req.lifespan = (time.perf_counter(), -1.0)
            self.running.append(req)
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, num_cached + n))
            kv.cache_blocks(req, num_cached + n, self.weight_version)
            self._budget -= n

    @staticmethod
    def _samples(req: Request, num_tokens_after_step: int) -> bool:
        return num_tokens_after_step == req.num_tokens and not req.prefill_only

    def _preempt(self, victim: Request, chosen: dict[int, ScheduledRequest], out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        self.running.remove(victim)
        entry = chosen.pop(id(victim), None)
        if entry is not None:
            self._budget += entry.num_scheduled_tokens
            # Blocks hashed this step hold no KV yet: nobody may find them later.
            kv.uncache(victim, victim.num_computed_tokens // kv.block_size)
        if victim.offloaded is not None:
            # Admitted for a restore in this same step: its KV is still in the pool.
            out.restores = [(r, b) for r, b in out.restores if r is not victim]
        else:
            copy = kv.offload(victim)
            if copy is not None:
                out.offloads.append(copy)
        kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PENDING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Apply a step's results: the one place a step changes requests.

        Each scheduled request advances ``num_computed_tokens`` by its scheduled tokens. A
        sampling request appends its token (with logprob and weight version) and either finishes
        (a stop token or max_new_tokens: FINISHED, blocks freed) or goes on DECODING. A scoring
        request records its prompt logprobs and finishes, reason "scored", once all its tokens are
        computed. Restored requests give their CPU pool blocks back.

        Args:
            scheduler_output: the step as scheduled.
            runner_output: what the forward and the sampler produced for it.

        Returns:
            The requests that got a token or finished this step, in batch order.
        """
        kv = self.kv_cache_manager
        for req, _ in scheduler_output.restores:
            kv.finish_restore(req)
        for req, logprobs in runner_output.prompt_logprobs:
            req.prompt_logprobs.extend(logprobs)
        tokens = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        version = self.weight_version
        updated: list[Request] = []
        k = 0
        for entry in scheduler_output.scheduled:
            req = entry.request
            req.num_computed_tokens += entry.num_scheduled_tokens
            if entry.sample:
                req.append_token(tokens[k], logprobs[k] if logprobs is not None else None, version)
                k += 1
                if req.done:
                    self._finish(req, RequestStatus.FINISHED)
                else:
                    req.status = RequestStatus.DECODING
                updated.append(req)
            elif req.prefill_only and req.num_computed_tokens == req.num_tokens:
                req.finish_reason = FINISH_SCORED
                self._finish(req, RequestStatus.FINISHED)
                updated.append(req)
        return updated

    def uncache_step(self, scheduler_output: SchedulerOutput) -> None:
        """A step's forward failed: drop its requests' blocks from the prefix cache, their KV may be incomplete."""
        for entry in scheduler_output.scheduled:
            self.kv_cache_manager.uncache(entry.request)
