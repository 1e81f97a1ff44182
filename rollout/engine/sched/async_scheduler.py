"""Async batching's scheduler: the next step is scheduled while the step before it runs.

vLLM v1's ``AsyncScheduler`` (vllm/v1/core/sched/async_scheduler.py): a subclass of ``Scheduler`` with two hooks
around a per-request placeholder count. A request scheduled to sample gets a placeholder
(``Request.num_output_placeholders``), which the scheduling rule counts as a token, so the next step is scheduled
before the token is known; the model runner copies the sampled token into that step's inputs on the device. When the
token arrives (``update_from_output``) the placeholder goes and the blocks it completes are hashed. Nothing scheduled
is taken back: a row of a request that ended in the step before is computed and dropped.

A running request waits for the step in flight instead (``_defer``) when that step samples its last token, its parked
forks join it in that step, or it has logits processors (they read the tokens so far) or a grammar (its matcher
follows the tokens so far).

Greedy tokens, logprobs, seeded samples and weight versions are what the synchronous loop gives (a weight update waits
for the step in flight); a row's bits may differ where the batches differ.
"""

from __future__ import annotations

from rollout.engine.sched.output import RunnerOutput, SchedulerOutput
from rollout.engine.sched.scheduler import Scheduler
from rollout.requests import Request, RequestStatus

__all__ = ["AsyncScheduler"]

_RUNNING = (RequestStatus.PREFILLING, RequestStatus.DECODING)


class AsyncScheduler(Scheduler):
    """``Scheduler`` for async batching: placeholders for the tokens that the step in flight samples.

    Same arguments as ``Scheduler``.
    """

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        super()._update_after_schedule(out)
        for entry in out.scheduled:
            if entry.sample:
                entry.request.num_output_placeholders += 1

    def _defer(self, req: Request) -> bool:
        if not req.num_output_placeholders:
            return False
        if req.num_generated_tokens + req.num_output_placeholders >= req.params.max_new_tokens:
            return True
        # Logits processors read the tokens so far, a grammar matcher is advanced by them.
        return bool(req.forks) or req.params.uses_logits_processors or req.grammar is not None

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """``Scheduler.update_from_output``, each sampled token replacing its placeholder; then the blocks that the new
        tokens complete are hashed for the prefix cache (a running request's only)."""
        for entry in scheduler_output.scheduled:
            if entry.sample:
                entry.request.num_output_placeholders -= 1
        updated = super().update_from_output(scheduler_output, runner_output)
        kv = self.kv_cache_manager
        for entry in scheduler_output.scheduled:
            req = entry.request
            if entry.sample and req.status in _RUNNING:
                kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens), req.kv_version)
        return updated
