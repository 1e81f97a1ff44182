"""The manager's pause: who holds the model, whether a step runs, and the waits a pause would make endless.

``ContinuousBatchingManager.pause()`` is a ``PauseGate``'s ``hold()``: any number of holders, re-entrant in each
thread; the loop runs no step while one holds the gate, and ``hold`` returns once the step in progress has ended. The
gate shares the manager's condition variable (and lock) with the rest of the manager's state.

A thread inside its own pause cannot wait for the loop, which waits for that pause to end: ``refusal`` and
``refuse_if_held`` give the ``RuntimeError`` message that ``stop``, ``destroy``, ``join`` and the waiting reads raise
there instead of hanging.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

WAIT_IN_PAUSE = (
    "{call} from inside this thread's manager.pause() would wait for the generation loop, which waits for "
    "the pause to end; leave the `with manager.pause()` block first"
)


class PauseGate:
    """The pause holders and the in-step flag of one generation loop, guarded by that loop's lock.

    Args:
        cond: the condition variable of the loop's lock; ``hold`` takes it, the loop-side methods
            (``wait_out``, ``begin_step``, ``end_step``) expect it held.

    Attributes:
        holders: pauses held now, over every thread (a re-entrant hold counts once per level).
        entered: holds entered since the gate was built, over every thread and level (a tensor-parallel
            loop compares it across ranks: a pause lasts until every rank has entered its own).
        in_step: True while the loop runs a step (set between ``begin_step`` and ``end_step``).
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.holders = 0
        self.entered = 0
        self.in_step = False
        self._local = threading.local()  # .depth: the holds of the current thread

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the gate: wait (at most one step) until no step runs, keep the loop out until exit.

        Re-entrant, and several threads may hold it at once; the loop resumes once every holder left.
        """
        with self._cond:
            self.holders += 1
            self.entered += 1
            self._cond.notify_all()
            while self.in_step:
                self._cond.wait()
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._cond:
                self.holders -= 1
                self._cond.notify_all()

    def held_here(self) -> bool:
        """True when the calling thread is inside its own ``hold()``."""
        return getattr(self._local, "depth", 0) > 0

    def refusal(self, call: str) -> str | None:
        """The error message for ``call`` waiting on the loop from the calling thread, or None if it may wait.

        Args:
            call: the call's name as the message shows it, such as ``"get_result()"``.
        """
        return WAIT_IN_PAUSE.format(call=call) if self.held_here() else None

    def refuse_if_held(self, call: str) -> None:
        """Refuse a call that waits for the loop from inside the calling thread's own pause.

        Raises:
            RuntimeError: the calling thread holds the gate (the message names ``call``).
        """
        message = self.refusal(call)
        if message is not None:
            raise RuntimeError(message)

    def wait_out(self, abort: Callable[[], bool], on_wake: Callable[[], None]) -> bool:
        """For the loop, with the lock held: wait while the gate is held, unless ``abort()`` is true.

        Args:
            abort: read on each wake; true ends the wait with holders left (a hard stop).
            on_wake: called after each wake with the lock held (the loop drains its inbox).

        Returns:
            True when it waited at all (the holders may have changed the model meanwhile).
        """
        waited = False
        while self.holders > 0 and not abort():
            waited = True
            self._cond.wait()
            on_wake()
        return waited

    def begin_step(self) -> None:
        """For the loop, with the lock held and no holder: mark a step as running (``hold`` then waits)."""
        self.in_step = True

    def end_step(self) -> None:
        """For the loop, with the lock held: mark the step as ended and wake the waiting holders. Idempotent."""
        self.in_step = False
        self._cond.notify_all()
