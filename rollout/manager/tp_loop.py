"""The manager's generation loop on a tensor-parallel model: every rank's loop runs the same steps.

The loop goes in rounds, each opened by one collective (``TensorParallel.agree``, a MAX all-reduce of a few ints over
the CPU group) that settles for all ranks:

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

from rollout.engine.engine import Engine
from rollout.manager.loop import GenerationLoop

# Seconds between rounds while idle or paused (the loop is woken early by local commands).
POLL_SECONDS = 0.05


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
