"""The scheduler: which requests compute how many tokens in the next step, and the state update after it.

One rule, vLLM v1's: a request's ``num_computed_tokens`` catches up with its ``num_tokens`` under the step's token
budget (``max_batch_tokens``). New prompts, chunked prefills, prefix-cache hits, decodes and re-prefills after
preemption are all this rule, mixed in any step. The scheduler reasons in tokens; the KV cache manager gives (or
refuses) the blocks behind them.

Policies:
- ``fifo``: running requests first, in admission order, then waiting requests in arrival order. A new request is
  admitted only if the free blocks left after its allocation stay above ``safety_margin`` of the cache.
- ``prefill_first``: waiting requests first, then running requests get what is left of the budget.

Preemption: when a running request needs a block and none is free, the most recently admitted running request goes
back to the head of the queue, its blocks freed. With recompute its tokens are computed again on re-admission (its
full blocks may still be in the prefix cache); with offload its KV is copied to a CPU pool and back.

Prompt forking (vLLM v0's ``n`` sampling, found by matching tokens): a waiting request whose tokens equal those of a
generation request whose prefill is in flight (admitted, nothing sampled since, under the current weight version) is
parked on it (``request.fork_parent``; in neither queue). In the step that completes the parent's prefill it samples
its first token from the parent's logits row and takes the parent's blocks (``KVCacheManager.fork``: full blocks
shared, the partial last block copied when first written), so G samples of a prompt compute it once, however they
arrive. Only the head of the waiting queue parks; it costs no budget and, like an admission, one free block (less the
safety margin). Parked forks sample in their parent's step outside ``max_requests_per_batch``. A parent preempted or
recomputed keeps its forks; one cancelled or failed hands them back to the head of the queue.

Counts advance when a step is scheduled (vLLM v1's ``_update_after_schedule``): ``schedule`` moves each scheduled
request's ``num_computed_tokens`` past the tokens the step computes, each ``ScheduledRequest`` keeping where they
start; ``update_from_output`` then writes the sampled tokens. Async batching is the subclass
``async_scheduler.AsyncScheduler``, which counts the tokens a step in flight will sample as placeholders
(``Request.num_output_placeholders``); this class never counts any.

The scheduler is the one writer of a request's status, tokens and ``num_computed_tokens``: at admission, preemption
and the end of ``schedule``, in ``update_from_output`` and in ``finish_request``.
"""

from __future__ import annotations

import time
from collections import deque

from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.sched.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from rollout.requests import FINISH_REASON_OF_STATUS, FINISH_SCORED, Request, RequestStatus


class Scheduler:
    """Builds each step's batch under the token budget and applies each step's results.

    Args:
        kv_cache_manager: the owner of the requests' blocks.
        max_batch_tokens: token budget of one step (>= 1).
        max_requests_per_batch: most requests in one step, None for no cap.
        scheduler_type: "fifo" or "prefill_first".
        fork_prompts: park and fork requests whose tokens equal an in-flight prefill (see the module docstring); None:
            when block sharing (prefix caching) is on.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_batch_tokens: int,
        max_requests_per_batch: int | None = None,
        scheduler_type: str = "fifo",
        fork_prompts: bool | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests_per_batch or 1 << 30
        self.scheduler_type = scheduler_type
        if fork_prompts is None:
            fork_prompts = kv_cache_manager.block_manager.enable_prefix_caching
        self.fork_prompts = fork_prompts
        # The generation requests whose prefill is in flight (admitted, nothing sampled since), by the
        # weight version and LoRA adapter (``Request.lora_id``) their KV is computed under and their tokens: the
        # parents that a waiting request with the same key parks on (the prefix cache keys blocks the same way);
        # and the key of each, by id(request), so that forgetting one builds no key.
        self._prefilling: dict[tuple[int, int, tuple[int, ...]], Request] = {}
        self._prefilling_key: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.weight_version = 0  # the model's version: keys each cached block and each parked prefill
        # The version at which the base weights were last set (<= weight_version: LoRA loads are versions too, of an
        # adapter only); with each request's adapter's version it names the weights of a token (``token_version``).
        self.base_version = 0
        self.num_preemptions = 0
        self._budget = 0  # tokens left in the step being scheduled

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

    def token_version(self, req: Request) -> int:
        """The weight version a token sampled for ``req`` now records: the version at which the weights that computed
        it were last set, the base weights' or its LoRA adapter's (``Request.lora_version``), whichever is later. An
        adapter loaded after the request's own does not change it (DESIGN.md, "Adapters obey the same promise")."""
        return max(self.base_version, req.lora_version)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs (a parked fork's parent does one or the other)."""
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
        elif req.fork_parent is not None:
            req.fork_parent.forks.remove(req)
            req.fork_parent = None
        else:
            self.waiting.remove(req)
        self._forget_prefill(req)
        if req.forks:
            # Cancelled or failed before its prefill completed: its forks prefill for themselves
            # (the first one admitted becomes the parent of the others), first in the queue.
            self._unpark(req)
        del self.requests[req.request_id]
        kv = self.kv_cache_manager
        kv.free(req)
        kv.drop_offloaded(req)
        req.status = status
        req.lifespan = (req.lifespan[0], time.perf_counter())

    def recompute_all(self) -> None:
        """Drop the KV of every unfinished request so it is computed again under the current weights.

        Running requests go back to the head of the queue, in order; waiting requests whose KV was offloaded forget it.
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

    # ------------------------------------------------------------------ prompt forking
    def _remember_prefill(self, req: Request, recomputed: bool) -> None:
        """``req`` is admitted: requests with the same tokens queued behind it, under the same weight version, will park
        on it.

        Args:
            req: the admitted request.
            recomputed: its KV is computed from scratch at this admission (not restored from the CPU pool), so under the
                current weight version even if it was first admitted under another (``recompute_all`` after a weight
                update).
        """
        if not self.fork_prompts or req.prefill_only:
            return
        old = self._prefilling_key.get(id(req))
        if old is not None:
            if not recomputed or old[0] == self.weight_version:
                return
            self._forget_prefill(req)
        key = (self.weight_version, req.lora_id, tuple(req.token_ids))
        if key not in self._prefilling:
            self._prefilling[key] = req
            self._prefilling_key[id(req)] = key

    def _forget_prefill(self, req: Request) -> None:
        """``req`` samples or ends: no request parks on it from now on."""
        key = self._prefilling_key.pop(id(req), None)
        if key is not None:
            del self._prefilling[key]

    def _fork_parent(self, req: Request) -> Request | None:
        """The request whose in-flight prefill of the same tokens a waiting request can park on, or None.

        Only a generation request without offloaded KV parks (a scoring request needs logits of its own; an offloaded
        one has its KV already).
        """
        if not self._prefilling or req.prefill_only or req.offloaded is not None:
            return None
        parent = self._prefilling.get((self.weight_version, req.lora_id, tuple(req.token_ids)))
        if parent is req:  # a preempted parent comes back through the queue itself
            return None
        return parent

    def _room_for_one_more_fork(self) -> bool:
        """True when the free blocks, less the safety margin while requests run, hold one block per layer group for each
        parked fork and one more: what a fork takes at its first write (in each group, a copy of the shared partial last
        block, or a new block). Parking, like an admission, keeps that room."""
        kv = self.kv_cache_manager
        margin = kv.safety_margin_blocks if self.running else 0
        num_parked = sum(len(parent.forks) for parent in self._prefilling.values())
        return kv.num_free_blocks - (num_parked + 1) * kv.num_groups >= margin

    def _list_forks(self, out: SchedulerOutput) -> None:
        """The parked requests of the parents whose prefill this step completes, into ``out.forks``."""
        for entry in out.scheduled:
            parent = entry.request
            if entry.sample and parent.forks:
                now = time.perf_counter()
                for child in parent.forks:
                    out.forks.append((parent, child))
                    if child.lifespan[0] < 0:  # first scheduled: the step that samples its first token
                        child.lifespan = (now, -1.0)

    def _fork(self, parent: Request, child: Request, num_computed_tokens: int) -> None:
        """After the step that completed ``parent``'s prefill (``num_computed_tokens`` computed): ``child`` takes its
        blocks and runs."""
        child.fork_parent = None
        self.kv_cache_manager.fork(parent, child)
        child.num_computed_tokens = num_computed_tokens
        child.kv_version = parent.kv_version
        if child.num_preemptions == 0:
            child.num_cached_prompt_tokens = child.num_prompt_tokens
        child.status = RequestStatus.DECODING
        self.running.append(child)

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
        # After every preemption of the pass: a preempted parent keeps its forks parked.
        self._list_forks(out)
        out.block_copies = self.kv_cache_manager.take_block_copies()
        self._count(out)
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance each scheduled request past the tokens the step computes (vLLM v1's hook of that name).

        A request that samples in the step takes no more parked forks: those parked until now sample in this step
        (``out.forks``).
        """
        for entry in out.scheduled:
            entry.request.num_computed_tokens += entry.num_scheduled_tokens
            if entry.sample:
                self._forget_prefill(entry.request)

    def _count(self, out: SchedulerOutput) -> None:
        """Fill in the step's token counts (before its requests' ``num_computed_tokens`` move)."""
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

    def _schedule_running(self, chosen: dict[int, ScheduledRequest], out: SchedulerOutput) -> None:
        """Give each running request, in admission order, the tokens it lacks (up to the budget).

        Request r with c computed of t tokens (and p placeholders) gets ``n = min(t + p - c, budget)``. When its blocks
        cannot hold ``c + n`` tokens, the most recently admitted running request is preempted (possibly r itself, which
        then ends the pass) until they can. A request with nothing to compute, or that ``_defer`` holds back, is left
        for a later step.

        Args:
            chosen: the step's entries so far, by ``id(request)``; the pass adds to it.
            out: the step (preemptions are recorded there).
        """
        kv = self.kv_cache_manager
        i = 0
        while i < len(self.running):
            if self._budget <= 0 or len(chosen) >= self.max_requests:
                return
            req = self.running[i]
            c = req.num_computed_tokens
            n = min(req.num_tokens + req.num_output_placeholders - c, self._budget)
            if id(req) in chosen or n <= 0 or self._defer(req):  # chosen: admitted earlier (prefill_first)
                i += 1
                continue
            while not kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim, chosen, out)
                if victim is req:
                    return
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, c + n))
            self._compute_under_current_weights(req, fresh=False)
            # Blocks of known tokens only (a placeholder's block is hashed once its token is known).
            kv.cache_blocks(req, min(c + n, req.num_tokens), req.kv_version)
            self._budget -= n
            i += 1

    def _defer(self, req: Request) -> bool:
        """True to leave a running request out of the step being scheduled (never, here; see ``AsyncScheduler``)."""
        return False

    def _admit_waiting(self, chosen: dict[int, ScheduledRequest], out: SchedulerOutput) -> None:
        """Admit waiting requests in order while the budget, the request cap and the blocks allow.

        Request r of t tokens reuses h computed tokens (prefix-cache hits, or its offloaded KV) and gets ``n = min(t -
        h, budget)`` more. It is admitted when its blocks for ``h + n`` tokens fit in the free blocks less the safety
        margin (no margin when nothing runs, so a big request can always start); otherwise admission stops, keeping
        arrival order. A request at the head whose tokens are being prefilled by another is parked on it instead, even
        when the budget is spent, if the blocks allow (``_room_for_one_more_fork``); otherwise admission stops too.
        """
        kv = self.kv_cache_manager
        while self.waiting:
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted while a step in flight samples for it (async)
                return
            parent = self._fork_parent(req)
            if parent is not None:
                if not self._room_for_one_more_fork():
                    return
                self.waiting.popleft()
                req.fork_parent = parent
                parent.forks.append(req)
                continue
            if self._budget <= 0 or len(chosen) >= self.max_requests:
                return
            hits, num_cached = kv.get_computed_blocks(req, self.weight_version)
            n = min(req.num_tokens - num_cached, self._budget)
            if not kv.allocate_slots(req, n, hits, num_cached, keep_margin=bool(self.running)):
                return
            self.waiting.popleft()
            recomputed = req.offloaded is None
            if not recomputed:
                out.restores.append((req, kv.restore_blocks(req)))
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
            req.status = RequestStatus.PREFILLING
            if req.lifespan[0] < 0:  # first admission (a preempted request keeps its first)
                req.lifespan = (time.perf_counter(), -1.0)
            self.running.append(req)
            self._remember_prefill(req, recomputed)
            chosen[id(req)] = ScheduledRequest(req, n, self._samples(req, num_cached + n))
            # Prefix-cache hits are the current version's; restored KV keeps the version it was computed under.
            self._compute_under_current_weights(req, fresh=recomputed)
            kv.cache_blocks(req, num_cached + n, req.kv_version)
            self._budget -= n

    def _compute_under_current_weights(self, req: Request, fresh: bool) -> None:
        """The tokens scheduled now for ``req`` are computed under ``self.weight_version``: its ``kv_version`` stays a
        version only while all of its KV is that version's.

        Args:
            req: a request scheduled in the step being built.
            fresh: its KV before these tokens is the current version's or none (an admission that is not a restore).
        """
        if fresh:
            req.kv_version = self.weight_version
        elif req.kv_version != self.weight_version:
            req.kv_version = None

    @staticmethod
    def _samples(req: Request, num_tokens_after_step: int) -> bool:
        return num_tokens_after_step == req.num_tokens + req.num_output_placeholders and not req.prefill_only

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
        """Apply a step's results: the one place a step's tokens reach its requests.

        A sampling request appends its token (with logprob, top logprobs and weight version) and either finishes (a stop
        token, a stop string or max_new_tokens: FINISHED, blocks freed) or goes on DECODING. The forks of a request
        whose prefill completed take its blocks and computed tokens (before it may finish and free them), join the
        running requests and append their own token the same way, right after it. A scoring request records its prompt
        logprobs and finishes, reason "scored", once all its tokens are computed. Restored requests give their CPU pool
        blocks back. A request that ended while the step was in flight (cancelled) is skipped: its row was computed and
        is dropped. One preempted while it was in flight (async batching) keeps its token and waits; its forks go back
        to the head of the queue, to prefill for themselves.

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
            if not req.status.is_final:
                req.prompt_logprobs.extend(logprobs)
        tokens = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        top = runner_output.top_logprobs
        updated: list[Request] = []
        # The forks' tokens follow those of the scheduled requests.
        k = sum(1 for entry in scheduler_output.scheduled if entry.sample)
        fork_rows: dict[int, list[tuple[Request, int]]] = {}
        for parent, child in scheduler_output.forks:
            fork_rows.setdefault(id(parent), []).append((child, k))
            k += 1
        k = 0
        for entry in scheduler_output.scheduled:
            req = entry.request
            if req.status.is_final:  # cancelled or failed while the step was in flight
                k += entry.sample
                continue
            end = entry.num_computed_tokens + entry.num_scheduled_tokens  # computed after this step
            if entry.sample:
                children = fork_rows.get(id(req), [])
                if children and req.status == RequestStatus.PENDING:
                    self._unpark(req)
                    children = []
                for child, _ in children:
                    req.forks.remove(child)
                    self._fork(req, child, end)
                for r, row in ((req, k), *children):
                    r.append_token(
                        tokens[row],
                        logprobs[row] if logprobs is not None else None,
                        self.token_version(r),
                        top[row] if top is not None else None,
                    )
                    if r.done:
                        self._finish(r, RequestStatus.FINISHED)
                    elif r.status != RequestStatus.PENDING:  # PENDING: preempted while in flight
                        r.status = RequestStatus.DECODING
                    updated.append(r)
                k += 1
            elif req.prefill_only and end == req.num_tokens:  # not the count: a later step may be scheduled
                req.finish_reason = FINISH_SCORED
                self._finish(req, RequestStatus.FINISHED)
                updated.append(req)
        return updated

    def _unpark(self, parent: Request) -> None:
        """Send the forks parked on ``parent`` back to the head of the queue, in order (they prefill for themselves)."""
        for fork in reversed(parent.forks):
            fork.fork_parent = None
            self.waiting.appendleft(fork)
        parent.forks = []
