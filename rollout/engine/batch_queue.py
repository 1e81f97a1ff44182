"""Async batching's step function: vLLM v1's ``step_with_batch_queue`` with a queue of two (``BatchQueue``).

Each ``step()`` schedules and launches the next step while the one in flight runs (its tokens are placeholders, filled
on the device), then waits for the one in flight and applies its results. On CPU the steps run in the runner's worker
thread. Nothing scheduled is taken back (see ``async_scheduler``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rollout.engine.sched.async_scheduler import AsyncScheduler
from rollout.engine.sched.output import RunnerOutput, SchedulerOutput
from rollout.engine.worker.runner import LaunchedStep, ModelRunner
from rollout.requests import Request

__all__ = ["BatchQueue"]


@dataclass
class _InFlight:
    """The step launched and not yet collected."""

    launched: LaunchedStep
    launched_at: float  # time.perf_counter()


class BatchQueue:
    """The step in flight of an async engine, and the updates of a drained step not returned yet.

    Args:
        scheduler: the engine's scheduler.
        runner: the engine's model runner.
        record: counts a step, ``record(scheduler_output, runner_output, seconds)`` (``Engine``'s): seconds is the wall
            time the step adds, from the later of its launch and the previous step's end to its end.

    Attributes:
        num_async_steps: steps scheduled and launched while the step before them ran.
    """

    def __init__(
        self,
        scheduler: AsyncScheduler,
        runner: ModelRunner,
        record: Callable[[SchedulerOutput, RunnerOutput, float], None],
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.record = record
        self.num_async_steps = 0
        self._in_flight: _InFlight | None = None
        self._completed: list[Request] = []  # updated by a drain, returned by the next step()
        self._last_step_end = 0.0

    @property
    def in_flight(self) -> bool:
        """True while a launched step is not collected."""
        return self._in_flight is not None

    @property
    def busy(self) -> bool:
        """True while a step is in flight or a drained step's updates are not returned yet."""
        return self._in_flight is not None or bool(self._completed)

    def step(self) -> list[Request]:
        """Schedule and launch the next step behind the one in flight, then wait for that one and apply it.

        Returns:
            The requests updated by the step applied (after those of a ``drain`` not returned yet).
        """
        updated, self._completed = self._completed, []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # Its KV copies (offloads of preempted requests), if any, run after the step in flight.
            if self._in_flight is not None:
                updated += self._complete()
            self.runner.execute(scheduler_output)
            self.record(scheduler_output, RunnerOutput(), 0.0)
            return updated
        previous = self._in_flight
        prepared = self.runner.prepare_step(scheduler_output)  # overlaps the step in flight
        launched = self.runner.launch(prepared, previous.launched if previous is not None else None)
        if previous is not None:
            self.num_async_steps += 1
            updated += self._complete()
        self._in_flight = _InFlight(launched, time.perf_counter())
        return updated

    def drain(self) -> list[Request]:
        """Finish the step in flight, if any, and apply its results; launch nothing (see ``Engine.drain``)."""
        updated, self._completed = self._completed, []
        if self._in_flight is not None:
            updated += self._complete()
        return updated

    def quiesce(self) -> None:
        """Finish the step in flight; its updates are returned by the next ``step()``."""
        if self._in_flight is not None:
            self._completed = self.drain()

    def drop(self) -> None:
        """Forget the step in flight (the engine closes; the runner's worker thread finishes it)."""
        self._in_flight = None

    def _complete(self) -> list[Request]:
        """Wait for the step in flight and apply its results."""
        flight = self._in_flight
        assert flight is not None
        self._in_flight = None
        scheduler_output = flight.launched.prepared.scheduler_output
        runner_output = self.runner.collect(flight.launched)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.perf_counter()
        self.record(scheduler_output, runner_output, now - max(flight.launched_at, self._last_step_end))
        self._last_step_end = now
        return updated
