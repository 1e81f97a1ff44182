"""The manager's inbox without a thread: ids, back-pressure, cancels before and after the engine has a request."""

from __future__ import annotations

import threading

import pytest

from rollout.intake import Inbox, QueueFullError
from rollout.outputs import OutputRouter
from rollout.requests import FINISH_REASON_OF_STATUS, Request, RequestStatus
from rollout.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=2)


class FakeEngine:
    """What the inbox needs of an engine: enqueue and finish_request."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def enqueue(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.status, req.error, req.finish_reason = status, error, FINISH_REASON_OF_STATUS[status]
        return req


def make_inbox(max_queue_size: int = 0) -> tuple[Inbox, OutputRouter, FakeEngine]:
    cond = threading.Condition()
    router = OutputRouter(cond, producing=lambda: False)
    engine = FakeEngine()
    return Inbox(cond, router, max_queue_size, lambda: 0), router, engine


def put(inbox: Inbox, prompts: list[list[int]], ids: list[str | None] | None = None, block: bool = False) -> list[str]:
    items = [(rid, p, PARAMS) for rid, p in zip(ids or [None] * len(prompts), prompts)]
    return inbox.put(items, False, False, block, timeout=0.01, still_open=lambda: True)


def test_put_names_requests_and_drain_hands_them_to_the_engine_in_order() -> None:
    inbox, router, engine = make_inbox()
    assert put(inbox, [[5], [6]], ["mine", None]) == ["mine", "req_0"]
    assert inbox.num_waiting() == 2 and "mine" in router
    inbox.drain(engine)
    assert list(engine.requests) == ["mine", "req_0"] and inbox.num_waiting() == 0
    with pytest.raises(ValueError, match="'mine' is already in use"):
        put(inbox, [[7]], ["mine"])


def test_a_batch_that_does_not_fit_is_refused_whole() -> None:
    inbox, router, _ = make_inbox(max_queue_size=3)
    put(inbox, [[5]])
    with pytest.raises(QueueFullError, match="nothing was queued"):
        put(inbox, [[6], [7], [8]])
    assert inbox.num_waiting() == 1
    with pytest.raises(QueueFullError, match="still full after"):
        put(inbox, [[6], [7], [8]], block=True)  # two fit, the third times out
    assert inbox.num_waiting() == 3


def test_cancels_apply_after_the_adds_before_them() -> None:
    inbox, router, engine = make_inbox()
    a, b = put(inbox, [[5, 6], [7]])
    inbox.drain(engine)
    c = put(inbox, [[8, 9]])[0]
    inbox.cancel(a)
    inbox.cancel(c)
    inbox.cancel("unknown")
    inbox.drain(engine)  # c reaches the engine, then both cancels end a and c there
    assert list(engine.requests) == [b] and inbox.num_waiting() == 0
    out_a, out_c = router.get_result(a), router.get_result(c)
    assert out_a.status == RequestStatus.CANCELLED and out_a.error == "cancelled by the caller"
    assert out_c.status == RequestStatus.CANCELLED and out_c.prompt_ids == [8, 9] and out_c.finish_reason == "cancelled"


def test_fail_all_ends_the_queued_requests() -> None:
    inbox, router, _ = make_inbox()
    [rid] = put(inbox, [[5]])
    inbox.fail_all("RuntimeError: boom")
    out = router.get_result(rid)
    assert out.status == RequestStatus.FAILED and out.error == "RuntimeError: boom" and inbox.num_waiting() == 0
