"""Chat: messages through the tokenizer's chat template, and Hermes tool calls out of the generated text.

The prompt is the template's text, encoded without adding special tokens again (the template writes
them itself, BOS included). Tool calls follow the Hermes format that vLLM's ``hermes`` parser reads
(Qwen 2.5/3, Hermes, SmolLM3 templates write it): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollout.environments import hermes_tool_call_blocks

from .errors import bad_request

TOOL_CALL_OPEN = "<tool_call>"


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        messages: OpenAI messages (``role``, ``content``, tool fields), passed to the template as they are.
        tools: OpenAI tool specs (``{"type": "function", "function": {...}}``), or None.
        add_generation_prompt: append the assistant turn's opening.
        continue_final_message: leave the last (assistant) message open for the model to continue.
        template_kwargs: extra template variables.

    Returns:
        The prompt's token ids.

    Raises:
        APIError: 400 when the tokenizer has no chat template (param ``messages``), or the template
            fails on these messages (its message is passed on).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request(
            "messages: the served model's tokenizer has no chat template; use /v1/completions with a prompt",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # a template error (jinja2's TemplateError, a bad message) is the caller's input
        raise bad_request(f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from e
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated text into its content and its Hermes tool calls.

    Args:
        text: the assistant's generated text.

    Returns:
        (content, tool_calls): content is the text outside the ``<tool_call>`` blocks, stripped, or None
        when nothing is left; tool_calls are OpenAI's ``{"id", "type": "function", "function": {"name",
        "arguments"}}`` with ``arguments`` a JSON string. A block whose JSON does not parse, or lacks a
        name, is not a call: it stays in the content, as vLLM's parser leaves it.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for start, end, name, arguments in hermes_tool_call_blocks(text):
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
        kept.append(text[last:start])
        last = end
    if not calls:
        return (text if text else None), []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls
