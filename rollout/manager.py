"""The persistent manager: a background thread that runs engine steps for a trainer's whole run.

Threads that add, cancel or read requests never touch the engine: they put commands in an inbox
(``intake.py``) that the loop drains between steps, and read results from the per-request handles
of an ``OutputRouter`` (``outputs.py``). One condition variable guards the inbox, the handles and
the pause state. A request is checked once, in the caller's thread and outside the lock, before it
is queued: the loop only hands checked ``Request`` objects to the engine.

``pause()`` is the trainer's window on the model: the loop finishes its current step and waits;
the caller may run an optimizer step, ``load_state_dict`` or a training forward/backward on the
same model object; on exit the loop resumes with the KV cache and every in-flight request kept.
``update_weights`` copies new tensors in place under a pause (``weights.py``) and bumps the weight
version, which each generated token records; prefix-cache blocks computed under an older version
are never reused by requests admitted later. By default in-flight requests keep their KV
(PipelineRL's in-flight weight update); ``recompute=True`` re-prefills them under the new weights
(AReaL's).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence

from transformers import GenerationConfig, PreTrainedModel

from .checks import token_ids
from .config import ContinuousBatchingConfig
from .engine import Engine, EngineStats
from .intake import Inbox, QueueFullError
from .models import vocab_size
from .outputs import OutputRouter, ResultCallback
from .requests import GenerationOutput, RequestStatus
from .sampling_params import (
    SamplingParams,
    build_sampling_params,
    check_processors_unchanged,
    resolve_generation_config,
)
from .stop_strings import check_tokenizer
from .weights import NamedTensors, copy_weights, plan_weight_copy

__all__ = ["ContinuousBatchingManager", "QueueFullError", "persistent_manager_of"]

logger = logging.getLogger(__name__)

# How long the idle loop sleeps before rechecking its state (it is woken on every command anyway).
_IDLE_WAIT_SECONDS = 0.05


class _State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"
    DESTROYED = "destroyed"


# The persistent manager of each model (``continuous_batching_context_manager(...,
# persistent_manager=True)``), reused by the next call with that model and by ``generate_batch``.
# The one place that links a model to a manager. A registered manager references its model, so a
# model stays alive until its persistent manager is destroyed (Python has no ephemerons).
_PERSISTENT: weakref.WeakKeyDictionary[PreTrainedModel, ContinuousBatchingManager] = weakref.WeakKeyDictionary()


def persistent_manager_of(model: PreTrainedModel) -> ContinuousBatchingManager | None:
    """The usable persistent manager registered for ``model`` (see ``persist``), if any."""
    manager = _PERSISTENT.get(model)
    if manager is not None and manager.state in ("failed", "destroyed"):
        del _PERSISTENT[model]
        return None
    return manager


class ContinuousBatchingManager:
    """Runs a continuous-batching engine in a background thread.

    Args:
        model: a ``transformers`` decoder-only causal LM, shared with the trainer
            (never copied). Its attention is switched to rollout's paged dispatcher
            while the manager lives; forwards without engine metadata are unchanged.
        generation_config: default sampling values of requests (max_new_tokens,
            do_sample, temperature, top_k, top_p, eos_token_id, the logits processors and
            stop strings of ``SamplingParams``); per-request arguments of ``add_request``
            override them. Unset values come from the model's.
        continuous_batching_config: engine configuration.
        tokenizer: the model's tokenizer, needed by requests with stop strings
            (``stop_strings``, ``stop``) to read the text of their tokens.

    Raises:
        UnsupportedModelError: the model cannot be paged.
        ValueError: a sampling value of the generation config is out of range, it has stop strings
            and there is no tokenizer, or it asks for a logits processor rollout lacks with
            ``drop_unsupported_processors=False``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        tokenizer: object | None = None,
    ) -> None:
        self.model = model
        self.cb_config = continuous_batching_config or ContinuousBatchingConfig()
        self.generation_config = resolve_generation_config(model, generation_config)
        self._vocab_size = vocab_size(model)
        self.default_params = build_sampling_params(
            self.generation_config,
            vocab_size=self._vocab_size,
            drop_unsupported_processors=self.cb_config.drop_unsupported_processors,
        )
        check_tokenizer(self.default_params.stop_strings, self.default_params.stop, tokenizer)
        self.tokenizer = tokenizer
        self._engine: Engine | None = Engine(model, self.cb_config, tokenizer=tokenizer)
        self._cond = threading.Condition()
        self._outputs = OutputRouter(self._cond, producing=self._producing)
        self._inbox = Inbox(self._cond, self._outputs, self.cb_config.max_queue_size, self._num_waiting_in_engine)
        self._state = _State.CREATED
        self._stop_requested = False
        self._hard_stop = False
        self._keep = False
        self._pause_count = 0
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._final_weight_version = 0
        self.final_stats: EngineStats | None = None  # the engine's statistics, set by destroy()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the background loop (again, after ``stop()``).

        Raises:
            RuntimeError: the manager was destroyed or failed.
        """
        with self._cond:
            if self._state == _State.DESTROYED:
                raise RuntimeError("this manager was destroyed and cannot start again; create a new one")
            if self._state == _State.FAILED:
                raise RuntimeError(f"this manager failed and cannot start again: {self._error!r}")
            old_thread = self._thread
        if old_thread is not None and old_thread.is_alive():
            with self._cond:
                stopping = self._stop_requested
            if not stopping:
                return
            old_thread.join()  # a stop(block=False) is still finishing: let it end, then restart
        with self._cond:
            if self._engine is None or self._engine.closed:
                version = self._engine.weight_version if self._engine is not None else 0
                self._engine = Engine(self.model, self.cb_config, tokenizer=self.tokenizer)
                self._engine.set_weight_version(version)
            self._stop_requested = False
            self._hard_stop = False
            self._state = _State.RUNNING
            self._thread = threading.Thread(target=self._loop, name="rollout-manager", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        """True while the background loop runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def state(self) -> str:
        """The manager's state: ``created``, ``running``, ``stopped``, ``failed`` or ``destroyed``."""
        return self._state.value

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.is_running()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop the loop.

        Args:
            block: wait for the loop to end (up to ``timeout`` seconds).
            timeout: seconds to wait when blocking; None waits for ever.
            keep_for_next_session: keep the engine and its KV cache (prefix cache
                included) for the next ``start()``; otherwise the engine is closed and
                the model's original attention restored once the loop has ended.
            hard_stop: end waiting and running requests at once, status FAILED with a
                RuntimeError in ``error`` and their partial tokens kept. Otherwise they
                are finished first.
        """
        with self._cond:
            if self._state == _State.DESTROYED:
                return
            self._stop_requested = True
            self._hard_stop = self._hard_stop or hard_stop
            self._keep = keep_for_next_session
            self._cond.notify_all()
        if block:
            self.join(timeout)

    def destroy(self) -> None:
        """Stop at once (hard stop), free the cache and restore the model's attention. Idempotent.

        The manager cannot start again afterwards, and it is no longer its model's persistent manager.
        """
        if self._state == _State.DESTROYED:
            return
        self.stop(block=True, hard_stop=True)
        with self._cond:
            self._state = _State.DESTROYED
            engine, self._engine = self._engine, None
        if engine is not None:
            self._final_weight_version = engine.weight_version
            self.final_stats = engine.stats
            engine.close()
        if _PERSISTENT.get(self.model) is self:
            del _PERSISTENT[self.model]

    def adopt_tokenizer(self, tokenizer: object) -> None:
        """Take ``tokenizer`` for stop strings if the manager was built without one; else keep its own."""
        with self._cond:
            if self.tokenizer is None:
                self.tokenizer = tokenizer
                if self._engine is not None:
                    self._engine.tokenizer = tokenizer

    def persist(self) -> None:
        """Register as the model's persistent manager until ``destroy()``.

        ``continuous_batching_context_manager(model, ..., persistent_manager=True)`` and
        ``generate_batch(model, ...)`` then run on this manager.
        """
        _PERSISTENT[self.model] = self

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ properties
    @property
    def weight_version(self) -> int:
        """Number of weight updates recorded so far (kept after ``destroy()``)."""
        return self._engine.weight_version if self._engine is not None else self._final_weight_version

    @property
    def engine(self) -> Engine:
        """The engine (for statistics; do not step it while the loop runs)."""
        if self._engine is None:
            raise RuntimeError("this manager was destroyed")
        return self._engine

    # ------------------------------------------------------------------ requests
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
    ) -> str | None:
        """Queue one request.

        Args:
            input_ids: the prompt's token ids (a list, tuple, 1-D tensor or array of ints).
            request_id: unique id; default ``req_<n>``.
            max_new_tokens, eos_token_id, temperature, top_k, top_p, seed, do_sample:
                override the sampling parameters for this request. A temperature alone
                implies ``do_sample = temperature > 0``.
            streaming: keep every intermediate snapshot for ``request_id_iter`` and
                result handlers; otherwise only the final output is delivered.
            record_timestamps: record a timestamp per generated token.
            block: when the queue is full, wait for room (up to ``timeout`` seconds).
            timeout: seconds to wait with ``block``.
            sampling_params: the request's sampling parameters (the overrides above apply on
                top); default: the manager's, from its generation config. The way to give a
                request its own logits processors or stop strings (``build_sampling_params(
                manager.default_params, stop=["</answer>"])``).

        Returns:
            The request id, or None (with a warning) after ``stop()``.

        Raises:
            ValueError: a bad prompt or sampling value, a duplicate ``request_id``, stop strings
                without a tokenizer, or a logits-processor value other than the generation
                config's under ``per_request_processors=False``; raised before anything is queued.
            QueueFullError: ``max_queue_size`` requests wait (and ``block`` is False or
                the wait timed out).
            RuntimeError: the manager failed (the message names the cause) or was destroyed.
        """
        params = build_sampling_params(
            sampling_params or self.default_params,
            vocab_size=self._vocab_size,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
        )
        if not self.cb_config.per_request_processors:
            check_processors_unchanged(params, self.default_params)
        prompt = token_ids(input_ids, "input_ids", self._vocab_size)
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str or None, got {request_id!r}")
        self._check_fits(request_id, prompt, params, "input_ids")
        return self._enqueue([(request_id, prompt, params)], streaming, record_timestamps, block, timeout)[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
        *,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | Sequence[int | None] | None = None,
        do_sample: bool | None = None,
        block: bool = False,
        timeout: float | None = None,
        request_id: None = None,
    ) -> list[str]:
        """Queue several requests; returns their ids in input order.

        Every prompt is checked before any is queued. Requests are queued sorted by prompt, so
        prompts that share a prefix are admitted next to each other and find each other's blocks
        in the prefix cache. Without ``block`` the batch is queued whole or not at all.

        Args:
            inputs: prompts, lists of token ids.
            sampling_params: as for ``add_request``; one ``SamplingParams`` for the whole batch.
            seed: one seed for all, or a sequence with one seed per input (G samples of one
                prompt need G seeds).
            max_new_tokens, streaming, record_timestamps, eos_token_id, temperature, top_k, top_p,
                do_sample, block, timeout: as for ``add_request``.
            request_id: not accepted (ids are chosen by the manager); use ``add_request``.

        Raises:
            ValueError: a bad prompt (its index is named), a bad sampling value, a seed list
                of the wrong length, stop strings without a tokenizer, or a logits-processor value
                other than the generation config's under ``per_request_processors=False``; nothing
                is queued.
            QueueFullError: the batch does not fit the queue and ``block`` is False; nothing is queued.
        """
        if request_id is not None:
            raise ValueError("add_requests takes no request_id; use add_request for chosen ids")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(inputs)
        if len(seeds) != len(inputs):
            raise ValueError(f"seed holds {len(seeds)} seeds for {len(inputs)} inputs")
        params = build_sampling_params(
            sampling_params or self.default_params,
            vocab_size=self._vocab_size,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
        )
        if not self.cb_config.per_request_processors:
            check_processors_unchanged(params, self.default_params)
        items: list[tuple[str | None, list[int], SamplingParams]] = []
        for i, (prompt_ids, seed_i) in enumerate(zip(inputs, seeds)):
            name = f"inputs[{i}]"
            prompt = token_ids(prompt_ids, name, self._vocab_size)
            params_i = params if seed_i is None else build_sampling_params(params, seed=seed_i)
            self._check_fits(None, prompt, params_i, name)
            items.append((None, prompt, params_i))
        order = sorted(range(len(items)), key=lambda i: items[i][1])
        queued = self._enqueue([items[i] for i in order], streaming, record_timestamps, block, timeout)
        ids: list[str | None] = [None] * len(items)
        for i, rid in zip(order, queued):
            ids[i] = rid
        return ids  # type: ignore[return-value]

    def _check_fits(self, request_id: str | None, prompt: list[int], params: SamplingParams, name: str) -> None:
        """Raise ValueError (naming the argument) when the request can never fit the engine's cache."""
        with self._cond:
            engine = self._engine
        if engine is None:
            raise RuntimeError("the manager was destroyed and accepts no request")
        try:
            engine.check_request(request_id, len(prompt), params)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    def _enqueue(
        self,
        items: list[tuple[str | None, list[int], SamplingParams]],
        streaming: bool,
        record_timestamps: bool,
        block: bool,
        timeout: float | None,
    ) -> list[str | None]:
        with self._cond:
            if self._state == _State.FAILED:
                raise RuntimeError(f"the manager failed and accepts no request: {self._error!r}") from self._error
            if self._state == _State.DESTROYED:
                raise RuntimeError("the manager was destroyed and accepts no request")
            if self._stop_requested or self._state == _State.STOPPED:
                logger.warning("add_request after stop(): request not added")
                return [None] * len(items)
            ids = self._inbox.put(items, streaming, record_timestamps, block, timeout, self._accepting)
            return list(ids)

    def _accepting(self) -> bool:
        return self._state not in (_State.FAILED, _State.DESTROYED) and not self._stop_requested

    def _num_waiting(self) -> int:
        """Requests not yet admitted: in the inbox or in the scheduler's waiting queue."""
        return self._inbox.num_waiting()

    def _num_waiting_in_engine(self) -> int:
        return len(self._engine.scheduler.waiting) if self._engine is not None else 0

    def cancel_request(self, request_id: str) -> None:
        """End a request: status CANCELLED with its partial tokens; its blocks are freed.

        Unknown or already finished ids are ignored.
        """
        self._inbox.cancel(request_id)

    # ------------------------------------------------------------------ results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished result, or the result of ``request_id``.

        None after ``timeout`` seconds or when nothing is left to wait for. Each result is delivered
        once (see ``OutputRouter.get_result``).

        Raises:
            KeyError: ``request_id`` is unknown or its result was already delivered.
        """
        return self._outputs.get_result(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield results as they finish, until none is pending and the loop idles or ends."""
        while True:
            result = self.get_result(timeout=None)
            if result is None:
                return
            yield result

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Stream a request's snapshots; the last one has a final status.

        Snapshots never change once yielded. Without ``streaming`` only the final output comes
        (see ``OutputRouter.stream``).

        Raises:
            KeyError: unknown request id, or its result was already delivered.
            TimeoutError: no chunk came within ``timeout`` seconds.
        """
        return self._outputs.stream(request_id, timeout)

    def register_result_handler(self, request_id: str, callback: ResultCallback) -> None:
        """Call ``callback(output)`` for each chunk (streaming) or once with the final output.

        It runs in the caller's running asyncio loop if there is one, else in the manager's thread
        (see ``OutputRouter.register_handler``).

        Raises:
            KeyError: unknown request id, or its result was already delivered.
        """
        self._outputs.register_handler(request_id, callback)

    def _producing(self) -> bool:
        # Results may still come while the loop runs, and before the first start() (queued
        # requests will run then).
        return self.is_running() or self._state == _State.CREATED

    # ------------------------------------------------------------------ pause and weights
    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the model: the loop finishes its current step and waits until every holder leaves.

        Re-entrant, and several threads may hold it at once. Returns within one
        engine step. The KV cache and in-flight requests are kept.
        """
        with self._cond:
            self._pause_count += 1
            self._cond.notify_all()
            while self._in_step:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._pause_count -= 1
                self._cond.notify_all()

    def update_weights(self, named_tensors: NamedTensors | None = None, *, recompute: bool = False) -> int:
        """Copy new weights into the model in place and bump the weight version.

        Args:
            named_tensors: a state dict or (name, tensor) pairs, names as in
                ``model.named_parameters()`` (buffers too). None only records that the
                caller changed the weights itself under ``pause()``.
            recompute: re-prefill in-flight requests under the new weights instead of
                keeping their KV.

        Returns:
            The new weight version.

        Raises:
            KeyError: an unknown name; ValueError: a shape or dtype mismatch; TypeError: a value
                that is not a tensor. All are raised before anything is copied.
            RuntimeError: the manager was destroyed.
        """
        if self._state == _State.DESTROYED:
            raise RuntimeError("this manager was destroyed; update the model directly or build a new manager")
        plan = plan_weight_copy(self.model, named_tensors)
        with self.pause():
            copy_weights(plan)
            engine = self.engine
            version = engine.bump_weight_version()
            if recompute:
                engine.recompute_in_flight()
        return version

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        engine = self._engine
        assert engine is not None
        try:
            while True:
                with self._cond:
                    self._inbox.drain(engine)
                    while self._pause_count > 0 and not self._hard_stop:
                        self._cond.wait()
                        self._inbox.drain(engine)
                    if self._hard_stop:
                        self._fail_all(engine, RuntimeError("the manager was stopped with hard_stop=True"))
                        return
                    if not engine.has_unfinished():
                        if self._stop_requested:
                            return
                        self._cond.wait(_IDLE_WAIT_SECONDS)
                        continue
                    self._in_step = True
                try:
                    updated = engine.step()
                finally:
                    with self._cond:
                        self._in_step = False
                        self._cond.notify_all()
                self._outputs.publish(updated)
        except BaseException as e:  # every failure must reach the readers
            logger.exception("rollout manager loop failed")
            with self._cond:
                self._error = e
                self._state = _State.FAILED
                self._fail_all(engine, e)
        finally:
            with self._cond:
                self._in_step = False
                if self._state == _State.RUNNING:
                    self._state = _State.STOPPED
                close = self._stop_requested and not self._keep
                self._cond.notify_all()
            if close:
                engine.close()

    def _fail_all(self, engine: Engine, error: BaseException) -> None:
        """End every request, in the engine, in the inbox or only in a handle: FAILED with ``error``."""
        message = f"{type(error).__name__}: {error}"
        for rid in list(engine.requests):
            req = engine.finish_request(rid, RequestStatus.FAILED, message)
            if req is not None:
                self._outputs.finish(rid, req.to_output())
        self._inbox.fail_all(message)
        self._outputs.fail_pending(message)
