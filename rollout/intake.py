"""The manager's intake: the inbox of checked requests and cancels, with back-pressure.

Callers' threads put requests (already checked, as ``Request`` objects) and cancels into the inbox;
the manager's loop drains it between engine steps (vLLM's engine-core input queue), so no caller
touches the engine. ``max_queue_size`` bounds the requests not yet admitted (in the inbox or in the
scheduler's waiting queue): ``put`` refuses a batch that does not fit, or waits for room.

The inbox shares the manager's condition variable: every method expects to be called with it held
(or takes it), and waiting callers are woken by the manager's ``notify_all``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine
from .outputs import OutputRouter, ended_output
from .requests import Request, RequestStatus
from .sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """``add_request`` found ``max_queue_size`` requests waiting."""


@dataclass
class _Cancel:
    request_id: str


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
        self._items: deque[Request | _Cancel] = deque()
        self._num_requests = 0  # requests (not cancels) in the inbox
        self._id_counter = 0

    def num_waiting(self) -> int:
        """Requests not yet admitted: in the inbox or in the engine's waiting queue."""
        return self._num_requests + self._num_waiting_in_engine()

    def put(
        self,
        items: list[tuple[str | None, list[int], SamplingParams]],
        streaming: bool,
        record_timestamps: bool,
        block: bool,
        timeout: float | None,
        still_open: Callable[[], bool],
        refuse_wait: str | None = None,
    ) -> list[str]:
        """Queue checked requests in order and open their result handles.

        Args:
            items: (request id or None for ``req_<n>``, prompt token ids, sampling parameters).
            streaming, record_timestamps: as for ``add_request``.
            block: wait for queue room (request by request) instead of refusing the batch.
            timeout: most seconds to wait with ``block``; None waits for ever.
            still_open: False once the manager stopped; a waiting caller then gives up.
            refuse_wait: when set, a batch that would have to wait for room without a timeout
                raises ``RuntimeError(refuse_wait)`` instead, before anything is queued (the
                caller holds a pause, so no room can come).

        Returns:
            The request ids, in order.

        Raises:
            ValueError: a chosen id is already in use (nothing is queued).
            QueueFullError: without ``block``, the batch does not fit (nothing is queued); with
                it, no room came within ``timeout``.
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
                rid = rid if rid is not None else self._new_id()
                self._outputs.open(rid, streaming)
                self._items.append(Request(rid, prompt, params, record_timestamps))
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

    def cancel(self, request_id: str) -> None:
        """Queue a cancel (ignored for unknown or finished requests)."""
        with self._cond:
            if self._outputs.is_pending(request_id):
                self._items.append(_Cancel(request_id))
                self._cond.notify_all()

    def drain(self, engine: Engine) -> None:
        """In the loop, between steps: hand queued requests to the engine and apply cancels, in order."""
        with self._cond:
            while self._items:
                item = self._items.popleft()
                if isinstance(item, Request):
                    self._num_requests -= 1
                    if item.request_id not in self._outputs:
                        continue
                    try:
                        engine.enqueue(item)
                    except ValueError as e:  # checked at add time; only a race could land here
                        out = ended_output(item.request_id, item.prompt_ids, RequestStatus.FAILED, str(e))
                        self._outputs.finish(item.request_id, out)
                else:
                    self._cancel(engine, item.request_id)
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
