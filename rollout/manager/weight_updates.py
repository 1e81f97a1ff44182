"""The manager's weight and adapter half (``WeightUpdates``): the pause over every manager on the model, in-place weight
updates, LoRA adapters, the prefix-cache reset and the weight version.

The weight version is the model object's, kept by its ``WeightWatch`` (``rollout.weights.versions``) and shared with
every manager and engine on the model; this part registers its manager's pause gate there, so that ``pause()`` on any
manager holds them all. Each change happens under that pause and the manager's lock: ``update_weights`` copies the
tensors in place (``copy_weights``) and bumps the version; a change made by hand is found by the watch (from a cheap
fingerprint when requests are added, ``sync``); ``load_lora`` loads a copy of the adapter into the engine and bumps the
version too, and keeps that copy for an engine the manager rebuilds (``restore``). In-flight requests keep their KV
unless the caller asks for a recompute; under tensor parallelism the driver's loop orders it for every rank (through
the inbox).

``ContinuousBatchingManager`` holds one and documents each public method (``update_weights``, ``load_lora``,
``unload_lora``, ``lora_adapters``, ``reset_prefix_cache``, ``pause``, ``weight_version``) where users read it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from rollout.engine import Engine, TensorParallel
from rollout.lora import LoraAdapter
from rollout.manager.intake import Inbox
from rollout.manager.pausing import PauseGate
from rollout.weights.versions import NamedTensors, WeightWatch, copy_weights, plan_weight_copy

__all__ = ["WeightUpdates"]


class WeightUpdates:
    """The weights and adapters one manager serves, and the changes made to them.

    Args:
        watch: the model's weight record and version (``watch_of(model)``), shared with every manager on the model.
        pausing: the manager's pause gate; registered with ``watch`` until ``release``.
        cond: the manager's condition variable (it guards the engine, the inbox and the version's changes).
        inbox: the manager's inbox (the adapters its queued requests were accepted under; a tensor-parallel
            recompute).
        engine: the manager's engine now, None once it was destroyed; called under ``cond`` or a pause.
        tp: the engine's tensor parallelism, or None.
        check_contents: decide from the weights' contents (``ContinuousBatchingConfig.check_weight_contents``).
    """

    def __init__(
        self,
        watch: WeightWatch,
        pausing: PauseGate,
        cond: threading.Condition,
        inbox: Inbox,
        engine: Callable[[], Engine | None],
        tp: TensorParallel | None,
        check_contents: bool,
    ) -> None:
        self.watch = watch
        self._pausing = pausing
        watch.gates.add(pausing)  # a pause of any manager on the model holds this manager's loop too
        self._cond = cond
        self._inbox = inbox
        self._engine = engine
        self._tp = tp
        self._check_contents = check_contents
        # Loaded adapters (a copy each) and the version their load made, loaded again into an engine rebuilt by start().
        self._loras: dict[str, tuple[LoraAdapter, int]] = {}
        self._final_version = 0  # the engine's, once the manager was destroyed

    @property
    def version(self) -> int:
        """The weight version (``ContinuousBatchingManager.weight_version``)."""
        engine = self._engine()
        if engine is None:
            return self._final_version
        return self.watch.version if self._tp is None else engine.weight_version

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the loaded adapters, in load order."""
        return list(self._loras)

    def pause(self) -> contextlib.AbstractContextManager[None]:
        """Hold every manager on the model, this manager's gate first (``WeightWatch.hold_all``)."""
        return self.watch.hold_all(self._pausing)

    def current_engine(self) -> Engine:
        """The engine.

        Raises:
            RuntimeError: the manager was destroyed.
        """
        engine = self._engine()
        if engine is None:
            raise RuntimeError("this manager was destroyed")
        return engine

    def update_weights(self, named_tensors: NamedTensors | None, recompute: bool, version: int | None) -> int:
        """``ContinuousBatchingManager.update_weights``: check, then copy under a pause and bump the version.

        Raises:
            KeyError, ValueError, TypeError: as ``plan_weight_copy``, before anything is copied; ValueError:
                ``version`` not above the current version.
            RuntimeError: the manager was destroyed.
        """
        if self._engine() is None:
            raise RuntimeError("this manager was destroyed; update the model directly or build a new manager")
        plan = plan_weight_copy(self.watch.model, named_tensors)
        if version is not None and version <= self.version:
            raise ValueError(f"weight_version: {version} is not above the current weight version {self.version}")
        with self.pause():
            copy_weights(plan)
            engine = self.current_engine()
            with self._cond:
                version = self.watch.bump(engine, self._check_contents, recompute, version)
            if recompute:  # the version change did it (a no-op again) but under tensor parallelism: the loop does it
                self._recompute_in_flight(engine)
        return version

    def load_lora(self, adapter: LoraAdapter, replace: bool) -> int:
        """``ContinuousBatchingManager.load_lora``: load a copy of ``adapter`` under a pause; returns the new version.

        Raises:
            FieldError: the engine refuses the adapter (nothing changes); ValueError: ``enable_lora`` is off.
            RuntimeError: the manager was destroyed, or the model is tensor-parallel.
        """
        if self._tp is not None:
            raise RuntimeError("load_lora: LoRA adapters are not served on a tensor-parallel model")
        snapshot = adapter.clone()  # what an engine rebuilt by start() loads again: the tensors of this version
        with self.pause(), self._cond:  # the lock: requests accepted meanwhile resolve before or after, never between
            engine = self.current_engine()
            loaded = engine.load_lora(snapshot, replace, self._inbox.queued_lora_ids())
            self._loras.pop(adapter.name, None)  # re-inserted last: load order
            loaded.version = self.watch.bump(engine, self._check_contents, adapter=True)
            self._loras[adapter.name] = (snapshot, loaded.version)
            return loaded.version

    def unload_lora(self, name: str) -> None:
        """``ContinuousBatchingManager.unload_lora``: forget adapter ``name`` under a pause.

        Raises:
            KeyError: no adapter of that name is loaded; ValueError: ``enable_lora`` is off.
            RuntimeError: the manager was destroyed.
        """
        with self.pause(), self._cond:
            self.current_engine().unload_lora(name)
            self._loras.pop(name, None)

    def reset_prefix_cache(self, reset_running_requests: bool) -> None:
        """``ContinuousBatchingManager.reset_prefix_cache``: forget every prefix-cache block under a pause.

        Raises:
            RuntimeError: the manager was destroyed.
        """
        with self.pause():
            engine = self.current_engine()
            if reset_running_requests:
                self._recompute_in_flight(engine)
            with self._cond:
                engine.block_manager.reset_prefix_cache()

    def _recompute_in_flight(self, engine: Engine) -> None:
        """Under a pause: drop every unfinished request's KV, so it is re-prefilled when the loop steps again."""
        if self._tp is None:
            engine.recompute_in_flight()
        elif self._tp.is_driver:  # every rank applies the driver's, at the same point of its loop
            self._inbox.put_recompute()

    def sync(self) -> None:
        """From a caller's thread: notice weights changed by hand (an optimizer step outside ``update_weights``).

        The fingerprint is compared first without pausing (the common case: unchanged); a change is recorded under a
        pause, so that no step runs while the version moves.
        """
        with self._cond:
            if not self.watch.changed():
                return
        with self.pause(), self._cond:
            self.watch.bump_if_changed(self._engine(), self._check_contents)

    def check(self, engine: Engine) -> None:
        """With no step running (``start()``): a change of the weights since the last record is a new version, which
        ``engine`` adopts."""
        self.watch.bump_if_changed(engine, self._check_contents)

    def restore(self, engine: Engine, version: int) -> None:
        """Give an engine the manager rebuilt (``start()`` after a closing ``stop()``) the weight version ``version``
        and every loaded adapter, each under the version its load made."""
        engine.set_weight_version(version)
        for adapter, adapter_version in self._loras.values():
            engine.load_lora(adapter, version=adapter_version)

    def release(self, engine: Engine | None) -> None:
        """On ``destroy()``: keep ``engine``'s weight version as the manager's, and leave the model's pause."""
        if engine is not None:
            self._final_version = engine.weight_version
        self.watch.gates.discard(self._pausing)
