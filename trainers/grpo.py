"""GRPO on rollout's continuous-batching rollouts: what GRPO adds to the recipe (``trainers.recipe``).

A step samples G completions of each prompt on the rollout backend (in process, they share the prompt's KV
blocks), scores them (``Recipe.score``), turns the rewards into group-normalised advantages
(``generate_trajectory -> GRPOTrajectory``), then ``grpo_step -> GRPOStats``: the clipped policy-gradient loss with
truncated importance weights against the rollout's logprobs (``trainers.loss``), accumulated over micro-batches,
and one optimizer step inside the backend's pause followed by the weight update. ``metrics`` turns the two
records into the metrics row's GRPO figures. With ``async_rollouts`` the engine generates the next batches while
the current one trains, at most ``max_staleness`` weight versions behind. The full design, the loss and the
asynchronous schedule are in docs/grpo_trainer.md.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

import rollout

from .config import GRPOConfig
from .lora import lora_plus_groups
from .loss import aggregate_loss, completion_logprobs, group_advantages, grpo_token_loss, zero_spread_groups
from .recipe import Recipe
from .rollout_queue import RolloutBatch
from .runs import TIMING_KEYS, resolve_output_dir, sample_seed, source_commit, summary
from .setup import backward
from .trajectory import TrainerState, Trajectory


@dataclass(kw_only=True)
class GRPOTrajectory(Trajectory):
    """A scored batch with its group-normalised advantages (``Trajectory``'s fields, and these).

    Attributes:
        advantages: float32 [N]; one per sample, exactly 0 in a group whose scores are all equal.
        zero_spread: float32 [N / G]; 1 for a group whose scores are all equal (it carries no signal).
    """

    advantages: torch.Tensor
    zero_spread: torch.Tensor


@dataclass
class GRPOStats:
    """One process's figures of a GRPO step (``metrics`` reduces them over the processes).

    Attributes:
        loss: this process's part of the global loss (summed over its micro-batches).
        is_ratio_sum, is_ratio_max, is_ratio_min: pi_prox / pi_behaviour over the forwarded trained tokens
            (sum, max, min; 0 and inf without any).
        is_tokens: forwarded trained tokens.
        fresh_ratio_max, fresh_ratio_min: the IS ratio over the forwarded trained tokens of the sequences sampled
            wholly under the current weights (every token at staleness 0; -inf and inf without any): exactly 1 with
            ``batch_invariant``.
        kl_sum: KL(behaviour || policy) estimated per forwarded trained token as r - 1 - log r (r the IS ratio,
            Schulman's k3, in float64: exactly 0 only where the two logprobs are equal), summed.
        is_truncated: of those, the tokens whose ratio exceeded ``is_cap``.
        staleness_sum, staleness_max: over every trained token (forwarded or not).
        trained_tokens: the tokens of the samples kept in the loss.
        skipped: kept samples not forwarded (advantage exactly 0: no gradient).
        grad_norm: the gradient norm before clipping (NaN until the optimizer step).
    """

    loss: float = 0.0
    is_ratio_sum: float = 0.0
    is_ratio_max: float = 0.0
    is_ratio_min: float = math.inf
    is_tokens: float = 0.0
    kl_sum: float = 0.0
    fresh_ratio_max: float = -math.inf
    fresh_ratio_min: float = math.inf
    is_truncated: float = 0.0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    trained_tokens: float = 0.0
    skipped: float = 0.0
    grad_norm: float = math.nan


class GRPOTrainer(Recipe[GRPOTrajectory, GRPOStats]):
    """GRPO with continuous-batching rollouts on the training model itself (or on a ``rollout_server``).

    Args and errors: those of ``trainers.recipe.Recipe``, with a ``GRPOConfig``.
    """

    algo: ClassVar[str] = "grpo"
    config: GRPOConfig

    def setup_model(self, policy: PreTrainedModel) -> None:
        """AdamW over the policy's parameters; the policy is the module trained (DDP-wrapped across processes)."""
        # A peft model passes its keyword arguments to the model it wraps: ask that one.
        model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        self._supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        cfg = self.config  # one group of every trained tensor; with LoRA+ the B matrices in a second one
        self.setup_optimization(
            policy, lora_plus_groups(policy.named_parameters(), cfg.learning_rate, cfg.lora_plus_ratio)
        )
        assert self.unwrapped is policy, "accelerate must wrap the model object, not copy it"

    def describe_step(self) -> str:
        cfg = self.config
        work = f"training {cfg.max_steps} steps of {cfg.prompts_per_batch * self.world_size} prompts x "
        if cfg.effective_prefetch:
            return (
                f"{work}{cfg.num_generations} samples; step 1 also waits for the first batch to be generated "
                "(later steps find theirs generated while the previous one trained)"
            )
        return f"{work}{cfg.num_generations} samples (synchronous: each step generates, then trains)"

    # ------------------------------------------------------------------ the trajectory
    def generate_trajectory(self, batch: RolloutBatch, outputs: list[rollout.GenerationOutput]) -> GRPOTrajectory:
        """The batch scored, with group-normalised advantages (``trainers.loss.group_advantages``)."""
        cfg = self.config
        scored = self.score(batch, outputs)
        return GRPOTrajectory(
            **vars(scored),
            advantages=group_advantages(scored.scores, cfg.num_generations, cfg.scale_rewards, cfg.advantage_eps),
            zero_spread=zero_spread_groups(scored.scores.view(-1, cfg.num_generations)).float(),
        )

    # ------------------------------------------------------------------ the step
    def train_on(self, trajectory: GRPOTrajectory) -> GRPOStats:
        return self.grpo_step(trajectory)

    def grpo_step(self, trajectory: GRPOTrajectory) -> GRPOStats:
        """The step's gradient (``_forward_backward``), then one optimizer step: clip to ``max_grad_norm``, AdamW,
        the schedule, inside ``changing_weights``. The forward/backward holds the backend's pause too unless
        ``train_outside_pause``."""
        cfg = self.config
        with contextlib.nullcontext() if cfg.train_outside_pause else self.queue.paused():
            stats = self._forward_backward(trajectory)
            with self.changing_weights():
                grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        stats.grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        return stats

    def _trained_lengths(self, trajectory: GRPOTrajectory) -> list[int]:
        if trajectory.loss_mask is not None:
            return [int(sum(m)) for m in trajectory.loss_mask]
        return [len(c) for c in trajectory.completion_ids]

    def _forward_backward(self, traj: GRPOTrajectory) -> GRPOStats:
        """Accumulate the gradient of the step's loss over micro-batches; returns this process's sums."""
        cfg = self.config
        acc = self.accelerator
        device = acc.device
        n = len(traj.completion_ids)
        kept_mask = 1 - traj.dropped
        lengths = torch.tensor(self._trained_lengths(traj), dtype=torch.float32)
        local_tokens = float((lengths * kept_mask).sum())
        counts = acc.reduce(torch.tensor([local_tokens, float(kept_mask.sum())], device=device), reduction="sum")
        global_count = float(counts[0] if cfg.loss_type == "dapo" else counts[1])
        stats = GRPOStats()
        if global_count == 0:
            return stats
        normaliser = global_count / self.world_size
        eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
        # Staleness over every trained token, whether or not its sequence is forwarded below.
        for i in range(n):
            if kept_mask[i] > 0 and traj.staleness[i]:
                stats.staleness_sum += float(sum(traj.staleness[i]))
                stats.staleness_max = max(stats.staleness_max, float(max(traj.staleness[i])))
        stats.trained_tokens = local_tokens
        # A sequence with advantage exactly 0 (its group's rewards were all equal: group_advantages returns exact
        # zeros there) or a dropped one adds exactly 0 to this loss and its gradient (the loss has no KL or
        # entropy term), so its forward and backward are skipped; the normaliser still counts its tokens, so the
        # gradient is the same (DAPO, Yu et al. 2025, arXiv:2503.14476, on why such groups carry no signal). At
        # least one micro-batch runs, so that every process reaches the backward that synchronises the gradients.
        kept = [i for i in range(n) if kept_mask[i] > 0]
        active = [i for i in kept if float(traj.advantages[i]) != 0.0]
        stats.skipped = float(len(kept) - len(active))  # dropped samples are counted by dropped_stale

        def length(i: int) -> int:
            return len(traj.prompt_ids[i]) + len(traj.completion_ids[i])

        chunks = self.micro_batches(active or [min(range(n), key=length)], length)
        for c, idx in enumerate(chunks):
            with (
                contextlib.nullcontext() if c == len(chunks) - 1 else acc.no_sync(self.model),
                rollout.batch_invariant() if cfg.batch_invariant else contextlib.nullcontext(),
            ):
                logps, mask = completion_logprobs(
                    self.model,
                    [traj.prompt_ids[i] for i in idx],
                    [traj.completion_ids[i] for i in idx],
                    cfg.temperature,
                    self.pad_token_id,
                    self._supports_logits_to_keep,
                    [traj.loss_mask[i] for i in idx] if traj.loss_mask is not None else None,
                )
                behaviour = torch.zeros_like(logps)
                for b, i in enumerate(idx):
                    k = len(traj.completion_ids[i])
                    behaviour[b, :k] = torch.tensor(traj.behaviour_logprobs[i], dtype=torch.float32)
                mask = mask * kept_mask[idx].to(device)[:, None]
                per_token, is_ratio = grpo_token_loss(
                    logps,
                    logps.detach(),
                    behaviour.to(device),
                    traj.advantages[idx].to(device),
                    cfg.epsilon,
                    eps_high,
                    cfg.is_cap,
                )
                loss = aggregate_loss(per_token, mask, cfg.loss_type, normaliser)
                backward(acc, loss)
            stats.loss += float(loss.detach())
            m = mask.bool()
            if m.any():
                stats.is_ratio_sum += float(is_ratio[m].sum())
                stats.is_ratio_max = max(stats.is_ratio_max, float(is_ratio[m].max()))
                stats.is_ratio_min = min(stats.is_ratio_min, float(is_ratio[m].min()))
                stats.is_truncated += float((is_ratio[m] > cfg.is_cap).sum())
                d = (logps.detach() - behaviour.to(device)).double()[m]
                stats.kl_sum += float((torch.exp(d) - 1 - d).sum())
                # Sequences sampled wholly under the current weights: a token at staleness 0 after a weight update
                # still read keys and values the earlier weights computed, so its logprob is not the current
                # policy's alone.
                whole = torch.tensor([max(traj.staleness[i], default=0) == 0 for i in idx], device=m.device)
                fresh = m & whole[:, None]
                if fresh.any():
                    stats.fresh_ratio_max = max(stats.fresh_ratio_max, float(is_ratio[fresh].max()))
                    stats.fresh_ratio_min = min(stats.fresh_ratio_min, float(is_ratio[fresh].min()))
                stats.is_tokens += float(m.sum())
        return stats

    # ------------------------------------------------------------------ metrics
    def metrics(self, trajectory: GRPOTrajectory, stats: GRPOStats) -> dict[str, float]:
        """Loss, importance ratios, staleness, dropped and skipped samples and the grad norm, over all processes
        (token figures are token-weighted; the loss is the global loss).

        Staleness (PPO's ``metrics`` logs the same): ``staleness_mean`` and ``staleness_max`` over the trained
        tokens (those of the samples not dropped; NaN without any), ``staleness_max_sampled`` over every sampled
        token, ``dropped_stale`` the samples dropped, ``trained_tokens`` the tokens of the samples kept."""
        acc = self.accelerator
        device = acc.device
        zero_spread = acc.gather(trajectory.zero_spread.to(device))
        totals = acc.reduce(
            torch.tensor(
                [
                    stats.loss,
                    stats.is_ratio_sum,
                    stats.is_tokens,
                    stats.staleness_sum,
                    stats.is_truncated,
                    float(trajectory.dropped.sum()),
                    stats.trained_tokens,
                    stats.skipped,
                    stats.kl_sum,
                ],
                dtype=torch.float64,
                device=device,
            ),
            reduction="sum",
        )
        sampled_stale = float(max(max(s, default=0) for s in trajectory.staleness))
        local_maxima = [
            [stats.is_ratio_max, stats.staleness_max, sampled_stale, -stats.is_ratio_min]
            + [stats.fresh_ratio_max, -stats.fresh_ratio_min]
        ]
        maxima = acc.gather(torch.tensor(local_maxima, dtype=torch.float64, device=device)).max(dim=0).values
        is_tokens, tokens = float(totals[2]), float(totals[6])
        return {
            "loss": float(totals[0]) / self.world_size,  # each process's part carries a factor world_size
            "frac_reward_zero_std": float(zero_spread.mean()),
            "is_ratio_mean": float(totals[1]) / is_tokens if is_tokens else math.nan,
            "is_ratio_max": float(maxima[0]) if is_tokens else math.nan,
            "is_ratio_min": -float(maxima[3]) if is_tokens else math.nan,
            "is_truncated_fraction": float(totals[4]) / is_tokens if is_tokens else math.nan,
            "behaviour_kl": float(totals[8]) / is_tokens if is_tokens else math.nan,
            # Over the sequences sampled wholly under the current weights (staleness 0); NaN without any.
            "is_ratio_fresh_max": float(maxima[4]) if math.isfinite(float(maxima[4])) else math.nan,
            "is_ratio_fresh_min": -float(maxima[5]) if math.isfinite(float(maxima[5])) else math.nan,
            "staleness_mean": float(totals[3]) / tokens if tokens else math.nan,
            "staleness_max": float(maxima[1]) if tokens else math.nan,
            "staleness_max_sampled": float(maxima[2]),
            "dropped_stale": float(totals[5]),
            "trained_tokens": tokens,
            "skipped_zero_advantage": float(totals[7]),
            "grad_norm": stats.grad_norm,
        }

    def completion_fields(self, trajectory: GRPOTrajectory, i: int) -> dict[str, float]:
        return {"advantage": float(trajectory.advantages[i])}


def train_grpo(config: GRPOConfig, **kwargs: Any) -> list[dict[str, float]]:
    """Build a GRPOTrainer and run it (the script's entry point)."""
    return GRPOTrainer(config, **kwargs).train()


__all__ = [
    "TIMING_KEYS",
    "GRPOStats",
    "GRPOTrainer",
    "GRPOTrajectory",
    "TrainerState",
    "resolve_output_dir",
    "sample_seed",
    "source_commit",
    "summary",
    "train_grpo",
]
