"""Batched per-request logits processors, in ``model.generate``'s order, on a step's raw logits.

Repetition penalty, no-repeat n-grams, bad words, ``min_length`` and ``min_new_tokens``, read from each request's
tokens (prompt and generated). A request without processors costs nothing; each processor works on the rows that
have it at once, in tensors; only the bad-word lookups and minimum lengths are decided per request in Python (no work
per vocabulary entry). ``sampler.sample_tokens`` applies them before temperature, top-k, top-p and min-p.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from rollout.sampling_params import SamplingParams

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
