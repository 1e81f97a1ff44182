"""rollout: a continuous-batching generation engine for the rollouts of RL trainers."""

from .api import attach, continuous_batching_context_manager, generate_batch, init_continuous_batching, is_attached
from .cache_sizing import num_blocks_for_model, usable_memory_bytes
from .chat_delta import ChatDelta
from .checks import FieldError
from .client import RolloutClient, RolloutServerError, RolloutWeightTransfer
from .config import ContinuousBatchingConfig
from .engine import Engine, EngineStats
from .environments import Environment, ToolCall, environment_tools, parse_tool_calls, tool_schemas
from .episodes import (
    ClientTurns,
    Episode,
    EpisodeLimits,
    ManagerTurns,
    Turn,
    TurnBackend,
    TurnOutput,
    episode_json,
    run_episode,
    run_episodes,
)
from .intake import QueueFullError
from .loading import load_model, rollout_home
from .lora import LoraAdapter, adapter_state_dict
from .manager import ContinuousBatchingManager
from .models import UnsupportedModelError, model_context_length
from .pool import RolloutPool
from .requests import GenerationOutput, RequestStatus
from .sampling_params import SamplingParams, build_sampling_params
from .scoring import ScoreOutput, score, score_with_engine

__all__ = [
    "attach",
    "is_attached",
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "FieldError",
    "QueueFullError",
    "continuous_batching_context_manager",
    "init_continuous_batching",
    "load_model",
    "LoraAdapter",
    "adapter_state_dict",
    "rollout_home",
    "model_context_length",
    "Engine",
    "EngineStats",
    "GenerationOutput",
    "RequestStatus",
    "ScoreOutput",
    "SamplingParams",
    "build_sampling_params",
    "UnsupportedModelError",
    "generate_batch",
    "score",
    "score_with_engine",
    "RolloutClient",
    "RolloutPool",
    "RolloutServerError",
    "RolloutWeightTransfer",
    "num_blocks_for_model",
    "usable_memory_bytes",
    "ChatDelta",
    "ClientTurns",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "ManagerTurns",
    "ToolCall",
    "Turn",
    "TurnBackend",
    "TurnOutput",
    "environment_tools",
    "episode_json",
    "parse_tool_calls",
    "run_episode",
    "run_episodes",
    "tool_schemas",
]

__version__ = "0.1.0"
