"""Tasks: datasets of prompts with a numeric answer.

- ``arithmetic_dataset``: generated arithmetic word problems ("Mia has 3 apples. She gets 5 more
  apples. How many apples does Mia have now?"), deterministic from a seed, so the default job needs
  no download. Small additions and subtractions: SmolLM2-135M-Instruct answers a few of them right
  before training.
- ``load_gsm8k_jsonl``: any local jsonl in GSM8K's format, one object a line with ``question`` and
  ``answer`` fields, the final number after ``####``.

Both return a ``datasets.Dataset`` in TRL's conversational format: ``prompt`` is a list of chat
messages; ``answer`` is the final number as a string; ``question`` is the bare question.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets

INSTRUCTION = "Give the final answer on the last line as 'Answer: <number>'."

_NAMES = ["Tom", "Anna", "Sam", "Mia", "Leo", "Emma", "Ben", "Lily", "Max", "Zoe", "Noah", "Ava"]
_ITEMS = ["apples", "books", "coins", "pencils", "cookies", "stickers", "marbles", "cards", "shells", "balloons"]
_ADD = [
    "{n} has {a} {it}. {n} gets {b} more {it}. How many {it} does {n} have now?",
    "{n} had {a} {it} and found {b} more. How many {it} does {n} have in total?",
    "There are {a} {it} in a box. {n} puts {b} more {it} in the box. How many {it} are in the box now?",
]
_SUB = [
    "{n} has {a} {it}. {n} gives {b} {it} to a friend. How many {it} does {n} have left?",
    "There are {a} {it} on a table. {n} takes {b} of them. How many {it} are left on the table?",
]


def make_message(question: str) -> list[dict[str, str]]:
    """The chat prompt of a question: one user message with the answer-format instruction."""
    return [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]


def arithmetic_problem(rng: random.Random, max_operand: int = 10, sub_fraction: float = 0.3) -> tuple[str, int]:
    """One word problem and its answer.

    Args:
        rng: the source of randomness.
        max_operand: operands are drawn from [1, max_operand].
        sub_fraction: probability of a subtraction (whose result is >= 0).

    Returns:
        (question, answer).
    """
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < sub_fraction:
        a, b = max(a, b), min(a, b)
        return rng.choice(_SUB).format(n=name, it=item, a=a, b=b), a - b
    return rng.choice(_ADD).format(n=name, it=item, a=a, b=b), a + b


def arithmetic_dataset(
    size: int = 2000, seed: int = 0, max_operand: int = 10, sub_fraction: float = 0.3
) -> datasets.Dataset:
    """Generated arithmetic word problems; the same seed gives the same dataset.

    Returns:
        A Dataset with columns ``prompt`` (chat messages), ``question`` and ``answer`` (the
        result as a string).

    Raises:
        ValueError: size < 1 or max_operand < 1.
    """
    if size < 1 or max_operand < 1:
        raise ValueError(f"size and max_operand must be >= 1, got size={size}, max_operand={max_operand}")
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        question, answer = arithmetic_problem(rng, max_operand, sub_fraction)
        rows.append({"prompt": make_message(question), "question": question, "answer": str(answer)})
    return datasets.Dataset.from_list(rows)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """'1,234' -> '1234', '3.50' -> '3.5', '7.0' -> '7'; text without a number is returned stripped."""
    text = text.strip().replace(",", "").replace("$", "")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value == int(value) else repr(value)


def gsm8k_final_answer(answer: str) -> str:
    """The final number of a GSM8K answer: the text after the last '####', normalised.

    Raises:
        ValueError: no '####' in the answer.
    """
    if "####" not in answer:
        raise ValueError("a GSM8K answer must end with '#### <number>'")
    return normalize_number(answer.rsplit("####", 1)[1])


def load_gsm8k_jsonl(path: str | Path) -> datasets.Dataset:
    """Load a GSM8K-format jsonl file.

    Each line is a JSON object with ``question`` and ``answer``; the answer's final number follows
    ``####``. Other fields are kept as columns.

    Returns:
        A Dataset with ``prompt`` (chat messages), ``question``, ``answer`` (the final number)
        and ``solution`` (the original answer text).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object, lacks a field, or whose answer has no
            '####' (the message names the line), or an empty file.
    """
    path = Path(path)
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not valid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}, line {lineno}: expected a JSON object")
            for key in ("question", "answer"):
                if not isinstance(obj.get(key), str):
                    raise ValueError(f"{path}, line {lineno}: missing string field {key!r}")
            try:
                final = gsm8k_final_answer(obj["answer"])
            except ValueError as e:
                raise ValueError(f"{path}, line {lineno}: {e}") from e
            row = {k: v for k, v in obj.items() if k not in ("question", "answer")}
            row.update(
                prompt=make_message(obj["question"]), question=obj["question"], answer=final, solution=obj["answer"]
            )
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return datasets.Dataset.from_list(rows)


def build_dataset(name: str, size: int = 2000, seed: int = 0) -> datasets.Dataset:
    """The dataset a config names: "arithmetic", "gsm8k:PATH", or a path to a GSM8K-format jsonl.

    Raises:
        ValueError: an unknown name that is not an existing file.
    """
    if name == "arithmetic":
        return arithmetic_dataset(size=size, seed=seed)
    if name.startswith("gsm8k:"):
        return load_gsm8k_jsonl(name[len("gsm8k:") :])
    if Path(name).is_file():
        return load_gsm8k_jsonl(name)
    raise ValueError(f"dataset: {name!r} is neither 'arithmetic' nor an existing GSM8K-format jsonl file")
