"""The chat template's token ids for an episode: its prompt, each environment message's delta, a turn's end.

``ChatDelta`` renders a first prompt once, then, for each environment message, the *delta*: the ids the template adds
after an assistant turn for those messages, rendered against a fixed stand-in conversation and tokenized alone.
Whether that delta starts with the template's end of turn depends on the turn before it: a turn the model closed with
the template's end-of-turn token (SmolLM2's ``<|im_end|>``) already holds it, and the delta starts after it (ChatML's
newline); a turn that ended any other way (a stop string such as ``</tool_call>``, a stop token that is not the
end-of-turn, a token bound) holds none, and the delta starts with the template's own. The choice is made from the
turn's last sampled id, never from its finish reason: ``"stop"`` covers all of the stop strings and stop tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatDelta"]

# A stand-in content for the assistant message the template closes: only its closing text is kept.
_STAND_IN = "ROLLOUTSTANDIN"


class ChatDelta:
    """Token ids of chat messages by the tokenizer's chat template: a first prompt, then each new message's delta.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        tools: the tools' schemas the template lists (None: no tools).
        template_kwargs: extra template variables.

    Attributes:
        end_of_turn_id: the id of the template's end-of-turn token, the first token of what the template writes after
            an assistant message's content (None when it writes none).

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer: an episode needs a tokenizer with a chat_template")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
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
