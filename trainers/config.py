"""The GRPO trainer's settings: one validated dataclass, loaded from YAML.

``load_config(path, **overrides)`` reads a YAML mapping with ``yaml.safe_load``, applies command-line
overrides on top, and builds ``GRPOConfig``. Every key is checked before anything heavy happens (model
load, process group, dataset): an unknown key, a value of the wrong type or out of range raises
``ConfigError`` whose message names the key (and suggests the closest known key for a typo).

The ``engine`` mapping holds ``rollout.ContinuousBatchingConfig`` fields; it is validated by that
class. ``return_logprobs`` and ``logprobs_mode`` are fixed by the trainer (True, "temperature").
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import SchedulerType

import rollout

from .rewards import resolve_reward_func

LOSS_TYPES = ("dapo", "grpo")
STALE_POLICIES = ("wait", "drop")
DTYPES = ("float32", "bfloat16", "float16")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
# Engine fields the trainer owns: the behaviour logprobs must be log_softmax(logits / T).
ENGINE_FIXED = {"return_logprobs": True, "logprobs_mode": "temperature"}


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclass
class GRPOConfig:
    """Settings of a GRPO run.

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

    Evaluation (held-out accuracy, greedy through the same manager; see ``trainers.evaluate``):
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
        num_generations: G, samples per prompt (>= 2; group-normalised advantages need two).
        batch_size: completions per process per step; a multiple of ``num_generations``.
        max_prompt_length: prompts longer than this keep their last tokens (TRL's rule).
        max_new_tokens: most tokens per completion.
        temperature: sampling temperature; the trainer divides its logits by the same value,
            so behaviour and trainer logprobs are the same function of the weights. Sampling is
            plain temperature sampling (no top-k/top-p), so the behaviour policy is exactly
            softmax(logits / T).

    Optimisation:
        learning_rate, weight_decay, adam_beta1, adam_beta2, max_grad_norm: AdamW and gradient
            clipping.
        lr_scheduler_type: the learning-rate schedule after warm-up, a ``transformers.SchedulerType``
            ("constant_with_warmup", "linear", "cosine", ...; ``transformers.get_scheduler``).
        warmup_steps: linear warm-up steps of the learning rate.
        micro_batch_size: sequences per training forward/backward (gradients accumulate over
            the micro-batches of a step; one optimizer step per step).
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
        async_rollouts: generate the next batches while the trainer works on the current one.
        max_staleness: most weight versions a trained token may be older than the weights it
            is trained on. 0 is synchronous mode (async_rollouts then changes nothing).
        stale_policy: "wait": batch j is submitted only once the weights are at version
            >= j - max_staleness, so no sample is ever too old; "drop": submit
            ``prefetch_batches`` ahead without waiting and drop (mask out of the loss) every
            sample with a token older than max_staleness.
        prefetch_batches: batches kept in flight beyond the one being trained (None: max_staleness).
        train_outside_pause: run the training forward/backward while the engine keeps
            generating (only the optimizer step holds ``pause()``). Off by default; see the
            trainer module's docstring.

    Run:
        max_steps: optimizer steps (one batch each).
        seed: seed of torch, of the dataset order and of the sampling seeds.
        output_dir: metrics.jsonl, timing.jsonl, the evaluation samples, trackers' logs and the
            final model go here. None (the default): ``$ROLLOUT_HOME/runs/grpo-<UTC date-time>``
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

    Remote rollouts:
        rollout_server: the URL of a ``rollout-serve --enable-control`` on the same model; rollouts are
            generated there over HTTP and the weights are streamed to it after every optimizer step
            (``trainers.remote``). None: the engine runs in the trainer's process on the trained model.
        rollout_api_key: the server's ``--api-key``.
        weight_sync_bucket_mb: bucket size of the weight stream, in MiB; 16 was the fastest on this CPU
            (docs/weight_sync.md: large buckets lose the overlap of packing and sending).
    """

    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None
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

    num_generations: int = 4
    batch_size: int = 16
    max_prompt_length: int = 256
    max_new_tokens: int = 64
    temperature: float = 1.0

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: str = "constant_with_warmup"
    micro_batch_size: int = 8
    epsilon: float = 0.2
    epsilon_high: float | None = None
    is_cap: float = 3.0
    loss_type: Literal["dapo", "grpo"] = "dapo"
    scale_rewards: bool = True
    advantage_eps: float = 1e-4

    async_rollouts: bool = False
    max_staleness: int = 0
    stale_policy: Literal["wait", "drop"] = "wait"
    prefetch_batches: int | None = None
    train_outside_pause: bool = False

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
    rollout_api_key: str | None = None
    weight_sync_bucket_mb: int = 16

    def __post_init__(self) -> None:
        validate_common(self)
        if self.num_generations < 1:
            raise ConfigError(f"num_generations must be >= 1, got {self.num_generations!r}")
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
        for name in ("epsilon", "is_cap", "advantage_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise ConfigError(f"epsilon_high must be > 0 or null, got {self.epsilon_high!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.weight_sync_bucket_mb < 1:
            raise ConfigError(f"weight_sync_bucket_mb must be >= 1, got {self.weight_sync_bucket_mb!r}")
        if self.rollout_server is not None and not self.rollout_server.startswith(("http://", "https://")):
            raise ConfigError(f"rollout_server must be an http:// or https:// URL, got {self.rollout_server!r}")
        self.engine_config()  # validate the engine mapping now

    # ------------------------------------------------------------------ derived values
    @property
    def prompts_per_batch(self) -> int:
        """Prompts per process per step: batch_size // num_generations."""
        return self.batch_size // self.num_generations

    @property
    def effective_prefetch(self) -> int:
        """Batches kept in flight beyond the one being trained (0 in synchronous mode)."""
        return effective_prefetch(self)

    def engine_config(self, **extra: Any) -> rollout.ContinuousBatchingConfig:
        """The engine's configuration: ``engine`` plus the fields the trainer fixes.

        Raises:
            ConfigError: an unknown engine key, a bad value, or an attempt to change a fixed field.
        """
        return engine_config(self, "GRPO", **extra)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate_common(config: Any) -> None:
    """Check the fields every trainer config shares (data, evaluation, sampling, optimisation, async
    rollouts, run); the trainer-specific ones are checked by the config itself.

    Raises:
        ConfigError: naming the first bad key.
    """
    if config.mixed_precision is False:  # YAML 1.1 reads an unquoted `no` (accelerate's spelling) as false
        config.mixed_precision = "no"
    _check_types(config)
    for name in ("dataset_size", "batch_size", "max_prompt_length", "max_new_tokens", "micro_batch_size", "max_steps"):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(config, name)!r}")
    if config.temperature <= 0:
        raise ConfigError(f"temperature must be > 0 (the trainer samples), got {config.temperature!r}")
    if config.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be > 0, got {config.learning_rate!r}")
    for name in (
        "weight_decay",
        "max_grad_norm",
        "warmup_steps",
        "max_staleness",
        "dataset_seed",
        "log_completions",
        "eval_size",
        "eval_seed",
    ):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)!r}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(config, name)!r}")
    schedules = [t.value for t in SchedulerType]
    if config.lr_scheduler_type not in schedules:
        raise ConfigError(f"lr_scheduler_type must be one of {schedules}, got {config.lr_scheduler_type!r}")
    if config.stale_policy not in STALE_POLICIES:
        raise ConfigError(f"stale_policy must be one of {STALE_POLICIES}, got {config.stale_policy!r}")
    if config.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {config.dtype!r}")
    if config.mixed_precision is not None and config.mixed_precision not in MIXED_PRECISIONS:
        raise ConfigError(f"mixed_precision must be one of {MIXED_PRECISIONS} or null, got {config.mixed_precision!r}")
    if config.mixed_precision not in (None, "no") and config.dtype != "float32":
        raise ConfigError(
            f"mixed_precision {config.mixed_precision!r} keeps float32 master weights under autocast; "
            f"dtype must be 'float32', got {config.dtype!r}"
        )
    if config.prefetch_batches is not None and config.prefetch_batches < 0:
        raise ConfigError(f"prefetch_batches must be >= 0 or null, got {config.prefetch_batches!r}")
    if config.eval_steps is not None and config.eval_steps < 1:
        raise ConfigError(f"eval_steps must be >= 1 or null, got {config.eval_steps!r}")
    if config.eval_max_new_tokens < 1:
        raise ConfigError(f"eval_max_new_tokens must be >= 1, got {config.eval_max_new_tokens!r}")
    if config.cpu_threads is not None and config.cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be >= 1 or null, got {config.cpu_threads!r}")
    if config.log_with is not None:
        # accelerate's own list: an unknown name would fail only after the model and engine are built.
        from accelerate.utils import LoggerType

        trackers = tuple(t.value for t in LoggerType)
        if config.log_with not in trackers:
            raise ConfigError(f"log_with must be null or one of {trackers}, got {config.log_with!r}")
    if not config.reward_funcs:
        raise ConfigError("reward_funcs must name at least one reward function")
    for spec in config.reward_funcs:
        if isinstance(spec, str) and ":" not in spec:  # a 'module:function' is imported by the trainer
            try:
                resolve_reward_func(spec)
            except ValueError as e:  # the one message, from the function the trainer resolves with
                raise ConfigError(str(e)) from e
    if config.reward_weights is not None and len(config.reward_weights) != len(config.reward_funcs):
        raise ConfigError(
            f"reward_weights has {len(config.reward_weights)} values but reward_funcs has {len(config.reward_funcs)}"
        )


def effective_prefetch(config: Any) -> int:
    """Batches kept in flight beyond the one being trained (0 in synchronous mode)."""
    if not config.async_rollouts or config.max_staleness == 0:
        return 0
    return config.max_staleness if config.prefetch_batches is None else config.prefetch_batches


def engine_config(config: Any, trainer: str, **extra: Any) -> rollout.ContinuousBatchingConfig:
    """The engine's configuration: ``config.engine`` plus the fields the trainer fixes.

    Raises:
        ConfigError: an unknown engine key, a bad value, or an attempt to change a fixed field.
    """
    known = rollout.ContinuousBatchingConfig.field_names()
    for key, value in config.engine.items():
        if key not in known:
            raise ConfigError(f"unknown key engine.{key}{_suggest(key, known)}")
        if key in ENGINE_FIXED and value != ENGINE_FIXED[key]:
            raise ConfigError(f"engine.{key} is fixed to {ENGINE_FIXED[key]!r} by the {trainer} trainer, got {value!r}")
    values = {**config.engine, **ENGINE_FIXED, **extra}
    try:
        return rollout.ContinuousBatchingConfig(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"engine: {e}") from e


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_types(config: Any) -> None:
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _matches(value, hints[f.name]):
            raise ConfigError(f"{f.name} must be {_describe(hints[f.name])}, got {value!r}")


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return "a mapping"
    return {bool: "a bool", int: "an int", float: "a number", str: "a string"}.get(tp, str(tp))


def parse_int(text: str) -> int:
    """An int written any way a number is written ("30", "5e3", "1_000", "2.0"); argparse's ``type`` for ints.

    Raises:
        ValueError: not a number, or not a whole one.
    """
    try:
        return int(text)
    except ValueError:
        value = float(text)
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def _coerce_number(value: Any, tp: Any) -> Any:
    """``value`` converted to the number type in ``tp`` when it is a number written another way.

    YAML 1.1 reads ``1e-5`` (no dot) as a string and ``5e3`` too; a whole float may fill an int
    field. Anything else is returned unchanged for the type check to judge.
    """
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    if isinstance(value, bool):
        return value
    if int in args and float not in args:
        if isinstance(value, str):
            try:
                return parse_int(value.strip())
            except ValueError:
                return value
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            return int(value)
    if float in args and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    if typing.get_origin(tp) is list and isinstance(value, list):
        return [_coerce_number(v, typing.get_args(tp)[0]) for v in value]
    return value


def coerce_numbers(values: dict[str, Any], cls: type) -> dict[str, Any]:
    """``values`` with every number written as a string (or a whole float for an int) converted to
    the type of ``cls``'s field of the same name; unknown keys are left as they are."""
    hints = typing.get_type_hints(cls)
    return {k: _coerce_number(v, hints[k]) if k in hints else v for k, v in values.items()}


def read_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping of a YAML config file (empty for an empty file).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: not valid YAML, or not a mapping (the message names the file).
    """
    text = Path(path).read_text()
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a trainer config must be a YAML mapping, got {type(loaded).__name__}")
    return loaded


def config_from_dict(values: dict[str, Any], cls: type = GRPOConfig) -> Any:
    """Build a ``cls`` (GRPOConfig, PPOConfig) from a mapping (numbers may be written as strings, e.g. "1e-5").

    Raises:
        ConfigError: an unknown key (named, with the closest known key), or a bad value.
    """
    if not isinstance(values, dict):
        raise ConfigError(f"a trainer config must be a mapping of keys to values, got {type(values).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key {key!r}{_suggest(str(key), known)}")
    values = coerce_numbers(values, cls)
    if isinstance(values.get("engine"), dict):
        values["engine"] = coerce_numbers(values["engine"], rollout.ContinuousBatchingConfig)
    return cls(**values)


def load_config(path: str | Path | None = None, cls: type = GRPOConfig, **overrides: Any) -> Any:
    """Read a YAML config and apply overrides (None values are ignored).

    Args:
        path: a YAML file holding a mapping; None starts from the defaults.
        **overrides: values that replace the file's.

    Raises:
        ConfigError: unknown key, bad value, or a file that is not a YAML mapping.
        FileNotFoundError: ``path`` does not exist.
    """
    values: dict[str, Any] = read_yaml_config(path) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return config_from_dict(values, cls)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from e
