"""The trainers' settings: ``TrainerConfig``, the fields every recipe shares, and ``GRPOConfig``, which extends it.

Typed dataclasses in the style of TRL's configs: the argument parser (``trainers.arguments``, a
``transformers.HfArgumentParser``) converts every value, from the YAML file, the flags or ``--set``, by
its field's type, and ``__post_init__`` checks ranges and the fields that depend on each other. A bad
value raises ``ConfigError`` naming the key, before the model loads. ``trainers.ppo_config.PPOConfig``
extends the same base.

The ``engine`` mapping holds ``rollout.ContinuousBatchingConfig`` fields; that class validates them.
``return_logprobs`` and ``logprobs_mode`` are fixed by the trainers (True, "temperature").
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import rollout

# transformers' SchedulerType (it imports torch) and the reward functions (torch) are imported where a config is
# checked: the console scripts answer a bad flag before torch is imported.

DType = Literal["float32", "bfloat16", "float16"]
MixedPrecision = Literal["no", "bf16", "fp16"]
StalePolicy = Literal["wait", "drop"]
LossType = Literal["dapo", "grpo"]
# Engine fields the trainer owns: the behaviour logprobs must be log_softmax(logits / T).
ENGINE_FIXED = {"return_logprobs": True, "logprobs_mode": "temperature"}


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


def check_one_of(name: str, value: Any, allowed: Any, nullable: bool = False) -> None:
    """Raise ConfigError unless ``value`` is one of the ``Literal`` type ``allowed`` (or None when ``nullable``)."""
    choices = get_args(allowed)
    if value not in choices and not (nullable and value is None):
        raise ConfigError(f"{name} must be one of {choices}{' or null' if nullable else ''}, got {value!r}")


def check_at_least(config: Any, names: tuple[str, ...], low: float, strict: bool = False) -> None:
    """Raise ConfigError naming the first of ``names`` below ``low`` (or not above it when ``strict``)."""
    for name in names:
        value = getattr(config, name)
        if value < low or (strict and value == low):
            raise ConfigError(f"{name} must be {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass
class TrainerConfig:
    """The settings every trainer shares; ``GRPOConfig`` and ``PPOConfig`` extend it (not used on its own).

    Model and data:
        model: local Hugging Face folder or an alias understood by ``rollout.load_model``
            ("smollm2-135m-instruct", the default).
        dtype: the dtype the weights are loaded in ("float32", "bfloat16", "float16"); a model handed
            to the trainer is used as it is. Mixed precision needs "float32" (the master weights).
        mixed_precision: accelerate's mixed precision ("no", "bf16", "fp16"): forwards and backwards
            (the engine's rollout forwards included, whose KV cache then holds bf16/fp16) run under
            autocast while the weights and the optimizer stay in ``dtype``. "bf16" is TRL's default on
            a GPU; "fp16" needs CUDA. None (the default): what the launcher says (``accelerate
            launch --mixed_precision``, the accelerate config file), else "no".
        dataset: "arithmetic" (the generated default task, no download), or the path of a
            GSM8K-format jsonl file (``question``/``answer`` fields, the answer after ``####``),
            or "gsm8k:PATH" for the same.
        dataset_size: number of problems of the "arithmetic" task.
        dataset_seed: seed of the "arithmetic" problems.
        prompt_column: dataset column holding the prompt: a string (tokenized as is) or a list
            of chat messages (the tokenizer's chat template is applied when it has one).
        reward_funcs: reward names of ``trainers.rewards.REWARD_FUNCS`` ("correctness",
            "format_if_correct", "format") or "module:function" import paths of functions with
            TRL's signature. "format" alone can be earned without solving the task; see
            docs/grpo_training.md before giving it weight.
        reward_weights: one weight per reward function; None weighs each 1.0.

    Evaluation (held-out accuracy, greedy through the same rollout backend; see ``trainers.evaluate``):
        eval_size: held-out problems per evaluation (0: no evaluation). For "arithmetic" they come
            from ``eval_seed`` and exclude every training question; for a GSM8K file without
            ``eval_dataset`` the file's last ``eval_size`` rows are held out of training.
        eval_dataset: a GSM8K-format file to evaluate on (e.g. the test split); training drops
            any question it holds.
        eval_seed: seed of the held-out arithmetic problems.
        eval_steps: evaluate every this many steps as well as at step 0 and after the last
            step (None: only at step 0 and at the end).
        eval_max_new_tokens: most tokens per greedy evaluation completion.

    Generation:
        batch_size: completions per process per step (``num_generations`` per prompt).
        max_prompt_length: prompts longer than this keep their last tokens (TRL's rule).
        max_new_tokens: most tokens per completion.
        temperature: sampling temperature; the trainer divides its logits by the same value,
            so behaviour and trainer logprobs are the same function of the weights. Sampling is
            plain temperature sampling (no top-k/top-p), so the behaviour policy is exactly
            softmax(logits / T).
        structured_outputs_regex: every training completion must match this regular expression (xgrammar's
            dialect; ``rollout.StructuredOutputs(regex=...)``): the engine masks, at each sampled token, the tokens
            that cannot continue a match, and allows the end of sequence only where the match is complete (a
            completion cut by ``max_new_tokens`` may be a prefix of one). None: unconstrained.
        structured_outputs_json_schema: the path of a JSON schema file (read and checked when the config is
            built); every training completion is a JSON value that validates against it. Exclusive with
            ``structured_outputs_regex``. The rollouts' logprobs stay the model's own (unmasked): the importance
            ratio compares the same function the trainer's forward computes (docs/training.md).
        structured_outputs_eval: constrain the held-out evaluation's greedy answers the same way. False (the
            default): evaluation is unconstrained, so ``eval_accuracy`` measures what the model writes on its own.

    Optimisation:
        learning_rate, weight_decay, adam_beta1, adam_beta2, max_grad_norm: AdamW and gradient
            clipping.
        lr_scheduler_type: the learning-rate schedule after warm-up, a ``transformers.SchedulerType``
            ("constant_with_warmup", "linear", "cosine", ...; ``transformers.get_scheduler``).
        warmup_steps: linear warm-up steps of the learning rate.
        micro_batch_size: sequences per training forward/backward; gradients accumulate over the
            micro-batches of an optimizer step and the loss is normalised once over its batch, so
            accelerate's ``gradient_accumulation_steps`` changes nothing (``trainers.setup.backward``).

    Asynchronous rollouts:
        async_rollouts: generate the next batches while the trainer works on the current one.
        max_staleness: most weight versions a trained token may be older than the weights it
            is trained on. 0 is synchronous mode (async_rollouts then changes nothing).
        stale_policy: "wait": batch j is submitted only once the weights are at version
            >= j - max_staleness, so no sample is ever too old; "drop": submit
            ``prefetch_batches`` ahead without waiting and drop (mask out of the loss) every
            sample with a token older than max_staleness.
        prefetch_batches: batches kept in flight beyond the one being trained (None: max_staleness).

    Run:
        max_steps: training steps (one rollout batch each).
        seed: seed of torch, of the dataset order and of the sampling seeds.
        output_dir: metrics.jsonl, timing.jsonl, the evaluation samples, trackers' logs and the
            final model go here. None (the default): ``$ROLLOUT_HOME/runs/<algo>-<UTC date-time>``
            (``~/.cache/rollout/runs/...``), a new folder for every run, outside any checkout.
        overwrite_output_dir: allow ``output_dir`` to hold an earlier run (its metrics.jsonl or
            model); without it such a folder is refused before the model loads.
        log_with: an accelerate tracker ("tensorboard", "wandb", ...) or None.
        save_model: save the final model and tokenizer with ``save_pretrained``.
        log_completions: write this many samples per step (prompt, completion, reward) to
            OUTPUT_DIR/completions.jsonl (main process; 0: none).
        cpu_threads: torch threads per process on CPU; None: the CPUs this process may use
            divided by the processes on this machine.
        engine: ``rollout.ContinuousBatchingConfig`` fields. When ``num_blocks`` is not given
            the cache is sized for the batches in flight, capped at what fits the engine's share of
            memory next to training (``max_memory_percent``, else
            ``trainers.setup.training_memory_percent``: 0.5 of what the gradients and AdamW moments leave).

    Remote rollouts (``trainers.remote``):
        rollout_server: the URL of a ``rollout-serve --enable-control`` on the same model, or several separated by
            commas (a fleet: ``rollout.RolloutPool``); rollouts are generated there over HTTP and the weights are
            streamed to every server after every step, one broadcast for all. None: the engine runs in the
            trainer's process on the trained model.
        rollout_router: vLLM's router in front of the ``rollout_server`` URLs (``vllm-router --policy
            consistent_hash``): generation goes through it, with a session key per prompt so that a prompt's
            samples share one replica's prefix cache. None: the trainer picks the replica by the same key.
        rollout_api_key: the server's ``--api-key``.
        weight_sync_bucket_mb: bucket size of the weight stream, in MiB; 16 was the fastest on this CPU
            (docs/weight_sync.md: large buckets lose the overlap of packing and sending).

    LoRA (``trainers.lora``; docs/lora.md):
        lora_r: the rank of a LoRA adapter trained in place of the full weights (peft's ``get_peft_model``; the
            base weights are frozen); after each step only the adapter reaches the rollout engine, as a new adapter
            that later requests name. None (the default): full fine-tuning.
        lora_alpha: peft's ``lora_alpha``: the adapter's output is scaled by ``lora_alpha / lora_r``.
        lora_target_modules: the linear layers adapted, by peft's rule (a module whose name is, or ends with
            ``.`` and, an entry); ``["all-linear"]``: every linear layer of the decoder (not the LM head).
        lora_plus_ratio: LoRA+ (Hayou et al. 2024): the B matrices learn at this many times ``learning_rate``
            (``trainers.lora.lora_plus_groups``); 1.0 (the default): one learning rate.

    Batch invariance (docs/batch_invariance.md):
        batch_invariant: the engine runs with ``ContinuousBatchingConfig(batch_invariant=True)`` and the trainer's
            forwards inside ``rollout.batch_invariant()``, so the behaviour logprobs equal the trainer's bitwise: at
            staleness 0 the importance ratio is exactly 1 on every token (``is_ratio_min`` = ``is_ratio_max`` = 1,
            ``behaviour_kl`` 0; PPO: ``first_ratio_max_dev`` 0). float32, no LoRA; with ``rollout_server`` the servers
            must run ``rollout-serve --batch-invariant``.
    """

    trainer_name: ClassVar[str] = "trainer"  # names the trainer in messages ("GRPO", "PPO")
    default_config_file: ClassVar[str | None] = None  # the recipe in configs/ the command line starts from

    model: str = "smollm2-135m-instruct"
    dtype: DType = "float32"
    mixed_precision: MixedPrecision | None = None
    dataset: str = "arithmetic"
    dataset_size: int = 2000
    dataset_seed: int = 0
    prompt_column: str = "prompt"
    reward_funcs: list[str] = field(default_factory=lambda: ["correctness", "format_if_correct"])
    reward_weights: list[float] | None = None

    eval_size: int = 200
    eval_dataset: str | None = None
    eval_seed: int = 1234
    eval_steps: int | None = None
    eval_max_new_tokens: int = 96

    batch_size: int = 16
    max_prompt_length: int = 256
    max_new_tokens: int = 64
    temperature: float = 1.0
    structured_outputs_regex: str | None = None
    structured_outputs_json_schema: str | None = None
    structured_outputs_eval: bool = False

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant_with_warmup"
    micro_batch_size: int = 8

    async_rollouts: bool = False
    max_staleness: int = 0
    stale_policy: StalePolicy = "wait"
    prefetch_batches: int | None = None

    max_steps: int = 30
    seed: int = 0
    output_dir: str | None = None
    overwrite_output_dir: bool = False
    log_with: str | None = None
    save_model: bool = True
    log_completions: int = 0
    cpu_threads: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    rollout_server: str | None = None
    rollout_router: str | None = None
    rollout_api_key: str | None = None
    weight_sync_bucket_mb: int = 16

    lora_r: int | None = None
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    lora_plus_ratio: float = 1.0

    batch_invariant: bool = False

    def __post_init__(self) -> None:
        check_at_least(
            self,
            ("dataset_size", "batch_size", "max_prompt_length", "max_new_tokens", "micro_batch_size", "max_steps"),
            1,
        )
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 (the trainer samples), got {self.temperature!r}")
        check_at_least(self, ("learning_rate",), 0, strict=True)
        nonnegative = ("weight_decay", "max_grad_norm", "warmup_steps", "max_staleness", "dataset_seed")
        check_at_least(self, (*nonnegative, "log_completions", "eval_size", "eval_seed"), 0)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        from transformers import SchedulerType

        schedules = [t.value for t in SchedulerType]
        if self.lr_scheduler_type not in schedules:
            raise ConfigError(f"lr_scheduler_type must be one of {schedules}, got {self.lr_scheduler_type!r}")
        check_one_of("stale_policy", self.stale_policy, StalePolicy)
        check_one_of("dtype", self.dtype, DType)
        check_one_of("mixed_precision", self.mixed_precision, MixedPrecision, nullable=True)
        if self.mixed_precision not in (None, "no") and self.dtype != "float32":
            raise ConfigError(
                f"mixed_precision {self.mixed_precision!r} keeps float32 master weights under autocast; "
                f"dtype must be 'float32', got {self.dtype!r}"
            )
        for name in ("prefetch_batches", "eval_steps", "cpu_threads"):
            value = getattr(self, name)
            low = 0 if name == "prefetch_batches" else 1
            if value is not None and value < low:
                raise ConfigError(f"{name} must be >= {low} or null, got {value!r}")
        check_at_least(self, ("eval_max_new_tokens", "weight_sync_bucket_mb"), 1)
        if self.log_with is not None:
            # accelerate's own list: an unknown name would fail only after the model and engine are built.
            from accelerate.utils import LoggerType

            trackers = tuple(t.value for t in LoggerType)
            if self.log_with not in trackers:
                raise ConfigError(f"log_with must be null or one of {trackers}, got {self.log_with!r}")
        self._check_rewards()
        self._check_lora()
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be true or false, got {self.batch_invariant!r}")
        if self.batch_invariant:
            if self.dtype != "float32" or self.mixed_precision not in (None, "no"):
                raise ConfigError("batch_invariant: true needs dtype float32 and no mixed_precision (float32 kernels)")
            if self.lora_r is not None:
                raise ConfigError("batch_invariant: true does not serve LoRA adapters yet: unset lora_r")
            if self.engine.get("batch_invariant") is False:
                raise ConfigError("batch_invariant: true conflicts with engine.batch_invariant: false")
        from .structured import structured_outputs_of  # it imports ConfigError from here

        # Read and checked here, once: a bad regex or schema file stops the run before the model loads.
        self._structured_outputs = structured_outputs_of(self)
        if self.rollout_server is not None:
            for url in self.rollout_server.split(","):
                if not url.strip().startswith(("http://", "https://")):
                    raise ConfigError(
                        f"rollout_server must be http:// or https:// URLs separated by commas, got {url.strip()!r}"
                    )
        if self.rollout_router is not None:
            if self.rollout_server is None:
                raise ConfigError("rollout_router needs rollout_server: the URLs of the servers behind it")
            if not self.rollout_router.startswith(("http://", "https://")):
                raise ConfigError(f"rollout_router must be an http:// or https:// URL, got {self.rollout_router!r}")

    def _check_lora(self) -> None:
        if isinstance(self.lora_plus_ratio, bool) or not isinstance(self.lora_plus_ratio, (int, float)):
            raise ConfigError(f"lora_plus_ratio must be a number > 0, got {self.lora_plus_ratio!r}")
        if not self.lora_plus_ratio > 0:
            raise ConfigError(f"lora_plus_ratio must be > 0, got {self.lora_plus_ratio!r}")
        if self.lora_r is None:
            if self.lora_plus_ratio != 1.0:
                raise ConfigError("lora_plus_ratio is for LoRA runs: set lora_r too (or leave lora_plus_ratio at 1.0)")
            return
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ConfigError(
                f"lora_r must be an int >= 1 (the adapter's rank) or null (full fine-tuning), got {self.lora_r!r}"
            )
        if not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        targets = self.lora_target_modules
        if not targets or any(not isinstance(t, str) or not t for t in targets):
            raise ConfigError(f"lora_target_modules must list module names (or be ['all-linear']), got {targets!r}")
        if "all-linear" in targets and len(targets) > 1:
            raise ConfigError(f"lora_target_modules: 'all-linear' stands alone, got {targets!r}")

    def _check_rewards(self) -> None:
        from .rewards import resolve_reward_func

        if not self.reward_funcs:
            raise ConfigError("reward_funcs must name at least one reward function")
        for spec in self.reward_funcs:
            if isinstance(spec, str) and ":" not in spec:  # a 'module:function' is imported by the trainer
                try:
                    resolve_reward_func(spec)
                except ValueError as e:  # the one message, from the function the trainer resolves with
                    raise ConfigError(str(e)) from e
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"reward_weights has {len(self.reward_weights)} values but reward_funcs has {len(self.reward_funcs)}"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def structured_outputs(self) -> rollout.StructuredOutputs | None:
        """The training rollouts' constraint (``structured_outputs_regex`` or ``_json_schema``), or None."""
        return self._structured_outputs

    def rollout_options(self, eos_token_ids: Sequence[int]) -> dict[str, Any]:
        """The ``add_request`` options of every training rollout (the rollout queue's ``request_kwargs``): plain
        temperature sampling, ``max_new_tokens``, the stop ids and the structured-output constraint, if any."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "do_sample": True,
            "eos_token_id": eos_token_ids,
            "structured_outputs": self.structured_outputs,
        }

    @property
    def eval_structured_outputs(self) -> rollout.StructuredOutputs | None:
        """The held-out evaluation's constraint: ``structured_outputs`` under ``structured_outputs_eval``, else None."""
        return self._structured_outputs if self.structured_outputs_eval else None

    @property
    def num_generations(self) -> int:
        """Completions per prompt (a field of ``GRPOConfig``; 1 for PPO)."""
        return 1

    @property
    def prompts_per_batch(self) -> int:
        """Prompts per process per step: batch_size // num_generations."""
        return self.batch_size // self.num_generations

    @property
    def effective_prefetch(self) -> int:
        """Batches kept in flight beyond the one being trained (0 in synchronous mode)."""
        if not self.async_rollouts or self.max_staleness == 0:
            return 0
        return self.max_staleness if self.prefetch_batches is None else self.prefetch_batches

    def lora_engine_fields(self) -> dict[str, Any]:
        """The engine fields a LoRA run needs (none without ``lora_r``): adapters on, ``max_lora_rank`` at least
        ``lora_r``, and ``max_loras`` at least ``effective_prefetch + 2`` (TRL's ``max_staleness + 2``: the adapter
        being loaded, the current one, and one per batch still generating under an older one)."""
        if self.lora_r is None:
            return {}
        return {
            "enable_lora": True,
            "max_loras": max(int(self.engine.get("max_loras", 1)), self.effective_prefetch + 2),
            "max_lora_rank": max(int(self.engine.get("max_lora_rank", 1)), self.lora_r),
        }

    def engine_config(self, **extra: Any) -> rollout.ContinuousBatchingConfig:
        """The engine's configuration: ``engine`` plus the fields the trainer fixes (and a LoRA run's,
        ``lora_engine_fields``).

        Raises:
            ConfigError: an unknown engine key, a bad value, or an attempt to change a fixed field.
        """
        known = rollout.ContinuousBatchingConfig.field_names()
        for key, value in self.engine.items():
            if key not in known:
                raise ConfigError(f"unknown key engine.{key}{suggest(key, known)}")
            if key in ENGINE_FIXED and value != ENGINE_FIXED[key]:
                raise ConfigError(
                    f"engine.{key} is fixed to {ENGINE_FIXED[key]!r} by the {self.trainer_name} trainer, got {value!r}"
                )
        try:
            fields = {**self.engine, **ENGINE_FIXED, **self.lora_engine_fields(), **extra}
            if self.batch_invariant:
                fields["batch_invariant"] = True
            return rollout.ContinuousBatchingConfig(**fields)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"engine: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready mapping (``<algo>_config.json`` of the run folder)."""
        return dataclasses.asdict(self)


def suggest(key: str, known: list[str], as_flag: bool = False) -> str:
    """`` (did you mean 'x'?)`` (or ``--x`` ``as_flag``) for the closest of ``known``, or an empty string."""
    close = difflib.get_close_matches(key, known, n=1)
    if not close:
        return ""
    return f" (did you mean {'--' + close[0] if as_flag else repr(close[0])}?)"


@dataclass
class GRPOConfig(TrainerConfig):
    """Settings of a GRPO run: the fields of ``TrainerConfig`` (see its docstring) and these.

    Generation:
        num_generations: G, samples per prompt (>= 2; group-normalised advantages need two);
            ``batch_size`` must be a multiple of it.

    The loss (``trainers.loss``):
        epsilon, epsilon_high: PPO clip range [1 - epsilon, 1 + epsilon_high] of the ratio
            pi_theta / pi_prox (epsilon_high None means epsilon).
        is_cap: truncation of the importance weight pi_prox / pi_behaviour (TRL's
            ``vllm_importance_sampling_cap``, token_truncate mode).
        loss_type: "dapo": sum of per-token losses over the global batch divided by the number
            of completion tokens of the global batch (the default); "grpo": mean over each
            sequence's tokens, then mean over the global batch's sequences.
        scale_rewards: divide the group-centred rewards by the group's std (+ advantage_eps).
        advantage_eps: eps of (r - mean_group) / (std_group + eps).

    Asynchronous rollouts:
        train_outside_pause: run the training forward/backward while the engine keeps
            generating (only the optimizer step holds ``pause()``). Off by default; see
            docs/grpo_trainer.md.
    """

    trainer_name: ClassVar[str] = "GRPO"
    default_config_file: ClassVar[str | None] = "grpo_default.yaml"

    num_generations: int = 4  # a field here, the base's property (1) elsewhere
    epsilon: float = 0.2
    epsilon_high: float | None = None
    is_cap: float = 3.0
    loss_type: LossType = "dapo"
    scale_rewards: bool = True
    advantage_eps: float = 1e-4
    train_outside_pause: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_generations < 2:
            raise ConfigError(
                "num_generations must be >= 2 (advantages are normalised within each group), "
                f"got {self.num_generations}"
            )
        if self.batch_size % self.num_generations:
            raise ConfigError(
                f"batch_size ({self.batch_size}) must be a multiple of num_generations ({self.num_generations}): "
                "each prompt's G completions are trained on the same process"
            )
        check_at_least(self, ("epsilon", "is_cap", "advantage_eps"), 0, strict=True)
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ConfigError(f"epsilon_high must be > 0 or null, got {self.epsilon_high!r}")
        check_one_of("loss_type", self.loss_type, LossType)
        self.engine_config()  # validate the engine mapping now
