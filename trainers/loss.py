"""The GRPO objective: group-normalised advantages, the clipped token loss with truncated importance
weights, its normalisation, and the padded training forward that gives the trained logprobs.

Pure functions of tensors, so the trainer, the tests and a user's own loop share them. The derivation
and the choice of each term are in docs/grpo_trainer.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: float [N], N a multiple of G; the G samples of a prompt are consecutive. NaN
            marks a sample no reward function scored.
        num_generations: G.
        scale: divide by the group's std (Bessel-corrected, NaN-aware) plus eps; otherwise
            only centre.
        eps: added to the std.

    Returns:
        float32 [N]: (r - mean_group) / (std_group + eps); exactly 0 for NaN rewards, for a group
        whose scored rewards are all equal (the float mean of equal values can differ from them
        in the last bit, and eps would turn that into a spurious advantage), and for groups
        with fewer than two scored samples when scaling.
    """
    grouped = rewards.float().view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    centred = torch.where(zero_spread_groups(grouped)[:, None], torch.zeros_like(grouped), grouped - mean)
    if scale:
        count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        var = torch.nansum(centred**2, dim=1, keepdim=True) / (count - 1).clamp(min=1)
        std = torch.sqrt(var)
        centred = torch.where(count > 1, centred / (std + eps), torch.zeros_like(centred))
    return torch.nan_to_num(centred, nan=0.0).view(-1)


def zero_spread_groups(grouped: torch.Tensor) -> torch.Tensor:
    """bool [P]: groups (rows of float [P, G], NaN = unscored) whose scored rewards are all equal.

    Such a group carries no learning signal (TRL logs their share as ``frac_reward_zero_std``).
    """
    scored = ~torch.isnan(grouped)
    hi = torch.where(scored, grouped, torch.full_like(grouped, -math.inf)).max(dim=1).values
    lo = torch.where(scored, grouped, torch.full_like(grouped, math.inf)).min(dim=1).values
    return (hi <= lo) | (scored.sum(dim=1) < 2)


def grpo_token_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    is_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped policy-gradient loss with truncated importance weights.

    Args:
        logprobs: float [B, L]; log pi_theta of each completion token (carries the gradient).
        prox_logprobs: float [B, L]; log pi_prox, the weights at the start of the update
            (``logprobs.detach()`` for one update per batch).
        behaviour_logprobs: float [B, L]; the rollout's logprobs (the behaviour policy).
        advantages: float [B]; one advantage per sequence.
        epsilon_low, epsilon_high: clip range [1 - epsilon_low, 1 + epsilon_high] of rho.
        is_cap: upper truncation of the importance weight pi_prox / pi_behaviour.

    Returns:
        per_token_loss float [B, L]: -min(w, cap) * min(rho A, clip(rho) A); and the raw
        importance ratio pi_prox / pi_behaviour float [B, L] (before truncation, detached).
        Padding positions are not masked here.
    """
    adv = advantages[:, None]
    rho = torch.exp(logprobs - prox_logprobs.detach())
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1 - epsilon_low, 1 + epsilon_high) * adv
    is_ratio = torch.exp(prox_logprobs.detach() - behaviour_logprobs)
    weight = torch.clamp(is_ratio, max=is_cap)
    return -weight * torch.minimum(unclipped, clipped), is_ratio


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, normaliser: float) -> torch.Tensor:
    """Sum a micro-batch's contribution to the global loss.

    Args:
        per_token_loss: float [B, L].
        mask: float [B, L]; 1 for trained completion tokens.
        loss_type: "dapo": sum of masked token losses / normaliser (the global token count);
            "grpo": sum over sequences of their masked token mean / normaliser (the global
            sequence count). Fully masked sequences contribute 0.
        normaliser: the global count (already divided by the world size for DDP's mean).

    Returns:
        A scalar tensor.
    """
    masked = per_token_loss * mask
    if loss_type == "dapo":
        return masked.sum() / normaliser
    per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.sum() / normaliser


def pad_batch(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad the prompts and right-pad the completions, so all completions start at one column.

    Args:
        prompt_ids, completion_ids: B token lists each.
        pad_token_id: the id written in padding positions.
        loss_masks: B lists of 0/1, one per completion token (0: a token not trained on, such as an
            environment's reply inside an episode); None: every completion token counts.

    Returns:
        input_ids int64 [B, P + L], attention_mask int64 [B, P + L], position_ids int64 [B, P + L]
        (0 at the first real token of each row), completion_mask float32 [B, L] (0 at padding and where
        ``loss_masks`` is 0); P is the longest prompt and L the longest completion.
    """
    B = len(prompt_ids)
    P = max(len(p) for p in prompt_ids)
    L = max(len(c) for c in completion_ids)
    input_ids = torch.full((B, P + L), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((B, P + L), dtype=torch.int64)
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[b, P - len(p) : P] = torch.tensor(list(p), dtype=torch.int64)
        input_ids[b, P : P + len(c)] = torch.tensor(list(c), dtype=torch.int64)
        attention[b, P - len(p) : P + len(c)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    completion_mask = attention[:, P:].float()
    for b, m in enumerate(loss_masks or []):
        completion_mask[b, : len(m)] *= torch.tensor(list(m), dtype=torch.float32)
    return input_ids, attention, position_ids, completion_mask


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float,
    pad_token_id: int,
    supports_logits_to_keep: bool = True,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) of each completion token under one padded forward.

    Only the last L + 1 positions go through the LM head (``logits_to_keep``): prompts are
    left-padded so every completion starts at the same column.

    Args:
        model: the causal LM (or its DDP wrapper).
        prompt_ids, completion_ids: B token lists each.
        temperature: the sampling temperature T.
        pad_token_id: id written in padding positions (masked out).
        supports_logits_to_keep: the model's forward accepts ``logits_to_keep``.
        loss_masks: per completion token, 0 where it is not trained on (see ``pad_batch``); None: all are.

    Returns:
        logprobs float32 [B, L] (0 at padding and masked tokens), completion mask float32 [B, L].
    """
    input_ids, attention, position_ids, comp_mask = pad_batch(prompt_ids, completion_ids, pad_token_id, loss_masks)
    device = next(model.parameters()).device
    L = comp_mask.shape[1]
    kwargs = dict(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
    )
    if supports_logits_to_keep:
        kwargs["logits_to_keep"] = L + 1
    logits = model(**kwargs).logits
    logits = logits[:, -(L + 1) : -1].float() / temperature
    targets = input_ids[:, -L:].to(device)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    comp_mask = comp_mask.to(device)
    return logps * comp_mask, comp_mask
