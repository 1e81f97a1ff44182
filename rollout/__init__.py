"""rollout: a continuous-batching generation engine for the rollouts of RL trainers.

The public names below are loaded on first use (PEP 562's module ``__getattr__``), each from the module that defines
it, and so are the submodules (``rollout.engine``...): ``import rollout`` and the light modules (``rollout.config``,
``rollout.fleet``...) import no torch, so a console script parses its arguments and answers a bad flag at once, before
the seconds torch takes to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors read; at run time each name is imported on first use
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

# Each public name -> the module of rollout that defines it.
_EXPORTS = {
    "attach": "api",
    "continuous_batching_context_manager": "api",
    "generate_batch": "api",
    "init_continuous_batching": "api",
    "is_attached": "api",
    "num_blocks_for_model": "cache_sizing",
    "usable_memory_bytes": "cache_sizing",
    "FieldError": "checks",
    "RolloutClient": "client",
    "RolloutServerError": "client",
    "RolloutWeightTransfer": "client",
    "ContinuousBatchingConfig": "config",
    "Engine": "engine",
    "EngineStats": "engine",
    "Environment": "environments",
    "ToolCall": "environments",
    "environment_tools": "environments",
    "parse_tool_calls": "environments",
    "tool_schemas": "environments",
    "ChatDelta": "chat_delta",
    "ClientTurns": "episodes",
    "Episode": "episodes",
    "EpisodeLimits": "episodes",
    "ManagerTurns": "episodes",
    "Turn": "episodes",
    "TurnBackend": "episodes",
    "TurnOutput": "episodes",
    "episode_json": "episodes",
    "run_episode": "episodes",
    "run_episodes": "episodes",
    "QueueFullError": "intake",
    "load_model": "loading",
    "rollout_home": "loading",
    "LoraAdapter": "lora",
    "adapter_state_dict": "lora",
    "ContinuousBatchingManager": "manager",
    "UnsupportedModelError": "models",
    "model_context_length": "models",
    "RolloutPool": "pool",
    "GenerationOutput": "requests",
    "RequestStatus": "requests",
    "SamplingParams": "sampling_params",
    "build_sampling_params": "sampling_params",
    "ScoreOutput": "scoring",
    "score": "scoring",
    "score_with_engine": "scoring",
}

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


def __getattr__(name: str) -> Any:
    """A public name (or a submodule) of rollout, imported on first use and kept.

    Raises:
        AttributeError: ``name`` is neither a public name nor a submodule of rollout.
    """
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # the submodule exists and failed to import one of its own
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
