"""The manager's lifecycle: its state, the stop flags its loop reads, the loop's thread and the error it failed with.

A manager is ``created``, then ``running`` from ``start()`` until its loop ends (``stopped``, or
``failed`` when the loop raised); ``destroyed`` is final, and so is ``failed`` for starting again.
``stop()`` only asks: the loop reads ``stop_requested`` (finish the pending requests, then end) and
``hard_stop`` (fail them at once) between steps, and whether the engine is kept for the next session
(``keep``) once it ended. A ``Lifecycle`` holds these flags and the thread; the manager's lock
guards them: every method expects it held, except ``is_running``, ``producing`` and ``join``, which
only read the thread, and ``wait_for_stopping_loop``, which takes the lock itself.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

# The messages of the manager's lifecycle keep the logger they had in manager.py.
logger = logging.getLogger("rollout.manager.manager")


class State(enum.Enum):
    """A manager's state; ``value`` is what ``ContinuousBatchingManager.state`` returns."""

    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"
    DESTROYED = "destroyed"


class Lifecycle:
    """The state, stop flags, loop thread and loop error of one manager.

    Args:
        cond: the condition variable of the manager's lock, which guards every attribute.
        thread_name: the name of the loop's thread.

    Attributes:
        state: the manager's ``State``.
        stop_requested: a stop was asked since the last start; the loop ends once idle.
        hard_stop: the stop asked fails the pending requests at once.
        keep: the engine is kept for the next session when the loop ends (else it is closed).
        error: what the loop raised, once ``state`` is FAILED.
        thread: the loop's thread, from the first ``launch``.
    """

    def __init__(self, cond: threading.Condition, thread_name: str = "rollout-manager") -> None:
        self._cond = cond
        self._thread_name = thread_name
        self.state = State.CREATED
        self.stop_requested = False
        self.hard_stop = False
        self.keep = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def check_startable(self) -> None:
        """Refuse to start a manager that cannot run again.

        Raises:
            RuntimeError: the manager was destroyed, or failed (the message names the error).
        """
        if self.state == State.DESTROYED:
            raise RuntimeError("this manager was destroyed and cannot start again; create a new one")
        if self.state == State.FAILED:
            raise RuntimeError(f"this manager failed and cannot start again: {self.error!r}")

    def wait_for_stopping_loop(self) -> bool:
        """Without the lock: whether a start should go on, once a loop that is being stopped has ended.

        Returns:
            False when a loop runs and no stop was asked (a start is then a no-op); True otherwise,
            after waiting for a loop still ending from ``stop(block=False)``.
        """
        with self._cond:
            thread, stopping = self.thread, self.stop_requested
        if thread is None or not thread.is_alive():
            return True
        if not stopping:
            return False
        thread.join()
        return True

    def launch(self, loop: Callable[[], None]) -> None:
        """Clear the stop flags, enter RUNNING and start ``loop`` in a new daemon thread."""
        self.stop_requested = False
        self.hard_stop = False
        self.state = State.RUNNING
        self.thread = threading.Thread(target=loop, name=self._thread_name, daemon=True)
        self.thread.start()

    def is_running(self) -> bool:
        """True while the loop's thread is alive."""
        return self.thread is not None and self.thread.is_alive()

    def producing(self) -> bool:
        """True while results may still come: the loop runs, or was never started (queued requests run then)."""
        return self.is_running() or self.state == State.CREATED

    def request_stop(self, hard_stop: bool, keep: bool) -> None:
        """Ask the loop to end; a hard stop asked earlier stays asked. Wakes the loop."""
        self.stop_requested = True
        self.hard_stop = self.hard_stop or hard_stop
        self.keep = keep
        self._cond.notify_all()

    def accepting(self) -> bool:
        """True while requests may be queued (not failed, destroyed or asked to stop)."""
        return self.state not in (State.FAILED, State.DESTROYED) and not self.stop_requested

    def admits_requests(self) -> bool:
        """Whether new requests are queued: False (with a warning) after ``stop()``.

        Raises:
            RuntimeError: the manager failed (chained to its error, which the message names) or was destroyed.
        """
        if self.state == State.FAILED:
            raise RuntimeError(f"the manager failed and accepts no request: {self.error!r}") from self.error
        if self.state == State.DESTROYED:
            raise RuntimeError("the manager was destroyed and accepts no request")
        if self.stop_requested or self.state == State.STOPPED:
            logger.warning("add_request after stop(): request not added")
            return False
        return True

    def fail(self, error: BaseException) -> None:
        """Record that the loop raised ``error``: the manager is FAILED."""
        self.error = error
        self.state = State.FAILED

    def loop_ended(self) -> bool:
        """Record that the loop ended (RUNNING becomes STOPPED); wakes the waiters.

        Returns:
            True when the engine is to be closed: a stop was asked without keeping it for the next session.
        """
        if self.state == State.RUNNING:
            self.state = State.STOPPED
        self._cond.notify_all()
        return self.stop_requested and not self.keep

    def destroy(self) -> None:
        """Enter DESTROYED (final): no request is accepted and no start allowed."""
        self.stop_requested = True
        self.state = State.DESTROYED

    def join(self, timeout: float | None = None, stop_trigger_time: float | None = None) -> bool:
        """Wait for the loop's thread to end; True if it has (or never started).

        Args:
            timeout: most seconds to wait; None waits until it ends.
            stop_trigger_time: ``time.perf_counter()`` when the stop was asked; the time the loop took
                to end is logged from it.
        """
        thread = self.thread
        if thread is None:
            return True
        thread.join(timeout)
        ended = not thread.is_alive()
        if not ended:
            logger.warning("the rollout manager's loop did not end within %s s", timeout)
        elif stop_trigger_time is not None:
            logger.info("the rollout manager's loop ended %.2f s after stop()", time.perf_counter() - stop_trigger_time)
        return ended
