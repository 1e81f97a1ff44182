"""Batched per-request logits processors, sampling and logprobs.

One pass over the step's logits handles requests with different processors, temperatures,
top-k, top-p, min-p and seeds. The order is ``model.generate``'s: the logits processors
(repetition penalty, no-repeat n-grams, bad words, min_length, min_new_tokens) on the raw
logits of every request that has them, greedy or not; then, for sampled requests only,
temperature, top-k, top-p and min-p. Greedy requests take the argmax of the processed logits.

The processors read each request's token sequence (prompt and generated tokens). A request
without processors costs nothing: its row is neither copied nor read. Each processor works on
the rows of the requests that have it at once, in tensors; only the bad-word lookups and the
minimum lengths are decided per request in Python (a dictionary lookup per prefix length, no
work per vocabulary entry).

A token is drawn by inverse-CDF sampling: one uniform number per request and a search in the
float64 cumulative distribution. A request with a seed draws that number from its own
generator, so its completion does not depend on the other requests in the batch; one draw per
token (instead of one random number per vocabulary entry, as the exponential race needs) keeps
the per-request generators cheap on CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .sampling_params import SamplingParams

NEG_INF = float("-inf")


def padded_histories(token_ids: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """The token sequences of some requests as one right-padded tensor.

    Args:
        token_ids: R sequences of token ids (each non-empty).
        pad: the value after the end of each sequence.
        device: where the tensor goes.

    Returns:
        int64 [R, L] with L the longest length; row r holds ``token_ids[r]`` then ``pad``.
    """
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    out = np.full((len(token_ids), int(lengths.max())), pad, dtype=np.int64)
    # Row-major boolean indexing fills the valid positions in sequence order.
    out[np.arange(out.shape[1])[None, :] < lengths[:, None]] = flat
    return torch.from_numpy(out).to(device)


def no_repeat_ngram_mask(history: torch.Tensor, lengths: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """Tokens that would complete an n-gram already present in each sequence.

    The last n - 1 tokens of a sequence are its current prefix; every earlier window of n tokens
    whose first n - 1 equal that prefix bans its last token.

    Args:
        history: int64 [G, L], sequences right-padded with ``vocab`` (see ``padded_histories``).
        lengths: int64 [G], each sequence's length; all >= n.
        n: the n-gram size (>= 1).
        vocab: V, the width of the logits.

    Returns:
        bool [G, V]: True where the token is banned.
    """
    G = history.shape[0]
    offsets = torch.arange(n - 1, device=history.device)
    prefix = history.gather(1, lengths[:, None] - (n - 1) + offsets[None, :])  # [G, n-1]
    windows = history.unfold(1, n, 1)  # [G, L-n+1, n]
    matches = (windows[..., :-1] == prefix[:, None, :]).all(dim=-1)
    # A window that runs into the padding ends with the pad value, or has it among its first n - 1
    # tokens (then it cannot match): either way it bans only the spare column ``vocab``.
    banned = torch.where(matches, windows[..., -1], vocab)
    mask = torch.zeros(G, vocab + 1, dtype=torch.bool, device=history.device)
    mask.scatter_(1, banned, True)
    return mask[:, :vocab]


def apply_logits_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]] | None,
    num_prompt_tokens: Sequence[int] | None,
) -> torch.Tensor:
    """Apply each request's logits processors, in ``model.generate``'s order.

    Repetition penalty (a seen token's logit divided by the penalty when positive, multiplied
    when negative), then the bans, each setting a logit to -inf: tokens completing a repeated
    n-gram, bad words, and the end-of-sequence ids while the request is shorter than
    ``min_length`` (prompt included) or ``min_new_tokens`` (generated tokens).

    Args:
        logits: float32 [B, V], raw logits; not changed.
        params: the sampling parameters of each row.
        token_ids: each row's sequence so far (prompt then generated tokens); may be None when no
            row uses a processor.
        num_prompt_tokens: each row's prompt length (the rest of its sequence was generated).

    Returns:
        float32 [B, V]: ``logits`` itself when no row uses a processor, else a new tensor in which
        only the rows of requests with processors differ.

    Raises:
        ValueError: a row uses a processor and ``token_ids`` or ``num_prompt_tokens`` is None.
    """
    rows = [i for i, p in enumerate(params) if p.uses_logits_processors]
    if not rows:
        return logits
    if token_ids is None or num_prompt_tokens is None:
        raise ValueError("logits processors need each row's token_ids and num_prompt_tokens")
    out = logits.clone()
    vocab = out.shape[-1]
    device = out.device
    history_rows = [i for i in rows if params[i].repetition_penalty != 1.0 or params[i].no_repeat_ngram_size > 0]
    if history_rows:
        history = padded_histories([token_ids[i] for i in history_rows], vocab, device).clamp_(max=vocab)
        position = {row: j for j, row in enumerate(history_rows)}
        penalised = [i for i in history_rows if params[i].repetition_penalty != 1.0]
        if penalised:
            seen = torch.zeros(len(penalised), vocab + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, history[[position[i] for i in penalised]], True)
            penalty = torch.tensor(
                [params[i].repetition_penalty for i in penalised], dtype=torch.float32, device=device
            )[:, None]
            index = torch.tensor(penalised, device=device)
            sub = out[index]
            scaled = torch.where(sub < 0, sub * penalty, sub / penalty)
            out[index] = torch.where(seen[:, :vocab], scaled, sub)
        by_size: dict[int, list[int]] = {}
        for i in history_rows:
            n = params[i].no_repeat_ngram_size
            if n > 0 and len(token_ids[i]) >= n:  # shorter sequences hold no n-gram yet
                by_size.setdefault(n, []).append(i)
        for n, group in by_size.items():
            lengths = torch.tensor([len(token_ids[i]) for i in group], dtype=torch.int64, device=device)
            mask = no_repeat_ngram_mask(history[[position[i] for i in group]], lengths, n, vocab)
            index = torch.tensor(group, device=device)
            out[index] = out[index].masked_fill(mask, NEG_INF)
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i in rows:
        p, seq = params[i], token_ids[i]
        banned = list(p.banned_tokens)
        for k, by_prefix in p.bad_word_prefixes.items():
            if len(seq) >= k:
                banned.extend(by_prefix.get(tuple(seq[-k:]), ()))
        if len(seq) < p.min_length or len(seq) - num_prompt_tokens[i] < p.min_new_tokens:
            banned.extend(p.eos_token_ids)
        ban_rows.extend([i] * len(banned))
        ban_tokens.extend(banned)
    if ban_rows:
        out[torch.tensor(ban_rows, device=device), torch.tensor(ban_tokens, device=device)] = NEG_INF
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below ``min_p`` times the row's top probability.

    Args:
        logits: float32 [B, V], after temperature, top-k and top-p.
        min_p: float32 [B] in [0, 1]; 0 keeps every token.

    Returns:
        float32 [B, V], a new tensor; the most likely token of each row always stays.
    """
    probs = torch.softmax(logits, dim=-1)
    drop = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, NEG_INF)


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
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row and its logprob.

    Args:
        logits: float32 [B, V], raw; row b belongs to the request with ``params[b]``.
        params: the sampling parameters of each row.
        generators: each row's own generator (requests with a seed), or None.
        default_generator: generator for sampled rows without their own.
        logprobs_mode: "temperature": log_softmax(logits / T) of the raw logits at the token (T = 1
            for requests that do not sample); "raw": log_softmax(logits); "sampled": log of the
            probability of the token in the distribution it was drawn from: after the logits
            processors, temperature, top-k, top-p and min-p (greedy rows: log_softmax of the
            processed logits, which is the raw logprob for a request without processors).
        return_logprobs: compute the logprobs at all.
        token_ids: each row's sequence so far (prompt then generated tokens), read by the logits
            processors; None is allowed when no row has any.
        num_prompt_tokens: each row's prompt length, with ``token_ids``.

    Returns:
        int64 [B] tokens, and float32 [B] logprobs (or None).

    Raises:
        ValueError: a row has logits processors and ``token_ids`` is None.
    """
    raw = logits.float()
    logits = apply_logits_processors(raw, params, token_ids, num_prompt_tokens)
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
        if any(p.min_p for p in sub_params):
            min_p = torch.tensor([p.min_p or 0.0 for p in sub_params], dtype=torch.float32, device=device)
            scaled = apply_min_p(scaled, min_p)
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
        # Tokens of probability 0 (banned, or outside top-k/top-p/min-p) never are the first to exceed it.
        cdf = torch.cumsum(probs.double(), dim=-1)
        u = (uniform.to(device) * cdf[:, -1])[:, None]
        chosen = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=V - 1)
        tokens[rows] = chosen
        if return_logprobs and logprobs_mode == "sampled":
            processed_logprobs = torch.log_softmax(scaled, dim=-1).gather(1, chosen[:, None])[:, 0]
    if not return_logprobs:
        return tokens, None
    if logprobs_mode == "temperature":
        lp = torch.log_softmax(raw / temps[:, None], dim=-1)
    elif logprobs_mode == "raw":
        lp = torch.log_softmax(raw, dim=-1)
    else:  # "sampled": greedy rows drew from their processed logits
        lp = torch.log_softmax(logits, dim=-1)
    logprobs = lp.gather(1, tokens[:, None])[:, 0]
    if processed_logprobs is not None:
        logprobs[torch.tensor(sampled_rows, device=device)] = processed_logprobs
    return tokens, logprobs
