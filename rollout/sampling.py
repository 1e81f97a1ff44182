"""Batched per-request sampling and logprobs.

One pass over the step's logits handles requests with different temperatures,
top-k, top-p and seeds. The order of the transformations is transformers':
temperature, then top-k, then top-p. A token is drawn by inverse-CDF sampling: one
uniform number per request and a search in the float64 cumulative distribution.
A request with a seed draws that number from its own generator, so its completion
does not depend on the other requests in the batch; one draw per token (instead of
one random number per vocabulary entry, as the exponential race needs) keeps the
per-request generators cheap on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling_params import SamplingParams

NEG_INF = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask the logits outside each row's top-k and top-p sets with -inf.

    Args:
        logits: float32 [B, V], already divided by the temperature.
        top_k: int64 [B]; 0 keeps every token. None: no row uses top-k.
        top_p: float32 [B]; 1.0 keeps every token. None: no row uses top-p.

    Returns:
        float32 [B, V], a new tensor; at least one token per row stays finite.
    """
    out = logits.clone()
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        max_k = int(k.max())
        kth = torch.topk(out, max_k, dim=-1).values.gather(1, (k - 1)[:, None])  # [B, 1]
        out.masked_fill_(out < kth, NEG_INF)
    if top_p is not None:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the tokens before it already reach top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p[:, None]
        drop_sorted[:, 0] = False
        # float32 running sums round up to 1.0 in the tail: top_p = 1 must keep every token.
        drop_sorted &= (top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        out.masked_fill_(drop, NEG_INF)
    return out


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
    logprobs_mode: str = "temperature",
    return_logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row and its logprob.

    Args:
        logits: float32 [B, V]; row b belongs to the request with ``params[b]``.
        params: the sampling parameters of each row.
        generators: each row's own generator (requests with a seed), or None.
        default_generator: generator for sampled rows without their own.
        logprobs_mode: "temperature": log_softmax(logits / T) at the token (T = 1 for
            requests that do not sample); "raw": log_softmax(logits); "sampled": log of the probability
            of the token in the distribution sampled from, after top-k/top-p (greedy
            rows report the raw logprob).
        return_logprobs: compute the logprobs at all.

    Returns:
        int64 [B] tokens, and float32 [B] logprobs (or None).
    """
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    tokens = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    processed_logprobs: torch.Tensor | None = None
    temps = torch.tensor(
        [p.temperature if p.do_sample and p.temperature > 0 else 1.0 for p in params],
        dtype=torch.float32,
        device=device,
    )
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=device)
        sub_params = [params[i] for i in sampled_rows]
        scaled = logits[rows] / temps[rows, None]
        top_k = None
        if any(p.top_k for p in sub_params):
            top_k = torch.tensor([p.top_k or 0 for p in sub_params], device=device)
        top_p = None
        if any(p.top_p is not None and p.top_p < 1.0 for p in sub_params):
            top_p = torch.tensor([p.top_p if p.top_p is not None else 1.0 for p in sub_params], device=device)
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        # One uniform draw per row, from the row's own generator when it has one.
        uniform = torch.empty(len(sampled_rows), dtype=torch.float64)
        shared = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if shared:
            uniform[shared] = torch.rand(len(shared), dtype=torch.float64, generator=default_generator)
        for j, i in enumerate(sampled_rows):
            gen = generators[i]
            if gen is not None:
                uniform[j] = torch.rand(1, dtype=torch.float64, generator=gen)
        # Inverse-CDF sampling in float64: the first token whose cumulative probability exceeds u.
        # Tokens of probability 0 (outside top-k/top-p) never are the first to exceed it.
        cdf = torch.cumsum(probs.double(), dim=-1)
        u = (uniform.to(device) * cdf[:, -1])[:, None]
        chosen = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=V - 1)
        tokens[rows] = chosen
        if return_logprobs and logprobs_mode == "sampled":
            processed_logprobs = torch.log_softmax(scaled, dim=-1).gather(1, chosen[:, None])[:, 0]
    if not return_logprobs:
        return tokens, None
    if logprobs_mode == "temperature":
        lp = torch.log_softmax(logits / temps[:, None], dim=-1)
    else:
        lp = torch.log_softmax(logits, dim=-1)
    logprobs = lp.gather(1, tokens[:, None])[:, 0]
    if processed_logprobs is not None:
        logprobs[torch.tensor(sampled_rows, device=device)] = processed_logprobs
    return tokens, logprobs
