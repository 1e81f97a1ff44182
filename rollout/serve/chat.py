"""Chat: messages through the tokenizer's chat template, and Hermes tool calls out of the generated text.

A message's content may be a list of text parts (``[{"type": "text", "text": ...}]``, what OpenAI's clients and agent
frameworks send): the template gets their texts joined with "\\n", as vLLM joins them for templates that read a string
(``_parse_chat_message_content_parts`` in vllm/entrypoints/chat_utils.py); a part of any other type (an image, audio,
a file...) is refused, the served models reading text only. The prompt is the template's text, encoded without adding
special tokens again (the template writes them itself, BOS included). Tool calls follow the Hermes format that vLLM's
``hermes`` parser reads (Qwen 2.5/3, Hermes, SmolLM3 templates write it):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A message's role is one of OpenAI's (``CHAT_ROLES``): any other is refused before the template runs, since a template
such as SmolLM2's renders whatever it is given (``<|im_start|>wizard``) and the model answers nonsense. ``developer``
(OpenAI's newer name of the system message) reaches a template that names it as it is; any other template gets
``system``, as vLLM maps it (most Hugging Face templates know no ``developer``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollout.agents import hermes_tool_call_blocks
from rollout.serve.errors import bad_request

TOOL_CALL_OPEN = "<tool_call>"
# The roles of OpenAI's chat messages (``ChatCompletionMessageParam``). The deprecated ``function`` is not served: chat
# templates render tool results as ``tool``.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# What joins the texts of a message's content parts (vLLM's joiner for templates that read a string).
PART_JOINER = "\n"


def check_roles(messages: list[dict[str, Any]]) -> None:
    """Refuse a message whose role is not one of OpenAI's (``CHAT_ROLES``).

    Raises:
        APIError: 400 (param ``messages.i.role``) naming the role given and the roles allowed.
    """
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in CHAT_ROLES:
            continue
        param = f"messages.{i}.role"
        given = "missing" if role is None else f"{role!r} is not a chat role"
        raise bad_request(f"{param}: {given}; a message's role is one of {', '.join(CHAT_ROLES)}", param)


def template_roles(tokenizer: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each ``developer`` message made a ``system`` one, unless the chat template names the
    ``developer`` role itself (vLLM's mapping: a template that does not know the role would render it verbatim or
    fail on it)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "developer" in template:  # a dict of named templates: left as it is
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each content given as a list of text parts replaced by their texts joined with "\\n".

    Args:
        messages: OpenAI messages; a ``content`` is a string, None (an assistant turn with tool calls), or a list of
            parts ``{"type": "text", "text": str}``.

    Returns:
        New message dicts (the others as given): every ``content`` a string or None.

    Raises:
        APIError: 400 (param ``messages.i.content.j``) for a part that is not a text part, naming its type
            (``image_url``, ``input_audio``...), or a text part without a string ``text``; (param
            ``messages.i.content``) for a content that is neither a string nor a list of parts.
    """
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append(message)
            continue
        if not isinstance(content, list):
            param = f"messages.{i}.content"
            raise bad_request(
                f"{param}: a message's content is a string or a list of text parts, got {type(content).__name__}",
                param,
            )
        texts = []
        for j, part in enumerate(content):
            param = f"messages.{i}.content.{j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                named = f"a part of type {kind!r}" if isinstance(kind, str) else f"{part!r}"
                raise bad_request(
                    f"{param}: {named} is not supported; only text parts ({{'type': 'text', 'text': ...}}): the "
                    "served model reads text only",
                    param,
                )
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{param}: a text part needs a string 'text', got {part.get('text')!r}", param)
            texts.append(part["text"])
        out.append({**message, "content": PART_JOINER.join(texts)})
    return out


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
        messages: OpenAI messages (``role``, ``content``, tool fields), passed to the template as they are but for
            ``developer`` roles (``template_roles``).
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
            template_roles(tokenizer, messages),
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
