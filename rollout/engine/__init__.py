"""The engine room: one model replica's continuous-batching engine. ``Engine`` (``engine``) takes requests in through
its gate (``gate.RequestGate``: the one check of a request) and runs the step, schedule -> execute -> update; its spec
(``spec``: config x model x device resolved once), the construction of its parts (``build``), its counters (``stats``),
its warmup (``warmup``), async batching's step queue (``batch_queue``) and the host-to-device staging that the sampler
and the worker share (``staging``, a leaf that imports nothing of rollout). The sub-rooms, in import order: ``kv``
(KV memory), ``sched`` (scheduling), ``attention`` (paged attention), ``sample`` (sampling), ``worker`` (the step's
inputs, forward and runner).

The top files may import every engine sub-room, ``rollout.weights``, ``rollout.lora`` and the ground modules
(``checks``, ``config``, ``sampling_params``, ``stop_strings``, ``requests``); never the manager, scoring, the fleet,
the agents or serve. Those rooms import the engine through this face only: the names below.
"""

from rollout.engine.engine import Engine
from rollout.engine.kv.sizing import num_blocks_for_model, usable_memory_bytes
from rollout.engine.stats import EngineStats
from rollout.engine.worker.distributed import TensorParallel, is_driver_rank
from rollout.engine.worker.invariant import batch_invariant
from rollout.weights.model_info import UnsupportedModelError

__all__ = [
    "Engine",
    "EngineStats",
    "TensorParallel",
    "UnsupportedModelError",
    "batch_invariant",
    "is_driver_rank",
    "num_blocks_for_model",
    "usable_memory_bytes",
]
