"""Environments of multi-turn episodes: TRL's ``environment_factory`` shape, their tools, and tool calls read from text.

An environment is any object with (TRL 1.16, ``GRPOTrainer(environment_factory=...)``):
- ``reset(**kwargs) -> str | None``: start an episode from a dataset row's fields; a string is appended to the last
  user message of the prompt (TRL's rule);
- public methods (names not starting with ``_``): the tools the model may call, each with a docstring and type
  hints from which ``transformers.utils.get_json_schema`` builds the schema the chat template lists;
- optionally ``get_reward() -> float``: the episode's reward, read once it has ended.

rollout adds one optional method, ``respond(text: str) -> str | None``, called when the model's turn holds no tool
call: a string is the environment's next user message (a second attempt after "that is wrong"), None ends the
episode. TRL does not know it: in TRL's trainer it would be listed as one more tool, so an environment meant for both
leaves it out. ``reset``, ``get_reward`` and ``respond`` are never tools.

Tool calls are read from the model's text by the tokenizer's own parser where it has one (transformers'
``tokenizer.parse_response`` with the tokenizer's ``response_template``, the path TRL takes), else by the Hermes
format that Qwen 2.5/3, Hermes and SmolLM3 templates write and vLLM's ``hermes`` parser reads:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A call that fails (unknown tool, bad arguments, an
exception inside the tool) comes back to the model as the tool's message ``{"error": "..."}``, as in TRL: an
episode never crashes on a tool.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "NOT_TOOLS",
    "Environment",
    "ToolCall",
    "call_tool",
    "environment_tools",
    "hermes_tool_call_blocks",
    "parse_hermes_tool_calls",
    "parse_tool_calls",
    "tool_schemas",
]

# Methods of an environment that are never offered to the model as tools.
NOT_TOOLS = frozenset({"reset", "get_reward", "respond"})
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@runtime_checkable
class Environment(Protocol):
    """What an episode needs of an environment: ``reset``; tools, ``get_reward`` and ``respond`` are optional."""

    def reset(self, **kwargs: Any) -> str | None:
        """Start a new episode; a string is appended to the prompt's last user message."""
        ...


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model wrote.

    Attributes:
        name: the tool's name.
        arguments: keyword arguments, parsed from the call's JSON (a dict); a string that is not a JSON object is
            kept as it is and reported to the model as an error when called.
    """

    name: str
    arguments: dict[str, Any] | str


def environment_tools(env: object) -> dict[str, Callable[..., Any]]:
    """The tools of an environment: its public methods (bound), ``NOT_TOOLS`` left out, in name order.

    Methods are listed on the class, as TRL does, so that reading a property runs nothing.
    """
    return {
        name: getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    }


def tool_schemas(tools: dict[str, Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schemas of ``tools`` in the form chat templates take (``{"type": "function", "function": ...}``).

    Raises:
        ValueError: a tool lacks the docstring or type hints ``transformers.utils.get_json_schema`` needs; the
            message names it.
    """
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"tool {name!r}: no JSON schema ({type(e).__name__}: {e}); give it type hints and a Google-style "
                "docstring with an Args section"
            ) from e
    return schemas


def hermes_tool_call_blocks(text: str) -> list[tuple[int, int, str, Any]]:
    """The Hermes tool-call blocks of ``text`` that are calls, in the order written: ``(start, end, name, arguments)``.

    ``start:end`` is the block's span in ``text`` (``<tool_call>`` to ``</tool_call>``), ``arguments`` the call's
    ``arguments`` (``parameters`` where that is absent; ``{}`` where both are) as parsed from its JSON, of any type.
    A block whose JSON does not parse or that has no string ``name`` is no call (vLLM's ``hermes`` parser leaves it
    as text too). One reader for the episodes' tools and rollout-serve's ``tool_calls``, so the two never disagree.
    """
    blocks = []
    for match in HERMES_CALL.finditer(text):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            continue
        arguments = payload.get("arguments", payload.get("parameters", {}))
        blocks.append((match.start(), match.end(), payload["name"], arguments))
    return blocks


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Hermes tool calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, in the order written.

    Which blocks are calls: ``hermes_tool_call_blocks``. Arguments that are not a JSON object are kept as a string.
    """
    return [
        ToolCall(name, arguments if isinstance(arguments, dict) else str(arguments))
        for _, _, name, arguments in hermes_tool_call_blocks(text)
    ]


def _arguments(value: Any) -> dict[str, Any] | str:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return str(value)


def parse_tool_calls(
    tokenizer: Any,
    turn_ids: Sequence[int],
    context_ids: Sequence[int],
    tools: list[dict[str, Any]] | None = None,
) -> list[ToolCall]:
    """The tool calls of one model turn.

    Args:
        tokenizer: the model's tokenizer. With a ``response_template`` (transformers >= 5.13 sets one for known chat
            templates, and TRL's ``add_response_schema`` does), its ``parse_response`` reads the turn; otherwise the
            Hermes format is read from the decoded text (special tokens kept: ``<tool_call>`` is one in some
            vocabularies).
        turn_ids: the turn's generated ids.
        context_ids: every id before the turn (``parse_response``'s ``prefix``: templates pre-write part of a turn).
        tools: the tools' schemas (``parse_response`` casts arguments by them).

    Returns:
        The calls, in the order written; empty for a plain answer.
    """
    if getattr(tokenizer, "response_template", None) is not None:
        message = tokenizer.parse_response(list(turn_ids), prefix=list(context_ids), tools=tools)
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            if isinstance(function.get("name"), str):
                calls.append(ToolCall(function["name"], _arguments(function.get("arguments", {}))))
        return calls
    return parse_hermes_tool_calls(tokenizer.decode(list(turn_ids), skip_special_tokens=False))


def call_tool(tools: dict[str, Callable[..., Any]], call: ToolCall) -> tuple[str, bool]:
    """Run one call; a failure becomes the tool's answer.

    Returns:
        (content, ok): the result as text (``str(result)``, TRL's rendering), or ``{"error": "..."}`` as JSON when
        the tool is unknown, the arguments are no JSON object or do not fit its signature, or it raised.
    """
    fn = tools.get(call.name)
    if fn is None:
        return json.dumps({"error": f"unknown tool {call.name!r}; tools: {sorted(tools)}"}), False
    if not isinstance(call.arguments, dict):
        return json.dumps({"error": f"arguments of {call.name!r} must be a JSON object, got {call.arguments!r}"}), False
    try:
        return str(fn(**call.arguments)), True
    except Exception as e:  # the model's mistake is the model's to see, never the rollout's crash
        return json.dumps({"error": f"{type(e).__name__}: {e}"}), False
