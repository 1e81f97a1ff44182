"""The persistent manager: a background thread that runs engine steps for a trainer's whole run.

Threads that add, cancel or read requests never touch the engine: they put
commands in an inbox that the loop drains between steps (vLLM's engine-core input
queue), and read results from per-request handles. One condition variable guards
the inbox, the handles and the pause state.

``pause()`` is the trainer's window on the model: the loop finishes its current
step and waits; the caller may run an optimizer step, ``load_state_dict`` or a
training forward/backward on the same model object; on exit the loop resumes with
the KV cache and every in-flight request kept. ``update_weights`` copies new
tensors in place under a pause and bumps the weight version, which each generated
token records; prefix-cache blocks computed under an older version are never
reused by requests admitted later. By default in-flight requests keep their KV
(PipelineRL's in-flight weight update); ``recompute=True`` re-prefills them under
the new weights (AReaL's).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .config import ContinuousBatchingConfig
from .checks import token_ids
from .engine import Engine, EngineStats
from .models import vocab_size
from .requests import GenerationOutput, Request, RequestStatus
from .sampling_params import SamplingParams, build_sampling_params, resolve_generation_config

logger = logging.getLogger(__name__)

ResultCallback = Callable[[GenerationOutput], Any]


class QueueFullError(RuntimeError):
    """``add_request`` found ``max_queue_size`` requests waiting."""


class _State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"
    DESTROYED = "destroyed"


@dataclass
class _Handle:
    """Reader-side state of one request."""

    request_id: str
    streaming: bool
    final: GenerationOutput | None = None
    delivered: bool = False
    stream: SimpleQueue = field(default_factory=SimpleQueue)
    callback: tuple[ResultCallback, asyncio.AbstractEventLoop | None] | None = None


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    record_timestamps: bool


@dataclass
class _Cancel:
    request_id: str


class ContinuousBatchingManager:
    """Runs a continuous-batching engine in a background thread.

    Args:
        model: a ``transformers`` decoder-only causal LM, shared with the trainer
            (never copied). Its attention is switched to rollout's paged dispatcher
            while the manager lives; forwards without engine metadata are unchanged.
        generation_config: default sampling values of requests (max_new_tokens,
            do_sample, temperature, top_k, top_p, eos_token_id); per-request arguments
            of ``add_request`` override them. Unset values come from the model's.
        continuous_batching_config: engine configuration.

    Raises:
        UnsupportedModelError: the model cannot be paged.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.cb_config = continuous_batching_config or ContinuousBatchingConfig()
        self.generation_config = resolve_generation_config(model, generation_config)
        self._vocab_size = vocab_size(model)
        self.default_params = build_sampling_params(self.generation_config, vocab_size=self._vocab_size)
        self._engine: Engine | None = Engine(model, self.cb_config)
        self._cond = threading.Condition()
        self._inbox: deque[_Add | _Cancel] = deque()
        self._handles: dict[str, _Handle] = {}
        self._finished_order: deque[str] = deque()
        self._num_queued = 0  # adds in the inbox or waiting in the engine
        self._state = _State.CREATED
        self._stop_requested = False
        self._hard_stop = False
        self._keep = False
        self._pause_count = 0
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._id_counter = 0
        self._final_weight_version = 0
        self.final_stats: EngineStats | None = None  # the engine's statistics, set by destroy()
        self.step_hook: Callable[[], None] | None = None  # test hook: called before each step

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
                self._engine = Engine(self.model, self.cb_config)
                self._engine.set_weight_version(version)
            self._stop_requested = False
            self._hard_stop = False
            self._state = _State.RUNNING
            self._thread = threading.Thread(target=self._loop, name="rollout-manager", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        """True while the background loop runs."""
        return self._thread is not None and self._thread.is_alive()

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
            if self._state in (_State.DESTROYED,):
                return
            self._stop_requested = True
            self._hard_stop = self._hard_stop or hard_stop
            self._keep = keep_for_next_session
            self._cond.notify_all()
        if block:
            self.join(timeout)

    def destroy(self) -> None:
        """Stop at once (hard stop), free the cache and restore the model's attention. Idempotent.

        The manager cannot start again afterwards.
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
        if getattr(self.model, "_rollout_manager", None) is self:
            del self.model._rollout_manager

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
    def _new_id(self) -> str:
        while True:
            rid = f"req_{self._id_counter}"
            self._id_counter += 1
            if rid not in self._handles:
                return rid

    def _make_params(self, **overrides: Any) -> SamplingParams:
        return build_sampling_params(self.default_params, vocab_size=self._vocab_size, **overrides)

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
    ) -> str | None:
        """Queue one request.

        Args:
            input_ids: the prompt's token ids.
            request_id: unique id; default ``req_<n>``.
            max_new_tokens, eos_token_id, temperature, top_k, top_p, seed, do_sample:
                override the manager's defaults for this request. A temperature alone
                implies ``do_sample = temperature > 0``.
            streaming: keep every intermediate snapshot for ``request_id_iter`` and
                result handlers; otherwise only the final output is delivered.
            record_timestamps: record a timestamp per generated token.
            block: when the queue is full, wait for room (up to ``timeout`` seconds).
            timeout: seconds to wait with ``block``.

        Returns:
            The request id, or None (with a warning) after ``stop()``.

        Raises:
            ValueError: a bad prompt or sampling value, or a duplicate ``request_id``;
                raised before anything is queued.
            QueueFullError: ``max_queue_size`` requests wait (and ``block`` is False or
                the wait timed out).
            RuntimeError: the manager failed (the message names the cause) or was destroyed.
        """
        params = self._make_params(
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            do_sample=do_sample,
        )
        prompt = token_ids(input_ids, "input_ids", self._vocab_size)
        with self._cond:
            if self._state == _State.FAILED:
                raise RuntimeError(f"the manager failed and accepts no request: {self._error!r}") from self._error
            if self._state == _State.DESTROYED:
                raise RuntimeError("the manager was destroyed and accepts no request")
            if self._stop_requested or self._state == _State.STOPPED:
                logger.warning("add_request after stop(): request not added")
                return None
            if request_id is not None and not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str or None, got {request_id!r}")
            if request_id is not None and request_id in self._handles:
                raise ValueError(f"request_id {request_id!r} is already in use")
            assert self._engine is not None
            self._engine.check_request(request_id, len(prompt), params)
            max_q = self.cb_config.max_queue_size
            if max_q and self._num_waiting() >= max_q:
                if not block:
                    raise QueueFullError(
                        f"{self._num_waiting()} requests are waiting (max_queue_size={max_q}); retry later or pass block=True"
                    )
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._num_waiting() >= max_q:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise QueueFullError(f"queue still full after {timeout} s (max_queue_size={max_q})")
                    self._cond.wait(remaining)
                    if self._state in (_State.FAILED, _State.DESTROYED) or self._stop_requested:
                        raise RuntimeError("the manager stopped while add_request waited for room")
            rid = request_id if request_id is not None else self._new_id()
            self._handles[rid] = _Handle(rid, streaming)
            self._inbox.append(_Add(rid, prompt, params, record_timestamps))
            self._num_queued += 1
            self._cond.notify_all()
            return rid

    def _num_waiting(self) -> int:
        # Requests not yet admitted: in the inbox or in the scheduler's waiting queue.
        waiting = len(self._engine.scheduler.waiting) if self._engine is not None else 0
        return self._num_queued + waiting

    def add_requests(self, inputs: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        """Queue several requests; returns their ids in input order.

        Requests are queued sorted by prompt, so prompts that share a prefix are admitted
        next to each other and find each other's blocks in the prefix cache. Every
        prompt is validated before any is queued.

        Args:
            inputs: prompts, lists of token ids.
            **kwargs: as for ``add_request`` (no ``request_id``). ``seed`` may also be a
                sequence with one seed per input (G samples of one prompt need G seeds).

        Raises:
            ValueError: a bad prompt (its index is named), or a seed list of the wrong
                length; nothing is queued.
        """
        if kwargs.get("request_id") is not None:
            raise ValueError("add_requests takes no request_id; use add_request for chosen ids")
        assert self._engine is not None
        seeds = kwargs.pop("seed", None)
        if isinstance(seeds, (list, tuple)):
            if len(seeds) != len(inputs):
                raise ValueError(f"seed holds {len(seeds)} seeds for {len(inputs)} inputs")
        else:
            seeds = [seeds] * len(inputs)
        params = self._make_params(
            **{k: kwargs.get(k) for k in ("max_new_tokens", "eos_token_id", "temperature", "top_k", "top_p", "do_sample")}
        )
        inputs = [token_ids(p, f"inputs[{i}]", self._vocab_size) for i, p in enumerate(inputs)]
        for i, prompt in enumerate(inputs):
            try:
                self._engine.check_request(None, len(prompt), params)
            except ValueError as e:
                raise ValueError(f"inputs[{i}]: {e}") from e
            if seeds[i] is not None:
                build_sampling_params(params, seed=seeds[i])
        max_q = self.cb_config.max_queue_size
        if max_q and not kwargs.get("block") and self._num_waiting() + len(inputs) > max_q:
            raise QueueFullError(
                f"{len(inputs)} requests do not fit the queue: {self._num_waiting()} wait (max_queue_size={max_q}); "
                "nothing was queued; pass block=True to wait for room"
            )
        order = sorted(range(len(inputs)), key=lambda i: tuple(inputs[i]))
        ids: list[str | None] = [None] * len(inputs)
        for i in order:
            ids[i] = self.add_request(inputs[i], seed=seeds[i], **kwargs)
        return ids  # type: ignore[return-value]

    def cancel_request(self, request_id: str) -> None:
        """End a request: status CANCELLED with its partial tokens; its blocks are freed.

        Unknown or already finished ids are ignored.
        """
        with self._cond:
            if request_id in self._handles and self._handles[request_id].final is None:
                self._inbox.append(_Cancel(request_id))
                self._cond.notify_all()

    # ------------------------------------------------------------------ results
    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next finished result, or the result of ``request_id``.

        Each result is delivered once: by this method, ``request_id_iter``, iteration or
        a result handler.

        Args:
            request_id: wait for this request; None takes the next finished one.
            timeout: seconds to wait; None waits until a result comes or the loop ends.

        Returns:
            The final output, or None after the timeout, or when nothing is left to wait
            for (the loop ended, or no request is pending).

        Raises:
            KeyError: ``request_id`` is unknown or its result was already delivered.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if request_id is not None:
                    handle = self._handles.get(request_id)
                    if handle is None:
                        raise KeyError(f"request_id {request_id!r} is unknown or its result was already delivered")
                    if handle.final is not None:
                        return self._deliver(handle)
                else:
                    while self._finished_order:
                        handle = self._handles.get(self._finished_order.popleft())
                        if handle is not None and handle.final is not None:
                            return self._deliver(handle)
                    if not any(h.final is None for h in self._handles.values()) and not self._inbox:
                        return None
                if not self.is_running() and not self._inbox_would_run():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining if remaining is not None else 1.0)

    def _inbox_would_run(self) -> bool:
        # Before the first start() queued requests will still run.
        return self._state == _State.CREATED

    def _deliver(self, handle: _Handle) -> GenerationOutput:
        handle.delivered = True
        del self._handles[handle.request_id]
        assert handle.final is not None
        return handle.final

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield results as they finish, until none is pending and the loop idles or ends."""
        while True:
            result = self.get_result(timeout=None)
            if result is None:
                return
            yield result

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Stream a request's snapshots; the last one has a final status.

        Each snapshot is a copy that never changes later. A request added without
        ``streaming`` yields its final output only. The iterator also ends if the loop
        ends (its final chunk then says FAILED).

        Raises:
            KeyError: unknown request id, or its result was already delivered.
            TimeoutError: no chunk came within ``timeout`` seconds.
        """
        with self._cond:
            handle = self._handles.get(request_id)
            if handle is None:
                raise KeyError(f"request_id {request_id!r} is unknown or its result was already delivered")
        while True:
            try:
                chunk: GenerationOutput = handle.stream.get(timeout=timeout if timeout is not None else 1.0)
            except Empty:
                if timeout is not None:
                    raise TimeoutError(f"no output of {request_id!r} within {timeout} s") from None
                with self._cond:
                    if handle.final is not None and handle.stream.empty():
                        chunk = handle.final
                    elif handle.final is None and not self.is_running() and self._state != _State.CREATED:
                        return  # the loop ended without this request (never started again)
                    else:
                        continue
            if chunk.status.is_final:
                with self._cond:
                    if not handle.delivered and request_id in self._handles:
                        self._deliver(handle)
                yield chunk
                return
            yield chunk

    def register_result_handler(self, request_id: str, callback: ResultCallback) -> None:
        """Call ``callback(output)`` for each chunk (streaming) or once with the final output.

        When called from a running asyncio loop, the callback runs in that loop through
        ``call_soon_threadsafe``; otherwise it runs in the manager's thread. The handler
        is dropped after the final output.

        Raises:
            KeyError: unknown request id, or its result was already delivered.
        """
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._cond:
            handle = self._handles.get(request_id)
            if handle is None:
                raise KeyError(f"request_id {request_id!r} is unknown or its result was already delivered")
            handle.callback = (callback, loop)
            if handle.final is not None:
                self._call_handler(handle, handle.final)
                self._deliver(handle)

    @staticmethod
    def _call_handler(handle: _Handle, output: GenerationOutput) -> None:
        assert handle.callback is not None
        fn, loop = handle.callback
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, output)
        else:
            try:
                fn(output)
            except Exception:  # noqa: BLE001 - a user callback must not kill the loop
                logger.exception("result handler of %s raised", handle.request_id)

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

    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
        *,
        recompute: bool = False,
    ) -> int:
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
            KeyError: an unknown name; ValueError: a shape or dtype mismatch. Both are
                raised before anything is copied.
        """
        if self._state == _State.DESTROYED:
            raise RuntimeError("this manager was destroyed; update the model directly or build a new manager")
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else (named_tensors or []))
        # remove_duplicate=False: tied weights (lm_head.weight = embed_tokens.weight) keep both names,
        # as in state_dict().
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        for name, tensor in pairs:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"update_weights: {name} must be a torch.Tensor, got {type(tensor).__name__}")
            if name not in targets:
                raise KeyError(f"update_weights: the model has no parameter or buffer named {name!r}")
            t = targets[name]
            if tuple(tensor.shape) != tuple(t.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, got {tuple(tensor.shape)}")
            if tensor.dtype != t.dtype:
                raise ValueError(f"update_weights: {name} has dtype {t.dtype}, got {tensor.dtype}")
        with self.pause():
            with torch.no_grad():
                for name, tensor in pairs:
                    targets[name].copy_(tensor)
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
                    self._drain_inbox(engine)
                    while self._pause_count > 0 and not self._hard_stop:
                        self._cond.wait()
                        self._drain_inbox(engine)
                    if self._hard_stop:
                        self._fail_all(engine, RuntimeError("the manager was stopped with hard_stop=True"))
                        return
                    if not engine.has_unfinished():
                        if self._stop_requested:
                            return
                        self._cond.wait(0.05)
                        continue
                    self._in_step = True
                try:
                    if self.step_hook is not None:
                        self.step_hook()
                    updated = engine.step()
                finally:
                    with self._cond:
                        self._in_step = False
                        self._cond.notify_all()
                with self._cond:
                    self._publish(updated)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the readers
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

    def _drain_inbox(self, engine: Engine) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, _Add):
                self._num_queued -= 1
                handle = self._handles.get(cmd.request_id)
                if handle is None:
                    continue
                try:
                    engine.add_request(cmd.prompt_ids, cmd.params, cmd.request_id, cmd.record_timestamps)
                except ValueError as e:  # validated at add time; only a race could land here
                    out = GenerationOutput(cmd.request_id, cmd.prompt_ids, status=RequestStatus.FAILED, error=str(e))
                    self._finish_handle(handle, out)
            else:
                req = engine.finish_request(cmd.request_id, RequestStatus.CANCELLED, "cancelled by the caller")
                handle = self._handles.get(cmd.request_id)
                if handle is not None and handle.final is None:
                    if req is not None:
                        out = req.to_output()
                    else:  # still in the inbox: drop the add
                        out = GenerationOutput(
                            cmd.request_id, [], status=RequestStatus.CANCELLED, error="cancelled by the caller",
                            finish_reason="cancelled",
                        )
                        self._drop_queued_add(cmd.request_id)
                    self._finish_handle(handle, out)
        self._cond.notify_all()

    def _drop_queued_add(self, request_id: str) -> None:
        for cmd in list(self._inbox):
            if isinstance(cmd, _Add) and cmd.request_id == request_id:
                self._inbox.remove(cmd)
                self._num_queued -= 1

    def _publish(self, updated: list[Request]) -> None:
        for req in updated:
            handle = self._handles.get(req.request_id)
            if handle is None:
                continue
            if req.status.is_final:
                self._finish_handle(handle, req.to_output())
            elif handle.streaming:
                chunk = req.to_output()
                handle.stream.put(chunk)
                if handle.callback is not None:
                    self._call_handler(handle, chunk)
        self._cond.notify_all()

    def _finish_handle(self, handle: _Handle, out: GenerationOutput) -> None:
        if handle.final is not None:
            return
        handle.final = out
        handle.stream.put(out)
        self._finished_order.append(handle.request_id)
        if handle.callback is not None:
            self._call_handler(handle, out)
            self._deliver(handle)

    def _fail_all(self, engine: Engine, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"
        for rid in list(engine.requests):
            req = engine.finish_request(rid, RequestStatus.FAILED, message)
            handle = self._handles.get(rid)
            if req is not None and handle is not None:
                self._finish_handle(handle, req.to_output())
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, _Add):
                self._num_queued -= 1
                handle = self._handles.get(cmd.request_id)
                if handle is not None:
                    out = GenerationOutput(cmd.request_id, cmd.prompt_ids, status=RequestStatus.FAILED, error=message)
                    self._finish_handle(handle, out)
        for handle in list(self._handles.values()):
            if handle.final is None:
                self._finish_handle(
                    handle, GenerationOutput(handle.request_id, [], status=RequestStatus.FAILED, error=message)
                )
        self._cond.notify_all()
