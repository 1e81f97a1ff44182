"""The PPO objective for language models: per-token rewards, GAE, whitening, the clipped policy and value
losses, entropy and the statistics PPO is read by.

Pure functions of padded tensors, so the trainer, the tests and a user's own loop share them. Every
[B, L] tensor is over completion tokens, right-padded: ``mask[b, t]`` is 1 for the t-th token of
completion b and 0 after its end. Token t is the action taken in state s_t (the prompt and the
first t completion tokens); ``values[b, t]`` estimates the return from s_t.

Ideas from: Schulman et al., "Proximal Policy Optimization Algorithms" (2017) for the clipped
objective; Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
Estimation" (2016) for GAE; Engstrom et al., "Implementation Matters in Deep Policy Gradients" (2020)
and Huang et al., "The 37 Implementation Details of PPO" (2022) for advantage whitening, the value
clip and mini-batching; Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (2019)
for the per-token KL penalty and its adaptive coefficient. OpenRLHF and verl were read for the
same ideas; no code is taken from them.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (float [..]; 0-d result; 0 for an empty mask)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of ``x`` over positions where ``mask`` is 1 (0-d; 0 for an empty mask)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the masked entries of ``x`` to mean 0 and std 1 over all of them.

    Args:
        x: float [B, L].
        mask: float [B, L]; 1 for real tokens.
        shift_mean: subtract the mean (False keeps it: only scale, as some implementations do for
            advantages whose sign should survive).
        eps: added to the variance.

    Returns:
        float [B, L]: (x - mean) / sqrt(var + eps) at masked positions, 0 elsewhere. Mean and
        (population) variance are taken over the masked entries of the whole batch.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' logprobs.

    Args:
        logprobs: float [B, L]; log pi of each sampled token (the policy that sampled it).
        ref_logprobs: float [B, L]; log pi_ref of the same tokens.
        estimator: "k1": log pi - log pi_ref (unbiased, can be negative per token); "k3":
            (r - 1) - log r with r = pi_ref / pi (unbiased, never negative, lower variance).

    Returns:
        float [B, L] (not masked).

    Raises:
        ValueError: an unknown estimator.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards: the task's score on each completion's last masked token, minus ``kl_coef * kl`` on every
    token.

    Args:
        scores: float [B]; the task reward of each completion (NaN: unscored, counted as 0).
        mask: float [B, L]; 1 on the tokens the policy chose (a prefix of a one-turn completion; an episode's model
            turns, its environment tokens 0). A row without any gets no reward.
        kl: float [B, L] per-token KL estimate, or None for no penalty.
        kl_coef: the penalty's coefficient.

    Returns:
        float32 [B, L], 0 at padding.
    """
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float()
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = ((mask > 0) * positions).argmax(dim=1)  # the last masked position (0 for a row without any)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.nan_to_num(scores.float(), nan=0.0).to(rewards.device)
    return rewards * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns over right-padded completions.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, with V and A
    taken as 0 past each completion's last token (the episode ends there: no bootstrap). t and t+1 run over the
    masked tokens only: an unmasked token (an episode's environment reply, between two model turns) is no action,
    so the recursion passes over it with V and A unchanged, as verl's multi-turn GAE does. For a mask that is a
    prefix this is the one-turn recursion.

    Args:
        rewards: float [B, L] per-token rewards (``token_rewards``).
        values: float [B, L] V(s_t) at rollout time (detached).
        mask: float [B, L]; 1 for the policy's tokens (a prefix of each row for one turn).
        gamma: discount in [0, 1].
        lam: GAE's lambda in [0, 1].

    Returns:
        advantages float32 [B, L] and returns float32 [B, L] (= advantages + values, the value
        loss's targets), both 0 at padding.
    """
    rewards, values, mask = rewards.float(), values.float() * mask, mask.float()
    B, L = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B, device=rewards.device)
    next_adv = torch.zeros(B, device=rewards.device)
    for t in reversed(range(L)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * m
        advantages[:, t] = adv
        # An unmasked position passes V and A back unchanged: trailing padding passes the zeros it started from
        # (the last real token sees V = A = 0 after it), an environment span the next model token's.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    return advantages, (advantages + values) * mask


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token.

    Args:
        logprobs: float [B, L]; log pi_theta of the sampled tokens (carries the gradient).
        old_logprobs: float [B, L]; log pi_old: the engine's logprobs of the sampled tokens.
        advantages: float [B, L] (detached).
        epsilon: the ratio's clip range [1 - epsilon, 1 + epsilon].

    Returns:
        per-token loss float [B, L]: max(-A r, -A clip(r, 1 - eps, 1 + eps)), and the ratio r =
        pi_theta / pi_old float [B, L] (detached). Padding is not masked here.
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    return torch.maximum(unclipped, clipped), ratio.detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token.

    Args:
        values: float [B, L]; V_phi(s_t) now (carries the gradient).
        old_values: float [B, L]; V(s_t) at rollout time.
        returns: float [B, L]; GAE's returns (targets).
        cliprange: V_clip = old + clamp(V - old, -cliprange, cliprange).

    Returns:
        per-token loss float [B, L]: 0.5 * max((V - R)^2, (V_clip - R)^2), and bool [B, L]: the
        clipped term is the larger (no gradient flows through V there). Padding is not masked here.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange, cliprange)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), (clipped_loss > unclipped_loss).detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: float [..., V] -> float [...] (nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 for a perfect critic, 0 for a constant one,
    negative when it is worse than a constant; NaN when the returns do not vary."""
    var_r = float(masked_var(returns, mask))
    if var_r == 0:
        return float("nan")
    return 1.0 - float(masked_var(returns - values, mask)) / var_r


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019): proportional control towards a target KL.

    After a batch with mean sequence KL ``kl``: error = clip(kl / target - 1, -0.2, 0.2) and
    coef *= 1 + error * n / horizon, where n is the number of sequences ``kl`` is the mean over (the PPO trainer
    passes the samples it trained on, over all processes: ``PPOTrainer.trained_kl``).

    Args:
        init_coef: the starting coefficient (> 0).
        target: the sequence KL to hold (nats); None keeps the coefficient fixed.
        horizon: sequences over which the error is corrected.
    """

    def __init__(self, init_coef: float, target: float | None, horizon: int) -> None:
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, kl: float, num_sequences: int) -> float:
        """Adapt to the last batch's mean sequence KL; returns the new coefficient."""
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * num_sequences / self.horizon
        return self.value
