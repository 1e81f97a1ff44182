"""rollout/engine"""

from rollout.engine.engine import Engine
from rollout.engine.stats import EngineStats
from rollout.engine.worker.distributed import TensorParallel

__all__ = ["Engine", "EngineStats", "TensorParallel"]
