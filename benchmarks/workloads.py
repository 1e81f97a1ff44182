"""The benchmark workloads: their questions, prompts and generation settings, and the token-list helpers
the systems share (left padding, G rows per prompt, truncation after EOS).

The questions come from a GSM8K-style jsonl (``question``/``answer``) or, by default, from the small
original sample file shipped in ``rollout/data/`` (package data, so an installed package has it too).
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig

# torch, transformers and the prompt encoder are imported by the helpers that use them: the console scripts read the
# workloads' names (their flags' choices) before torch is imported.

logger = logging.getLogger(__name__)

# rollout's package data (installed with it): the sample questions and the shared system prompt.
DATA_DIR = Path(str(importlib.resources.files("rollout") / "data"))
SAMPLE_QUESTIONS = DATA_DIR / "sample_questions.jsonl"
SHARED_PREFIX_SYSTEM_PROMPT = DATA_DIR / "shared_prefix_system_prompt.txt"


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: which questions, and how each is generated.

    Attributes:
        name: the workload's CLI name.
        num_prompts: number of questions.
        start: index of the first question in the source; falls back to 0 when the source is too short
            (the shipped sample file has 66 questions).
        max_new_tokens: generation budget per sequence.
        do_sample: sample (True) or greedy (False).
        temperature: sampling temperature; top_k and top_p are disabled, so it is pure sampling.
        num_samples: G, the completions per prompt (``num_return_sequences``).
        system_prompt: put the ~1,000-token shared system prompt in front of every question.
    """

    name: str
    num_prompts: int
    start: int
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    num_samples: int = 1
    system_prompt: bool = False


WORKLOADS = {
    "gsm8k-greedy": Workload("gsm8k-greedy", num_prompts=32, start=200, max_new_tokens=96),
    "gsm8k-grpo": Workload(
        "gsm8k-grpo", num_prompts=8, start=0, max_new_tokens=128, do_sample=True, temperature=1.0, num_samples=8
    ),
    "shared-prefix": Workload("shared-prefix", num_prompts=64, start=0, max_new_tokens=32, system_prompt=True),
}
# Workloads of benchmarks.scoring (prefill-only logprobs), which rollout-bench runs through it.
SCORING_WORKLOADS = ("scoring",)


def load_questions(path: str | os.PathLike) -> list[str]:
    """Read the ``question`` field of every line of a GSM8K-style jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in f if line.strip()]


def select_questions(questions: Sequence[str], start: int, num: int) -> tuple[list[str], int]:
    """Take ``num`` consecutive questions from ``start``, or from 0 when the source is too short.

    Returns:
        The questions and the start index actually used.

    Raises:
        ValueError: the source has fewer than ``num`` questions.
    """
    if num > len(questions):
        raise ValueError(f"asked for {num} questions but the source has only {len(questions)}")
    if start + num > len(questions):
        logger.warning("source has %d questions: starting at index 0 instead of %d", len(questions), start)
        start = 0
    return list(questions[start : start + num]), start


def build_prompts(tokenizer, questions: Sequence[str], workload: Workload) -> list[list[int]]:
    """Token ids of every question of a workload: the model's chat template of the question as a user
    message, assistant turn opened, the shared system prompt in front where the workload asks for one."""
    from trainers.prompts import encode_prompt

    system = (
        [{"role": "system", "content": SHARED_PREFIX_SYSTEM_PROMPT.read_text(encoding="utf-8").strip()}]
        if workload.system_prompt
        else []
    )
    return [encode_prompt(tokenizer, [*system, {"role": "user", "content": q}]) for q in questions]


def make_generation_config(workload: Workload, eos_token_id: int | list[int], pad_token_id: int) -> GenerationConfig:
    """The GenerationConfig every system receives for a workload."""
    from transformers import GenerationConfig

    sampling = (
        {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0}
        if workload.do_sample
        else {"do_sample": False}
    )
    return GenerationConfig(
        max_new_tokens=workload.max_new_tokens,
        num_return_sequences=workload.num_samples,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **sampling,
    )


def truncate_at_eos(tokens: Sequence[int], eos_ids: set[int]) -> list[int]:
    """The tokens up to and including the first EOS (all of them when there is none)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return list(tokens[: i + 1])
    return list(tokens)


def expand_rows(prompts: Sequence[list[int]], num_samples: int) -> list[list[int]]:
    """Each prompt repeated ``num_samples`` times, adjacent: the rows a static batch generates."""
    return [p for p in prompts for _ in range(num_samples)]


def left_pad(rows: Sequence[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into a batch.

    Returns:
        input_ids int64 [B, L] and attention_mask int64 [B, L] (0 on padding), L the longest row.
    """
    import torch

    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, length - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, length - len(r) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def chunks(items: Sequence, size: int) -> list:
    """``items`` cut into consecutive pieces of ``size`` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]
