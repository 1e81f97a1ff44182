"""The manager's generation loop: what its background thread runs for the life of one engine.

Between two engine steps, with the manager's lock held, the loop hands the inbox's requests and cancels to the engine
(``intake.Inbox.drain``), waits while anyone holds the pause (``pausing.PauseGate``), and reads the stop flags
(``lifecycle.Lifecycle``): a hard stop fails every request at once; a stop ends the loop once the engine is idle. Each
step runs outside the lock, marked in the pause gate so that a new pause waits for it, and its updated requests go to
their result handles (``outputs.OutputRouter.publish``). With async batching a pause or a hard stop first has the
engine finish the step in flight (``Engine.drain``). After any pause (counted by the gate's ``entered``, so one that
began and ended while the loop was publishing counts too) the loop has the model's ``WeightWatch`` decide whether the
weights changed, from their contents, before it steps again. Whatever the loop raises fails the manager and every
request; its end closes the engine unless it is kept for the next session.

On a tensor-parallel model (``TensorParallelLoop``) every rank's loop runs the same steps, in rounds, each opened by
one collective (``TensorParallel.agree``, a MAX all-reduce of a few ints over the CPU group) that settles for all ranks:

- what enters the engine: the driver (TP rank 0) broadcasts its inbox (requests, cancels, a recompute); the other
  ranks' ``add_request`` queue nothing, so the driver's order is every rank's;
- the weight version: the driver's (it enters prefix-cache hashes, so the ranks' schedules must agree on it);
- whether a step may run: not while any rank holds a pause, nor while the ranks have entered different numbers of
  pauses (a pause is collective, as in transformers: every rank calls ``pause()`` / ``update_weights`` alike);
- stopping: the driver's stop (another rank's waits for it); a hard stop from any rank.

A rank marks a step as running (``PauseGate.begin_step``) when it sends its state without a pause held, so a later
pause waits for the round; in a pause round the loop polls every ``POLL_SECONDS``, so a long pause never runs into
``cpu_group_timeout``. Source: transformers' ``ContinuousBatchProcessor._update_tp_group_state``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rollout.engine import Engine
from rollout.manager.intake import Inbox
from rollout.manager.lifecycle import Lifecycle
from rollout.manager.outputs import OutputRouter
from rollout.manager.pausing import PauseGate
from rollout.requests import Request, RequestStatus
from rollout.weights.versions import WeightWatch

# The loop's messages keep the logger they had in manager.py.
logger = logging.getLogger("rollout.manager.manager")

# How long the idle loop sleeps before rechecking its state (it is woken on every command anyway).
IDLE_WAIT_SECONDS = 0.05
# Seconds between a tensor-parallel loop's rounds while idle or paused (it is woken early by local commands).
POLL_SECONDS = 0.05


class GenerationLoop:
    """The loop of one manager, over the pieces the manager shares with the callers' threads.

    Args:
        cond: the manager's (re-entrant) condition variable, which guards every piece below.
        inbox: the checked requests and cancels queued by the callers.
        outputs: the result handles.
        pausing: the pause holders and the in-step flag.
        life: the state and stop flags; the loop records its failure and its end there.
        weights: the model's weight record and version, compared when a pause ends.
        check_contents: compare the weights' contents (``ContinuousBatchingConfig.check_weight_contents``).
    """

    def __init__(
        self,
        cond: threading.Condition,
        inbox: Inbox,
        outputs: OutputRouter,
        pausing: PauseGate,
        life: Lifecycle,
        weights: WeightWatch,
        check_contents: bool = True,
    ) -> None:
        self._cond = cond
        self._inbox = inbox
        self._outputs = outputs
        self._pausing = pausing
        self._life = life
        self._weights = weights
        self._check_contents = check_contents
        self._checked_pauses = pausing.entered  # the gate's holds the weights were last checked after

    def weights_checked(self) -> None:
        """With the lock held: the weights were just checked (``start()``): pauses up to now need no check."""
        self._checked_pauses = self._pausing.entered

    def run(self, engine: Engine) -> None:
        """Step ``engine`` until a stop ends the loop or a step raises; never raises itself.

        On return the lifecycle has recorded the end (STOPPED, or FAILED with the error) and, when a stop was asked
        without ``keep``, the engine is closed.
        """
        try:
            # A new thread starts on cuda:0: launch on the model's GPU (rank k's under accelerate).
            engine.use_device_in_this_thread()
            self._rounds(engine)
        except BaseException as e:  # every failure must reach the readers
            logger.exception("rollout manager loop failed%s", self._where(engine))
            with self._cond:
                self._life.fail(e)
                self.fail_all(engine, e)
        finally:
            with self._cond:
                self._pausing.end_step()
                close = self._life.loop_ended()
            if close:
                engine.close()

    def _where(self, engine: Engine) -> str:
        """What the failure log adds after "loop failed" (the TP rank in ``TensorParallelLoop``)."""
        return ""

    def _rounds(self, engine: Engine) -> None:
        """The loop proper: returns when a stop ends it; raises what a step raises."""
        life, gate = self._life, self._pausing
        while True:
            with self._cond:
                self._inbox.drain(engine)
                # A step in flight (async batching) keeps the gate's step mark: a pause or a hard stop
                # first has it finished, launching nothing after it.
                drain = engine.in_flight and (gate.holders > 0 or life.hard_stop)
                if not drain:
                    gate.wait_out(abort=lambda: life.hard_stop, on_wake=lambda: self._inbox.drain(engine))
                    if gate.entered != self._checked_pauses and not life.hard_stop:
                        # Every pause since the last check has ended: its holders may have changed the weights.
                        self._checked_pauses = gate.entered
                        self._weights.bump_if_changed(engine, self._check_contents)
                    if life.hard_stop:
                        self.fail_all(engine, RuntimeError("the manager was stopped with hard_stop=True"))
                        return
                    if not engine.has_unfinished():
                        if life.stop_requested:
                            return
                        self._cond.wait(IDLE_WAIT_SECONDS)
                        continue
                    gate.begin_step()
            self._step(engine, engine.drain if drain else engine.step)

    def _step(self, engine: Engine, step: Callable[[], list[Request]]) -> None:
        """Run ``step`` outside the lock, then lift the gate's step mark (unless a step stays in flight) and publish the
        updated requests."""
        try:
            updated = step()
        finally:
            with self._cond:
                if not engine.in_flight:
                    self._pausing.end_step()
        self._outputs.publish(updated)

    def fail_all(self, engine: Engine, error: BaseException) -> None:
        """End every request, in the engine, in the inbox or only in a handle: FAILED with ``error``."""
        message = f"{type(error).__name__}: {error}"
        for rid in list(engine.requests):
            req = engine.finish_request(rid, RequestStatus.FAILED, message)
            if req is not None:
                self._outputs.finish(rid, req.to_output())
        self._inbox.fail_all(message)
        self._outputs.fail_pending(message)


class TensorParallelLoop(GenerationLoop):
    """``GenerationLoop`` for an engine with ``engine.tp`` set; same arguments and guarantees."""

    def _where(self, engine: Engine) -> str:
        assert engine.tp is not None
        return f" (tensor-parallel rank {engine.tp.tp_rank})"

    def _rounds(self, engine: Engine) -> None:
        """Step ``engine`` in lockstep with the other ranks until a stop; raises what a step raises.

        Every rank's loop ends in the same round (a stop once idle, or a hard stop). A step that raises on one rank
        fails that rank's manager; the others fail when their next collective times out (``cpu_group_timeout``).
        """
        tp = engine.tp
        assert tp is not None, "TensorParallelLoop needs a tensor-parallel engine"
        life, gate = self._life, self._pausing
        was_paused = False
        while True:
            with self._cond:
                items = self._inbox.take() if tp.is_driver else []
                holding = gate.holders > 0
                if not holding:
                    gate.begin_step()  # committed to this round: a new pause waits for its end
                    if tp.is_driver and (items or was_paused):
                        # Weights changed by hand in the pause (or before these requests) get a new version.
                        self._weights.bump_if_changed(engine, self._check_contents)
                stop, hard, entered = life.stop_requested, life.hard_stop, gate.entered
                version = engine.weight_version
            state = tp.agree(len(items), stop, hard, holding, entered, version)
            if state.num_items:
                items = tp.broadcast_object(items)
            with self._cond:
                self._inbox.apply(engine, items)
                if not tp.is_driver and not state.paused:
                    # Adopted only between pauses: in one, the driver's may already count an update
                    # this rank has still to make (its update_weights then returns the same number).
                    engine.set_weight_version(state.weight_version)
                if state.hard_stop:
                    self.fail_all(engine, RuntimeError("the manager was stopped with hard_stop=True"))
                    return
                was_paused = state.paused
                idle = state.paused or not engine.has_unfinished()
                if idle:
                    gate.end_step()
                    if not state.paused and state.stop:
                        return
                    self._cond.wait(POLL_SECONDS)
                    continue
            self._step(engine, engine.step)
