"""Lifecycle without a manager: the states and their refusals, the stop flags the loop reads, and (with a
thread, synced on the lock) a start that waits for a loop still stopping."""

from __future__ import annotations

import logging
import threading

import pytest

from rollout.manager.lifecycle import Lifecycle, State


def test_a_new_lifecycle_accepts_and_produces() -> None:
    life = Lifecycle(threading.Condition())
    assert life.state == State.CREATED and life.state.value == "created"
    assert life.accepting() and life.admits_requests()
    assert life.producing()  # queued requests run at the first start
    assert not life.is_running()
    life.check_startable()
    assert life.join() is True  # no loop: nothing to wait for
    assert life.wait_for_stopping_loop() is True


def test_a_stop_ends_acceptance_and_a_hard_stop_stays_asked(caplog: pytest.LogCaptureFixture) -> None:
    cond = threading.Condition()
    life = Lifecycle(cond)
    with cond:
        life.request_stop(hard_stop=True, keep=False)
        life.request_stop(hard_stop=False, keep=True)
    assert life.stop_requested and life.hard_stop and life.keep
    assert not life.accepting()
    with caplog.at_level(logging.WARNING, logger="rollout.manager.manager"):
        assert life.admits_requests() is False
    assert "add_request after stop()" in caplog.text


def test_a_failed_lifecycle_refuses_requests_and_starts() -> None:
    cond = threading.Condition()
    life = Lifecycle(cond)
    error = ValueError("boom")
    life.fail(error)
    assert life.state == State.FAILED and life.error is error and not life.accepting()
    with pytest.raises(RuntimeError, match="failed and accepts no request: ValueError") as info:
        life.admits_requests()
    assert info.value.__cause__ is error
    with pytest.raises(RuntimeError, match="failed and cannot start again"):
        life.check_startable()
    with cond:
        assert life.loop_ended() is False and life.state == State.FAILED  # the end keeps FAILED


def test_a_destroyed_lifecycle_is_final() -> None:
    life = Lifecycle(threading.Condition())
    life.destroy()
    assert life.state == State.DESTROYED and life.stop_requested and not life.accepting()
    assert not life.producing()
    with pytest.raises(RuntimeError, match="destroyed and accepts no request"):
        life.admits_requests()
    with pytest.raises(RuntimeError, match="destroyed and cannot start again"):
        life.check_startable()


@pytest.mark.parametrize("keep", [False, True])
def test_the_loop_s_end_stops_and_closes_unless_kept(keep: bool) -> None:
    cond = threading.Condition()
    life = Lifecycle(cond)
    life.state = State.RUNNING
    with cond:
        assert life.loop_ended() is False  # no stop asked (a failure ended it): the engine stays
        life.state = State.RUNNING
        life.request_stop(hard_stop=False, keep=keep)
        assert life.loop_ended() is (not keep)
    assert life.state == State.STOPPED


def test_a_start_waits_for_a_loop_that_is_stopping() -> None:
    cond = threading.Condition()
    life = Lifecycle(cond, thread_name="test-loop")
    names: list[str] = []

    def loop() -> None:
        names.append(threading.current_thread().name)
        with cond:
            cond.wait_for(lambda: life.stop_requested)
            life.loop_ended()

    with cond:
        life.launch(loop)
        assert life.state == State.RUNNING and life.is_running() and life.producing()
    assert life.wait_for_stopping_loop() is False  # running, no stop asked: a start is a no-op
    assert life.join(timeout=0) is False  # still running
    with cond:
        life.request_stop(hard_stop=False, keep=False)
    assert life.wait_for_stopping_loop() is True  # it joined the loop
    assert not life.is_running() and not life.producing()
    assert life.state == State.STOPPED and names == ["test-loop"]
    assert life.join() is True
    with cond:
        life.launch(loop)  # a restart clears the stop flags
        assert not life.stop_requested and not life.hard_stop
        life.request_stop(hard_stop=False, keep=False)
    assert life.join(timeout=60) is True
