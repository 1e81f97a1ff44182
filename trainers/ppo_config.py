"""The PPO trainer's settings: one validated dataclass, loaded from YAML like ``GRPOConfig``.

The fields shared with GRPO (model, data, held-out evaluation, sampling, AdamW, asynchronous rollouts,
run folder, ``engine``) mean the same and are checked by the same code (``trainers.config.validate_common``);
the PPO fields are checked here. A bad value raises ``ConfigError`` naming the key, before any work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import rollout

from .config import ConfigError, effective_prefetch, engine_config, validate_common

VALUE_MODELS = ("head", "critic")
KL_ESTIMATORS = ("k1", "k3")


@dataclass
class PPOConfig:
    """Settings of a PPO run (the defaults are ``configs/ppo_default.yaml``, the recipe of docs/ppo_run.md).

    Model, data, evaluation, generation, optimisation, asynchronous rollouts and run: the fields of
    the same names in ``trainers.config.GRPOConfig`` (see its docstring), with these differences:
        batch_size: prompts per process per step, one completion each (PPO samples no group).
        learning_rate: the policy's AdamW learning rate (the value model has its own).
        micro_batch_size: sequences per training forward/backward; gradients accumulate over the
            micro-batches of a mini-batch.

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
            controller); null: fixed coefficient.
        kl_horizon: the controller's horizon in sequences.

    Optimisation per rollout batch:
        ppo_epochs: passes over the batch.
        num_mini_batches: optimizer steps per pass (``batch_size`` must divide by it).
        epsilon: the policy ratio's clip range [1 - epsilon, 1 + epsilon]; the ratio is taken
            against the engine's logprobs (the behaviour policy).
        entropy_coef: weight of the entropy bonus (0: off; the entropy is still logged).
    """

    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None
    dataset: str = "arithmetic"
    dataset_size: int = 2000
    dataset_seed: int = 0
    prompt_column: str = "prompt"
    reward_funcs: list[str] = field(default_factory=lambda: ["correctness", "format_if_correct"])
    reward_weights: list[float] | None = field(default_factory=lambda: [1.0, 0.5])

    eval_size: int = 200
    eval_dataset: str | None = None
    eval_seed: int = 1234
    eval_steps: int | None = None
    eval_max_new_tokens: int = 96

    batch_size: int = 16
    max_prompt_length: int = 256
    max_new_tokens: int = 64
    temperature: float = 0.7

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant_with_warmup"
    micro_batch_size: int = 8

    value_model: Literal["head", "critic"] = "head"
    value_learning_rate: float = 1e-3
    vf_coef: float = 0.1
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_target: float | None = None
    kl_horizon: int = 10000
    ppo_epochs: int = 1
    num_mini_batches: int = 2
    epsilon: float = 0.2
    entropy_coef: float = 0.0

    async_rollouts: bool = True
    max_staleness: int = 1
    stale_policy: Literal["wait", "drop"] = "wait"
    prefetch_batches: int | None = None

    max_steps: int = 30
    seed: int = 0
    output_dir: str | None = None
    overwrite_output_dir: bool = False
    log_with: str | None = None
    save_model: bool = True
    log_completions: int = 2
    cpu_threads: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_common(self)
        for name in ("value_learning_rate", "epsilon", "kl_horizon"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("vf_coef", "cliprange_value", "kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("ppo_epochs", "num_mini_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch_size % self.num_mini_batches:
            raise ConfigError(
                f"num_mini_batches ({self.num_mini_batches}) must divide batch_size ({self.batch_size}): "
                "every optimizer step takes the same number of sequences"
            )
        if self.value_model not in VALUE_MODELS:
            raise ConfigError(f"value_model must be one of {VALUE_MODELS}, got {self.value_model!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ConfigError(f"kl_target must be > 0 or null, got {self.kl_target!r}")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigError("kl_target adapts kl_coef multiplicatively, so kl_coef must start above 0, got 0")
        self.engine_config()  # validate the engine mapping now

    @property
    def prompts_per_batch(self) -> int:
        """Prompts per process per step: ``batch_size`` (one completion each)."""
        return self.batch_size

    @property
    def num_generations(self) -> int:
        """Completions per prompt: 1."""
        return 1

    @property
    def uses_reference(self) -> bool:
        """A reference policy is kept (a KL penalty is on)."""
        return self.kl_coef > 0 or self.kl_target is not None

    @property
    def effective_prefetch(self) -> int:
        """Batches kept in flight beyond the one being trained (0 in synchronous mode)."""
        return effective_prefetch(self)

    def engine_config(self, **extra: Any) -> rollout.ContinuousBatchingConfig:
        """The engine's configuration: ``engine`` plus the fields the trainer fixes.

        Raises:
            ConfigError: an unknown engine key, a bad value, or an attempt to change a fixed field.
        """
        return engine_config(self, "PPO", **extra)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
