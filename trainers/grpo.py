"""GRPO on rollout's persistent manager, one process per device, data parallel through ``accelerate``.

Each process holds one model replica (DDP across processes) and one persistent
``rollout.ContinuousBatchingManager`` built on the same model object (no copy of the weights). A step
samples G completions of each prompt on the manager (they share the prompt's KV blocks), scores them,
turns the rewards into group-normalised advantages, runs the clipped policy-gradient loss with
truncated importance weights against the rollout's logprobs (``trainers.loss``), and takes the
optimizer step inside ``manager.pause()`` followed by ``manager.update_weights(None)``. With
``async_rollouts`` the engine generates the next batches while the current one trains, at most
``max_staleness`` weight versions behind. Held-out evaluation (``trainers.evaluate``) runs at step 0,
every ``eval_steps`` and at the end. The full design, the loss and the asynchronous schedule are in
docs/grpo_trainer.md.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

import rollout

from .config import GRPOConfig
from .evaluate import evaluate_sharded
from .loss import aggregate_loss, completion_logprobs, group_advantages, grpo_token_loss, zero_spread_groups
from .prompts import encode_prompt
from .remote import RemoteRollouts
from .rewards import RewardFunc, compute_rewards
from .rollout_queue import PromptSampler, RolloutBatch, RolloutQueue
from .runs import TIMING_KEYS, RunFolder, flat_config, nanstd, resolve_output_dir, sample_seed, source_commit, summary
from .setup import backward, engine_config_for, setup_accelerator, setup_data, setup_policy

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- the trainer
@dataclass
class TrainerState:
    """What reward functions see as ``trainer_state``."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class _Prepared:
    """A scored batch, ready for the loss."""

    prompt_ids: list[list[int]]  # one per sample
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    advantages: torch.Tensor  # [N]
    sample_mask: torch.Tensor  # [N]; 0 for dropped (stale) samples
    staleness: list[list[int]]  # per token: version at training - version sampled
    rewards: torch.Tensor  # [N]
    rewards_per_func: torch.Tensor  # [N, F]
    finish_length: torch.Tensor  # [N] 1 where the completion hit max_new_tokens
    zero_spread: torch.Tensor  # [N / G] 1 for a group whose rewards are all equal (no signal)
    texts: list[str] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)


class GRPOTrainer:
    """GRPO with continuous-batching rollouts on the training model itself.

    Args:
        config: the run's settings (validated).
        model, tokenizer: the policy; loaded from ``config.model`` with ``rollout.load_model``
            when None.
        train_dataset: a ``datasets.Dataset`` with ``config.prompt_column`` and the columns the
            reward functions need; built from ``config.dataset`` when None.
        reward_funcs: callables with TRL's signature (or names/paths); ``config.reward_funcs``
            when None.
        accelerator: an existing Accelerator; one is built otherwise (CPU when CUDA is absent, with
            ``config.mixed_precision``). A given one must agree with ``config.mixed_precision`` when
            that is set.
        eval_dataset: held-out problems (``config.prompt_column`` and ``answer`` columns) for
            ``eval_accuracy``; when None and ``train_dataset`` is None, the held-out split of
            ``config.dataset`` (``trainers.tasks.build_datasets``); None with a given
            ``train_dataset``: no evaluation.

    Raises:
        ConfigError: a bad setting or a dataset without a needed column (the message names it);
            raised before the model is loaded. Among them: ``mixed_precision`` "fp16" without CUDA,
            a given accelerator whose mixed precision differs from ``config.mixed_precision``, and
            mixed precision (from the config or the launcher) with a ``dtype`` other than float32.
    """

    def __init__(
        self,
        config: GRPOConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        train_dataset: datasets.Dataset | None = None,
        reward_funcs: Sequence[RewardFunc | str] | None = None,
        accelerator: Accelerator | None = None,
        eval_dataset: datasets.Dataset | None = None,
    ) -> None:
        self._t_created = time.perf_counter()  # the run's wall time counts the model load
        self.config = config
        acc, self.output_dir = setup_accelerator(config, accelerator, "grpo")
        self.accelerator = acc
        self.rank, self.world_size = acc.process_index, acc.num_processes
        # Data and rewards first: a bad column fails before the model loads.
        self.dataset, self.eval_dataset, self.reward_funcs, self.reward_names, self.reward_weights = setup_data(
            config, train_dataset, eval_dataset, reward_funcs, self.world_size
        )
        torch.manual_seed(config.seed)
        model, self.tokenizer, self.pad_token_id, self.eos_token_ids = setup_policy(config, model, tokenizer)
        self._supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )
        self.model, self.optimizer = acc.prepare(model, optimizer)
        self.unwrapped = acc.unwrap_model(self.model)
        assert self.unwrapped is model, "accelerate must wrap the model object, not copy it"
        self.scheduler = get_scheduler(
            config.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=config.warmup_steps,
            num_training_steps=config.max_steps,
        )

        self.manager = (
            self._remote_rollouts()
            if config.rollout_server
            else rollout.ContinuousBatchingManager(
                self.unwrapped,
                # Exactly the config's sampling: the model's generation config (a checkpoint's top_k,
                # top_p or repetition_penalty) must not reach the rollouts, or the policy trained on is
                # not the one sampled from.
                rollout.SamplingParams(
                    max_new_tokens=config.max_new_tokens,
                    do_sample=True,
                    temperature=config.temperature,
                    eos_token_ids=self.eos_token_ids,
                ),
                self._engine_config(self.unwrapped),
            )
        )
        self.state = TrainerState(0, config.max_steps)
        self._sampler = PromptSampler(self.dataset, config.prompts_per_batch, config.seed, self.rank, self.world_size)
        self.queue = RolloutQueue(
            self.manager,
            # Through the method, so a subclass that overrides _rows_for_batch is honoured.
            rows_for_batch=lambda j: self._rows_for_batch(j),
            encode=lambda row: self.encode_prompt(row[config.prompt_column]),
            samples_per_prompt=config.num_generations,
            max_steps=config.max_steps,
            prefetch=config.effective_prefetch,
            max_staleness=config.max_staleness,
            stale_policy=config.stale_policy,
            request_kwargs=dict(
                max_new_tokens=config.max_new_tokens,
                temperature=config.temperature,
                do_sample=True,
                eos_token_id=self.eos_token_ids,
            ),
            seed=lambda j, i, g: sample_seed(config.seed, self.rank, j, i, g),
            id_prefix="grpo",
        )
        self.run_folder = RunFolder(self.output_dir, "grpo", acc.is_main_process)
        self._logged_metrics: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ setup helpers
    def _remote_rollouts(self) -> RemoteRollouts:
        """The rollout-serve at ``config.rollout_server`` in place of a local manager (``trainers.remote``)."""
        acc, cfg = self.accelerator, self.config

        def share_version(version: int) -> int:
            return int(broadcast_object_list([version])[0]) if acc.num_processes > 1 else version

        return RemoteRollouts(
            str(cfg.rollout_server),
            self.unwrapped,
            api_key=cfg.rollout_api_key,
            bucket_bytes=cfg.weight_sync_bucket_mb << 20,
            is_sender=acc.is_main_process,
            share_version=share_version,
        )

    def _engine_config(
        self, model: PreTrainedModel, usable_bytes: int | None = None
    ) -> rollout.ContinuousBatchingConfig:
        """The engine's settings (``trainers.setup.engine_config_for``).

        Args:
            model: the policy, on its training device.
            usable_bytes: the device's usable memory; None measures it.
        """
        return engine_config_for(self.config, model, self.accelerator.device.type, usable_bytes)

    # ------------------------------------------------------------------ data
    def _rows_for_batch(self, j: int) -> list[dict[str, Any]]:
        return self._sampler.rows(j)

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt (``trainers.prompts.encode_prompt``), truncated to ``max_prompt_length``."""
        return encode_prompt(self.tokenizer, prompt, self.config.max_prompt_length)

    # ------------------------------------------------------------------ scoring
    def _log_metric(self, name: str, value: float) -> None:
        self._logged_metrics.setdefault(name, []).append(float(value))

    def _prepare(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> _Prepared:
        cfg = self.config
        G = cfg.num_generations
        rows = [row for row in batch.rows for _ in range(G)]
        prompts = [r[cfg.prompt_column] for r in rows]
        completion_ids = [list(o.generated_tokens) for o in outputs]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [r[k] for r in rows] for k in self.dataset.column_names if k != cfg.prompt_column}
        rewards, per_func = compute_rewards(
            self.reward_funcs,
            self.reward_weights,
            prompts,
            completions,
            completion_ids,
            columns,
            trainer_state=self.state,
            log_metric=self._log_metric,
        )
        advantages = group_advantages(rewards, G, cfg.scale_rewards, cfg.advantage_eps)
        staleness, too_old = self.queue.staleness(outputs)
        if too_old.any() and cfg.stale_policy == "wait":
            logger.warning(
                "%d samples are older than max_staleness under stale_policy 'wait'; dropping them", int(too_old.sum())
            )
        for o in outputs:
            if len(o.logprobs) != len(o.generated_tokens):
                raise RuntimeError("the engine returned no logprobs: return_logprobs must be on")
        prompt_ids = [ids for ids in batch.prompt_ids for _ in range(G)]
        return _Prepared(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            behaviour_logprobs=[list(o.logprobs) for o in outputs],
            advantages=advantages,
            sample_mask=(~too_old).float(),
            staleness=staleness,
            rewards=rewards,
            rewards_per_func=per_func,
            finish_length=torch.tensor([o.finish_reason == "length" for o in outputs], dtype=torch.float32),
            zero_spread=zero_spread_groups(rewards.float().view(-1, G)).float(),
            texts=texts,
            prompts=prompts,
        )

    # ------------------------------------------------------------------ training
    def _micro_batches(self, n: int) -> list[list[int]]:
        mb = self.config.micro_batch_size
        return [list(range(i, min(i + mb, n))) for i in range(0, n, mb)]

    def _forward_backward(self, prep: _Prepared) -> dict[str, float]:
        """Accumulate the gradients of the step's loss; returns per-process sums for the metrics."""
        cfg = self.config
        acc = self.accelerator
        device = acc.device
        n = len(prep.completion_ids)
        lengths = torch.tensor([len(c) for c in prep.completion_ids], dtype=torch.float32)
        local_tokens = float((lengths * prep.sample_mask).sum())
        local_seqs = float(prep.sample_mask.sum())
        counts = acc.reduce(torch.tensor([local_tokens, local_seqs], device=device), reduction="sum")
        global_count = float(counts[0] if cfg.loss_type == "dapo" else counts[1])
        sums = {
            "loss": 0.0,
            "is_sum": 0.0,
            "is_max": 0.0,
            "is_tokens": 0.0,
            "stale_sum": 0.0,
            "stale_max": 0.0,
            "clipped": 0.0,
            "is_min": math.inf,
            "tokens": 0.0,
            "skipped": 0.0,
        }
        if global_count == 0:
            return sums
        normaliser = global_count / self.world_size
        eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
        # Staleness over every trained token, whether or not its sequence is forwarded below.
        for i in range(n):
            if prep.sample_mask[i] > 0 and prep.staleness[i]:
                sums["stale_sum"] += float(sum(prep.staleness[i]))
                sums["stale_max"] = max(sums["stale_max"], float(max(prep.staleness[i])))
        sums["tokens"] = local_tokens
        # A sequence with advantage exactly 0 (its group's rewards were all equal: group_advantages
        # returns exact zeros there) or a dropped one adds exactly 0 to this loss and its gradient (the
        # loss has no KL or entropy term), so its forward and backward are skipped; the normaliser still
        # counts its tokens, so the gradient is the same (DAPO, Yu et al. 2025, arXiv:2503.14476, on
        # why such groups carry no signal). At least one micro-batch runs, so that every process reaches
        # the backward that synchronises the gradients.
        kept = [i for i in range(n) if prep.sample_mask[i] > 0]
        active = [i for i in kept if float(prep.advantages[i]) != 0.0]
        sums["skipped"] = float(len(kept) - len(active))  # dropped samples are counted by dropped_stale

        def length(i: int) -> int:
            return len(prep.prompt_ids[i]) + len(prep.completion_ids[i])

        if not active:
            active = [min(range(n), key=length)]
        # Longest first: similar lengths share a micro-batch and little is padded.
        order = sorted(active, key=length, reverse=True)
        chunks = [[order[i] for i in mb] for mb in self._micro_batches(len(order))]
        for c, idx in enumerate(chunks):
            sync = c == len(chunks) - 1
            ctx = contextlib.nullcontext() if sync else acc.no_sync(self.model)
            with ctx:
                logps, mask = completion_logprobs(
                    self.model,
                    [prep.prompt_ids[i] for i in idx],
                    [prep.completion_ids[i] for i in idx],
                    cfg.temperature,
                    self.pad_token_id,
                    self._supports_logits_to_keep,
                )
                behaviour = torch.zeros_like(logps)
                for b, i in enumerate(idx):
                    k = len(prep.completion_ids[i])
                    behaviour[b, :k] = torch.tensor(prep.behaviour_logprobs[i], dtype=torch.float32)
                mask = mask * prep.sample_mask[idx].to(device)[:, None]
                adv = prep.advantages[idx].to(device)
                per_token, is_ratio = grpo_token_loss(
                    logps, logps.detach(), behaviour.to(device), adv, cfg.epsilon, eps_high, cfg.is_cap
                )
                loss = aggregate_loss(per_token, mask, cfg.loss_type, normaliser)
                backward(acc, loss)
            sums["loss"] += float(loss.detach())
            m = mask.bool()
            if m.any():
                sums["is_sum"] += float(is_ratio[m].sum())
                sums["is_max"] = max(sums["is_max"], float(is_ratio[m].max()))
                sums["is_min"] = min(sums["is_min"], float(is_ratio[m].min()))
                sums["clipped"] += float((is_ratio[m] > cfg.is_cap).sum())
                sums["is_tokens"] += float(m.sum())
        return sums

    def _optimizer_step(self) -> tuple[float, float, int]:
        """Clip, step, schedule. Returns (grad norm before clipping, the learning rate this step used,
        the new weight version)."""
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        version = self.manager.update_weights(None)  # re-entrant: still inside the caller's pause
        return float(grad_norm) if grad_norm is not None else float("nan"), lr, version

    def train_step(self, step: int) -> dict[str, float]:
        """One step: collect batch ``step``, score it, and update the weights. Returns the metrics row."""
        cfg = self.config
        acc = self.accelerator
        t0, c0 = time.perf_counter(), time.process_time()
        batch, outputs = self.queue.take(step)
        t_collected = time.perf_counter()
        tokens_per_s = self.queue.throughput(batch, outputs)
        self.state.global_step = step
        self._logged_metrics = {}
        prep = self._prepare(batch, outputs)
        t_prepared = time.perf_counter()

        if cfg.train_outside_pause:
            sums = self._forward_backward(prep)
            t_fb = time.perf_counter()
            with self.queue.paused():
                grad_norm, lr, version = self._optimizer_step()
        else:
            with self.queue.paused():
                sums = self._forward_backward(prep)
                t_fb = time.perf_counter()
                grad_norm, lr, version = self._optimizer_step()
        t_end = time.perf_counter()

        # Metrics over all processes.
        device = acc.device
        rewards = acc.gather(prep.rewards.to(device))
        per_func = acc.gather(prep.rewards_per_func.to(device))
        lengths = acc.gather(torch.tensor([float(len(c)) for c in prep.completion_ids], device=device))
        truncated = acc.gather(prep.finish_length.to(device))
        zero_spread = acc.gather(prep.zero_spread.to(device))
        totals = acc.reduce(
            torch.tensor(
                [
                    sums["loss"],
                    sums["is_sum"],
                    sums["is_tokens"],
                    sums["stale_sum"],
                    sums["clipped"],
                    float((1 - prep.sample_mask).sum()),
                    tokens_per_s,
                    sums["tokens"],
                    sums["skipped"],
                ],
                dtype=torch.float64,
                device=device,
            ),
            reduction="sum",
        )
        sampled_stale = float(max(max(s) for s in prep.staleness))
        maxima = (
            acc.gather(
                torch.tensor(
                    [[sums["is_max"], sums["stale_max"], sampled_stale, -sums["is_min"]]],
                    dtype=torch.float64,
                    device=device,
                )
            )
            .max(dim=0)
            .values
        )
        is_tokens = float(totals[2])
        tokens = float(totals[7])
        row: dict[str, float] = {
            "step": step + 1,
            "loss": float(totals[0]) / self.world_size,  # each process's part carries a factor world_size
            "reward_mean": float(torch.nanmean(rewards)),
            "reward_std": float(nanstd(rewards)),
            "completion_len_mean": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "truncated_fraction": float(truncated.mean()),
            "frac_reward_zero_std": float(zero_spread.mean()),
            "rollout_tokens_per_s": float(totals[6]),
            "is_ratio_mean": float(totals[1]) / is_tokens if is_tokens else float("nan"),
            "is_ratio_max": float(maxima[0]) if is_tokens else float("nan"),
            "is_ratio_min": -float(maxima[3]) if is_tokens else float("nan"),
            "is_truncated_fraction": float(totals[4]) / is_tokens if is_tokens else float("nan"),
            "staleness_mean": float(totals[3]) / tokens if tokens else float("nan"),
            "staleness_max": float(maxima[1]) if tokens else float("nan"),
            "staleness_max_sampled": float(maxima[2]),
            "dropped_stale": float(totals[5]),
            "trained_tokens": tokens,
            "skipped_zero_advantage": float(totals[8]),
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "weight_version": version,
            "step_time_s": t_end - t0,
            "step_cpu_s": time.process_time() - c0,
            "wait_rollout_s": t_collected - t0,
            "prepare_s": t_prepared - t_collected,
            "train_s": t_fb - t_prepared,
        }
        for j, name in enumerate(self.reward_names):
            row[f"rewards/{name}"] = float(torch.nanmean(per_func[:, j]))
        for name, values in self._logged_metrics.items():
            row[f"custom/{name}"] = sum(values) / len(values)
        if cfg.log_completions and acc.is_main_process:
            self._write_completions(step + 1, prep)
        return row

    def _write_completions(self, step: int, prep: _Prepared) -> None:
        records = []
        for i in range(min(self.config.log_completions, len(prep.texts))):
            prompt = prep.prompts[i]
            records.append(
                {
                    "step": step,
                    "prompt": prompt if isinstance(prompt, str) else prompt[-1].get("content", ""),
                    "completion": prep.texts[i],
                    "reward": float(prep.rewards[i]),
                    "advantage": float(prep.advantages[i]),
                }
            )
        self.run_folder.append("completions.jsonl", records)

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy held-out accuracy of the current weights (all processes; each takes a shard).

        Returns:
            ``eval_accuracy`` (fraction right, by ``trainers.evaluate.is_correct``) and
            ``eval_completion_len`` (mean tokens); an empty dict without an evaluation set. The
            main process appends every process's samples to OUTPUT_DIR/eval_completions.jsonl.
        """
        if self.eval_dataset is None:
            return {}
        cfg = self.config
        total, samples = evaluate_sharded(
            self.manager,
            self.tokenizer,
            self.accelerator,
            self.eval_dataset,
            self.encode_prompt,
            cfg.prompt_column,
            cfg.eval_max_new_tokens,
            self.eos_token_ids,
        )
        self.run_folder.append("eval_completions.jsonl", [{"step": step, **sample} for sample in samples])
        return {"eval_accuracy": total.accuracy, "eval_completion_len": total.completion_len_mean}

    def _eval_due(self, step: int) -> bool:
        """Evaluate after step ``step`` (1-based)? At the last step, and every ``eval_steps``."""
        every = self.config.eval_steps
        return step == self.config.max_steps or (every is not None and step % every == 0)

    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` steps; write metrics, trackers and the final model. Returns the metrics rows.

        OUTPUT_DIR/metrics.jsonl gets one row per step (a row ``step: 0`` holds the evaluation
        before training); in synchronous mode it is the same on every run of a config. The
        wall-clock figures (step times, rollout tokens/s, evaluation time) vary from run to run and
        go to OUTPUT_DIR/timing.jsonl; the returned rows and the trackers get both.
        """
        cfg = self.config
        acc = self.accelerator
        main = acc.is_main_process
        self.run_folder.start(cfg.to_dict())
        if cfg.log_with:
            acc.init_trackers("grpo", config=flat_config(cfg.to_dict()))
        rows: list[dict[str, float]] = []

        def record(row: dict[str, float]) -> None:
            rows.append(row)
            self.run_folder.record(row)
            if cfg.log_with:
                acc.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

        t_start = time.perf_counter()
        self._log(f"writing metrics, samples and the final model to {self.output_dir}")
        self.manager.start()
        try:
            if self.eval_dataset is not None:
                row0: dict[str, float] = {"step": 0, **self._timed_eval(0)}
                record(row0)
            self._log(
                f"training {cfg.max_steps} steps of {cfg.prompts_per_batch * self.world_size} prompts x "
                f"{cfg.num_generations} samples; step 1 also waits for the first batch to be generated "
                "(later steps find theirs generated while the previous one trained)"
                if cfg.effective_prefetch
                else f"training {cfg.max_steps} steps of {cfg.prompts_per_batch * self.world_size} prompts x "
                f"{cfg.num_generations} samples (synchronous: each step generates, then trains)"
            )
            bar = tqdm(total=cfg.max_steps, desc="grpo", unit="step", disable=not main)
            try:
                for step in range(cfg.max_steps):
                    row = self.train_step(step)
                    if self.eval_dataset is not None and self._eval_due(step + 1):
                        bar.clear()
                        row.update(self._timed_eval(step + 1))
                    record(row)
                    if main:
                        bar.set_postfix(
                            reward=f"{row['reward_mean']:.3f}",
                            tok_s=f"{row['rollout_tokens_per_s']:.0f}",
                            refresh=False,
                        )
                        bar.update(1)
            finally:
                bar.close()
        finally:
            # A batch still generating (after an error) is dropped, not finished: destroy() alone
            # would let it run to the end first.
            self.manager.stop(hard_stop=True)
            self.manager.destroy()  # also restores the model's attention implementation
        acc.wait_for_everyone()
        if cfg.save_model:
            self.save_model(self.output_dir)
        if cfg.log_with:
            acc.end_training()
        wall = time.perf_counter() - self._t_created
        self.run_folder.write_summary(
            rows,
            steps=cfg.max_steps,
            wall_s=wall,
            train_s=time.perf_counter() - t_start,
            world_size=self.world_size,
            device=str(acc.device),
            mixed_precision=acc.mixed_precision,
        )
        self._log(summary(rows, self.output_dir, wall, cfg.save_model))
        return rows

    def _timed_eval(self, step: int) -> dict[str, float]:
        n = len(self.eval_dataset) if self.eval_dataset is not None else 0
        self._log(
            f"step {step}: evaluating {n} held-out problems (greedy, at most {self.config.eval_max_new_tokens} tokens)"
        )
        t0 = time.perf_counter()
        result = self.evaluate(step)
        result["eval_time_s"] = time.perf_counter() - t0
        self._log(
            f"step {step}: eval_accuracy {result['eval_accuracy']:.3f}, "
            f"eval_completion_len {result['eval_completion_len']:.1f} tokens ({result['eval_time_s']:.0f} s)"
        )
        return result

    def _log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            logger.info(message)

    def close(self) -> None:
        """Destroy the manager (``train`` does it at its end), dropping unfinished requests; restores the attention."""
        self.manager.stop(hard_stop=True)
        self.manager.destroy()

    def save_model(self, directory: str | Path) -> None:
        """save_pretrained of the model (main process) and of the tokenizer."""
        acc = self.accelerator
        if acc.is_main_process:
            self.unwrapped.save_pretrained(str(directory), is_main_process=True, save_function=acc.save)
            self.tokenizer.save_pretrained(str(directory))
        acc.wait_for_everyone()


def train_grpo(config: GRPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a GRPOTrainer and run it (the script's entry point)."""
    return GRPOTrainer(config, **kwargs).train()


__all__ = [
    "TIMING_KEYS",
    "GRPOTrainer",
    "TrainerState",
    "resolve_output_dir",
    "sample_seed",
    "source_commit",
    "summary",
    "train_grpo",
]
