"""rollout: a continuous-batching generation engine for the rollouts of RL trainers."""

from .api import generate_batch
from .config import ContinuousBatchingConfig
from .engine import Engine, UnsupportedModelError
from .requests import GenerationOutput, RequestStatus, SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "Engine",
    "GenerationOutput",
    "RequestStatus",
    "SamplingParams",
    "UnsupportedModelError",
    "generate_batch",
]

__version__ = "0.1.0"
