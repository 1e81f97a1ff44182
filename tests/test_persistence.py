"""The model-to-manager link without a thread: one persistent manager per model, dropped once it failed or was
destroyed, ended only by its own manager, keyed weakly by the model."""

from __future__ import annotations

import gc
import weakref

from rollout.manager.persistence import persistent_manager_of, register_persistent, unregister_persistent


class Model:
    """A model stand-in: any weakly referenceable object keys the link."""


class FakeManager:
    """What the link needs of a manager: ``model`` and ``state``."""

    def __init__(self, model: Model, state: str = "created") -> None:
        self.model = model
        self.state = state


def test_a_registered_manager_is_found_until_it_ends_its_link() -> None:
    model, other = Model(), Model()
    assert persistent_manager_of(model) is None
    first = FakeManager(model)
    register_persistent(first)
    assert persistent_manager_of(model) is first and persistent_manager_of(other) is None
    second = FakeManager(model, state="running")
    register_persistent(second)  # replaces the first
    assert persistent_manager_of(model) is second
    unregister_persistent(first)  # not its link: kept
    assert persistent_manager_of(model) is second
    unregister_persistent(second)
    assert persistent_manager_of(model) is None
    unregister_persistent(second)  # no link: nothing to do


def test_a_failed_or_destroyed_manager_is_not_returned_and_its_link_is_dropped() -> None:
    for state in ("failed", "destroyed"):
        model = Model()
        manager = FakeManager(model, state="stopped")
        register_persistent(manager)
        assert persistent_manager_of(model) is manager
        manager.state = state
        assert persistent_manager_of(model) is None
        manager.state = "stopped"
        assert persistent_manager_of(model) is None  # the link was dropped, not only hidden


def test_a_registered_manager_keeps_its_model_alive_until_its_link_ends() -> None:
    model = Model()
    manager = FakeManager(model)
    register_persistent(manager)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is not None and persistent_manager_of(ref()) is manager  # the manager references its model
    unregister_persistent(manager)
    del manager
    gc.collect()
    assert ref() is None  # the link itself held the model only weakly
