"""Prompt encoding and end-of-sequence ids shared by the GRPO trainer and the evaluation CLI."""

from __future__ import annotations

import warnings
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]], max_prompt_length: int | None = None
) -> list[int]:
    """Token ids of a prompt.

    A list of chat messages goes through the tokenizer's chat template (with the generation
    prompt); without a template the messages' contents are joined with newlines (with a
    warning). A string is tokenized as it is; when it already starts with the tokenizer's BOS
    text, the BOS the tokenizer adds is not added a second time.

    Args:
        tokenizer: the policy's tokenizer.
        prompt: text, or chat messages (``{"role": ..., "content": ...}``).
        max_prompt_length: keep only the last this many tokens (TRL's truncation side); None keeps all.

    Returns:
        The token ids.

    Raises:
        ValueError: the prompt encodes to no tokens.
    """
    if isinstance(prompt, str):
        ids = _encode_text(tokenizer, prompt)
    elif getattr(tokenizer, "chat_template", None):
        ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
    else:
        # warnings.warn shows this once per call site, not once per prompt.
        warnings.warn("the tokenizer has no chat template: message prompts are joined as plain text", stacklevel=2)
        ids = _encode_text(tokenizer, "\n".join(str(m["content"]) for m in prompt) + "\n")
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return ids[-max_prompt_length:] if max_prompt_length else ids


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = list(tokenizer(text).input_ids)
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    if bos and bos_id is not None and text.startswith(bos) and ids[:2] == [bos_id, bos_id]:
        ids = ids[1:]
    return ids


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and the model's generation-config EOS ids, in order."""
    ids: list[int] = []
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if value is None:
            continue
        for v in [value] if isinstance(value, int) else list(value):
            if int(v) not in ids:
                ids.append(int(v))
    return ids
