"""The manager's intake without a thread: the request checks (parameters, prompts, fit, seeds), then the inbox:
ids, back-pressure, cancels before and after the engine has a request."""

from __future__ import annotations

import threading

import pytest

from rollout.checks import FieldError
from rollout.manager.intake import (
    Inbox,
    QueueFullError,
    check_fits,
    checked_batch,
    checked_request,
    checked_scoring_batch,
    derive_seeds,
    request_params,
)
from rollout.manager.outputs import OutputRouter
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


class FittingEngine:
    """What the checks need of an engine: its gate's ``check``, refusing requests longer than ``capacity`` tokens."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.checked: list[tuple[str | None, int, SamplingParams]] = []
        self.gate = self  # the engine's RequestGate: ``check`` below

    def check(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        self.checked.append((request_id, num_prompt_tokens, params))
        if num_prompt_tokens + (0 if scoring else params.max_new_tokens) > self.capacity:
            raise ValueError(f"request {request_id!r} needs more tokens than the cache holds")


def test_derive_seeds_spreads_one_int_and_keeps_a_sequence() -> None:
    assert derive_seeds(7, 3) == [7, 8, 9]
    assert derive_seeds(None, 2) == [None, None]
    assert derive_seeds([3, None], 2) == [3, None] and derive_seeds((1, 1), 2) == [1, 1]
    assert derive_seeds("x", 2) == ["x", "x"]  # not an int: SamplingParams names it later
    with pytest.raises(ValueError, match="seed holds 1 seeds for 2 inputs"):
        derive_seeds([1], 2)


def test_request_params_put_the_overrides_on_the_caller_s_params_or_the_defaults() -> None:
    defaults = SamplingParams(max_new_tokens=4, temperature=0.5, do_sample=True)
    params = request_params(defaults, None, vocab_size=16, per_request_processors=True, max_new_tokens=2, seed=3)
    assert (params.max_new_tokens, params.temperature, params.seed) == (2, 0.5, 3)
    mine = SamplingParams(max_new_tokens=9)
    params = request_params(defaults, mine, vocab_size=16, per_request_processors=True, top_k=None)
    assert params.max_new_tokens == 9 and not params.do_sample
    with pytest.raises(ValueError, match="eos"):
        request_params(defaults, None, vocab_size=16, per_request_processors=True, eos_token_id=16)


def test_request_params_refuse_other_processor_values_without_per_request_processors() -> None:
    defaults = SamplingParams(max_new_tokens=4, temperature=0.5, do_sample=True)
    same = request_params(defaults, None, vocab_size=16, per_request_processors=False, max_new_tokens=2, seed=1)
    assert same.max_new_tokens == 2  # max_new_tokens and seeds may still differ
    with pytest.raises(ValueError, match="temperature=0.7: per_request_processors is False"):
        request_params(defaults, None, vocab_size=16, per_request_processors=False, temperature=0.7)


def test_checked_request_checks_the_prompt_the_id_and_the_fit() -> None:
    engine = FittingEngine(capacity=8)
    assert checked_request(engine, (5, 6), "a", PARAMS, vocab_size=16) == ("a", [5, 6], PARAMS)
    assert engine.checked == [("a", 2, PARAMS)]
    with pytest.raises(ValueError, match="input_ids"):
        checked_request(engine, [5, 16], None, PARAMS, vocab_size=16)
    with pytest.raises(ValueError, match="request_id must be a str or None, got 3"):
        checked_request(engine, [5], 3, PARAMS, vocab_size=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^input_ids: request 'b' needs more tokens"):
        checked_request(engine, list(range(7)), "b", PARAMS, vocab_size=16)
    with pytest.raises(RuntimeError, match="destroyed and accepts no request"):
        checked_request(None, [5], None, PARAMS, vocab_size=16)
    with pytest.raises(ValueError, match="input_ids"):  # the prompt is checked before the engine
        checked_request(None, [], None, PARAMS, vocab_size=16)


def test_checked_batch_sorts_by_prompt_seeds_each_request_and_names_the_bad_input() -> None:
    engine = FittingEngine(capacity=8)
    items, order = checked_batch(engine, [[9, 1], [2], [9, 0]], PARAMS, [None, 5, 6], vocab_size=16)
    assert [prompt for _, prompt, _ in items] == [[2], [9, 0], [9, 1]] and order == [1, 2, 0]
    assert [params.seed for _, _, params in items] == [5, 6, None] and items[2][2] is PARAMS
    assert all(rid is None for rid, _, _ in items)
    with pytest.raises(ValueError, match=r"^inputs\[1\]: request None needs more tokens"):
        checked_batch(engine, [[1], list(range(7))], PARAMS, [None, None], vocab_size=16)
    with pytest.raises(ValueError, match=r"inputs\[0\]"):
        checked_batch(engine, [[99]], PARAMS, [None], vocab_size=16)
    assert checked_batch(engine, [], PARAMS, [], vocab_size=16) == ([], [])


def test_check_fits_names_the_argument() -> None:
    check_fits(FittingEngine(capacity=8), "a", [1, 2], PARAMS, "x")
    with pytest.raises(ValueError, match=r"^inputs\[3\]: request 'a'"):
        check_fits(FittingEngine(capacity=2), "a", [1, 2], PARAMS, "inputs[3]")


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


def test_checked_scoring_batch_fits_the_prompt_alone_and_bounds_score_from() -> None:
    engine = FittingEngine(capacity=8)
    items = checked_scoring_batch(engine, [[5] * 8, [6, 7]], 1, vocab_size=256)  # nothing is generated: 8 fit
    assert [prompt for _, prompt, _ in items] == [[5] * 8, [6, 7]]
    with pytest.raises(ValueError, match=r"^inputs\[1\]: "):
        checked_scoring_batch(engine, [[5], [5] * 9], 1, vocab_size=256)
    with pytest.raises(FieldError, match="score_from") as caught:
        checked_scoring_batch(engine, [[5, 6]], 3, vocab_size=256)
    assert caught.value.field == "score_from"
