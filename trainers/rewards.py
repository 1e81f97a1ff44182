"""Reward functions with TRL's signature, and the code that applies them to a batch.

A reward function is called as ``reward(prompts, completions, completion_ids, **columns)`` and
returns one ``float`` or ``None`` per completion, exactly as in TRL's ``GRPOTrainer``:

- ``prompts``: the dataset's prompts (strings, or lists of chat messages), one per completion;
- ``completions``: the decoded completions; for conversational prompts each is
  ``[{"role": "assistant", "content": text}]``, else the text;
- ``completion_ids``: the completions' token ids;
- ``columns``: every other dataset column, one value per completion, plus ``trainer_state`` (an
  object with ``global_step`` and ``max_steps``) and ``log_metric(name, value)``.

``None`` means "no reward from this function for this sample" (TRL's rule): the function is left out
of that sample's weighted sum; a sample that no function scores gets a NaN reward, is left out of its
group's mean and std, and its advantage is 0.

A function's required dataset columns are its parameters without a default other than
``prompts``, ``completions`` and ``completion_ids`` (``correctness_reward`` needs ``answer``); the
trainer checks the dataset has them before it starts.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .tasks import normalize_number

RewardFunc = Callable[..., list[float | None]]

_STANDARD_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"}
_ANSWER = re.compile(r"answer\s*:\s*\**\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FINAL_LINE = re.compile(r"^\s*\**answer\s*:\s*\**\s*\$?\s*-?\d[\d,]*(?:\.\d+)?\s*\**\.?\s*$", re.IGNORECASE)


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion given as a string or as TRL's list of one assistant message."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def extract_answer(text: str) -> str | None:
    """The number after the last 'Answer:' in the text, else the last number, normalised; None if none."""
    found = _ANSWER.findall(text)
    if found:
        return normalize_number(found[-1])
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def correctness_reward(
    prompts: list, completions: list, completion_ids: list, answer: list[str], **kwargs: Any
) -> list[float]:
    """1.0 when the completion's final number (after 'Answer:', else its last number) equals ``answer``."""
    rewards = []
    for completion, target in zip(completions, answer):
        predicted = extract_answer(completion_text(completion))
        rewards.append(1.0 if predicted is not None and predicted == normalize_number(str(target)) else 0.0)
    return rewards


def format_reward(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
    """1.0 when the last non-empty line is 'Answer: <number>', 0.5 when 'Answer: <number>' is elsewhere, else 0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        lines = [line for line in text.splitlines() if line.strip()]
        if lines and _FINAL_LINE.match(lines[-1]):
            rewards.append(1.0)
        elif _ANSWER.search(text):
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards


def format_if_correct_reward(
    prompts: list, completions: list, completion_ids: list, answer: list[str], **kwargs: Any
) -> list[float]:
    """``format_reward`` for a correct completion, 0 for a wrong one.

    A format reward on its own can be earned without solving the task, and group normalisation
    gives a group of all-wrong samples full-size advantages for any formatting difference among
    them (docs/grpo_training.md). Gated by correctness, formatting only ranks right answers.
    """
    right = correctness_reward(prompts, completions, completion_ids, answer)
    fmt = format_reward(prompts, completions, completion_ids)
    return [f * r for f, r in zip(fmt, right)]


REWARD_FUNCS: dict[str, RewardFunc] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "format_if_correct": format_if_correct_reward,
}


def resolve_reward_func(spec: str | RewardFunc) -> RewardFunc:
    """A callable from a registered name, a "module:function" path, or a callable.

    Raises:
        ValueError: an unknown name or a path that cannot be imported (the message names it).
    """
    if callable(spec):
        return spec
    if spec in REWARD_FUNCS:
        return REWARD_FUNCS[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward_funcs: cannot import {spec!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"reward_funcs: {spec!r} is not callable")
        return fn
    raise ValueError(f"reward_funcs: unknown reward {spec!r}; known: {sorted(REWARD_FUNCS)} or 'module:function'")


def reward_name(fn: RewardFunc) -> str:
    """The name metrics use for a reward function."""
    for name, registered in REWARD_FUNCS.items():
        if registered is fn:
            return name
    return getattr(fn, "__name__", type(fn).__name__)


def required_columns(fn: RewardFunc) -> list[str]:
    """Dataset columns a reward function needs: its parameters without a default, beyond TRL's standard ones."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in params
        if p.name not in _STANDARD_ARGS
        and p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def compute_rewards(
    funcs: Sequence[RewardFunc],
    weights: Sequence[float],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the reward functions to a batch of completions.

    Args:
        funcs: reward functions.
        weights: one weight per function.
        prompts, completions, completion_ids: one entry per completion.
        columns: other dataset columns, one list entry per completion.
        **extra: passed to every function too (``trainer_state``, ``log_metric``).

    Returns:
        rewards float32 [N]: the weighted sum over functions of the non-None rewards (NaN where
        every function returned None); per_func float32 [N, F] with NaN for None.

    Raises:
        ValueError: a function returned a list of the wrong length.
    """
    n = len(completions)
    per_func = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    for j, fn in enumerate(funcs):
        out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
        if len(out) != n:
            raise ValueError(f"reward function {reward_name(fn)!r} returned {len(out)} rewards for {n} completions")
        per_func[:, j] = torch.tensor([math.nan if r is None else float(r) for r in out], dtype=torch.float32)
    w = torch.tensor(list(weights), dtype=torch.float32)
    rewards = (per_func * w).nansum(dim=1)
    rewards[torch.isnan(per_func).all(dim=1)] = math.nan
    return rewards, per_func
