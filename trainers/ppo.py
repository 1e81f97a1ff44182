"""PPO with a learned value model and GAE on rollout's persistent manager, data parallel through ``accelerate``.

The recipe's shape follows torchtune's: ``__init__`` composes the shared ``trainers.setup`` steps and
``_setup_*`` helpers; a step is ``generate_trajectory(step) -> PPOTrajectory`` (sample one completion
per prompt on the manager, score it, compute the rollout-time values, per-token rewards, GAE and
returns) then ``ppo_step(trajectory) -> PPOStats`` (``ppo_epochs`` passes of ``num_mini_batches``
optimizer steps of the clipped policy loss and the clipped value loss); ``train`` writes the metrics,
and no logging happens inside either.

What it shares with the GRPO trainer (``trainers.grpo``): the rollout queue with its staleness bound
(``trainers.rollout_queue``), the tasks and reward functions, the held-out evaluation
(``trainers.evaluate``), the run folder and the closing summary (``trainers.runs``), the setup steps
(``trainers.setup``) and the padded training forward (``trainers.loss.pad_batch``). What differs: one
sample per prompt (no group), a value model (``trainers.value_model``), per-token advantages, and
several optimizer steps per batch, every one against the engine's logprobs as the old policy (so the
clip is active from the second mini-batch on; at equal weights the ratio is 1).

The optimizer steps of a batch run inside ``manager.pause()``: the engine shares the policy's weights,
so none of its steps may read them while they change. ``manager.update_weights(None)`` then bumps the
weight version once per batch, the version the staleness bound counts in.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

import rollout

from .evaluate import evaluate_sharded
from .loss import completion_logprobs, pad_batch
from .ppo_config import PPOConfig
from .ppo_loss import (
    AdaptiveKLController,
    entropy_from_logits,
    explained_variance,
    gae,
    kl_penalty,
    policy_loss,
    token_rewards,
    value_loss,
    whiten,
)
from .prompts import encode_prompt
from .rewards import RewardFunc, compute_rewards
from .rollout_queue import PromptSampler, RolloutBatch, RolloutQueue
from .runs import RunFolder, flat_config, nanstd, sample_seed, summary
from .setup import backward, engine_config_for, setup_accelerator, setup_data, setup_policy
from .value_model import PolicyWithValue

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What reward functions see as ``trainer_state``."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class PPOTrajectory:
    """One process's scored batch with everything the PPO step needs. [N, L]: N completions, L the
    longest; right-padded, ``mask`` 0 after each completion's end and on dropped (too stale) samples.

    Attributes:
        prompt_ids, completion_ids: N token lists each.
        mask: float32 [N, L].
        old_logprobs: float32 [N, L]; the engine's logprobs (the behaviour policy: PPO's pi_old).
        trainer_logprobs: float32 [N, L]; the trainer's logprobs of the same tokens at the weights
            the step starts from (equal to ``old_logprobs`` up to kernel rounding for sequences sampled
            wholly under those weights; metric ``logprob_diff_max``).
        values: float32 [N, L]; V(s_t) at the weights the step starts from.
        ref_logprobs: float32 [N, L] under the reference policy, or None without a KL penalty.
        kl: float32 [N, L] per-token KL estimate to the reference, or None.
        scores: float32 [N]; the task reward (weighted sum of the reward functions; NaN: unscored).
        scores_per_func: float32 [N, F].
        rewards: float32 [N, L]; per-token rewards (score on the last token, KL penalty on all).
        advantages: float32 [N, L]; GAE, whitened when the config says so.
        returns: float32 [N, L]; the value targets.
        staleness: per token, current weight version - version it was sampled under.
        dropped: float32 [N]; 1 for samples masked out as too stale.
        truncated: float32 [N]; 1 where a completion hit ``max_new_tokens``.
        texts, prompts: decoded completions and the dataset prompts (for completions.jsonl).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    trainer_logprobs: torch.Tensor
    values: torch.Tensor
    ref_logprobs: torch.Tensor | None
    kl: torch.Tensor | None
    scores: torch.Tensor
    scores_per_func: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    staleness: list[list[int]]
    dropped: torch.Tensor
    truncated: torch.Tensor
    texts: list[str] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)


@dataclass
class PPOStats:
    """Token means over all optimizer steps of one PPO step (this process's sums; see ``ppo_step``).

    Attributes:
        policy_loss, value_loss, entropy: per-token means.
        approx_kl: mean of (r - 1) - log r, r = pi_theta / pi_old (Schulman's k3), over trained tokens.
        clip_fraction: share of trained tokens whose ratio left [1 - eps, 1 + eps].
        value_clip_fraction: share of tokens where the clipped value term was the larger.
        ratio_max: the largest ratio seen.
        first_ratio_max_dev: max |r - 1| over the first mini-batch of the first epoch (the weights
            that sampled: kernel rounding only, unless the batch is stale).
        grad_norm, value_grad_norm: mean gradient norms before clipping (policy, value-only parameters).
        tokens: trained tokens summed over the epochs.
        optimizer_steps: optimizer steps taken.
    """

    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    clip_fraction: float
    value_clip_fraction: float
    ratio_max: float
    first_ratio_max_dev: float
    grad_norm: float
    value_grad_norm: float
    tokens: float
    optimizer_steps: int


class PPOTrainer:
    """PPO with continuous-batching rollouts on the training model itself.

    Args:
        config: the run's settings (validated).
        model, tokenizer: the policy; loaded from ``config.model`` with ``rollout.load_model`` when None.
        train_dataset: a ``datasets.Dataset`` with ``config.prompt_column`` and the columns the
            reward functions need; built from ``config.dataset`` when None.
        reward_funcs: callables with TRL's signature (or names/paths); ``config.reward_funcs`` when None.
        accelerator: an existing Accelerator; one is built otherwise.
        eval_dataset: held-out problems (``prompt_column`` and ``answer``); as in ``GRPOTrainer``.

    Raises:
        ConfigError: a bad setting or a dataset without a needed column (the message names it),
            raised before the model is loaded.
    """

    def __init__(
        self,
        config: PPOConfig,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        train_dataset: datasets.Dataset | None = None,
        reward_funcs: Sequence[RewardFunc | str] | None = None,
        accelerator: Accelerator | None = None,
        eval_dataset: datasets.Dataset | None = None,
    ) -> None:
        self._t_created = time.perf_counter()  # the run's wall time counts the model load
        self.config = config
        acc, self.output_dir = setup_accelerator(config, accelerator, "ppo")
        self.accelerator = acc
        self.rank, self.world_size = acc.process_index, acc.num_processes
        self.dataset, self.eval_dataset, self.reward_funcs, self.reward_names, self.reward_weights = setup_data(
            config, train_dataset, eval_dataset, reward_funcs, self.world_size
        )
        torch.manual_seed(config.seed)
        model, self.tokenizer, self.pad_token_id, self.eos_token_ids = setup_policy(config, model, tokenizer)
        # Both copies are made before the manager switches the policy's attention implementation.
        self.reference = self._setup_reference(model)
        self.model, self.optimizer, self.scheduler = self._setup_model_and_optimizer(model)
        self.unwrapped: PolicyWithValue = acc.unwrap_model(self.model)
        assert self.unwrapped.policy is model, "accelerate must wrap the model object, not copy it"
        self.policy = model
        self.manager = self._setup_manager(model)
        self.queue = self._setup_queue()
        self.kl_ctl = AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
        self.state = TrainerState(0, config.max_steps)
        self.run_folder = RunFolder(self.output_dir, "ppo", acc.is_main_process)
        self._logged_metrics: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ setup helpers
    def _setup_reference(self, model: PreTrainedModel) -> PreTrainedModel | None:
        """A frozen copy of the initial policy, only when a KL penalty needs it."""
        if not self.config.uses_reference:
            return None
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
        return reference

    def _setup_model_and_optimizer(
        self, model: PreTrainedModel
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The policy with its value model, AdamW with two parameter groups (policy at ``learning_rate``,
        value head and critic at ``value_learning_rate``), the schedule in PPO steps (one per batch)."""
        cfg = self.config
        module = PolicyWithValue(model, cfg.value_model)
        value_ids = {id(p) for p in module.value_parameters()}
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in module.parameters() if id(p) not in value_ids], "lr": cfg.learning_rate},
                {"params": module.value_parameters(), "lr": cfg.value_learning_rate},
            ],
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        module, optimizer = self.accelerator.prepare(module, optimizer)
        scheduler = get_scheduler(
            cfg.lr_scheduler_type, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps
        )
        return module, optimizer, scheduler

    def _setup_manager(self, model: PreTrainedModel) -> rollout.ContinuousBatchingManager:
        cfg = self.config
        return rollout.ContinuousBatchingManager(
            model,
            # Exactly the config's sampling: the model's generation config (a checkpoint's top_k,
            # top_p or repetition_penalty) must not reach the rollouts, or pi_old is not softmax(logits / T).
            rollout.SamplingParams(
                max_new_tokens=cfg.max_new_tokens,
                do_sample=True,
                temperature=cfg.temperature,
                eos_token_ids=self.eos_token_ids,
            ),
            engine_config_for(cfg, model, self.accelerator.device.type),
        )

    def _setup_queue(self) -> RolloutQueue:
        cfg = self.config
        sampler = PromptSampler(self.dataset, cfg.prompts_per_batch, cfg.seed, self.rank, self.world_size)
        return RolloutQueue(
            self.manager,
            rows_for_batch=sampler.rows,
            encode=lambda row: self.encode_prompt(row[cfg.prompt_column]),
            samples_per_prompt=1,
            max_steps=cfg.max_steps,
            prefetch=cfg.effective_prefetch,
            max_staleness=cfg.max_staleness,
            stale_policy=cfg.stale_policy,
            request_kwargs=dict(
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                do_sample=True,
                eos_token_id=self.eos_token_ids,
            ),
            seed=lambda j, i, g: sample_seed(cfg.seed, self.rank, j, i, g),
            id_prefix="ppo",
        )

    def encode_prompt(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt (``trainers.prompts.encode_prompt``), truncated to ``max_prompt_length``."""
        return encode_prompt(self.tokenizer, prompt, self.config.max_prompt_length)

    # ------------------------------------------------------------------ forwards
    def _forward(
        self, module: torch.nn.Module, idx: list[int], traj_prompts: list[list[int]], traj_completions: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logprobs (at the sampling temperature), values and logits of completions ``idx``.

        Returns:
            logprobs float32 [b, l], values float32 [b, l], logits/T float32 [b, l, V], mask float32 [b, l];
            l the longest completion among ``idx``.
        """
        device = self.accelerator.device
        input_ids, attention, position_ids, mask = pad_batch(
            [traj_prompts[i] for i in idx], [traj_completions[i] for i in idx], self.pad_token_id
        )
        L = mask.shape[1]
        logits, values = module(input_ids.to(device), attention.to(device), position_ids.to(device), L + 1)
        logits = logits[:, :-1].float() / self.config.temperature
        targets = input_ids[:, -L:].to(device)
        logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
        mask = mask.to(device)
        return logps * mask, values[:, :-1] * mask, logits, mask

    def _micro_batches(self, idx: list[int], lengths: list[int]) -> list[list[int]]:
        # Longest first: similar lengths share a micro-batch and little is padded.
        order = sorted(idx, key=lambda i: -lengths[i])
        mb = self.config.micro_batch_size
        return [order[i : i + mb] for i in range(0, len(order), mb)]

    # ------------------------------------------------------------------ trajectory
    def _log_metric(self, name: str, value: float) -> None:
        self._logged_metrics.setdefault(name, []).append(float(value))

    @torch.no_grad()
    def generate_trajectory(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> PPOTrajectory:
        """Score a collected batch and compute its values, per-token rewards, advantages and returns.

        Runs the trainer's forward once per micro-batch at the current weights (values and the
        trainer's logprobs), and the reference's when a KL penalty is on. The engine must be paused
        or done with these weights' batch; the caller holds no pause (forwards only read the weights).
        """
        cfg = self.config
        device = self.accelerator.device
        rows = batch.rows
        prompts = [r[cfg.prompt_column] for r in rows]
        completion_ids = [list(o.generated_tokens) for o in outputs]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [r[k] for r in rows] for k in self.dataset.column_names if k != cfg.prompt_column}
        scores, per_func = compute_rewards(
            self.reward_funcs,
            self.reward_weights,
            prompts,
            completions,
            completion_ids,
            columns,
            trainer_state=self.state,
            log_metric=self._log_metric,
        )
        staleness, too_old = self.queue.staleness(outputs)
        for o in outputs:
            if len(o.logprobs) != len(o.generated_tokens):
                raise RuntimeError("the engine returned no logprobs: return_logprobs must be on")
        N = len(outputs)
        L = max(len(c) for c in completion_ids)
        mask = torch.zeros(N, L, device=device)
        old_logprobs = torch.zeros(N, L, device=device)
        for b, o in enumerate(outputs):
            k = len(o.generated_tokens)
            mask[b, :k] = 1.0
            old_logprobs[b, :k] = torch.tensor(o.logprobs, dtype=torch.float32, device=device)
        mask = mask * (~too_old).float().to(device)[:, None]
        prompt_ids = list(batch.prompt_ids)
        lengths = [len(c) for c in completion_ids]
        trainer_logprobs = torch.zeros(N, L, device=device)
        values = torch.zeros(N, L, device=device)
        ref_logprobs = torch.zeros(N, L, device=device) if self.reference is not None else None
        for idx in self._micro_batches(list(range(N)), lengths):
            logps, v, _, m = self._forward(self.unwrapped, idx, prompt_ids, completion_ids)
            w = m.shape[1]
            trainer_logprobs[idx, :w] = logps
            values[idx, :w] = v
            if ref_logprobs is not None:
                ref, _ = completion_logprobs(
                    self.reference,
                    [prompt_ids[i] for i in idx],
                    [completion_ids[i] for i in idx],
                    cfg.temperature,
                    self.pad_token_id,
                )
                ref_logprobs[idx, :w] = ref
        kl = kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator) * mask if ref_logprobs is not None else None
        rewards = token_rewards(scores.to(device), mask, kl, self.kl_ctl.value) * mask
        values = values * mask
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        return PPOTrajectory(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            mask=mask,
            old_logprobs=old_logprobs * mask,
            trainer_logprobs=trainer_logprobs * mask,
            values=values,
            ref_logprobs=ref_logprobs,
            kl=kl,
            scores=scores.float(),
            scores_per_func=per_func.float(),
            rewards=rewards,
            advantages=advantages,
            returns=returns,
            staleness=staleness,
            dropped=too_old.float(),
            truncated=torch.tensor([o.finish_reason == "length" for o in outputs], dtype=torch.float32),
            texts=texts,
            prompts=prompts,
        )

    # ------------------------------------------------------------------ the PPO step
    def ppo_step(self, traj: PPOTrajectory, step: int) -> PPOStats:
        """``ppo_epochs`` passes over the batch, each in ``num_mini_batches`` optimizer steps.

        Every mini-batch's loss is sum over its tokens of (policy loss + vf_coef * value loss -
        entropy_coef * entropy) divided by its token count over all processes; its micro-batches
        accumulate gradients (DDP syncs on the last). Gradients of the policy parameters and of the
        value-only parameters are clipped to ``max_grad_norm`` separately, so a large value error
        does not shrink the policy's step (in "head" mode the shared trunk is a policy parameter).
        The mini-batch order is a seeded shuffle of (seed, rank, step, epoch).
        """
        cfg = self.config
        acc = self.accelerator
        device = acc.device
        N = len(traj.completion_ids)
        lengths = [len(c) for c in traj.completion_ids]
        size = N // cfg.num_mini_batches
        sums = dict.fromkeys(("pg", "vf", "ent", "akl", "clip", "vclip", "tokens", "gn", "vgn"), 0.0)
        ratio_max, first_dev, n_opt = 0.0, 0.0, 0
        policy_params = [p for g in self.optimizer.param_groups[:1] for p in g["params"]]
        value_params = [p for g in self.optimizer.param_groups[1:] for p in g["params"]]
        for epoch in range(cfg.ppo_epochs):
            order = list(range(N))
            random.Random(sample_seed(cfg.seed, self.rank, step, epoch, 7)).shuffle(order)
            for k in range(cfg.num_mini_batches):
                mini = order[k * size : (k + 1) * size]
                local = float(traj.mask[mini].sum())
                count = float(acc.reduce(torch.tensor([local], device=device), reduction="sum")[0])
                if count == 0:
                    continue
                normaliser = count / self.world_size  # DDP averages the processes' gradients
                chunks = self._micro_batches(mini, lengths)
                for c, idx in enumerate(chunks):
                    ctx = contextlib.nullcontext() if c == len(chunks) - 1 else acc.no_sync(self.model)
                    with ctx:
                        logps, v, logits, m = self._forward(self.model, idx, traj.prompt_ids, traj.completion_ids)
                        w = m.shape[1]
                        m = traj.mask[idx, :w]
                        adv = traj.advantages[idx, :w]
                        pg, ratio = policy_loss(logps, traj.old_logprobs[idx, :w], adv, cfg.epsilon)
                        vf, vclipped = value_loss(v, traj.values[idx, :w], traj.returns[idx, :w], cfg.cliprange_value)
                        if cfg.entropy_coef > 0:
                            ent = entropy_from_logits(logits)
                        else:
                            with torch.no_grad():
                                ent = entropy_from_logits(logits.detach())
                        loss = ((pg + cfg.vf_coef * vf - cfg.entropy_coef * ent) * m).sum() / normaliser
                        backward(acc, loss)
                    with torch.no_grad():
                        log_r = torch.log(ratio.clamp(min=1e-30))
                        sums["pg"] += float((pg * m).sum())
                        sums["vf"] += float((vf * m).sum())
                        sums["ent"] += float((ent * m).sum())
                        sums["akl"] += float((((ratio - 1) - log_r) * m).sum())
                        sums["clip"] += float((((ratio - 1).abs() > cfg.epsilon).float() * m).sum())
                        sums["vclip"] += float((vclipped.float() * m).sum())
                        sums["tokens"] += float(m.sum())
                        if m.any():
                            ratio_max = max(ratio_max, float(ratio[m.bool()].max()))
                            if epoch == 0 and k == 0:
                                first_dev = max(first_dev, float((ratio[m.bool()] - 1).abs().max()))
                gn = acc.clip_grad_norm_(policy_params, cfg.max_grad_norm)
                vgn = acc.clip_grad_norm_(value_params, cfg.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                sums["gn"] += float(gn) if gn is not None else math.nan
                sums["vgn"] += float(vgn) if vgn is not None else math.nan
                n_opt += 1
        self.scheduler.step()
        t = max(sums["tokens"], 1.0)
        return PPOStats(
            policy_loss=sums["pg"] / t,
            value_loss=sums["vf"] / t,
            entropy=sums["ent"] / t,
            approx_kl=sums["akl"] / t,
            clip_fraction=sums["clip"] / t,
            value_clip_fraction=sums["vclip"] / t,
            ratio_max=ratio_max,
            first_ratio_max_dev=first_dev,
            grad_norm=sums["gn"] / max(n_opt, 1),
            value_grad_norm=sums["vgn"] / max(n_opt, 1),
            tokens=sums["tokens"],
            optimizer_steps=n_opt,
        )

    def train_step(self, step: int) -> dict[str, float]:
        """One step: collect batch ``step``, build its trajectory, run the PPO step, update the weights.

        Returns:
            The metrics row (learning figures and wall-clock figures; ``train`` splits them).
        """
        acc = self.accelerator
        t0, c0 = time.perf_counter(), time.process_time()
        batch, outputs = self.queue.take(step)
        t_collected = time.perf_counter()
        tokens_per_s = self.queue.throughput(batch, outputs)
        self.state.global_step = step
        self._logged_metrics = {}
        lr = self.scheduler.get_last_lr()[0]
        with self.queue.paused():
            # Held from the trajectory's forwards on: a step of the engine between them and the
            # optimizer steps would not change the weights, but it would share the CPU.
            traj = self.generate_trajectory(batch, outputs)
            t_prepared = time.perf_counter()
            stats = self.ppo_step(traj, step)
            version = self.manager.update_weights(None)  # re-entrant: still inside the pause
        t_end = time.perf_counter()
        row = self._metrics_row(step, traj, stats, lr, version, tokens_per_s)
        if self.reference is not None and traj.kl is not None:
            seq_kl = float((traj.kl.sum(dim=1)).mean())
            self.kl_ctl.update(seq_kl, len(traj.completion_ids) * self.world_size)
        row.update(
            {
                "step_time_s": t_end - t0,
                "step_cpu_s": time.process_time() - c0,
                "wait_rollout_s": t_collected - t0,
                "prepare_s": t_prepared - t_collected,
                "train_s": t_end - t_prepared,
                "rollout_tokens_per_s": tokens_per_s,
            }
        )
        if self.config.log_completions:
            self._write_completions(step + 1, traj)
        acc.wait_for_everyone()
        return row

    def _metrics_row(
        self, step: int, traj: PPOTrajectory, stats: PPOStats, lr: float, version: int, tokens_per_s: float
    ) -> dict[str, float]:
        """The step's learning figures over all processes (token figures are token-weighted)."""
        acc = self.accelerator
        device = acc.device
        m = traj.mask
        scores = acc.gather(traj.scores.to(device))
        per_func = acc.gather(traj.scores_per_func.to(device))
        lengths = acc.gather(torch.tensor([float(len(c)) for c in traj.completion_ids], device=device))
        truncated = acc.gather(traj.truncated.to(device))
        trained = m.bool()
        diff = (traj.trainer_logprobs - traj.old_logprobs).abs()
        # Sequences sampled wholly under the current weights: a token sampled after an update mid-sequence
        # still attends to KV the old weights computed, so its engine logprob is not the trainer's.
        fresh = trained & torch.tensor([max(s, default=0) == 0 for s in traj.staleness], device=device)[:, None]
        seq_kl = traj.kl.sum(dim=1) if traj.kl is not None else None
        local = torch.tensor(
            [
                stats.policy_loss * stats.tokens,
                stats.value_loss * stats.tokens,
                stats.entropy * stats.tokens,
                stats.approx_kl * stats.tokens,
                stats.clip_fraction * stats.tokens,
                stats.value_clip_fraction * stats.tokens,
                stats.tokens,
                float(seq_kl.sum()) if seq_kl is not None else 0.0,
                float(len(traj.completion_ids)),
                float(traj.dropped.sum()),
                float((traj.values * m).sum()),
                float((traj.returns * m).sum()),
                float(m.sum()),
                sum(sum(s) for s in traj.staleness),
                sum(len(s) for s in traj.staleness),
            ],
            dtype=torch.float64,
            device=device,
        )
        t = acc.reduce(local, reduction="sum")
        tok = float(t[6]) or math.nan
        mtok = float(t[12]) or math.nan
        maxima = (
            acc.gather(
                torch.tensor(
                    [
                        [
                            stats.ratio_max,
                            stats.first_ratio_max_dev,
                            float(diff[fresh].max()) if fresh.any() else 0.0,
                            float(max((max(s, default=0) for s in traj.staleness), default=0)),
                        ]
                    ],
                    dtype=torch.float64,
                    device=device,
                )
            )
            .max(dim=0)
            .values
        )
        row: dict[str, float] = {
            "step": step + 1,
            "reward_mean": float(torch.nanmean(scores)),
            "reward_std": float(nanstd(scores)),
            "completion_len_mean": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "truncated_fraction": float(truncated.mean()),
            "generated_tokens": float(lengths.sum()),
            "policy_loss": float(t[0]) / tok,
            "value_loss": float(t[1]) / tok,
            "entropy": float(t[2]) / tok,
            "approx_kl": float(t[3]) / tok,
            "clip_fraction": float(t[4]) / tok,
            "value_clip_fraction": float(t[5]) / tok,
            "explained_variance": explained_variance(traj.values, traj.returns, m),
            "value_mean": float(t[10]) / mtok,
            "return_mean": float(t[11]) / mtok,
            "ratio_max": float(maxima[0]),
            "first_ratio_max_dev": float(maxima[1]),
            "logprob_diff_max": float(maxima[2]),
            "staleness_mean": float(t[13]) / max(float(t[14]), 1.0),
            "staleness_max": float(maxima[3]),
            "dropped_stale": float(t[9]),
            "trained_tokens": float(t[6]),
            "grad_norm": stats.grad_norm,
            "value_grad_norm": stats.value_grad_norm,
            "learning_rate": lr,
            "weight_version": version,
        }
        if seq_kl is not None:
            row["kl"] = float(t[7]) / float(t[8])
            row["kl_coef"] = self.kl_ctl.value
        for j, name in enumerate(self.reward_names):
            row[f"rewards/{name}"] = float(torch.nanmean(per_func[:, j]))
        for name, values in self._logged_metrics.items():
            row[f"custom/{name}"] = sum(values) / len(values)
        return row

    def _write_completions(self, step: int, traj: PPOTrajectory) -> None:
        records = []
        for i in range(min(self.config.log_completions, len(traj.texts))):
            prompt = traj.prompts[i]
            k = len(traj.completion_ids[i])
            records.append(
                {
                    "step": step,
                    "prompt": prompt if isinstance(prompt, str) else prompt[-1].get("content", ""),
                    "completion": traj.texts[i],
                    "reward": float(traj.scores[i]),
                    "value_first": float(traj.values[i, 0]),
                    "advantage_first": float(traj.advantages[i, 0]),
                    "advantage_last": float(traj.advantages[i, k - 1]),
                }
            )
        self.run_folder.append("completions.jsonl", records)

    # ------------------------------------------------------------------ evaluation and the run
    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy held-out accuracy of the current policy (``trainers.evaluate.evaluate_sharded``).

        Returns:
            ``eval_accuracy`` and ``eval_completion_len``; empty without an evaluation set. The samples
            go to OUTPUT_DIR/eval_completions.jsonl.
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
        self.run_folder.append("eval_completions.jsonl", [{"step": step, **s} for s in samples])
        return {"eval_accuracy": total.accuracy, "eval_completion_len": total.completion_len_mean}

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

    def _eval_due(self, step: int) -> bool:
        every = self.config.eval_steps
        return step == self.config.max_steps or (every is not None and step % every == 0)

    def train(self) -> list[dict[str, float]]:
        """Run ``max_steps`` steps; write the run folder (``trainers.runs``), trackers and the final model.

        Returns:
            The metrics rows (row ``step: 0`` holds the evaluation before training).
        """
        cfg = self.config
        acc = self.accelerator
        self.run_folder.start(cfg.to_dict())
        if cfg.log_with:
            acc.init_trackers("ppo", config=flat_config(cfg.to_dict()))
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
                record({"step": 0, **self._timed_eval(0)})
            self._log(
                f"training {cfg.max_steps} PPO steps of {cfg.batch_size * self.world_size} prompts x 1 sample, "
                f"{cfg.ppo_epochs} epochs x {cfg.num_mini_batches} mini-batches each; value model: {cfg.value_model}"
            )
            bar = tqdm(total=cfg.max_steps, desc="ppo", unit="step", disable=not acc.is_main_process)
            try:
                for step in range(cfg.max_steps):
                    row = self.train_step(step)
                    if self.eval_dataset is not None and self._eval_due(step + 1):
                        bar.clear()
                        row.update(self._timed_eval(step + 1))
                    record(row)
                    bar.set_postfix(
                        reward=f"{row['reward_mean']:.3f}", ev=f"{row['explained_variance']:.2f}", refresh=False
                    )
                    bar.update(1)
            finally:
                bar.close()
        finally:
            self.manager.stop(hard_stop=True)
            self.manager.destroy()  # also restores the policy's attention implementation
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
            value_model=cfg.value_model,
        )
        extra = ", the value model (value_head.safetensors, value_model.json" + (
            ", critic/)" if cfg.value_model == "critic" else ")"
        )
        self._log(summary(rows, self.output_dir, wall, cfg.save_model, extra if cfg.save_model else ""))
        return rows

    def _log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            logger.info(message)

    def close(self) -> None:
        """Destroy the manager (``train`` does it at its end), dropping unfinished requests; restores the attention."""
        self.manager.stop(hard_stop=True)
        self.manager.destroy()

    def save_model(self, directory: str | Path) -> None:
        """save_pretrained of the policy and tokenizer, and the value model beside them (main process)."""
        acc = self.accelerator
        if acc.is_main_process:
            self.policy.save_pretrained(str(directory), is_main_process=True, save_function=acc.save)
            self.tokenizer.save_pretrained(str(directory))
            self.unwrapped.save_value(directory)
        acc.wait_for_everyone()


def train_ppo(config: PPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a PPOTrainer and run it (the script's entry point)."""
    return PPOTrainer(config, **kwargs).train()


__all__ = ["PPOStats", "PPOTrainer", "PPOTrajectory", "train_ppo"]
