"""What a step computes and what it produced: ``SchedulerOutput`` (with its ``ScheduledRequest`` entries), built by
``Scheduler.schedule``, and ``RunnerOutput``, returned by the model runner for ``Scheduler.update_from_output`` (vLLM
v1's ``sched/output.py`` and ``ModelRunnerOutput``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.requests import Request

__all__ = ["RunnerOutput", "ScheduledRequest", "SchedulerOutput"]


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_scheduled_tokens: tokens computed this step, starting at ``request.num_computed_tokens``.
        sample: True when the step brings the request level with its tokens, so the logits of its last scheduled token
            are sampled.
        num_computed_tokens: the request's computed tokens when the step was scheduled: the position of its first query
            token (None at construction: the request's count then).
    """

    request: Request
    num_scheduled_tokens: int
    sample: bool
    num_computed_tokens: int = None  # type: ignore[assignment]  # filled in by __post_init__

    def __post_init__(self) -> None:
        if self.num_computed_tokens is None:
            self.num_computed_tokens = self.request.num_computed_tokens


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: the scheduled requests, in batch order.
        preempted: the requests preempted while scheduling.
        offloads: (device blocks, CPU pool blocks) to copy out before the forward: the KV of preempted requests. The
            device blocks are already free; nothing writes them before the forward.
        restores: (request, device blocks) to copy the request's offloaded KV into (from ``request.offloaded``'s pool
            blocks) before the forward.
        block_copies: (source block, destination block) device copies of copy-on-write, made after the offloads and
            before the restores and the forward, in order.
        forks: (parent, child): the parked requests forked in this step. The parent's prefill completes (it samples);
            each child samples its first token from the parent's logits row and takes the parent's blocks after the
            forward.
        total_num_scheduled_tokens: tokens computed in the step (T).
        num_scheduled_prompt_tokens: how many of those are prompt tokens.
        is_decode_only: every scheduled request computes one token and samples it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    offloads: list[tuple[list[int], list[int]]] = field(default_factory=list)
    restores: list[tuple[Request, list[int]]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)
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
        sampled_token_ids: one token id per scheduled request with ``sample``, in batch order, then one per fork of
            ``SchedulerOutput.forks``, in that order.
        logprobs: one logprob per sampled token when logprobs are recorded, else None.
        prompt_logprobs: (scoring request, the logprobs of the positions it scored this step).
        top_logprobs: per sampled token, (ids, logprobs) of its request's ``num_top_logprobs`` most likely tokens, most
            likely first (empty lists for a request that asks for none); None when no request of the step asks.
    """

    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    prompt_logprobs: list[tuple[Request, list[float]]] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
