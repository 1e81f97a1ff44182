"""The pause of ``/pause`` and ``/resume``: a pause that spans HTTP calls, over the manager's one-thread ``pause()``.

``manager.pause()`` is a context manager held by one thread; ``PauseHolder`` holds it in a thread of its own between
``hold`` and ``release``. ``ServerPause`` is the state the routes see, vLLM's rules (``AsyncLLM.pause_generation``):

- a pause lasts from ``/pause`` until ``/resume`` (``paused``, what ``/is_paused`` answers), whatever its mode;
- ``wait`` holds new requests back (before they are queued) until the in-flight ones finished, then holds the engine;
  a ``/resume`` that arrives meanwhile cancels it: the wait returns, nothing is held, new requests are queued;
- on a server whose engine is already held (a ``keep`` or an ``abort`` pause), ``keep`` and ``wait`` return at once
  (the requests a ``keep`` froze would never finish), and ``abort`` ends the frozen requests;
- one pause and one resume change the holder at a time, in arrival order (an ``asyncio.Lock``, which is fair), so a
  resume that overtakes a pause still leaves the engine stepping.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from rollout import ContinuousBatchingManager

PAUSE_MODES = ("keep", "abort", "wait")


class PauseHolder:
    """Holds ``manager.pause()`` in a thread of its own between ``hold`` and ``release``.

    Args:
        manager: the manager to pause.
    """

    def __init__(self, manager: ContinuousBatchingManager) -> None:
        self._manager = manager
        self._thread: threading.Thread | None = None
        self._release = threading.Event()

    def hold(self) -> None:
        """Enter the pause (blocking: returns once the step in progress has ended); a no-op when held."""
        if self._thread is not None:
            return
        entered = threading.Event()
        self._release.clear()

        def run() -> None:
            with self._manager.pause():
                entered.set()
                self._release.wait()

        self._thread = threading.Thread(target=run, name="rollout-serve-pause", daemon=True)
        self._thread.start()
        entered.wait()

    def release(self) -> None:
        """Leave the pause (the loop steps again); a no-op when not held."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._release.set()
            thread.join()


async def _first(*waits: Awaitable[object]) -> None:
    """Return once any of ``waits`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class ServerPause:
    """The server's pause, between ``/pause`` and ``/resume`` (see the module docstring for the rules).

    Args:
        manager: the server's manager.

    Attributes:
        admit: set unless a ``wait`` pause holds new requests back; a job waits on it before it is queued.
        mode: the mode of the last ``/pause`` while paused, else None.
    """

    def __init__(self, manager: ContinuousBatchingManager) -> None:
        self._holder = PauseHolder(manager)
        self.admit = asyncio.Event()
        self.admit.set()
        self.mode: str | None = None
        self._cycle: asyncio.Event | None = None  # this pause's; set by the resume that ends it
        self._held = asyncio.Event()  # the engine is held
        self._lock = asyncio.Lock()

    @property
    def paused(self) -> bool:
        """True from ``pause`` until ``resume`` (a ``wait`` that still waits included)."""
        return self._cycle is not None

    async def pause(self, mode: str, idle: asyncio.Event, abort: Callable[[], object]) -> bool:
        """Pause generation; returns once the engine is held, or the pause was cancelled.

        Args:
            mode: ``keep``, ``abort`` or ``wait`` (checked by the caller).
            idle: set while no request is in flight (what ``wait`` waits for).
            abort: ends every in-flight request (finish reason ``abort``).

        Returns:
            True when the engine is held; False when a ``resume`` cancelled this pause while it waited.
        """
        if self._cycle is None:
            self._cycle = asyncio.Event()
        cycle = self._cycle
        self.mode = mode
        if mode == "abort":
            abort()
        elif mode == "wait" and not self._held.is_set():
            self.admit.clear()
            await _first(idle.wait(), cycle.wait(), self._held.wait())
        async with self._lock:
            if cycle.is_set():
                return False
            await asyncio.to_thread(self._holder.hold)
            self._held.set()
        return True

    async def resume(self) -> None:
        """End the pause (a pending ``wait`` returns False): the engine steps again, held-back requests are queued."""
        cycle, self._cycle = self._cycle, None
        if cycle is not None:
            cycle.set()
        self.mode = None
        self.admit.set()
        async with self._lock:
            await asyncio.to_thread(self._holder.release)
            self._held.clear()

    def release_at_shutdown(self) -> None:
        """Let the engine step (from any thread) so that the manager can finish and stop; the pause is over."""
        self._holder.release()
