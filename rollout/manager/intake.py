"""The manager's intake: checking requests in the caller's thread, the inbox of checked requests and cancels.

A request is checked once, in the caller's thread and outside the manager's lock, before it is queued
(``request_params``, ``checked_request``, ``checked_batch``; ``derive_seeds`` spreads one seed over a batch); nothing
is queued when a check fails. Callers put checked ``Request`` objects and cancels into the inbox, which the manager's
loop drains between steps (vLLM's engine-core input queue). ``max_queue_size`` bounds the requests not yet admitted:
``put`` refuses a batch that does not fit, or waits for room. The inbox shares the manager's condition variable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.checks import FieldError, check_int, is_int, token_ids
from rollout.engine import Engine
from rollout.manager.outputs import OutputRouter, ended_output
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams, build_sampling_params, check_processors_unchanged

# A checked request on its way to the inbox: (request id, or None for ``req_<n>``; prompt token ids; sampling
# parameters).
Item = tuple[str | None, list[int], SamplingParams]


class QueueFullError(RuntimeError):
    """``add_request`` found ``max_queue_size`` requests waiting."""


def derive_seeds(seed: int | Sequence[int | None] | None, num_requests: int) -> list[int | None]:
    """One seed per request: s + k for request k from one int s (``generate_batch``'s rule), or the sequence itself.

    Raises:
        ValueError: a sequence of the wrong length.
    """
    if isinstance(seed, (list, tuple)):
        if len(seed) != num_requests:
            raise ValueError(f"seed holds {len(seed)} seeds for {num_requests} inputs")
        return list(seed)
    if seed is None:
        return [None] * num_requests
    if not is_int(seed):
        return [seed] * num_requests  # SamplingParams names the bad value
    return [int(seed) + k for k in range(num_requests)]


def request_params(
    defaults: SamplingParams,
    sampling_params: SamplingParams | None,
    *,
    vocab_size: int,
    per_request_processors: bool,
    **overrides: Any,
) -> SamplingParams:
    """A request's sampling parameters: ``sampling_params`` (default: ``defaults``) with the overrides on top.

    Args:
        defaults: the manager's parameters, from its generation config.
        sampling_params: the caller's parameters, or None.
        vocab_size: end-of-sequence and bad-word ids must lie in ``[0, vocab_size)``.
        per_request_processors: False refuses logits-processor values other than the defaults'
            (``ContinuousBatchingConfig.per_request_processors``).
        overrides: ``build_sampling_params``'s keyword overrides (max_new_tokens, do_sample, temperature, top_k, top_p,
            seed, eos_token_id); None keeps a value.

    Raises:
        ValueError: a bad sampling value, or a logits-processor value other than the defaults' under
            ``per_request_processors=False``.
    """
    params = build_sampling_params(sampling_params or defaults, vocab_size=vocab_size, **overrides)
    if not per_request_processors:
        check_processors_unchanged(params, defaults)
    return params


def check_fits(
    engine: Engine | None,
    request_id: str | None,
    prompt: list[int],
    params: SamplingParams,
    name: str,
    scoring: bool = False,
) -> None:
    """Raise ValueError (naming the argument) when the request can never fit the engine's cache.

    Args:
        engine: the manager's engine; None once the manager was destroyed.
        request_id: the request's id, or None (named in the message).
        prompt: the checked prompt token ids.
        params: the request's sampling parameters (``max_new_tokens`` counts).
        name: how the message names the argument (``"input_ids"``, ``"inputs[3]"``).
        scoring: a scoring request (it generates nothing: the prompt alone must fit).

    Raises:
        FieldError: the engine's check's message (``engine.gate.check``, the one check of a request against the
            engine), prefixed with ``name``; its ``field`` is ``name`` when the prompt alone cannot fit, else the field
            at fault (``max_new_tokens``, ``num_top_logprobs``, ``stop_strings``, ``lora``).
        RuntimeError: there is no engine (the manager was destroyed).
    """
    if engine is None:
        raise RuntimeError("the manager was destroyed and accepts no request")
    try:
        engine.gate.check(request_id, len(prompt), params, scoring)
    except FieldError as e:
        raise FieldError(name if e.field == "input_ids" else e.field, f"{name}: {e}") from e
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def checked_request(
    engine: Engine | None, input_ids: Any, request_id: str | None, params: SamplingParams, vocab_size: int
) -> Item:
    """One request for the inbox: its prompt (``input_ids``) and id checked, and that it fits the cache.

    Raises:
        ValueError: a bad prompt, a request id that is not a str, or a request that can never fit.
        RuntimeError: there is no engine (the manager was destroyed).
    """
    prompt = token_ids(input_ids, "input_ids", vocab_size)
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id must be a str or None, got {request_id!r}")
    check_fits(engine, request_id, prompt, params, "input_ids")
    return request_id, prompt, params


def checked_batch(
    engine: Engine | None,
    inputs: Sequence[Any],
    params: SamplingParams,
    seeds: Sequence[int | None],
    vocab_size: int,
) -> tuple[list[Item], list[int]]:
    """A batch for the inbox: every prompt checked, in queue order.

    Args:
        engine: the manager's engine (whether each request fits its cache); None once destroyed.
        inputs: the prompts, each named ``inputs[i]`` in messages.
        params: the batch's sampling parameters.
        seeds: one seed per prompt (see ``derive_seeds``); None keeps ``params``' seed.
        vocab_size: prompt ids must lie in ``[0, vocab_size)``.

    Returns:
        The items sorted by prompt, so that prompts sharing a prefix are admitted next to each other
        and find each other's blocks in the prefix cache; and ``order``: item j is ``inputs[order[j]]``.

    Raises:
        ValueError: a bad prompt or a request that can never fit (its index is named); a bad seed.
        RuntimeError: there is no engine (the manager was destroyed).
    """
    items: list[Item] = []
    for i, (prompt_ids, seed_i) in enumerate(zip(inputs, seeds)):
        name = f"inputs[{i}]"
        prompt = token_ids(prompt_ids, name, vocab_size)
        params_i = params if seed_i is None else build_sampling_params(params, seed=seed_i)
        check_fits(engine, None, prompt, params_i, name)
        items.append((None, prompt, params_i))
    order = sorted(range(len(items)), key=lambda i: items[i][1])
    return [items[i] for i in order], order


def checked_scoring_batch(
    engine: Engine | None, inputs: Sequence[Any], score_from: int, vocab_size: int, lora: str | None = None
) -> list[Item]:
    """Scoring requests for the inbox: every prompt checked, and ``score_from`` against each; scored under the LoRA
    adapter ``lora`` (None: the base model).

    Raises:
        FieldError: a bad prompt or one that can never fit (``inputs[i]``), or ``score_from`` outside
            ``[1, len(prompt)]``.
        RuntimeError: there is no engine (the manager was destroyed).
    """
    params = SamplingParams(max_new_tokens=1, lora=lora)  # nothing is sampled; the fit check counts the prompt alone
    items: list[Item] = []
    for i, prompt_ids in enumerate(inputs):
        name = f"inputs[{i}]"
        prompt = token_ids(prompt_ids, name, vocab_size)
        check_int("score_from", score_from, minimum=1, maximum=len(prompt))
        check_fits(engine, None, prompt, params, name, scoring=True)
        items.append((None, prompt, params))
    return items


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Recompute:
    """Re-prefill every in-flight request under the current weights (a tensor-parallel driver's update)."""


# What the loop hands to the engine, in order (a tensor-parallel driver broadcasts these to its ranks).
InboxItem = Request | _Cancel | _Recompute


class Inbox:
    """Requests and cancels on their way from callers to the engine.

    Args:
        cond: the manager's (re-entrant) condition variable.
        outputs: the result router; each queued request gets its handle there.
        max_queue_size: most requests not yet admitted; 0 for no bound.
        num_waiting_in_engine: the requests queued in the engine but not yet admitted.
    """

    def __init__(
        self,
        cond: threading.Condition,
        outputs: OutputRouter,
        max_queue_size: int,
        num_waiting_in_engine: Callable[[], int],
    ) -> None:
        self._cond = cond
        self._outputs = outputs
        self.max_queue_size = max_queue_size
        self._num_waiting_in_engine = num_waiting_in_engine
        self._items: deque[InboxItem] = deque()
        self._num_requests = 0  # requests (not cancels) in the inbox
        self._id_counter = 0

    def num_waiting(self) -> int:
        """Requests not yet admitted: in the inbox or in the engine's waiting queue."""
        return self._num_requests + self._num_waiting_in_engine()

    def put(
        self,
        items: list[Item],
        streaming: bool,
        record_timestamps: bool,
        block: bool,
        timeout: float | None,
        still_open: Callable[[], bool],
        refuse_wait: str | None = None,
        score_from: int | None = None,
        score_temperature: float = 1.0,
        bind: Callable[[Request], None] | None = None,
    ) -> list[str]:
        """Queue checked requests in order and open their result handles.

        Args:
            items: (request id or None for ``req_<n>``, prompt token ids, sampling parameters).
            streaming, record_timestamps: as for ``add_request``.
            score_from, score_temperature: make every request a scoring request (``Request.score_from``); None for
                generation requests.
            block: wait for queue room (request by request) instead of refusing the batch.
            timeout: most seconds to wait with ``block``; None waits for ever.
            still_open: False once the manager stopped; a waiting caller then gives up.
            refuse_wait: when set, a batch that would have to wait for room without a timeout raises
                ``RuntimeError(refuse_wait)`` instead, before anything is queued (the caller holds a pause, so no room
                can come).
            bind: called with each request as it is queued, under the lock (it binds the request's LoRA adapter:
                ``Engine.bind_adapter``); what it raises propagates, and only the requests queued before stay queued
                (none without ``block``: a batch shares its adapter).

        Returns:
            The request ids, in order.

        Raises:
            ValueError: a chosen id is already in use (nothing is queued).
            QueueFullError: without ``block``, the batch does not fit (nothing is queued); with it, no room came within
                ``timeout``.
            RuntimeError: the manager stopped while the caller waited for room, or ``refuse_wait``.
        """
        with self._cond:
            for rid, _, _ in items:
                if rid is not None and rid in self._outputs:
                    raise ValueError(f"request_id {rid!r} is already in use")
            max_q = self.max_queue_size
            if max_q and not block and self.num_waiting() + len(items) > max_q:
                raise QueueFullError(
                    f"{len(items)} request(s) do not fit the queue: {self.num_waiting()} wait "
                    f"(max_queue_size={max_q}); nothing was queued; retry later or pass block=True"
                )
            if max_q and block and timeout is None and refuse_wait and self.num_waiting() + len(items) > max_q:
                raise RuntimeError(refuse_wait)
            deadline = None if timeout is None else time.monotonic() + timeout
            ids = []
            for rid, prompt, params in items:
                while max_q and self.num_waiting() >= max_q:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise QueueFullError(f"queue still full after {timeout} s (max_queue_size={max_q})")
                    self._cond.wait(remaining)
                    if not still_open():
                        raise RuntimeError("the manager stopped while add_request waited for room")
                request = Request(rid or "", prompt, params, record_timestamps, score_from, score_temperature)
                if bind is not None:
                    bind(request)
                rid = rid if rid is not None else self._new_id()
                request.request_id = rid
                self._outputs.open(rid, streaming)
                self._items.append(request)
                self._num_requests += 1
                ids.append(rid)
            self._cond.notify_all()
            return ids

    def _new_id(self) -> str:
        while True:
            rid = f"req_{self._id_counter}"
            self._id_counter += 1
            if rid not in self._outputs:
                return rid

    def queued_lora_ids(self) -> set[int]:
        """The uids of the LoRA adapters the queued requests were accepted under (their slots must stay)."""
        with self._cond:
            return {item.lora_id for item in self._items if isinstance(item, Request) and item.lora_id}

    def cancel(self, request_id: str) -> None:
        """Queue a cancel (ignored for unknown or finished requests)."""
        with self._cond:
            if self._outputs.is_pending(request_id):
                self._items.append(_Cancel(request_id))
                self._cond.notify_all()

    def put_recompute(self) -> None:
        """Queue a re-prefill of every in-flight request, applied in order with the requests and cancels."""
        with self._cond:
            self._items.append(_Recompute())
            self._cond.notify_all()

    def drain(self, engine: Engine) -> None:
        """In the loop, between steps: hand queued requests to the engine and apply cancels, in order."""
        with self._cond:
            self.apply(engine, self.take())

    def take(self) -> list[InboxItem]:
        """Remove and return the queued items in order (requests whose handle is gone are dropped)."""
        with self._cond:
            items: list[InboxItem] = []
            while self._items:
                item = self._items.popleft()
                if isinstance(item, Request):
                    self._num_requests -= 1
                    if item.request_id not in self._outputs:
                        continue
                items.append(item)
            return items

    def apply(self, engine: Engine, items: Sequence[InboxItem]) -> None:
        """Hand ``take``'s items to the engine in order: enqueue requests, end cancelled ones, recompute.

        A tensor-parallel rank other than the driver applies the driver's items: it has no handle for them, so the
        outputs of failed or cancelled requests go nowhere there.
        """
        with self._cond:
            for item in items:
                if isinstance(item, Request):
                    try:
                        engine.enqueue(item)
                    except ValueError as e:  # checked at add time; only a race could land here
                        out = ended_output(item.request_id, item.prompt_ids, RequestStatus.FAILED, str(e))
                        self._outputs.finish(item.request_id, out)
                elif isinstance(item, _Cancel):
                    self._cancel(engine, item.request_id)
                else:
                    engine.recompute_in_flight()
            self._cond.notify_all()

    def _cancel(self, engine: Engine, request_id: str) -> None:
        # A request's add precedes its cancel in this one FIFO, so the engine has the request (or it
        # has already finished, and then its result stands).
        req = engine.finish_request(request_id, RequestStatus.CANCELLED, "cancelled by the caller")
        if req is not None:
            self._outputs.finish(request_id, req.to_output())

    def fail_all(self, message: str) -> None:
        """End every queued request: FAILED with ``message``; drop the cancels."""
        with self._cond:
            while self._items:
                item = self._items.popleft()
                if isinstance(item, Request):
                    self._num_requests -= 1
                    out = ended_output(item.request_id, item.prompt_ids, RequestStatus.FAILED, message)
                    self._outputs.finish(item.request_id, out)
