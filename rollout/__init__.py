"""rollout: a continuous-batching generation engine for the rollouts of RL trainers."""

from rollout.agents import (
    ChatDelta,
    ClientTurns,
    Environment,
    Episode,
    EpisodeLimits,
    ManagerTurns,
    ToolCall,
    Turn,
    TurnBackend,
    TurnOutput,
    environment_tools,
    episode_json,
    parse_tool_calls,
    run_episode,
    run_episodes,
    tool_schemas,
)
from rollout.checks import FieldError
from rollout.config import ContinuousBatchingConfig
from rollout.engine.engine import Engine, EngineStats
from rollout.engine.kv.sizing import num_blocks_for_model, usable_memory_bytes
from rollout.fleet import RolloutClient, RolloutPool, RolloutServerError, RolloutWeightTransfer
from rollout.lora import LoraAdapter, adapter_state_dict
from rollout.manager.batch import (
    attach,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
    is_attached,
)
from rollout.manager.intake import QueueFullError
from rollout.manager.manager import ContinuousBatchingManager
from rollout.requests import GenerationOutput, RequestStatus
from rollout.sampling_params import SamplingParams, build_sampling_params
from rollout.scoring.offline import ScoreOutput, score, score_with_engine
from rollout.weights.loading import load_model, rollout_home
from rollout.weights.model_info import UnsupportedModelError, model_context_length

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
