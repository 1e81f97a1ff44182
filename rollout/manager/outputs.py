"""Result delivery: per-request handles, streamed snapshots, asyncio result handlers.

The ``OutputRouter`` is the reader side of the persistent manager: each request has its own handle (its final
output, a queue of streamed snapshots that never change once handed out, an optional callback), so no reader requeues
another's result. Each final result is delivered once: by ``get_result``, the end of ``stream``, or a result handler.

The producer (the manager's loop) calls ``publish`` after each engine step and ``finish`` for requests that end
outside a step; readers call ``get_result``, ``stream`` and ``register_handler``. The router holds no thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any

from rollout.requests import FINISH_REASON_OF_STATUS, GenerationOutput, Request, RequestStatus

logger = logging.getLogger(__name__)

ResultCallback = Callable[[GenerationOutput], Any]

# How often a reader waiting without a timeout rechecks that results may still come.
_POLL_SECONDS = 1.0


def ended_output(request_id: str, prompt_ids: list[int], status: RequestStatus, error: str) -> GenerationOutput:
    """The final output of a request that ended before the engine ran it (cancelled or failed in the inbox)."""
    return GenerationOutput(
        request_id, list(prompt_ids), status=status, error=error, finish_reason=FINISH_REASON_OF_STATUS.get(status)
    )


@dataclass
class RequestHandle:
    """Reader-side state of one request.

    Attributes:
        request_id: the request's id.
        streaming: every snapshot is queued, not only the final output.
        final: the final output once the request ended.
        delivered: the final output was handed to a reader.
        stream: the snapshots not yet read, the final one last.
        callback: (result handler, the asyncio loop it runs in or None).
    """

    request_id: str
    streaming: bool
    final: GenerationOutput | None = None
    delivered: bool = False
    stream: SimpleQueue = field(default_factory=SimpleQueue)
    callback: tuple[ResultCallback, asyncio.AbstractEventLoop | None] | None = None


class OutputRouter:
    """Per-request result delivery between one producer thread and any number of readers.

    Args:
        cond: the condition variable guarding the router (the manager passes its own, so one
            lock guards its inbox, its pause state and the handles). Must be re-entrant (the
            default ``threading.Condition()`` is).
        producing: returns True while results may still come (the producer runs or will run);
            a reader with nothing to read returns once it is False.
    """

    def __init__(self, cond: threading.Condition | None = None, producing: Callable[[], bool] = lambda: True) -> None:
        self._cond = cond or threading.Condition()
        self._producing = producing
        self._handles: dict[str, RequestHandle] = {}
        self._finished_order: deque[str] = deque()

    # ------------------------------------------------------------------ producer side
    def open(self, request_id: str, streaming: bool) -> None:
        """Create the handle of a new request.

        Raises:
            ValueError: the id has a handle whose result was not delivered yet.
        """
        with self._cond:
            if request_id in self._handles:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._handles[request_id] = RequestHandle(request_id, streaming)

    def __contains__(self, request_id: str) -> bool:
        """True while the id has a handle (its result not delivered yet)."""
        return request_id in self._handles

    def is_pending(self, request_id: str) -> bool:
        """True while the request has a handle and no final output."""
        handle = self._handles.get(request_id)
        return handle is not None and handle.final is None

    def publish(self, requests: Iterable[Request]) -> None:
        """After an engine step: a snapshot of each streaming request, the final output of each ended one."""
        with self._cond:
            for req in requests:
                handle = self._handles.get(req.request_id)
                if handle is None:
                    continue
                if req.status.is_final:
                    self._finish(handle, req.to_output())
                elif handle.streaming:
                    chunk = req.to_output()
                    handle.stream.put(chunk)
                    if handle.callback is not None:
                        self._call_handler(handle, chunk)
            self._cond.notify_all()

    def finish(self, request_id: str, output: GenerationOutput) -> None:
        """Record a request's final output (ignored if it already has one or has no handle)."""
        with self._cond:
            handle = self._handles.get(request_id)
            if handle is not None:
                self._finish(handle, output)
            self._cond.notify_all()

    def fail_pending(self, error: str) -> None:
        """End every request still without a final output: FAILED with ``error``, no tokens."""
        with self._cond:
            for handle in list(self._handles.values()):
                if handle.final is None:
                    self._finish(handle, ended_output(handle.request_id, [], RequestStatus.FAILED, error))
            self._cond.notify_all()

    def _finish(self, handle: RequestHandle, out: GenerationOutput) -> None:
        if handle.final is not None:
            return
        handle.final = out
        handle.stream.put(out)
        self._finished_order.append(handle.request_id)
        if handle.callback is not None:
            self._call_handler(handle, out)
            self._deliver(handle)

    # ------------------------------------------------------------------ reader side
    def get_result(
        self, request_id: str | None = None, timeout: float | None = None, refuse_wait: str | None = None
    ) -> GenerationOutput | None:
        """The next finished result, or the result of ``request_id``.

        Args:
            request_id: wait for this request; None takes the next finished one.
            timeout: seconds to wait; None waits until a result comes or nothing can come.
            refuse_wait: when set, a wait without a timeout raises ``RuntimeError(refuse_wait)``
                instead of starting (a result already there is still returned).

        Returns:
            The final output, or None after the timeout, or when nothing is left to wait for
            (the producer ended, or no request is pending).

        Raises:
            KeyError: ``request_id`` is unknown or its result was already delivered.
            RuntimeError: ``refuse_wait``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if request_id is not None:
                    handle = self._handle(request_id)
                    if handle.final is not None:
                        return self._deliver(handle)
                else:
                    while self._finished_order:
                        handle = self._handles.get(self._finished_order.popleft())
                        if handle is not None and handle.final is not None:
                            return self._deliver(handle)
                    if all(h.final is not None for h in self._handles.values()):
                        return None
                if not self._producing():
                    return None
                if refuse_wait is not None and timeout is None:
                    raise RuntimeError(refuse_wait)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining if remaining is not None else _POLL_SECONDS)

    def stream(
        self, request_id: str, timeout: float | None = None, refuse_wait: Callable[[], str | None] | None = None
    ) -> Iterator[GenerationOutput]:
        """A request's snapshots; the last one has a final status and delivers the result.

        A request opened without ``streaming`` yields its final output only. The iterator also
        ends, without a final chunk, if the producer ends without finishing the request.

        Raises:
            KeyError: unknown request id, or its result was already delivered.
            TimeoutError: no chunk came within ``timeout`` seconds.
            RuntimeError: ``refuse_wait()`` returns a message (checked before each wait, in the
                iterating thread), no timeout is given and the next chunk is not there yet.
        """
        with self._cond:
            handle = self._handle(request_id)
        while True:
            if refuse_wait is not None and timeout is None and handle.stream.empty():
                message = refuse_wait()
                if message is not None:
                    raise RuntimeError(message)
            try:
                chunk: GenerationOutput = handle.stream.get(timeout=timeout if timeout is not None else _POLL_SECONDS)
            except Empty:
                if timeout is not None:
                    raise TimeoutError(f"no output of {request_id!r} within {timeout} s") from None
                with self._cond:
                    if handle.final is not None and handle.stream.empty():
                        chunk = handle.final
                    elif handle.final is None and not self._producing():
                        return
                    else:
                        continue
            if chunk.status.is_final:
                with self._cond:
                    if not handle.delivered and request_id in self._handles:
                        self._deliver(handle)
                yield chunk
                return
            yield chunk

    def register_handler(self, request_id: str, callback: ResultCallback) -> None:
        """Call ``callback(output)`` for each chunk (streaming) or once with the final output.

        When called from a running asyncio loop, the callback runs in that loop through
        ``call_soon_threadsafe``; otherwise it runs in the producer's thread, and an exception it
        raises is logged, not propagated. The handler is dropped after the final output.

        Raises:
            KeyError: unknown request id, or its result was already delivered.
        """
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._cond:
            handle = self._handle(request_id)
            handle.callback = (callback, loop)
            if handle.final is not None:
                self._call_handler(handle, handle.final)
                self._deliver(handle)

    def _handle(self, request_id: str) -> RequestHandle:
        """The request's handle; raises KeyError when the id is unknown or its result was already delivered."""
        handle = self._handles.get(request_id)
        if handle is None:
            raise KeyError(f"request_id {request_id!r} is unknown or its result was already delivered")
        return handle

    def _deliver(self, handle: RequestHandle) -> GenerationOutput:
        handle.delivered = True
        del self._handles[handle.request_id]
        assert handle.final is not None
        return handle.final

    @staticmethod
    def _call_handler(handle: RequestHandle, output: GenerationOutput) -> None:
        assert handle.callback is not None
        fn, loop = handle.callback
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, output)
        else:
            try:
                fn(output)
            except Exception:  # a user callback must not kill the producer
                logger.exception("result handler of %s raised", handle.request_id)
