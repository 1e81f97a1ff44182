"""rollout: a continuous-batching generation engine for the rollouts of RL trainers.

The public names below are loaded on first use (PEP 562's module ``__getattr__``), each from the module that defines
it, and so are the submodules (``rollout.engine``...): ``import rollout`` and the light modules (``rollout.config``,
``rollout.fleet.cli``...) import no torch, so a console script parses its arguments and answers a bad flag at once,
before the seconds torch takes to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.lazy import lazy_face

if TYPE_CHECKING:  # what type checkers and editors read; at run time each name is imported on first use
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

    # Loaded from here for older code, not exported (see below): the redundant aliases say so.
    from rollout.engine import Engine as Engine
    from rollout.engine import EngineStats as EngineStats
    from rollout.engine import batch_invariant as batch_invariant
    from rollout.engine import num_blocks_for_model as num_blocks_for_model
    from rollout.engine import usable_memory_bytes as usable_memory_bytes
    from rollout.fleet import RolloutClient, RolloutPool, RolloutServerError, RolloutWeightTransfer
    from rollout.lora import LoraAdapter, adapter_state_dict
    from rollout.manager import (
        ContinuousBatchingManager,
        QueueFullError,
        attach,
        continuous_batching_context_manager,
        generate_batch,
        init_continuous_batching,
        is_attached,
    )
    from rollout.requests import GenerationOutput, RequestStatus
    from rollout.sampling_params import SamplingParams, build_sampling_params
    from rollout.scoring import ScoreOutput, score, score_with_engine
    from rollout.structured_outputs import StructuredOutputs
    from rollout.weights import UnsupportedModelError, load_model, model_context_length, rollout_home

# Each public name -> the room (or ground module) whose face defines it. ``Engine``, ``EngineStats``,
# ``num_blocks_for_model`` and ``usable_memory_bytes`` still load from here but are not in ``__all__``: the engine is
# the internals of the manager, scoring and benchmarks (vLLM exports ``LLM``, not ``EngineCore``); import them from
# ``rollout.engine``.
_EXPORTS = {
    "attach": "rollout.manager",
    "batch_invariant": "rollout.engine",
    "continuous_batching_context_manager": "rollout.manager",
    "generate_batch": "rollout.manager",
    "init_continuous_batching": "rollout.manager",
    "is_attached": "rollout.manager",
    "num_blocks_for_model": "rollout.engine",
    "usable_memory_bytes": "rollout.engine",
    "FieldError": "rollout.checks",
    "RolloutClient": "rollout.fleet",
    "RolloutServerError": "rollout.fleet",
    "RolloutWeightTransfer": "rollout.fleet",
    "ContinuousBatchingConfig": "rollout.config",
    "Engine": "rollout.engine",
    "EngineStats": "rollout.engine",
    "Environment": "rollout.agents",
    "ToolCall": "rollout.agents",
    "environment_tools": "rollout.agents",
    "parse_tool_calls": "rollout.agents",
    "tool_schemas": "rollout.agents",
    "ChatDelta": "rollout.agents",
    "ClientTurns": "rollout.agents",
    "Episode": "rollout.agents",
    "EpisodeLimits": "rollout.agents",
    "ManagerTurns": "rollout.agents",
    "Turn": "rollout.agents",
    "TurnBackend": "rollout.agents",
    "TurnOutput": "rollout.agents",
    "episode_json": "rollout.agents",
    "run_episode": "rollout.agents",
    "run_episodes": "rollout.agents",
    "QueueFullError": "rollout.manager",
    "load_model": "rollout.weights",
    "rollout_home": "rollout.weights",
    "LoraAdapter": "rollout.lora",
    "adapter_state_dict": "rollout.lora",
    "ContinuousBatchingManager": "rollout.manager",
    "UnsupportedModelError": "rollout.weights",
    "model_context_length": "rollout.weights",
    "RolloutPool": "rollout.fleet",
    "GenerationOutput": "rollout.requests",
    "RequestStatus": "rollout.requests",
    "SamplingParams": "rollout.sampling_params",
    "build_sampling_params": "rollout.sampling_params",
    "StructuredOutputs": "rollout.structured_outputs",
    "ScoreOutput": "rollout.scoring",
    "score": "rollout.scoring",
    "score_with_engine": "rollout.scoring",
}

__all__ = [
    "attach",
    "batch_invariant",
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
    "GenerationOutput",
    "RequestStatus",
    "ScoreOutput",
    "SamplingParams",
    "build_sampling_params",
    "StructuredOutputs",
    "UnsupportedModelError",
    "generate_batch",
    "score",
    "score_with_engine",
    "RolloutClient",
    "RolloutPool",
    "RolloutServerError",
    "RolloutWeightTransfer",
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


__getattr__, __dir__ = lazy_face(globals(), _EXPORTS, submodules=True)
