"""The PPO trainer's settings: ``PPOConfig`` extends ``trainers.config.TrainerConfig`` with the value model, GAE,
the KL penalty and the optimisation passes per batch.

The fields shared with GRPO (model, data, held-out evaluation, sampling, AdamW, asynchronous rollouts, run folder,
``engine``, remote rollouts) are the base's and mean the same; the PPO fields are checked here. A bad value raises
``ConfigError`` naming the key, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from .config import ConfigError, TrainerConfig, check_at_least, check_one_of

ValueModel = Literal["head", "critic"]
KLEstimator = Literal["k1", "k3"]


@dataclass
class PPOConfig(TrainerConfig):
    """Settings of a PPO run (the defaults are ``configs/ppo_default.yaml``, the recipe of docs/ppo_run.md).

    Model, data, evaluation, generation, optimisation, asynchronous rollouts, run and remote rollouts: the
    fields of ``trainers.config.TrainerConfig`` (see its docstring), with these differences:
        batch_size: prompts per process per step, one completion each (PPO samples no group).
        learning_rate: the policy's AdamW learning rate (the value model has its own).
        micro_batch_size: sequences per training forward/backward; gradients accumulate over the
            micro-batches of a mini-batch.
        reward_weights, temperature, async_rollouts, max_staleness, log_completions: other defaults
            ([1.0, 0.5], 0.7, true, 1, 2).

    Value model:
        value_model: "head": a linear value head on the policy's last hidden state (one forward
            gives logits and values; the value loss also trains the shared trunk, scaled by
            ``vf_coef``); "critic": a separate copy of the policy's trunk with its own head, trained
            only by the value loss (twice the training compute and weights).
        value_learning_rate: AdamW learning rate of the value head (and the critic's trunk).
        vf_coef: weight of the value loss in the total loss.
        cliprange_value: the value clip: V is kept within ``cliprange_value`` of the value at
            rollout time (the max of the clipped and unclipped squared errors is taken).

    Rewards and advantages:
        gamma, lam: GAE's discount and lambda over completion tokens (Schulman et al. 2016).
        whiten_advantages: shift and scale the advantages to mean 0, std 1 over the batch's tokens.
        kl_coef: per-token penalty -kl_coef * KL(pi_rollout || pi_ref) added to the rewards
            (0 with ``kl_target`` null: no reference model is kept).
        kl_estimator: "k1" (log pi - log pi_ref) or "k3" ((r - 1) - log r, r = pi_ref / pi;
            non-negative), per token (Schulman's "Approximating KL divergence").
        kl_target: adapt ``kl_coef`` towards this sequence KL (Ziegler et al. 2019's proportional
            controller), after each step from the mean sequence KL of the samples it trained on, over all
            processes (a step that trains on none leaves it); null: fixed coefficient.
        kl_horizon: the controller's horizon in sequences.

    Optimisation per rollout batch:
        ppo_epochs: passes over the batch.
        num_mini_batches: optimizer steps per pass (``batch_size`` must divide by it).
        epsilon: the policy ratio's clip range [1 - epsilon, 1 + epsilon]; the ratio is taken
            against the engine's logprobs (the behaviour policy).
        entropy_coef: weight of the entropy bonus (0: off; the entropy is still logged).
    """

    trainer_name: ClassVar[str] = "PPO"
    default_config_file: ClassVar[str | None] = "ppo_default.yaml"

    reward_weights: list[float] | None = field(default_factory=lambda: [1.0, 0.5])
    temperature: float = 0.7
    async_rollouts: bool = True
    max_staleness: int = 1
    log_completions: int = 2

    value_model: ValueModel = "head"
    value_learning_rate: float = 1e-3
    vf_coef: float = 0.1
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k1"
    kl_target: float | None = None
    kl_horizon: int = 10000
    ppo_epochs: int = 1
    num_mini_batches: int = 2
    epsilon: float = 0.2
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least(self, ("value_learning_rate", "epsilon", "kl_horizon"), 0, strict=True)
        check_at_least(self, ("vf_coef", "cliprange_value", "kl_coef", "entropy_coef"), 0)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        check_at_least(self, ("ppo_epochs", "num_mini_batches"), 1)
        if self.lora_r is not None and self.value_model == "critic":
            raise ConfigError(
                "value_model 'critic' trains a full copy of the trunk, which a LoRA run (lora_r) does not; use "
                "value_model 'head' (a value head on the adapted policy) or lora_r null"
            )
        if self.batch_size % self.num_mini_batches:
            raise ConfigError(
                f"num_mini_batches ({self.num_mini_batches}) must divide batch_size ({self.batch_size}): "
                "every optimizer step takes the same number of sequences"
            )
        check_one_of("value_model", self.value_model, ValueModel)
        check_one_of("kl_estimator", self.kl_estimator, KLEstimator)
        if self.kl_target is not None and self.kl_target <= 0:
            raise ConfigError(f"kl_target must be > 0 or null, got {self.kl_target!r}")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigError("kl_target adapts kl_coef multiplicatively, so kl_coef must start above 0, got 0")
        self.engine_config()  # validate the engine mapping now

    @property
    def uses_reference(self) -> bool:
        """A reference policy is kept (a KL penalty is on)."""
        return self.kl_coef > 0 or self.kl_target is not None
