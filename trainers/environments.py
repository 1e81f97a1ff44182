"""Environments of the multi-turn recipe (``trainers.multiturn``), in TRL's ``environment_factory`` shape.

``RetryArithmetic`` is the task ``configs/grpo_multiturn.yaml`` trains on: a word problem of the generated arithmetic
task (``trainers.tasks``); when the model's answer is wrong, the environment says so and the model answers again,
up to ``max_attempts`` answers. Why this task rather than a calculator tool: SmolLM2-135M-Instruct's chat template
has no tool format and the model never writes a tool call, so a tool task would first have to teach a call syntax
from nothing, which 15 minutes on 2 CPU cores do not buy; the arithmetic task is one the default recipe shows it
learns there (docs/grpo_run.md), and the second attempt is a real second turn: the model reads its own wrong
answer and the environment's reply (tokens it is not trained on) before it samples again.

Reward: 1.0 for a right first answer, ``second_try_reward`` for a right later one, 0 otherwise, so a group
prefers first-time answers but still learns from corrections. An episode is a success when any answer is right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .evaluate import is_correct

FEEDBACK = (
    "That is not right. Check the numbers and try again. Give the final answer on the last line as 'Answer: <number>'."
)


class RetryArithmetic:
    """A word problem answered in up to ``max_attempts`` turns; ``respond`` judges each answer.

    Args:
        max_attempts: answers the model may give (>= 1).
        second_try_reward: reward of a right answer after the first (in [0, 1]).

    Raises:
        ValueError: an argument out of range (named).
    """

    def __init__(self, max_attempts: int = 2, second_try_reward: float = 0.5) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        if not 0 <= second_try_reward <= 1:
            raise ValueError(f"second_try_reward must be in [0, 1], got {second_try_reward!r}")
        self.max_attempts = max_attempts
        self.second_try_reward = second_try_reward
        self.answer = ""
        self.attempts = 0
        self.solved_at: int | None = None

    def reset(self, answer: str = "", **row: Any) -> str | None:
        """Start on a row of the arithmetic task (its ``answer``); the prompt already holds the question."""
        self.answer = str(answer)
        self.attempts = 0
        self.solved_at = None
        return None

    def respond(self, text: str) -> str | None:
        """Judge one answer (its last number, ``trainers.evaluate.is_correct``): None ends the episode (right, or no
        attempt left); otherwise the feedback message."""
        self.attempts += 1
        if is_correct(text, self.answer):
            self.solved_at = self.attempts
            return None
        return FEEDBACK if self.attempts < self.max_attempts else None

    def get_reward(self) -> float:
        """1.0 for a right first answer, ``second_try_reward`` for a right later one, else 0."""
        if self.solved_at is None:
            return 0.0
        return 1.0 if self.solved_at == 1 else self.second_try_reward


ENVIRONMENTS: dict[str, Callable[..., Any]] = {"retry_arithmetic": RetryArithmetic}


def environment_factory(name: str, **kwargs: Any) -> Callable[[], Any]:
    """A zero-argument factory of the environment ``name`` (TRL's ``environment_factory``).

    Raises:
        ValueError: an unknown name (the known ones listed).
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"environment: unknown {name!r}; known: {sorted(ENVIRONMENTS)}")
    cls = ENVIRONMENTS[name]
    return lambda: cls(**kwargs)
