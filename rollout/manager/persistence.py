"""The model-to-manager link: each model's persistent manager, in one weak mapping.

A persistent manager (``persistent_manager=True``, or ``stop(keep_for_next_session=True)``) is reused by the next
call with that model and returned by ``init_continuous_batching``; this module is the one place that links them. The
mapping is keyed weakly by the model, but a registered manager references its model, so a model stays alive until
its persistent manager is destroyed. The manager registers itself (``persist``) and leaves on ``destroy()``; the
entry points look it up.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol


class PersistentManager(Protocol):
    """What the link needs of a manager: its model and its state (``failed`` and ``destroyed`` end the link)."""

    model: Any

    @property
    def state(self) -> str: ...


_PERSISTENT: weakref.WeakKeyDictionary[Any, PersistentManager] = weakref.WeakKeyDictionary()


def persistent_manager_of(model: Any) -> Any:
    """The usable persistent manager registered for ``model`` (see ``register_persistent``), if any.

    Returns:
        The ``ContinuousBatchingManager``, or None when there is none or it failed or was destroyed
        (the link is then dropped).
    """
    manager = _PERSISTENT.get(model)
    if manager is not None and manager.state in ("failed", "destroyed"):
        del _PERSISTENT[model]
        return None
    return manager


def register_persistent(manager: PersistentManager) -> None:
    """Make ``manager`` its model's persistent manager (replacing any other)."""
    _PERSISTENT[manager.model] = manager


def unregister_persistent(manager: PersistentManager) -> None:
    """End the link of ``manager``'s model, if it leads to ``manager``; another manager's link is kept."""
    if _PERSISTENT.get(manager.model) is manager:
        del _PERSISTENT[manager.model]
