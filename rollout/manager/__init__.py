"""The persistent manager: a continuous-batching engine run in a background thread for a trainer's whole run.

Owns:
- ``manager.py``: ``ContinuousBatchingManager``, the engine it builds and rebuilds, its lifecycle and ``pause()``;
- ``request_api.py``: ``RequestAPI``, the manager's base class: ``add_request(s)``, ``add_scoring_requests``,
  ``cancel_request``, ``get_result``, ``request_id_iter``, result handlers;
- ``weight_updates.py``: ``WeightUpdates``, the manager's weight and adapter half: ``update_weights``, LoRA adapters,
  ``reset_prefix_cache``, the weight version;
- ``intake.py`` (checks in the caller's thread, the ``Inbox``), ``loop.py`` (``GenerationLoop`` and, on a
  tensor-parallel model, ``TensorParallelLoop``), ``pausing.py`` (``PauseGate``), ``lifecycle.py`` (state, stop flags,
  the loop's thread), ``outputs.py`` (``OutputRouter``: per-request results and streams), ``persistence.py`` (a model's
  persistent manager);
- ``batch.py``: ``generate_batch``, ``init_continuous_batching``, ``continuous_batching_context_manager`` and
  ``attach``, transformers' entry points as functions of the model.

May import: the engine through its face only (``from rollout.engine import ...``, never an engine sub-room such as
``rollout.engine.kv`` or ``rollout.engine.worker``), ``rollout.weights``, ``rollout.lora`` and the ground modules
(``rollout.checks``, ``config``, ``sampling_params``, ``stop_strings``, ``requests``). Nothing imports this room but
the rooms above it (agents, serve) and the face (``rollout``).
"""

from rollout.manager.batch import (
    attach,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
    is_attached,
)
from rollout.manager.intake import QueueFullError
from rollout.manager.manager import ContinuousBatchingManager

__all__ = [
    "ContinuousBatchingManager",
    "QueueFullError",
    "attach",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
    "is_attached",
]
