"""GenerationLoop over a fake engine: run in the test's own thread, it drains the inbox, steps until a stop
finds the engine idle, publishes the results and closes the engine unless it is kept; a hard stop and a
failing step fail every request; a step never runs while a pause is held (the one test with a thread, synced
on events and the lock), and weights changed under the pause bump the weight version."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout.manager.intake import Inbox
from rollout.manager.lifecycle import Lifecycle, State
from rollout.manager.loop import GenerationLoop
from rollout.manager.outputs import OutputRouter
from rollout.manager.pausing import PauseGate
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams
from rollout.weights.versions import WeightWatch


class FakeEngine:
    """Generates token 1 per step for each request; a request ends after ``tokens`` of them."""

    def __init__(self, tokens: int = 2, fail_at_step: int | None = None) -> None:
        self.tokens = tokens
        self.fail_at_step = fail_at_step
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.weight_version = 0
        self.closed = False
        self.enqueued = threading.Event()

    def use_device_in_this_thread(self) -> None:
        pass

    def enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.enqueued.set()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def in_flight(self) -> bool:  # a synchronous engine: nothing runs between two steps
        return False

    def drain(self) -> list[Request]:
        return []

    def step(self) -> list[Request]:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise ValueError("the step broke")
        updated = list(self.requests.values())
        for req in updated:
            req.token_ids.append(1)
            if len(req.token_ids) - len(req.prompt_ids) == self.tokens:
                req.status = RequestStatus.FINISHED
                req.finish_reason = "length"
                del self.requests[req.request_id]
        return updated

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.status, req.error = status, error
        return req

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    def close(self) -> None:
        self.closed = True


class Parts:
    """A manager's pieces around one loop, as the manager wires them."""

    def __init__(self, engine: FakeEngine, model: torch.nn.Module | None = None) -> None:
        self.cond = threading.Condition()
        self.engine = engine
        self.life = Lifecycle(self.cond)
        self.life.state = State.RUNNING  # as launch() leaves it
        self.pausing = PauseGate(self.cond)
        self.outputs = OutputRouter(self.cond, producing=self.life.producing)
        self.inbox = Inbox(self.cond, self.outputs, 0, lambda: 0)
        self.model = model if model is not None else torch.nn.Linear(2, 2)
        self.loop = GenerationLoop(
            self.cond, self.inbox, self.outputs, self.pausing, self.life, WeightWatch(self.model)
        )

    def add(self, *prompts: list[int]) -> list[str]:
        items = [(None, prompt, SamplingParams()) for prompt in prompts]
        return self.inbox.put(items, False, False, block=False, timeout=None, still_open=self.life.accepting)

    def stop(self, hard_stop: bool = False, keep: bool = False) -> None:
        with self.cond:
            self.life.request_stop(hard_stop, keep)


@pytest.mark.parametrize("keep", [False, True])
def test_the_loop_runs_the_queued_requests_then_stops(keep: bool) -> None:
    parts = Parts(FakeEngine(tokens=2))
    ids = parts.add([5, 6], [7])
    parts.stop(keep=keep)  # asked before the loop starts: it still finishes the pending requests
    parts.loop.run(parts.engine)
    assert parts.engine.steps == 2
    for rid in ids:
        out = parts.outputs.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FINISHED and out.generated_tokens == [1, 1]
    assert parts.life.state == State.STOPPED and not parts.pausing.in_step
    assert parts.engine.closed is (not keep)


def test_a_hard_stop_fails_every_request_at_once() -> None:
    parts = Parts(FakeEngine(tokens=5))
    ids = parts.add([5, 6], [7])
    parts.stop(hard_stop=True)
    parts.loop.run(parts.engine)
    assert parts.engine.steps == 0 and parts.engine.closed
    for rid in ids:
        out = parts.outputs.get_result(rid, timeout=0)
        assert out.status == RequestStatus.FAILED and "hard_stop=True" in out.error
    assert parts.life.state == State.STOPPED


def test_a_failing_step_fails_the_manager_and_every_request() -> None:
    parts = Parts(FakeEngine(tokens=5, fail_at_step=2))
    ids = parts.add([5, 6])
    parts.loop.run(parts.engine)  # never raises
    assert parts.life.state == State.FAILED and isinstance(parts.life.error, ValueError)
    assert not parts.pausing.in_step
    out = parts.outputs.get_result(ids[0], timeout=0)
    assert out.status == RequestStatus.FAILED and out.error == "ValueError: the step broke"
    assert out.generated_tokens == [1]  # the partial tokens are kept
    assert not parts.engine.closed  # no stop was asked: the manager's destroy() closes it


def test_no_step_runs_while_a_pause_is_held_and_weights_changed_under_it_bump_the_version() -> None:
    parts = Parts(FakeEngine(tokens=2))
    with parts.pausing.hold():
        ids = parts.add([5, 6])
        thread = threading.Thread(target=parts.loop.run, args=(parts.engine,))
        thread.start()
        assert parts.engine.enqueued.wait(timeout=60)  # drained under the lock, which it keeps until it waits
        with parts.cond:  # the loop released the lock: it waits in the pause
            assert parts.engine.steps == 0 and parts.engine.requests
            with torch.no_grad():
                parts.model.weight.add_(1.0)  # changed by hand, not through update_weights
            parts.life.request_stop(hard_stop=False, keep=False)
        assert parts.engine.steps == 0
    thread.join()
    assert parts.engine.weight_version == 1 and parts.engine.steps == 2
    assert parts.outputs.get_result(ids[0], timeout=0).status == RequestStatus.FINISHED
    assert parts.life.state == State.STOPPED and parts.engine.closed


class InFlightEngine(FakeEngine):
    """A FakeEngine that keeps a step in flight between calls, as async batching does: each ``step()``
    completes the step launched by the call before it, then launches the next; ``drain()`` only completes.
    From its second call on, ``step()`` waits for ``go`` (so the test can take the pause meanwhile)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens=tokens)
        self._flight = False
        self.drains = 0
        self.calls = 0
        self.go = threading.Event()
        self.waiting_for_go = threading.Event()

    @property
    def in_flight(self) -> bool:
        return self._flight

    def step(self) -> list[Request]:
        self.calls += 1
        if self.calls > 1:
            self.waiting_for_go.set()
            assert self.go.wait(timeout=60)
        updated = super().step() if self._flight else []
        self._flight = bool(self.requests)
        return updated

    def drain(self) -> list[Request]:
        self.drains += 1
        updated = super().step() if self._flight else []
        self._flight = False
        return updated


def test_a_pause_has_the_step_in_flight_finished_before_the_holder_gets_the_model() -> None:
    parts = Parts(InFlightEngine(tokens=4))
    ids = parts.add([5, 6])
    thread = threading.Thread(target=parts.loop.run, args=(parts.engine,))
    thread.start()
    seen: list[tuple[bool, int, int]] = []

    def hold() -> None:
        with parts.pausing.hold():
            seen.append((parts.engine.in_flight, parts.engine.drains, parts.engine.steps))

    # The loop's second step() waits for go; the first one left a step in flight.
    assert parts.engine.waiting_for_go.wait(timeout=60)
    holder = threading.Thread(target=hold)
    holder.start()
    with parts.cond:
        assert parts.cond.wait_for(lambda: parts.pausing.holders == 1, timeout=60)
        assert parts.pausing.in_step and not seen  # the holder waits for the step in flight
    parts.engine.go.set()
    holder.join(timeout=60)
    # When the holder ran, the engine had finished its step in flight (by a drain) and launched nothing.
    assert seen == [(False, 1, 2)]
    parts.stop()
    thread.join(timeout=60)
    out = parts.outputs.get_result(ids[0], timeout=0)
    assert out.status == RequestStatus.FINISHED and out.generated_tokens == [1] * 4
    assert parts.life.state == State.STOPPED and not parts.pausing.in_step
