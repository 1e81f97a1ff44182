"""rollout.agents: multi-turn episodes, their turns and their environments.

Owns ``turns`` (``TurnOutput``, the ``TurnBackend`` protocol and its backends ``ManagerTurns`` and ``ClientTurns``,
the ``TurnClient`` protocol), ``episodes`` (``EpisodeLimits``, ``Turn``, ``Episode``, ``run_episode(s)``,
``episode_json``), ``chat_delta`` (the chat template's ids of each environment message) and ``environments`` (TRL's
environment shape, tools, tool-call parsing).

May import ``rollout.manager`` and the ground modules (``rollout.checks``, ``config``, ``sampling_params``,
``stop_strings``, ``requests``, ``structured_outputs``). The fleet only through the ``TurnClient`` protocol: nothing of
``rollout.fleet`` is imported here (a ``RolloutClient`` or ``RolloutPool`` is passed in by the caller).
"""

from rollout.agents.chat_delta import ChatDelta
from rollout.agents.environments import (
    Environment,
    ToolCall,
    environment_tools,
    hermes_tool_call_blocks,
    parse_tool_calls,
    tool_schemas,
)
from rollout.agents.episodes import Episode, EpisodeLimits, Turn, episode_json, run_episode, run_episodes
from rollout.agents.turns import ClientTurns, ManagerTurns, TurnBackend, TurnClient, TurnOutput

# By module, as the docstring lists them: turns, episodes, chat_delta, environments.
__all__ = [
    "TurnOutput",
    "TurnBackend",
    "TurnClient",
    "ManagerTurns",
    "ClientTurns",
    "EpisodeLimits",
    "Turn",
    "Episode",
    "run_episode",
    "run_episodes",
    "episode_json",
    "ChatDelta",
    "Environment",
    "ToolCall",
    "environment_tools",
    "hermes_tool_call_blocks",
    "parse_tool_calls",
    "tool_schemas",
]
