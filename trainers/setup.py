"""Setup steps every trainer runs before its first step, in this order: the accelerator and the run
folder, CPU threads, the datasets and reward functions (a bad column fails before the model loads),
the policy and its tokenizer, the context check, the engine's settings and the rollout backend; and the
one backward the trainers' losses go through (``backward``).

Module functions of a ``trainers.config.TrainerConfig``, composed by ``trainers.recipe.Recipe.__init__``
(torchtune's ``_setup_*`` steps).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import rollout

from .backend import RolloutBackend
from .config import ConfigError
from .prompts import eos_token_ids
from .remote import RemoteRollouts
from .rewards import RewardFunc, required_columns, resolve_reward_func, reward_name
from .runs import resolve_output_dir
from .tasks import build_datasets

logger = logging.getLogger(__name__)

GIB = 1024**3
# Colocated training (see ``training_memory_percent``): the gradient and AdamW's two moments are each
# as large as the trainable parameters, and none exists before the first backward and optimizer step.
TRAINING_STATE_FACTOR = 3
# The share of what remains that the engine takes next to a trainer, as TRL does for its own
# continuous-batching path: trl/trainer/grpo_trainer.py (TRL 1.16.0, GRPOTrainer.__init__) sets
# ``cb_kwargs.setdefault("max_memory_percent", 0.5)`` because transformers' 0.9 "leaves almost no
# VRAM for the training backward pass". The other half is left to activations and the loss's logits.
TRAINING_ENGINE_SHARE = 0.5
# Floor of ``training_memory_percent`` (``max_memory_percent`` must be > 0).
MIN_TRAINING_MEMORY_PERCENT = 0.01


def training_state_bytes(model: torch.nn.Module) -> int:
    """Bytes that training will add to ``model``: ``TRAINING_STATE_FACTOR`` x its trainable parameters' bytes.

    The gradient and AdamW's ``exp_avg`` and ``exp_avg_sq`` each match a parameter in size and dtype
    (``torch.optim.AdamW`` allocates them lazily, at the first backward and step).
    """
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return TRAINING_STATE_FACTOR * trainable


def training_memory_percent(model: torch.nn.Module, usable_bytes: int | None = None) -> float:
    """The engine's memory share next to a trainer of ``model``: ``max_memory_percent`` for a colocated engine.

    The engine is built before the trainer's gradients and optimizer state exist, so sizing from the
    memory usable then (0.9 of it on CUDA by default) leaves the first backward nothing. This share
    first sets aside ``training_state_bytes(model)`` (gradient and AdamW moments: 3 x the trainable
    parameters' bytes), then gives the engine ``TRAINING_ENGINE_SHARE`` (0.5, TRL's default for its own
    continuous-batching path) of the rest; the other half is left to the training forward's
    activations and logits. It is never above the engine's own default for the device (0.25 on CPU).

    Args:
        model: the policy model, on the device the engine will use.
        usable_bytes: that device's usable memory in bytes; None measures it (``rollout.usable_memory_bytes``).

    Returns:
        ``min(device default, TRAINING_ENGINE_SHARE * (usable - state) / usable)``, as a fraction of the
        usable memory; ``MIN_TRAINING_MEMORY_PERCENT`` (with a warning) when the state alone fills it.
    """
    device = next(model.parameters()).device
    usable = rollout.usable_memory_bytes(device) if usable_bytes is None else usable_bytes
    state = training_state_bytes(model)
    default = rollout.ContinuousBatchingConfig().resolved_memory_percent(device.type)
    if usable <= 0 or state >= usable:
        logger.warning(
            "training state (%.3f GiB: gradients and AdamW moments) does not fit the %.3f GiB usable on %s; the "
            "engine takes %.0f%% of it",
            state / GIB,
            usable / GIB,
            device,
            100 * MIN_TRAINING_MEMORY_PERCENT,
        )
        return MIN_TRAINING_MEMORY_PERCENT
    share = TRAINING_ENGINE_SHARE * (usable - state) / usable
    return max(MIN_TRAINING_MEMORY_PERCENT, min(default, share))


def setup_accelerator(config: Any, accelerator: Accelerator | None, prefix: str) -> tuple[Accelerator, Path]:
    """The run's Accelerator (built when None: CPU without CUDA, with ``config.mixed_precision``) and output folder.

    Raises:
        ConfigError: ``mixed_precision`` "fp16" without CUDA, a given accelerator whose mixed precision
            differs from ``config.mixed_precision``, mixed precision with a ``dtype`` other than
            float32, or an output folder that ``resolve_output_dir`` refuses.
    """
    if accelerator is None:
        # The output folder is the trackers' logging folder, so it is resolved before the Accelerator.
        cpu = not torch.cuda.is_available()
        if cpu and config.mixed_precision == "fp16":
            raise ConfigError("mixed_precision 'fp16' needs a CUDA GPU (autocast to float16); use 'bf16' on CPU")
        output_dir = resolve_output_dir(config, PartialState(cpu=cpu).num_processes, prefix)
        log_dir = str(output_dir) if config.log_with else None
        accelerator = Accelerator(
            cpu=cpu, mixed_precision=config.mixed_precision, log_with=config.log_with, project_dir=log_dir
        )
    else:
        if config.mixed_precision is not None and config.mixed_precision != accelerator.mixed_precision:
            raise ConfigError(
                f"mixed_precision is {config.mixed_precision!r} but the given accelerator's is "
                f"{accelerator.mixed_precision!r}"
            )
        output_dir = resolve_output_dir(config, accelerator.num_processes, prefix)
    if accelerator.mixed_precision == "fp16" and accelerator.device.type != "cuda":
        # accelerate takes fp16 from the launcher on CPU and then runs without autocast: say so.
        raise ConfigError(
            "mixed_precision 'fp16' (from the launcher or the accelerator) needs a CUDA GPU; use 'bf16' on CPU"
        )
    if accelerator.mixed_precision != "no" and config.dtype != "float32":
        raise ConfigError(
            f"mixed precision {accelerator.mixed_precision!r} keeps float32 master weights under autocast; "
            f"dtype must be 'float32', got {config.dtype!r}"
        )
    if accelerator.gradient_accumulation_steps > 1:
        logger.info(
            "gradient_accumulation_steps %d (from the launcher or the accelerator): the trainer accumulates each "
            "step's gradient over its own micro-batches (micro_batch_size) and normalises the loss once over the "
            "step's batch, so the setting changes neither the gradient nor the optimizer steps (see setup.backward)",
            accelerator.gradient_accumulation_steps,
        )
    accelerator.wait_for_everyone()  # every process checked the folder before the main one writes to it
    if accelerator.device.type == "cpu":
        set_cpu_threads(config.cpu_threads)
    return accelerator, output_dir


def backward(accelerator: Accelerator, loss: torch.Tensor) -> None:
    """``accelerator.backward`` of a micro-batch's part of a step's loss, normalised once.

    The trainers divide each micro-batch's loss by the step's global token or sequence count, so the
    micro-batches' gradients add up to the gradient of the step's loss: the accumulation is already in
    the loss. ``accelerator.backward`` divides by ``gradient_accumulation_steps`` again (set with
    ``Accelerator(gradient_accumulation_steps=N)`` or ``accelerate launch --gradient_accumulation_steps N``),
    which made the gradient, the logged grad_norm and the clip N times smaller (TRL issues 5619, 6024
    report the same double division). Multiplying by N first undoes it, whatever N is, and keeps
    ``accelerator.backward``'s loss scaling under fp16.

    Args:
        accelerator: the run's Accelerator; ``accumulate()`` is never entered, so its optimizer steps
            and zeroes at every call and only this division depends on N.
        loss: a 0-d tensor, the micro-batch's part of the step's loss.
    """
    accelerator.backward(loss * accelerator.gradient_accumulation_steps)


def set_cpu_threads(threads: int | None) -> None:
    """torch threads: ``threads``, or the CPUs this process may use divided by the processes on this machine."""
    if threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, len(os.sched_getaffinity(0)) // max(local, 1))
    torch.set_num_threads(threads)


def setup_data(
    config: Any,
    train_dataset: datasets.Dataset | None,
    eval_dataset: datasets.Dataset | None,
    reward_funcs: Sequence[RewardFunc | str] | None,
    world_size: int,
) -> tuple[datasets.Dataset, datasets.Dataset | None, list[RewardFunc], list[str], list[float]]:
    """The training and held-out datasets and the reward functions, checked against each other.

    ``train_dataset`` None builds both splits from ``config.dataset``; a given ``train_dataset``
    without ``eval_dataset`` means no evaluation. ``config.eval_size`` 0 drops the held-out set.

    Returns:
        (train dataset, held-out dataset or None, reward functions, their names, their weights).

    Raises:
        ConfigError: a dataset that cannot be built, a missing column (named), a reward function
            that cannot be resolved, weights that do not match the functions, or a dataset smaller
            than one step.
    """
    try:
        if train_dataset is None:
            train_dataset, built_eval = build_datasets(
                config.dataset,
                config.dataset_size,
                config.dataset_seed,
                config.eval_dataset,
                config.eval_size,
                config.eval_seed,
            )
            eval_dataset = eval_dataset if eval_dataset is not None else built_eval
    except (ValueError, FileNotFoundError) as e:
        message = str(e)
        raise ConfigError(message if message.startswith("dataset: ") else f"dataset: {message}") from e
    eval_dataset = eval_dataset if config.eval_size > 0 else None
    specs = list(reward_funcs) if reward_funcs is not None else list(config.reward_funcs)
    try:
        funcs = [resolve_reward_func(s) for s in specs]
    except ValueError as e:
        raise ConfigError(str(e)) from e
    names = [reward_name(f) for f in funcs]
    weights = list(config.reward_weights) if config.reward_weights is not None else [1.0] * len(specs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    check_columns(config.prompt_column, train_dataset, eval_dataset, funcs, names)
    if len(train_dataset) < config.prompts_per_batch * world_size:
        raise ConfigError(
            f"dataset: {len(train_dataset)} prompts cannot fill one step of "
            f"{config.prompts_per_batch} prompts x {world_size} processes"
        )
    return train_dataset, eval_dataset, funcs, names, weights


def check_columns(
    prompt_column: str,
    dataset: datasets.Dataset,
    eval_dataset: datasets.Dataset | None,
    reward_funcs: Sequence[RewardFunc],
    reward_names: Sequence[str],
) -> None:
    """Raise ConfigError naming a column the prompts, the held-out answers or a reward function need but lack."""
    if eval_dataset is not None:
        for col in (prompt_column, "answer"):
            if col not in eval_dataset.column_names:
                raise ConfigError(f"eval_dataset: no column {col!r} (columns: {sorted(eval_dataset.column_names)})")
    columns = set(dataset.column_names)
    if prompt_column not in columns:
        raise ConfigError(f"prompt_column: the dataset has no column {prompt_column!r} (columns: {sorted(columns)})")
    for fn, name in zip(reward_funcs, reward_names):
        for col in required_columns(fn):
            if col not in columns:
                raise ConfigError(
                    f"reward_funcs: {name!r} needs the dataset column {col!r}, which the dataset lacks "
                    f"(columns: {sorted(columns)})"
                )


def setup_policy(
    config: Any, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, int, list[int]]:
    """The policy in eval mode (no dropout: the engine and the trainer compute the same function), its
    tokenizer, the pad id and the EOS ids; loaded from ``config.model`` when either is None.

    Raises:
        ConfigError: the model cannot be loaded, or its context cannot hold a prompt plus a completion.
    """
    if model is None or tokenizer is None:
        try:
            model, tokenizer = rollout.load_model(config.model, dtype=getattr(torch, config.dtype))
        except OSError as e:  # no such folder, or not a model folder: the config's fault, said as such
            raise ConfigError(f"model: cannot load {config.model!r}: {str(e).splitlines()[0]}") from e
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    check_context(config, rollout.model_context_length(model))
    return model, tokenizer, 0 if pad is None else pad, eos_token_ids(model, tokenizer)


def check_context(config: Any, context: int | None) -> None:
    """Refuse completions that cannot fit the model's context (``max_position_embeddings``) after the
    longest prompt, before any work: the engine would refuse every such request at the first step.

    Raises:
        ConfigError: naming ``max_new_tokens`` (or ``eval_max_new_tokens``), the longest prompt
            (``max_prompt_length``) and the context.
    """
    if context is None:
        return
    for name in ("max_new_tokens", "eval_max_new_tokens"):
        value = getattr(config, name)
        if config.max_prompt_length + value > context:
            raise ConfigError(
                f"{name}: a prompt of max_prompt_length ({config.max_prompt_length} tokens) plus {name} "
                f"({value}) is past the model's context of {context} tokens; lower {name} to at most "
                f"{context - config.max_prompt_length} or max_prompt_length"
            )


def engine_config_for(
    config: Any, model: PreTrainedModel, device_type: str, usable_bytes: int | None = None
) -> rollout.ContinuousBatchingConfig:
    """The engine's settings: ``config.engine``, and when it sets no ``num_blocks``, a cache for the batches in flight.

    That cache holds every sequence in flight at full length (plus slack), but never more than fits
    the engine's memory share next to training: ``engine.max_memory_percent`` when set, else
    ``training_memory_percent(model)`` (room left for the gradients and AdamW moments,
    which exist only after the first step, then TRL's 0.5 share of the rest).

    Args:
        config: the trainer's config (``batch_size`` sequences per batch, ``effective_prefetch`` batches ahead).
        model: the policy, on its training device.
        device_type: "cpu" or "cuda".
        usable_bytes: the device's usable memory; None measures it.
    """
    if config.engine.get("num_blocks") is not None:
        return config.engine_config()
    base = config.engine_config()
    block = base.resolved_page_size(device_type)
    per_seq = -(-(config.max_prompt_length + config.max_new_tokens) // block) + 1
    in_flight = (config.effective_prefetch + 1) * config.batch_size
    wanted = in_flight * per_seq + 8
    percent = base.max_memory_percent
    if percent is None:
        percent = training_memory_percent(model, usable_bytes)
    fits = rollout.num_blocks_for_model(model, base, memory_percent=percent, usable_bytes=usable_bytes)
    if fits < wanted:
        logger.warning(
            "KV cache: %d blocks hold the %d sequences in flight, %.0f%% of usable memory holds %d; using %d "
            "(requests wait for blocks; set engine.num_blocks or engine.max_memory_percent to override)",
            wanted,
            in_flight,
            100 * percent,
            fits,
            fits,
        )
    return config.engine_config(num_blocks=min(wanted, fits))


def rollout_backend(
    config: Any,
    policy: PreTrainedModel,
    accelerator: Accelerator,
    eos_token_ids: Sequence[int],
    tokenizer: Any | None = None,
) -> RolloutBackend:
    """The trainer's rollout backend on ``policy``: the ``rollout-serve`` replicas at ``config.rollout_server``
    (behind ``config.rollout_router``, if set; ``trainers.remote.RemoteRollouts``; the main process streams the
    weights, every process learns their version), else a persistent ``rollout.ContinuousBatchingManager`` on the
    policy object itself (no copy of the weights), its cache sized by ``engine_config_for``, with ``tokenizer``
    (what structured outputs are compiled against; a server has its own)."""
    if config.rollout_server:

        def share_version(version: int) -> int:
            return int(broadcast_object_list([version])[0]) if accelerator.num_processes > 1 else version

        return RemoteRollouts(
            config.rollout_server.split(","),
            policy,
            router_url=config.rollout_router,
            api_key=config.rollout_api_key,
            bucket_bytes=config.weight_sync_bucket_mb << 20,
            is_sender=accelerator.is_main_process,
            share_version=share_version,
            lora=(config.lora_r, config.lora_engine_fields()["max_loras"]) if config.lora_r is not None else None,
        )
    # Exactly the config's sampling: the model's generation config (a checkpoint's top_k, top_p or
    # repetition_penalty) must not reach the rollouts, or the policy trained on is not the one sampled from.
    params = rollout.SamplingParams(
        max_new_tokens=config.max_new_tokens,
        do_sample=True,
        temperature=config.temperature,
        eos_token_ids=tuple(eos_token_ids),
    )
    engine_config = engine_config_for(config, policy, accelerator.device.type)
    return rollout.ContinuousBatchingManager(policy, params, engine_config, tokenizer=tokenizer)
