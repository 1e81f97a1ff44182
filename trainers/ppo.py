"""PPO with a learned value model and GAE on rollout's continuous-batching rollouts: what PPO adds to the recipe
(``trainers.recipe``).

A step is ``generate_trajectory(batch, outputs) -> PPOTrajectory`` (the batch scored by ``Recipe.score``, then the
rollout-time values, per-token rewards, GAE and returns) then ``ppo_step(trajectory) -> PPOStats`` (``ppo_epochs``
passes of ``num_mini_batches`` optimizer steps of the clipped policy loss and the clipped value loss); ``metrics``
turns them into the metrics row's PPO figures, and no logging happens inside either.

What differs from GRPO (``trainers.grpo``): one sample per prompt (no group), a value model
(``trainers.value_model``), per-token advantages, and several optimizer steps per batch, every one against the
engine's logprobs as the old policy (so the clip is active from the second mini-batch on; at equal weights the
ratio is 1). Everything else, the rollout queue and its staleness bound, the rewards, the held-out evaluation, the
run folder, the rollout backend (a local manager or a ``rollout_server``), is the recipe's.

The trajectory's forwards and the optimizer steps of a batch run inside the backend's pause: a local engine shares
the policy's weights, so none of its steps may read them while they change. The backend then moves to the new
weights once per batch (``Recipe.changing_weights``), the version the staleness bound counts in.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

import rollout

from .lora import lora_plus_groups
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
from .recipe import Recipe
from .rollout_queue import RolloutBatch
from .runs import sample_seed
from .setup import backward
from .trajectory import Trajectory
from .value_model import PolicyWithValue


@dataclass(kw_only=True)
class PPOTrajectory(Trajectory):
    """One process's scored batch with everything the PPO step needs (``Trajectory``'s fields, and these). [N, L]:
    N completions, L the longest; right-padded, ``mask`` 0 after each completion's end and on dropped (too stale)
    samples, and 0 on an episode's environment tokens (``loss_mask``, ``trainers.multiturn``): GAE passes over them.

    Attributes:
        mask: float32 [N, L].
        old_logprobs: float32 [N, L]; the engine's logprobs (the behaviour policy: PPO's pi_old).
        trainer_logprobs: float32 [N, L]; the trainer's logprobs of the same tokens at the weights
            the step starts from (equal to ``old_logprobs`` up to kernel rounding for sequences sampled
            wholly under those weights; metric ``logprob_diff_max``).
        values: float32 [N, L]; V(s_t) at the weights the step starts from.
        ref_logprobs: float32 [N, L] under the reference policy, or None without a KL penalty.
        kl: float32 [N, L] per-token KL estimate to the reference, or None.
        kl_coef: the KL coefficient the rewards were built with.
        rewards: float32 [N, L]; per-token rewards (score on the last token, KL penalty on all).
        advantages: float32 [N, L]; GAE, whitened when the config says so.
        returns: float32 [N, L]; the value targets.
    """

    mask: torch.Tensor
    old_logprobs: torch.Tensor
    trainer_logprobs: torch.Tensor
    values: torch.Tensor
    ref_logprobs: torch.Tensor | None
    kl: torch.Tensor | None
    kl_coef: float
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


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
        kl: the mean sequence KL to the reference over the samples trained on (dropped stale samples left
            out), over all processes: what the adaptive KL controller learned from; None without a KL
            penalty or when no process kept a sample.
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
    kl: float | None = None


class PPOTrainer(Recipe[PPOTrajectory, PPOStats]):
    """PPO with continuous-batching rollouts on the training model itself (or on a ``rollout_server``).

    Args and errors: those of ``trainers.recipe.Recipe``, with a ``PPOConfig``.
    """

    algo: ClassVar[str] = "ppo"
    trajectory_in_pause: ClassVar[bool] = True  # its forwards share the CPU with the engine's steps otherwise
    progress_metrics: ClassVar[dict[str, str]] = {"reward": "reward_mean", "ev": "explained_variance"}
    config: PPOConfig
    unwrapped: PolicyWithValue

    def setup_model(self, policy: PreTrainedModel) -> None:
        """The policy with its value model (``trainers.value_model``), AdamW with two parameter groups (policy at
        ``learning_rate``, value head and critic at ``value_learning_rate``), the schedule in PPO steps, and a
        frozen reference copy of the initial policy when a KL penalty needs one."""
        cfg = self.config
        self.reference = None
        if cfg.uses_reference and cfg.lora_r is not None:
            # peft starts lora_B at zero: the initial policy is the frozen base model itself, no copy needed.
            self.reference = self.policy
        elif cfg.uses_reference:
            self.reference = copy.deepcopy(policy).eval()
            self.reference.requires_grad_(False)
        module = PolicyWithValue(policy, cfg.value_model)
        value_ids = {id(p) for p in module.value_parameters()}
        policy_params = [(n, p) for n, p in module.named_parameters() if id(p) not in value_ids]
        groups = lora_plus_groups(policy_params, cfg.learning_rate, cfg.lora_plus_ratio)
        groups.append({"params": module.value_parameters(), "lr": cfg.value_learning_rate})
        self.setup_optimization(module, groups)
        assert self.unwrapped.policy is policy, "accelerate must wrap the model object, not copy it"
        self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)

    def describe_step(self) -> str:
        cfg = self.config
        return (
            f"training {cfg.max_steps} PPO steps of {cfg.batch_size * self.world_size} prompts x 1 sample, "
            f"{cfg.ppo_epochs} epochs x {cfg.num_mini_batches} mini-batches each; value model: {cfg.value_model}"
        )

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
        with rollout.batch_invariant() if self.config.batch_invariant else contextlib.nullcontext():
            logits, values = module(input_ids.to(device), attention.to(device), position_ids.to(device), L + 1)
            logits = logits[:, :-1].float() / self.config.temperature
            targets = input_ids[:, -L:].to(device)
            logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
        mask = mask.to(device)
        return logps * mask, values[:, :-1] * mask, logits, mask

    # ------------------------------------------------------------------ trajectory
    @torch.no_grad()
    def generate_trajectory(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> PPOTrajectory:
        """Score a collected batch and compute its values, per-token rewards, advantages and returns.

        Runs the trainer's forward once per micro-batch at the current weights (values and the trainer's
        logprobs), and the reference's when a KL penalty is on. The engine must be paused or done with these
        weights' batch (the recipe holds the pause: ``trajectory_in_pause``).
        """
        cfg = self.config
        device = self.accelerator.device
        scored = self.score(batch, outputs)
        prompt_ids, completion_ids = scored.prompt_ids, scored.completion_ids
        N = len(completion_ids)
        L = max(len(c) for c in completion_ids)
        mask = torch.zeros(N, L, device=device)
        old_logprobs = torch.zeros(N, L, device=device)
        for b, logprobs in enumerate(scored.behaviour_logprobs):
            mask[b, : len(logprobs)] = 1.0
            if scored.loss_mask is not None:  # an episode: environment tokens are no actions
                mask[b, : len(logprobs)] = torch.tensor(scored.loss_mask[b], dtype=torch.float32, device=device)
            old_logprobs[b, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32, device=device)
        mask = mask * (1 - scored.dropped).to(device)[:, None]
        lengths = [len(c) for c in completion_ids]
        trainer_logprobs = torch.zeros(N, L, device=device)
        values = torch.zeros(N, L, device=device)
        ref_logprobs = torch.zeros(N, L, device=device) if self.reference is not None else None
        for idx in self.micro_batches(range(N), lambda i: lengths[i]):
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
        rewards = token_rewards(scored.scores.to(device), mask, kl, self.kl_ctl.value) * mask
        values = values * mask
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        return PPOTrajectory(
            **vars(scored),
            mask=mask,
            old_logprobs=old_logprobs * mask,
            trainer_logprobs=trainer_logprobs * mask,
            values=values,
            ref_logprobs=ref_logprobs,
            kl=kl,
            kl_coef=self.kl_ctl.value,
            rewards=rewards,
            advantages=advantages,
            returns=returns,
        )

    # ------------------------------------------------------------------ the PPO step
    def train_on(self, trajectory: PPOTrajectory) -> PPOStats:
        return self.ppo_step(trajectory, self.state.global_step)

    def ppo_step(self, traj: PPOTrajectory, step: int) -> PPOStats:
        """``ppo_epochs`` passes over the batch, each in ``num_mini_batches`` optimizer steps, inside
        ``changing_weights``; then the adaptive KL coefficient learns the mean KL of the samples trained on, over
        all processes (``trained_kl``; a step that trains on none leaves it unchanged).

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
        with self.changing_weights():
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
                    chunks = self.micro_batches(mini, lambda i: lengths[i])
                    for c, idx in enumerate(chunks):
                        with contextlib.nullcontext() if c == len(chunks) - 1 else acc.no_sync(self.model):
                            logps, v, logits, m = self._forward(self.model, idx, traj.prompt_ids, traj.completion_ids)
                            w = m.shape[1]
                            m = traj.mask[idx, :w]
                            adv = traj.advantages[idx, :w]
                            pg, ratio = policy_loss(logps, traj.old_logprobs[idx, :w], adv, cfg.epsilon)
                            vf, vclipped = value_loss(
                                v, traj.values[idx, :w], traj.returns[idx, :w], cfg.cliprange_value
                            )
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
        kl = self.trained_kl(traj)
        if kl is not None:
            self.kl_ctl.update(*kl)
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
            kl=kl[0] if kl is not None else None,
        )

    def trained_kl(self, traj: PPOTrajectory) -> tuple[float, int] | None:
        """The mean sequence KL to the reference over the samples trained on, and their number, over all
        processes (the sums of KL and of kept samples are all-reduced, so every process gets the same figures
        and the same coefficient). A dropped (too stale) sample is no part of the step, so it is left out
        rather than counted as KL 0 (its ``kl`` row is masked to zeros). Every process must call it.

        Returns:
            (mean KL in nats, kept samples), or None without a KL penalty or when no process kept a sample.
        """
        if self.reference is None or traj.kl is None:
            return None
        acc = self.accelerator
        kept = 1 - traj.dropped.to(traj.kl.device)
        local = torch.stack([(traj.kl.sum(dim=1).double() * kept).sum(), kept.double().sum()])
        total_kl, count = (float(x) for x in acc.reduce(local, reduction="sum"))
        if count == 0:
            return None
        return total_kl / count, int(count)

    # ------------------------------------------------------------------ metrics
    def metrics(self, trajectory: PPOTrajectory, stats: PPOStats) -> dict[str, float]:
        """Losses, ratios, the value model's fit, staleness and grad norms over all processes (token figures are
        token-weighted); with a KL penalty, the coefficient the batch's rewards used (``kl_coef``) and the mean
        sequence KL of the samples trained on (``kl``, the controller's input; absent from the row when no sample
        was trained on, as ``eval_accuracy`` is on a step without evaluation).

        Staleness as in GRPO (``GRPOTrainer.metrics``): ``staleness_mean`` and ``staleness_max`` over the trained
        tokens (those of the samples not dropped; NaN without any), ``staleness_max_sampled`` over every sampled
        token, ``dropped_stale`` the samples dropped, ``trained_tokens`` the tokens of the samples kept (once, whatever
        ``ppo_epochs``)."""
        acc = self.accelerator
        device = acc.device
        traj, m = trajectory, trajectory.mask
        diff = (traj.trainer_logprobs - traj.old_logprobs).abs()
        # Sequences sampled wholly under the current weights: a token sampled after an update mid-sequence
        # still attends to KV the old weights computed, so its engine logprob is not the trainer's.
        fresh = m.bool() & torch.tensor([max(s, default=0) == 0 for s in traj.staleness], device=device)[:, None]
        trained_staleness = [s for s, d in zip(traj.staleness, traj.dropped.tolist()) if d == 0]
        local = torch.tensor(
            [
                stats.policy_loss * stats.tokens,
                stats.value_loss * stats.tokens,
                stats.entropy * stats.tokens,
                stats.approx_kl * stats.tokens,
                stats.clip_fraction * stats.tokens,
                stats.value_clip_fraction * stats.tokens,
                stats.tokens,
                float(traj.dropped.sum()),
                float((traj.values * m).sum()),
                float((traj.returns * m).sum()),
                float(m.sum()),
                sum(sum(s) for s in trained_staleness),
                sum(len(s) for s in trained_staleness),
            ],
            dtype=torch.float64,
            device=device,
        )
        t = acc.reduce(local, reduction="sum")
        tok = float(t[6]) or math.nan
        mtok = float(t[10]) or math.nan
        stale_tokens = float(t[12])
        local_maxima = [
            stats.ratio_max,
            stats.first_ratio_max_dev,
            float(diff[fresh].max()) if fresh.any() else 0.0,
            float(max((max(s, default=0) for s in trained_staleness), default=0)),
            float(max((max(s, default=0) for s in traj.staleness), default=0)),
        ]
        maxima = acc.gather(torch.tensor([local_maxima], dtype=torch.float64, device=device)).max(dim=0).values
        row = {
            "policy_loss": float(t[0]) / tok,
            "value_loss": float(t[1]) / tok,
            "entropy": float(t[2]) / tok,
            "approx_kl": float(t[3]) / tok,
            "clip_fraction": float(t[4]) / tok,
            "value_clip_fraction": float(t[5]) / tok,
            "explained_variance": explained_variance(traj.values, traj.returns, m),
            "value_mean": float(t[8]) / mtok,
            "return_mean": float(t[9]) / mtok,
            "ratio_max": float(maxima[0]),
            "first_ratio_max_dev": float(maxima[1]),
            "logprob_diff_max": float(maxima[2]),
            "staleness_mean": float(t[11]) / stale_tokens if stale_tokens else math.nan,
            "staleness_max": float(maxima[3]) if stale_tokens else math.nan,
            "staleness_max_sampled": float(maxima[4]),
            "dropped_stale": float(t[7]),
            "trained_tokens": float(t[10]),  # the batch's, as GRPO's (t[6] counts them once per epoch)
            "grad_norm": stats.grad_norm,
            "value_grad_norm": stats.value_grad_norm,
        }
        if traj.kl is not None:
            row["kl_coef"] = traj.kl_coef
            if stats.kl is not None:
                row["kl"] = stats.kl
        return row

    def completion_fields(self, trajectory: PPOTrajectory, i: int) -> dict[str, float]:
        k = len(trajectory.completion_ids[i])
        return {
            "value_first": float(trajectory.values[i, 0]),
            "advantage_first": float(trajectory.advantages[i, 0]),
            "advantage_last": float(trajectory.advantages[i, k - 1]),
        }

    # ------------------------------------------------------------------ the run
    def summary_fields(self) -> dict[str, Any]:
        return {"value_model": self.config.value_model}

    def saved_files(self) -> str:
        return ", the value model (value_head.safetensors, value_model.json" + (
            ", critic/)" if self.config.value_model == "critic" else ")"
        )

    def save_model(self, directory: str | Path) -> None:
        """The policy and tokenizer (``save_pretrained``), and the value model beside them (main process)."""
        if self.accelerator.is_main_process:
            self.unwrapped.save_value(directory)
        super().save_model(directory)


def train_ppo(config: PPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a PPOTrainer and run it (the script's entry point)."""
    return PPOTrainer(config, **kwargs).train()


__all__ = ["PPOStats", "PPOTrainer", "PPOTrajectory", "train_ppo"]
