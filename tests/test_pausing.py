"""PauseGate without a manager: re-entrant holds counted over threads, the refusal of waits inside one's own
pause, a hold that waits for the step in progress, and the loop's wait that ends when the holders leave or on
an abort. Threads appear only where the behaviour is about threads; they sync on events and the lock."""

from __future__ import annotations

import threading

import pytest

from rollout.manager.pausing import WAIT_IN_PAUSE, PauseGate


def test_holds_are_reentrant_and_counted() -> None:
    gate = PauseGate(threading.Condition())
    assert gate.holders == 0 and not gate.held_here()
    with gate.hold():
        assert gate.holders == 1 and gate.held_here()
        with gate.hold():
            assert gate.holders == 2 and gate.held_here()
        assert gate.holders == 1 and gate.held_here()
    assert gate.holders == 0 and not gate.held_here()


def test_a_hold_is_released_when_its_block_raises() -> None:
    gate = PauseGate(threading.Condition())
    with pytest.raises(ValueError), gate.hold():
        raise ValueError("boom")
    assert gate.holders == 0 and not gate.held_here()


def test_only_the_holding_thread_is_refused_a_wait() -> None:
    gate = PauseGate(threading.Condition())
    assert gate.refusal("get_result()") is None
    gate.refuse_if_held("stop()")  # nothing held: no error
    seen: dict[str, object] = {}

    def other() -> None:
        seen["held_here"] = gate.held_here()
        seen["refusal"] = gate.refusal("join()")

    with gate.hold():
        assert gate.refusal("get_result()") == WAIT_IN_PAUSE.format(call="get_result()")
        with pytest.raises(RuntimeError, match=r"stop\(\) from inside this thread's manager.pause\(\)"):
            gate.refuse_if_held("stop()")
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == {"held_here": False, "refusal": None}  # another thread's hold does not refuse this one


def test_several_threads_hold_at_once() -> None:
    cond = threading.Condition()
    gate = PauseGate(cond)
    entered = threading.Barrier(3)
    release = threading.Event()

    def holder() -> None:
        with gate.hold():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=holder) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert gate.holders == 2 and not gate.held_here()
    release.set()
    for t in threads:
        t.join()
    assert gate.holders == 0


def test_a_hold_waits_for_the_step_in_progress() -> None:
    cond = threading.Condition()
    gate = PauseGate(cond)
    entered = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with gate.hold():
            entered.set()
            release.wait()

    with cond:
        gate.begin_step()
    thread = threading.Thread(target=holder)
    thread.start()
    with cond:
        assert cond.wait_for(lambda: gate.holders == 1, timeout=60)  # counted before it waits for the step
        assert gate.in_step and not entered.is_set()  # it cannot enter while the step runs
        gate.end_step()
    assert entered.wait(timeout=60)
    release.set()
    thread.join()
    assert gate.holders == 0 and not gate.in_step


def test_the_loop_waits_out_the_holders_and_drains_on_each_wake() -> None:
    cond = threading.Condition()
    gate = PauseGate(cond)
    with cond:
        assert gate.wait_out(abort=lambda: False, on_wake=lambda: None) is False  # no holder: no wait
    waiting = threading.Event()
    woke = threading.Event()
    done = threading.Event()
    result: list[bool] = []

    def loop() -> None:
        with cond:
            waiting.set()
            result.append(gate.wait_out(abort=lambda: False, on_wake=woke.set))
        done.set()

    with gate.hold():
        thread = threading.Thread(target=loop)
        thread.start()
        assert waiting.wait(timeout=60)
        with cond:  # the loop released the lock: it waits in wait_out
            cond.notify_all()
        assert woke.wait(timeout=60)
        assert not done.is_set()  # woken while still held: it waits again
    thread.join()
    assert result == [True]


def test_an_abort_ends_the_wait_with_holders_left() -> None:
    cond = threading.Condition()
    gate = PauseGate(cond)
    abort = threading.Event()
    waiting = threading.Event()
    result: list[bool] = []

    def loop() -> None:
        with cond:
            waiting.set()
            result.append(gate.wait_out(abort=abort.is_set, on_wake=lambda: None))

    with gate.hold():
        thread = threading.Thread(target=loop)
        thread.start()
        assert waiting.wait(timeout=60)
        with cond:
            abort.set()
            cond.notify_all()
        thread.join()
        assert result == [True] and gate.holders == 1
    with cond:
        abort.set()
        with gate.hold():
            pass
        assert gate.wait_out(abort=abort.is_set, on_wake=lambda: None) is False


def test_end_step_is_idempotent() -> None:
    cond = threading.Condition()
    gate = PauseGate(cond)
    with cond:
        gate.begin_step()
        assert gate.in_step
        gate.end_step()
        gate.end_step()
        assert not gate.in_step
