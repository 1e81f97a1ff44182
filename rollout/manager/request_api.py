"""The manager's request API (``RequestAPI``): queue requests, cancel them, read results.

``ContinuousBatchingManager`` is a ``RequestAPI``: it subclasses this class, whose methods are the manager's request
methods as users call them (``manager.add_request(...)``), and gives it the parts it works on. A request is checked
once, in the caller's thread and outside the lock, before it is queued (``intake.py``'s checks, then its ``Inbox``),
where the manager's loop takes it; results come from the per-request handles of the ``OutputRouter`` (``outputs.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from rollout.checks import check_number
from rollout.engine import Engine, TensorParallel
from rollout.manager.intake import (
    Inbox,
    Item,
    checked_batch,
    checked_request,
    checked_scoring_batch,
    derive_seeds,
    request_params,
)
from rollout.manager.lifecycle import Lifecycle
from rollout.manager.outputs import OutputRouter, ResultCallback
from rollout.manager.pausing import PauseGate
from rollout.requests import GenerationOutput
from rollout.sampling_params import SamplingParams
from rollout.structured_outputs import StructuredOutputs

__all__ = ["RequestAPI"]


class RequestAPI:
    """``add_request``, ``add_requests``, ``add_scoring_requests``, ``cancel_request`` and the ways to read results.

    The request side of a ``ContinuousBatchingManager`` (its base class); it keeps the parts it is given under the
    names the manager uses too.

    Args:
        default_params: the sampling parameters a request starts from (``default_params``).
        per_request_processors: ``ContinuousBatchingConfig.per_request_processors`` (False: a request's logits-processor
            values must be the defaults').
        vocab_size: the model's vocabulary size (prompt and end-of-sequence ids lie below it).
        engine: the engine requests are checked against and bound to; the manager replaces it when it builds a new one
            (``start()``) and sets it to None when destroyed. Read under ``cond``.
        cond: the manager's condition variable (it guards the engine, the inbox, the handles and the lifecycle).
        inbox: where checked requests and cancels wait for the loop.
        outputs: the per-request result handles.
        life: the manager's lifecycle (whether it admits requests, and still accepts them while a caller waits).
        pausing: the manager's pause gate (a wait inside the caller's own pause is refused).
        tp: the engine's tensor parallelism, or None.
        sync_weight_version: notices weights changed by hand (``WeightUpdates.sync``), called before requests are
            queued on a model without tensor parallelism (a tensor-parallel loop notices them itself, without a pause).
    """

    def __init__(
        self,
        default_params: SamplingParams,
        per_request_processors: bool,
        vocab_size: int,
        engine: Engine,
        cond: threading.Condition,
        inbox: Inbox,
        outputs: OutputRouter,
        life: Lifecycle,
        pausing: PauseGate,
        tp: TensorParallel | None,
        sync_weight_version: Callable[[], None],
    ) -> None:
        self._default_params = default_params
        self._per_request_processors = per_request_processors
        self._vocab_size = vocab_size
        self._engine: Engine | None = engine
        self._cond = cond
        self._inbox = inbox
        self._outputs = outputs
        self._life = life
        self._pausing = pausing
        self._tp = tp
        self._sync_weight_version = sync_weight_version

    @property
    def default_params(self) -> SamplingParams:
        """The sampling parameters a request starts from (from the generation config; ``add_request``'s arguments and
        ``sampling_params`` override them)."""
        return self._default_params

    @default_params.setter
    def default_params(self, params: SamplingParams) -> None:
        self._default_params = params

    def add_request(
        self,
        input_ids: Sequence[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        do_sample: bool | None = None,
        block: bool = False,
        timeout: float | None = None,
        *,
        sampling_params: SamplingParams | None = None,
        lora: str | None = None,
        structured_outputs: StructuredOutputs | dict | None = None,
    ) -> str | None:
        """Queue one request.

        Args:
            input_ids: the prompt's token ids (a list, tuple, 1-D tensor or array of ints).
            request_id: unique id; default ``req_<n>``.
            max_new_tokens, eos_token_id, temperature, top_k, top_p, seed, do_sample: override the sampling parameters
                for this request. A temperature alone implies ``do_sample = temperature > 0``.
            streaming: keep every intermediate snapshot for ``request_id_iter`` and result handlers; otherwise only the
                final output is delivered.
            record_timestamps: record a timestamp per generated token.
            block: when the queue is full, wait for room (up to ``timeout`` seconds).
            timeout: seconds to wait with ``block``.
            sampling_params: the request's sampling parameters (the overrides above apply on top); default: the
                manager's, from its generation config. The way to give a request its own logits processors or stop
                strings (``build_sampling_params( manager.default_params, stop=["</answer>"])``).
            lora: the loaded LoRA adapter the request runs under (``load_lora``); None keeps ``sampling_params.lora``
                (default: the base model).
            structured_outputs: what the output must match (``StructuredOutputs``, or a dict of its fields such as
                ``{"regex": "[0-9]+"}``); None keeps ``sampling_params.structured_outputs``. Needs the manager's
                tokenizer; the grammar is compiled here, in the caller's thread, once per distinct spec.

        Returns:
            The request id, or None (with a warning) after ``stop()``. On a tensor-parallel rank other than the
            driver, None: the request is checked but not queued (the driver's is run by every rank), as in transformers.

        Raises:
            ValueError: a bad prompt or sampling value, a duplicate ``request_id``, stop strings or structured outputs
                without a tokenizer, a bad ``structured_outputs`` (FieldError naming ``structured_outputs.<kind>``), or
                a logits-processor value other than the generation config's under ``per_request_processors=False``;
                raised before anything is queued.
            QueueFullError: ``max_queue_size`` requests wait (and ``block`` is False or the wait timed out).
            RuntimeError: the manager failed (the message names the cause) or was destroyed, or ``block`` would wait for
                room without a timeout inside this thread's ``pause()``.
        """
        params = self._params(
            sampling_params,
            max_new_tokens,
            do_sample,
            temperature,
            top_k,
            top_p,
            eos_token_id,
            lora,
            seed,
            structured_outputs,
        )
        item = checked_request(self._current_engine(), input_ids, request_id, params, self._vocab_size)
        return self._enqueue([item], streaming, record_timestamps, block, timeout)[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        *,
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | Sequence[int | None] | None = None,
        do_sample: bool | None = None,
        block: bool = False,
        timeout: float | None = None,
        request_id: None = None,
        lora: str | None = None,
        structured_outputs: StructuredOutputs | dict | None = None,
    ) -> list[str]:
        """Queue several requests; returns their ids in input order.

        Every prompt is checked before any is queued. Requests are queued sorted by prompt, so prompts that share a
        prefix are admitted next to each other and find each other's blocks in the prefix cache. Without ``block`` the
        batch is queued whole or not at all.

        The positional order is transformers' (``inputs, max_new_tokens, streaming, record_timestamps``); the rest is
        keyword-only. On a tensor-parallel rank other than the driver the prompts are checked, nothing is queued and
        every id is None.

        Args:
            inputs: prompts, lists of token ids.
            sampling_params: as for ``add_request``; one ``SamplingParams`` for the whole batch.
            seed: an int s seeds input k (in input order) with s + k, the rule of ``generate_batch``, so the G copies of
                one prompt get G distinct, reproducible samples; a sequence gives one seed per input (None entries:
                unseeded). Without it, a seed in ``sampling_params`` is spread the same way.
            max_new_tokens, streaming, record_timestamps, eos_token_id, temperature, top_k, top_p, do_sample, block,
                timeout, lora, structured_outputs: as for ``add_request`` (one constraint for every input; each
                request gets its own matcher).
            request_id: not accepted (ids are chosen by the manager); use ``add_request``.

        Raises:
            ValueError: as for ``add_request`` (a bad prompt's index is named), or a seed list of the wrong length;
                nothing is queued.
            QueueFullError: the batch does not fit the queue and ``block`` is False; nothing is queued.
        """
        if request_id is not None:
            raise ValueError("add_requests takes no request_id; use add_request for chosen ids")
        if seed is None and sampling_params is not None:
            seed = sampling_params.seed
        seeds = derive_seeds(seed, len(inputs))
        params = self._params(
            sampling_params,
            max_new_tokens,
            do_sample,
            temperature,
            top_k,
            top_p,
            eos_token_id,
            lora,
            None,
            structured_outputs,
        )
        items, order = checked_batch(self._current_engine(), inputs, params, seeds, self._vocab_size)
        queued = self._enqueue(items, streaming, record_timestamps, block, timeout)
        ids: list[str | None] = [None] * len(items)
        for i, rid in zip(order, queued):
            ids[i] = rid
        return ids  # type: ignore[return-value]

    def add_scoring_requests(
        self, inputs: Sequence[Sequence[int]], score_from: int = 1, temperature: float = 1.0, lora: str | None = None
    ) -> list[str]:
        """Queue prefill-only scoring requests: each computes its prompt's tokens and records their logprobs.

        They are scheduled by the running loop beside the generation requests (the scheduler's scoring requests, as
        ``rollout.score`` runs them on an engine of its own): no pause, no second KV cache. Each finishes with
        ``finish_reason`` "scored" and ``GenerationOutput.prompt_logprobs`` float [len(prompt) - score_from]: the
        logprob of each token from ``score_from`` on, ``log_softmax(logits / temperature)`` in nats; nothing is
        sampled and no weight version is recorded. Read them as any result (``get_result``, a result handler).

        Args:
            inputs: prompts, lists of token ids.
            score_from: the first token scored (>= 1: the first token has no context).
            temperature: logits are divided by this before the log-softmax (> 0).
            lora: score under this loaded LoRA adapter (None: the base model).

        Returns:
            The request ids, in input order (None entries on a tensor-parallel rank other than the driver).

        Raises:
            ValueError: a bad prompt, one longer than the model's context or the cache (its index is named), or
                ``score_from`` / ``temperature`` out of range; nothing is queued.
            QueueFullError: the batch does not fit ``max_queue_size``; nothing is queued.
        """
        check_number("temperature", temperature, minimum=0, min_open=True)
        items = checked_scoring_batch(self._current_engine(), inputs, score_from, self._vocab_size, lora)
        ids = self._enqueue(items, False, False, False, None, score=(score_from, float(temperature)))
        return ids  # type: ignore[return-value]

    def _params(
        self,
        sampling_params: SamplingParams | None,
        max_new_tokens: int | None,
        do_sample: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        eos_token_id: int | Sequence[int] | None,
        lora: str | None,
        seed: int | None = None,
        structured_outputs: StructuredOutputs | dict | None = None,
    ) -> SamplingParams:
        """A request's parameters: the defaults, ``sampling_params`` and the per-request arguments of ``add_request``
        (``intake.request_params``, with the manager's vocabulary and processor rule); None keeps a value.

        Raises:
            ValueError: as ``intake.request_params``.
        """
        return request_params(
            self.default_params,
            sampling_params,
            vocab_size=self._vocab_size,
            per_request_processors=self._per_request_processors,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            lora=lora,
            structured_outputs=structured_outputs,
        )

    def _current_engine(self) -> Engine | None:
        """The engine, read under the lock; None once the manager was destroyed."""
        with self._cond:
            return self._engine

    def _enqueue(
        self,
        items: list[Item],
        streaming: bool,
        record_timestamps: bool,
        block: bool,
        timeout: float | None,
        score: tuple[int, float] | None = None,
    ) -> list[str | None]:
        """Queue checked items (``Inbox.put``), bound to their adapters; None for each where nothing is queued (after
        ``stop()``, or on a tensor-parallel rank other than the driver).

        Raises:
            ValueError, QueueFullError, RuntimeError: as ``Inbox.put`` (``refuse_wait``: ``block`` inside this thread's
                ``pause()``); as ``Engine.bind_adapter`` (no adapter of that name is loaded).
        """
        if self._tp is None:  # a tensor-parallel loop notices hand-made changes itself, without a pause
            self._sync_weight_version()
        refuse = self._pausing.refusal("add_request(block=True)")
        with self._cond:
            if not self._life.admits_requests() or (self._tp is not None and not self._tp.is_driver):
                return [None] * len(items)
            score_from, score_temperature = score if score is not None else (None, 1.0)
            engine = self._engine
            ids = self._inbox.put(
                items,
                streaming,
                record_timestamps,
                block,
                timeout,
                self._life.accepting,
                refuse_wait=refuse,
                score_from=score_from,
                score_temperature=score_temperature,
                # The adapter is resolved now, under the lock that load_lora and unload_lora hold: the request runs
                # under the tensors loaded when it was accepted, until it ends.
                bind=engine.bind_adapter if engine is not None else None,
            )
            return list(ids)

    def cancel_request(self, request_id: str) -> None:
        """End a request: status CANCELLED with its partial tokens; its blocks are freed.

        Unknown or already finished ids are ignored.
        """
        self._inbox.cancel(request_id)

    # ------------------------------------------------------------------ results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished result, or the result of ``request_id``.

        None after ``timeout`` seconds or when nothing is left to wait for. Each result is delivered once (see
        ``OutputRouter.get_result``).

        Raises:
            KeyError: ``request_id`` is unknown or its result was already delivered.
            RuntimeError: it would wait without a timeout inside this thread's ``pause()``.
        """
        return self._outputs.get_result(request_id, timeout, refuse_wait=self._pausing.refusal("get_result()"))

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield results as they finish, until none is pending and the loop idles or ends."""
        while True:
            result = self.get_result(timeout=None)
            if result is None:
                return
            yield result

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Stream a request's snapshots; the last one has a final status.

        Snapshots never change once yielded. Without ``streaming`` only the final output comes (see
        ``OutputRouter.stream``).

        Raises:
            KeyError: unknown request id, or its result was already delivered.
            TimeoutError: no chunk came within ``timeout`` seconds.
            RuntimeError: it would wait without a timeout inside this thread's ``pause()``.
        """
        return self._outputs.stream(request_id, timeout, refuse_wait=lambda: self._pausing.refusal("request_id_iter()"))

    def register_result_handler(self, request_id: str, callback: ResultCallback) -> None:
        """Call ``callback(output)`` for each chunk (streaming) or once with the final output.

        It runs in the caller's running asyncio loop if there is one, else in the manager's thread (see
        ``OutputRouter.register_handler``).

        Raises:
            KeyError: unknown request id, or its result was already delivered.
        """
        self._outputs.register_handler(request_id, callback)
