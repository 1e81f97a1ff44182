"""The records one training step passes along: what reward functions see of the run (``TrainerState``) and the
scored rollout batch every algorithm's trajectory extends (``Trajectory``; ``trainers.grpo.GRPOTrajectory`` and
``trainers.ppo.PPOTrajectory`` add their advantages). Built by ``trainers.recipe.Recipe.score``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainerState:
    """What reward functions see as ``trainer_state``."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class Trajectory:
    """One process's scored rollout batch: what every algorithm's trajectory starts from. N samples; a prompt's
    ``num_generations`` samples are consecutive.

    Attributes:
        prompt_ids, completion_ids: N token lists each.
        behaviour_logprobs: N lists; the engine's logprob of each completion token (the behaviour policy).
        scores: float32 [N]; the task reward (weighted sum of the reward functions; NaN: unscored).
        scores_per_func: float32 [N, F].
        staleness: N lists; per token, the weight version now minus the version it was sampled under.
        dropped: float32 [N]; 1 for samples with a token older than ``max_staleness`` (out of the loss).
        truncated: float32 [N]; 1 where a completion hit ``max_new_tokens``.
        texts, prompts: decoded completions and the dataset prompts (for completions.jsonl).
        loss_mask: N lists of 0/1 per completion token, 1 where the token is trained on; None: every token
            (one model turn per sample; an episode's environment tokens would carry 0).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    scores: torch.Tensor
    scores_per_func: torch.Tensor
    staleness: list[list[int]]
    dropped: torch.Tensor
    truncated: torch.Tensor
    texts: list[str] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    loss_mask: list[list[int]] | None = None
