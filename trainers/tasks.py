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
from collections.abc import Iterable
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
        ValueError: a line that is not a JSON object, lacks a field, has an empty question or
            answer, or whose answer has no '####' (the message names the line); an empty file or
            one of blank lines only.
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
                if not obj[key].strip():
                    raise ValueError(f"{path}, line {lineno}: field {key!r} is empty")
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
        what = "is empty" if path.stat().st_size == 0 else "holds only blank lines"
        raise ValueError(f"{path} {what}: a GSM8K-format file needs one JSON object per line")
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


def heldout_arithmetic_dataset(
    size: int, seed: int, exclude: Iterable[str], max_operand: int = 10, sub_fraction: float = 0.3
) -> datasets.Dataset:
    """Arithmetic problems from ``seed`` whose question text is not in ``exclude`` (the training set).

    The generator draws from about 60,000 distinct problems, so a training set of a few thousand
    shares a few of them with any other seed; those are skipped, and the set holds ``size``
    problems that training never samples.

    Raises:
        ValueError: size < 1, or ``size`` new problems not found in 100 x size draws.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    seen = set(exclude)
    rng = random.Random(seed)
    rows = []
    for _ in range(100 * size):
        question, answer = arithmetic_problem(rng, max_operand, sub_fraction)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": make_message(question), "question": question, "answer": str(answer)})
        if len(rows) == size:
            return datasets.Dataset.from_list(rows)
    raise ValueError(f"found only {len(rows)} held-out problems of the {size} asked for")


def split_heldout(dataset: datasets.Dataset, size: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Hold out the last ``size`` rows; the training part also loses every row whose question is held out.

    Returns:
        (train, heldout).

    Raises:
        ValueError: the dataset has no more rows than ``size``, or no ``question`` column.
    """
    if "question" not in dataset.column_names:
        raise ValueError(f"a held-out split needs a 'question' column (columns: {dataset.column_names})")
    if len(dataset) <= size:
        raise ValueError(f"cannot hold out {size} of {len(dataset)} rows and keep any for training")
    heldout = dataset.select(range(len(dataset) - size, len(dataset)))
    held = set(heldout["question"])
    keep = [i for i, q in enumerate(dataset["question"][: len(dataset) - size]) if q not in held]
    return dataset.select(keep), heldout


def build_datasets(
    name: str,
    size: int = 2000,
    seed: int = 0,
    eval_dataset: str | None = None,
    eval_size: int = 200,
    eval_seed: int = 1234,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The training set and a held-out evaluation set that training never samples.

    - "arithmetic": ``size`` problems from ``seed`` for training; ``eval_size`` problems from
      ``eval_seed`` that are not in the training set for evaluation.
    - a GSM8K-format file with ``eval_dataset`` (e.g. its test split): that file, its first
      ``eval_size`` rows, for evaluation; training drops any question it holds.
    - a GSM8K-format file alone: its last ``eval_size`` rows are held out.

    ``eval_size`` 0 gives no evaluation set (None).

    Returns:
        (train, heldout or None).

    Raises:
        ValueError, FileNotFoundError: a bad name or file, or too few rows to hold out.
    """
    train = build_dataset(name, size, seed)
    if eval_size == 0:
        return train, None
    if name == "arithmetic" and eval_dataset is None:
        return train, heldout_arithmetic_dataset(eval_size, eval_seed, train["question"])
    if eval_dataset is None:
        try:
            return split_heldout(train, eval_size)
        except ValueError as e:
            raise ValueError(f"{e}; lower eval_size, give an eval_dataset, or set eval_size 0 (no evaluation)") from e
    heldout = build_dataset(eval_dataset, eval_size, eval_seed)
    heldout = heldout.select(range(min(eval_size, len(heldout))))
    held = set(heldout["question"])
    train = train.select([i for i, q in enumerate(train["question"]) if q not in held])
    if len(train) == 0:
        raise ValueError("every training question is also in the evaluation set")
    return train, heldout
