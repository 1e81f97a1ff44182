"""rollout: a continuous-batching generation engine for the rollouts of RL trainers."""

from .api import continuous_batching_context_manager, generate_batch, init_continuous_batching
from .config import ContinuousBatchingConfig
from .engine import Engine, UnsupportedModelError
from .manager import ContinuousBatchingManager, QueueFullError
from .models import load_model, rollout_home
from .scoring import ScoreOutput, model_context_length, score, score_with_engine
from .requests import GenerationOutput, RequestStatus, SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "QueueFullError",
    "continuous_batching_context_manager",
    "init_continuous_batching",
    "load_model",
    "rollout_home",
    "model_context_length",
    "Engine",
    "GenerationOutput",
    "RequestStatus",
    "ScoreOutput",
    "SamplingParams",
    "UnsupportedModelError",
    "generate_batch",
    "score",
    "score_with_engine",
]

__version__ = "0.1.0"
