"""The chat template's token ids for an episode: its prompt, each environment message's delta, a turn's end, its tools.

``ChatDelta`` renders a first prompt once, then, for each environment message, the *delta*: the ids the template adds
after an assistant turn for those messages, rendered against a fixed stand-in conversation and tokenized alone.
Whether that delta starts with the template's end of turn depends on the turn before it: a turn the model closed with
the template's end-of-turn token (SmolLM2's ``<|im_end|>``) already holds it, and the delta starts after it (ChatML's
newline); a turn that ended any other way (a stop string such as ``</tool_call>``, a stop token that is not the
end-of-turn, a token bound) holds none, and the delta starts with the template's own. The choice is made from the
turn's last sampled id, never from its finish reason: ``"stop"`` covers all of the stop strings and stop tokens.

Tools: a template that lists no tools (SmolLM2's writes neither the schemas nor a call format) leaves a model unable
to call them, silently. ``ChatDelta`` finds that out by rendering a message with and without ``tools=``, warns once
per template, and on request (``tools_in_system_message``) lists the tools itself in a system message with the Hermes
call format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) that ``rollout.agents.environments``' default
parser reads: the text Qwen 2.5's and Hermes' templates write.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = ["ChatDelta", "ToolsInSystemMessage", "template_drops_tools", "tools_system_prompt"]

logger = logging.getLogger(__name__)

# A stand-in content for the assistant message the template closes: only its closing text is kept.
_STAND_IN = "ROLLOUTSTANDIN"
ToolsInSystemMessage = bool | Literal["auto"]
# Templates (by their text) already warned about dropping the tools: one warning per template and process.
_WARNED_TEMPLATES: set[str] = set()


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system prompt that lists ``tools`` and the Hermes call format (Qwen 2.5's and Hermes' template text).

    Args:
        tools: the tools' JSON schemas (``rollout.tool_schemas``: ``{"type": "function", "function": {...}}``).
    """
    listing = "\n".join(json.dumps(dict(tool)) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_drops_tools(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
) -> bool:
    """Whether the tokenizer's chat template renders a conversation the same with ``tools=`` as without (SmolLM2's
    does: the model is never shown the tools)."""
    messages = [{"role": "user", "content": _STAND_IN}]
    kwargs = dict(template_kwargs or {})
    with_tools = tokenizer.apply_chat_template(messages, tools=list(tools), tokenize=False, **kwargs)
    return with_tools == tokenizer.apply_chat_template(messages, tools=None, tokenize=False, **kwargs)


class ChatDelta:
    """Token ids of chat messages by the tokenizer's chat template: a first prompt, then each new message's delta.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        tools: the tools' schemas the template lists (None: no tools).
        template_kwargs: extra template variables.
        tools_in_system_message: list the tools in a system message of the prompt (``prompt_messages``) instead of
            through the template's ``tools``: True always, "auto" when the template drops them, False never (a
            template that drops them gets one warning).

    Attributes:
        end_of_turn_id: the id of the template's end-of-turn token, the first token of what the template writes after
            an assistant message's content (None when it writes none).
        tools_message: the system message listing the tools, when ``tools_in_system_message`` put one in.

    Raises:
        ValueError: the tokenizer has no chat template, or ``tools_in_system_message`` is not True, False or "auto".
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools_in_system_message: ToolsInSystemMessage = False,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer: an episode needs a tokenizer with a chat_template")
        if not (isinstance(tools_in_system_message, bool) or tools_in_system_message == "auto"):
            raise ValueError(f"tools_in_system_message must be True, False or 'auto', got {tools_in_system_message!r}")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self.tools_message: dict[str, str] | None = None
        if self.tools is not None:
            dropped = template_drops_tools(tokenizer, self.tools, self.template_kwargs)
            if tools_in_system_message is True or (tools_in_system_message == "auto" and dropped):
                self.tools_message = {"role": "system", "content": tools_system_prompt(self.tools)}
                self.tools = None  # the system message lists them; the template must not list them twice
            elif dropped and str(tokenizer.chat_template) not in _WARNED_TEMPLATES:
                _WARNED_TEMPLATES.add(str(tokenizer.chat_template))
                logger.warning(
                    "the chat template of %s renders no tools: the model is not shown %s and will not call them; "
                    "pass tools_in_system_message='auto' (run_episode, run_episodes) to list them in a system message",
                    getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
                    [t.get("function", t).get("name") for t in self.tools],
                )
        stand_in = self._render([{"role": "user", "content": _STAND_IN}, self._assistant([])], False)
        # What the template writes after an assistant message's content: its end of turn (ChatML: "<|im_end|>\n").
        self._closing = stand_in[stand_in.rindex(_STAND_IN) + len(_STAND_IN) :]
        # Its first token that is not whitespace is the end-of-turn token a model samples to close its turn.
        self.end_of_turn_id: int | None = None
        self._end_text = ""
        for token in self._encode(self._closing):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            if text.strip() and text in self._closing:
                self.end_of_turn_id, self._end_text = token, text
                break

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes every special token itself (BOS included): none is added again.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    @staticmethod
    def _assistant(tool_names: Sequence[str]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": _STAND_IN}
        if tool_names:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": {}}} for name in tool_names
            ]
        return message

    def prompt_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the tools' system message, when there is one: first, or appended to the content of a
        leading system message (as Qwen 2.5's template does). A new list; ``messages`` is left unchanged."""
        if self.tools_message is None:
            return list(messages)
        if messages and messages[0].get("role") == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{self.tools_message['content']}"}
            return [first, *messages[1:]]
        return [dict(self.tools_message), *messages]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids of ``messages`` with the assistant turn opened (``add_generation_prompt``)."""
        return self._encode(self._render(messages, True))

    def closes_turn(self, turn_ids: Sequence[int]) -> bool:
        """Whether a model turn's ids end with the template's end-of-turn token (the model closed its turn)."""
        return bool(turn_ids) and self.end_of_turn_id is not None and turn_ids[-1] == self.end_of_turn_id

    def delta_ids(self, new_messages: list[dict[str, Any]], closed: bool) -> list[int]:
        """The ids the template adds after a model turn for ``new_messages``, the next assistant turn opened.

        Args:
            new_messages: the environment's messages (``tool`` messages answering the turn's calls, or one ``user``
                message).
            closed: the turn ended with the template's end-of-turn token (``closes_turn``), which the model wrote
                itself: the delta starts after it. False for any other end (a stop string, another stop token, a
                token bound): the delta starts with the template's own end of the assistant turn.

        Raises:
            ValueError: the template renders the stand-in conversation differently once messages follow it (it
                rewrites earlier turns), so no delta exists.
        """
        tool_names = [m.get("name", "tool") for m in new_messages if m.get("role") == "tool"]
        base = [{"role": "user", "content": _STAND_IN}, self._assistant(tool_names)]
        prefix = self._render(base, False)
        full = self._render(base + new_messages, True)
        if not full.startswith(prefix):
            raise ValueError(
                "the chat template renders earlier turns differently once messages follow them; an episode's delta "
                "cannot be taken from it"
            )
        tail = full[len(prefix) :]
        if not closed:
            return self._encode(self._closing + tail)
        # After the model's own end-of-turn token, the delta starts where the template's text goes on after that
        # token (past any tool calls the template renders from the stand-in's ``tool_calls``); a template that writes
        # no end-of-turn there gets nothing before the tail.
        content_end = prefix.rindex(_STAND_IN) + len(_STAND_IN)
        at = prefix.rfind(self._end_text) if self._end_text else -1
        head = prefix[at + len(self._end_text) :] if at >= content_end else ""
        return self._encode(head + tail)
