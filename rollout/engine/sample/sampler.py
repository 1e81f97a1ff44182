"""Batched per-request sampling and logprobs.

One pass over the step's logits handles requests with different processors, temperatures, top-k, top-p, min-p and
seeds, in ``model.generate``'s order: the logits processors (``logits_processors``) on the raw logits of every
request that has them, greedy or not; then, for sampled requests only, temperature, top-k, top-p and min-p. Greedy
requests take the argmax of the processed logits.

A token is drawn by inverse-CDF sampling: one uniform number per request and a search in the float64 cumulative
distribution. A request with a seed takes the ``t``-th number of its own counter-based stream for its ``t``-th
generated token (``seeded_uniforms``: SplitMix64 jumped to position ``t``), so its completion depends neither on the
batch nor on preemptions; requests without a seed share one draw of the engine's generator per step
(``step_uniforms``). A step's per-row arrays reach the device in one copy (``engine.staging.HostStaging``), and nothing
here reads a device value back on the host. On CPU, with rollout's extension loaded, the search is one kernel
(``rollout_cpu::inverse_cdf_sample``): the same float64 running sums in the same order as ``torch.cumsum`` then
``torch.searchsorted``, so the same token, without their [S, V] float64 copies and single-threaded scan
(``scripts/bench_sampler.py``: 1.4x on 64 rows of 49,152); a step whose rows all sample skips the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from rollout.engine.sample.logits_processors import NEG_INF, apply_logits_processors
from rollout.engine.sample.structured import apply_grammar_masks
from rollout.engine.staging import HostStaging
from rollout.sampling_params import SamplingParams

# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
# the state advances by the golden-ratio increment and each output is the state through a 64-bit
# finaliser, so the t-th output of a stream is computable directly from its start state.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 values (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """Number ``counters[i]`` of the random stream of ``seeds[i]``, for every i at once.

    The stream of a seed is SplitMix64 started from the state ``mix64(seed + golden)`` (so that
    neighbouring seeds start far apart); its number t is ``mix64(start + (t + 1) * golden)``, the top
    53 bits scaled to [0, 1). A request's t-th generated token takes number t: the same seed gives the
    same numbers whatever else is in the batch, with no generator object per request.

    Args:
        seeds: any ints (taken modulo 2**64).
        counters: ints >= 0, one per seed.

    Returns:
        float64 [len(seeds)] in [0, 1).
    """
    with np.errstate(over="ignore"):
        s = np.array([seed % 2**64 for seed in seeds], dtype=np.uint64)
        t = np.asarray(counters, dtype=np.uint64)
        start = _mix64(s + _GOLDEN)
        z = _mix64(start + (t + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def step_uniforms(
    params: Sequence[SamplingParams], counters: Sequence[int], default_generator: torch.Generator
) -> np.ndarray:
    """The uniform numbers of one step's rows: at most one draw of ``default_generator``.

    Args:
        params: each row's sampling parameters.
        counters: each row's number of generated tokens so far (the position in its seed's stream).
        default_generator: the engine's CPU generator, for sampled rows without a seed.

    Returns:
        float64 [B]: ``seeded_uniforms`` for sampled rows with a seed; one ``torch.rand`` call of
        ``default_generator`` for the other sampled rows, in row order; 0 for greedy rows (unused).
    """
    out = np.zeros(len(params), dtype=np.float64)
    seeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is not None]
    shared = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
    if seeded:
        out[seeded] = seeded_uniforms([params[i].seed for i in seeded], [counters[i] for i in seeded])
    if shared:
        out[shared] = torch.rand(len(shared), dtype=torch.float64, generator=default_generator).numpy()
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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_k: int | None = None
) -> torch.Tensor:
    """Mask the logits outside each row's top-k and top-p sets with -inf.

    Args:
        logits: float32 [B, V], already divided by the temperature.
        top_k: int64 [B]; 0 keeps every token. None: no row uses top-k.
        top_p: float32 [B]; 1.0 keeps every token. None: no row uses top-p.
        max_k: the largest k in use, with 0 counted as V and capped at V, when the caller knows it
            on the host; None reads it from ``top_k`` (a device-to-host sync on CUDA).

    Returns:
        float32 [B, V], a new tensor; at least one token per row stays finite.
    """
    out = logits.clone()
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        if max_k is None:
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


class TopLogprobs(NamedTuple):
    """The most likely tokens of the rows that asked for them (``SamplingParams.num_top_logprobs`` > 0).

    Attributes:
        rows: the batch rows that asked, ascending (host ints).
        token_ids: int64 [len(rows), K] on the logits' device, K the largest count asked for (at most V);
            row j holds the K most likely token ids of batch row ``rows[j]``, most likely first. A row that
            asked for fewer reads its first ``num_top_logprobs`` columns.
        logprobs: float32 [len(rows), K], their logprobs, in the distribution of the sampled token's logprob.
    """

    rows: list[int]
    token_ids: torch.Tensor
    logprobs: torch.Tensor


class SampleOutput(NamedTuple):
    """What ``sample_tokens`` returns: tokens [B], logprobs [B] or None, top logprobs or None (see fields)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top: TopLogprobs | None


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    logprobs_mode: str = "temperature",
    return_logprobs: bool = True,
    token_ids: Sequence[Sequence[int]] | None = None,
    num_prompt_tokens: Sequence[int] | None = None,
    uniform: np.ndarray | None = None,
    staging: HostStaging | None = None,
    grammars: Sequence[Any | None] | None = None,
    cpu_kernel: bool = False,
) -> SampleOutput:
    """Pick one token per row, its logprob, and the top logprobs of the rows that ask for them.

    Args:
        logits: float32 [B, V], raw; row b belongs to the request with ``params[b]``.
        params: the sampling parameters of each row.
        logprobs_mode: "temperature": log_softmax(logits / T) of the raw logits at the token (T = 1 for
            requests that do not sample); "raw": log_softmax(logits); "sampled": the token's log-probability in
            the distribution it was drawn from (greedy rows: log_softmax of the processed logits).
        return_logprobs: compute the sampled tokens' logprobs at all.
        token_ids: each row's sequence so far (prompt then generated tokens), read by the logits
            processors; None is allowed when no row has any.
        num_prompt_tokens: each row's prompt length, with ``token_ids``.
        uniform: float64 [B] in [0, 1), the number each sampled row draws its token with (the
            engine's ``step_uniforms``; greedy rows' entries are unused); may be None when no row samples.
        staging: the buffers that carry the per-row values to the device (one copy per call); None
            uses a fresh one.
        grammars: per row, the request's grammar matcher (``structured.new_matcher``) or None; a constrained row's
            disallowed tokens are masked after the logits processors, before temperature, top-k and top-p (a row whose
            processors ban every token its grammar allows is masked from its unprocessed logits instead). The
            logprobs of the "temperature" and "raw" modes stay the unmasked model's; None: no row is constrained.
        cpu_kernel: CPU logits draw their sampled rows with rollout's kernel (``rollout_cpu::inverse_cdf_sample``,
            engine/attention/csrc/sample_cpu.cpp; the caller has loaded it): the same tokens as the torch ops, in
            one pass over each row's probabilities instead of a float64 copy and ``torch.cumsum``.

    Returns:
        ``SampleOutput``: int64 [B] tokens; float32 [B] logprobs (None without ``return_logprobs``); and
        ``TopLogprobs`` of the rows with ``num_top_logprobs`` > 0 (None when no row asks; then nothing
        is computed for it), taken by ``torch.topk`` of the same log-distribution (``logprobs_mode``)
        as the logprob, whatever ``return_logprobs`` says. All on the logits' device; nothing is read
        back to the host.

    Raises:
        ValueError: a row has logits processors and ``token_ids`` is None, or ``uniform`` is None while
            a row samples.
    """
    raw = logits.float()
    logits = apply_logits_processors(raw, params, token_ids, num_prompt_tokens)
    if grammars is not None:
        logits = apply_grammar_masks(logits, grammars, copy=logits is raw, unprocessed=raw)
    B, V = logits.shape
    device = logits.device
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    every_row_samples = len(sampled_rows) == B
    # A sampled row's token is its draw (below): the argmax only for the greedy rows.
    tokens = torch.empty(B, dtype=torch.long, device=device) if every_row_samples else torch.argmax(logits, dim=-1)
    top_rows = [i for i, p in enumerate(params) if p.num_top_logprobs > 0]
    need_logprobs = return_logprobs or bool(top_rows)
    need_temps = bool(sampled_rows) or (need_logprobs and logprobs_mode == "temperature")
    if not need_temps and not top_rows:
        if not return_logprobs:
            return SampleOutput(tokens, None, None)
        return SampleOutput(tokens, _token_logprobs(_log_distribution(raw, logits, None, logprobs_mode), tokens), None)
    # Every per-row value the device needs, gathered on the host and sent in one copy.
    temps = np.array([p.temperature if p.do_sample and p.temperature > 0 else 1.0 for p in params], dtype=np.float64)
    # Every temperature 1 (GRPO's usual): x / 1 is x exactly, so no [B, V] division is made.
    unit_temps = bool((temps == 1.0).all())
    arrays = [temps]
    if top_rows and len(top_rows) < B:
        arrays.append(np.array(top_rows, dtype=np.int64))
    sub_params = [params[i] for i in sampled_rows]
    use_top_k = any(p.top_k for p in sub_params)
    use_top_p = any(p.top_p is not None and p.top_p < 1.0 for p in sub_params)
    use_min_p = any(p.min_p for p in sub_params)
    max_k = None
    if sampled_rows:
        if uniform is None:
            raise ValueError("sample_tokens needs uniform numbers for its sampled rows (step_uniforms)")
        u = np.asarray(uniform, dtype=np.float64)[sampled_rows]
        arrays += [np.array(sampled_rows, dtype=np.int64), u]
        if use_top_k:
            ks = [p.top_k or 0 for p in sub_params]
            arrays.append(np.array(ks, dtype=np.int64))
            max_k = max(min(k, V) if k > 0 else V for k in ks)
        if use_top_p:
            arrays.append(np.array([p.top_p if p.top_p is not None else 1.0 for p in sub_params], dtype=np.float64))
        if use_min_p:
            arrays.append(np.array([p.min_p or 0.0 for p in sub_params], dtype=np.float64))
    staged = iter((staging or HostStaging(device)).upload(*arrays))
    temps_t = next(staged).float()
    top_index = next(staged) if top_rows and len(top_rows) < B else None
    processed: torch.Tensor | None = None  # "sampled" mode: the sampled rows' log-distribution [S, V]
    rows: torch.Tensor | None = None
    if sampled_rows:
        rows, u_t = next(staged), next(staged)
        top_k = next(staged) if use_top_k else None
        top_p = next(staged).float() if use_top_p else None
        min_p = next(staged).float() if use_min_p else None
        if every_row_samples:
            scaled = logits if unit_temps else logits / temps_t[:, None]  # read only below: the filters copy
        else:
            scaled = logits[rows] / temps_t[rows, None]
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p, max_k)
        if min_p is not None:
            scaled = apply_min_p(scaled, min_p)
        probs = torch.softmax(scaled, dim=-1)
        # Inverse-CDF sampling in float64: the first token whose cumulative probability exceeds u.
        # Tokens of probability 0 (banned, or outside top-k/top-p/min-p) never are the first to exceed it.
        if cpu_kernel and probs.device.type == "cpu":
            chosen = torch.ops.rollout_cpu.inverse_cdf_sample(probs, u_t.double())
        else:
            cdf = torch.cumsum(probs.double(), dim=-1)
            chosen = torch.searchsorted(cdf, (u_t * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=V - 1)
        if every_row_samples:
            tokens = chosen
        else:
            tokens[rows] = chosen
        if need_logprobs and logprobs_mode == "sampled":
            processed = torch.log_softmax(scaled, dim=-1)
    if not need_logprobs:
        return SampleOutput(tokens, None, None)
    dist = _log_distribution(raw, logits, None if unit_temps else temps_t, logprobs_mode)
    logprobs = None
    if return_logprobs:
        logprobs = _token_logprobs(dist, tokens)
        if processed is not None:
            logprobs[rows] = processed.gather(1, tokens[rows][:, None])[:, 0]
    top = None
    if top_rows:
        if processed is not None:
            # The sampled rows' logprobs come from the distribution they were drawn from: so do their
            # alternatives (an out-of-place copy, made only when a row asks for alternatives).
            dist = dist.index_copy(0, rows, processed)
        k = min(max(params[i].num_top_logprobs for i in top_rows), V)
        values, ids = (dist if top_index is None else dist.index_select(0, top_index)).topk(k, dim=-1)
        top = TopLogprobs(top_rows, ids, values)
    return SampleOutput(tokens, logprobs, top)


def _log_distribution(
    raw: torch.Tensor, processed: torch.Tensor, temps: torch.Tensor | None, mode: str
) -> torch.Tensor:
    """float32 [B, V]: each row's log-distribution in ``mode`` (see ``sample_tokens``), before the
    "sampled" mode's temperature and filters (the caller puts those rows in).

    ``temps`` (float32 [B]) is read by the "temperature" mode only; None there: every temperature is 1.
    """
    if mode == "temperature":
        return torch.log_softmax(raw if temps is None else raw / temps[:, None], dim=-1)
    if mode == "raw":
        return torch.log_softmax(raw, dim=-1)
    return torch.log_softmax(processed, dim=-1)  # "sampled": greedy rows drew from their processed logits


def _token_logprobs(dist: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [B]: ``dist`` [B, V] at each row's token (int64 [B])."""
    return dist.gather(1, tokens[:, None])[:, 0]


def score_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Logprobs of scored positions: ``log_softmax(logits / T)`` at each target token.

    Args:
        logits: float32 [S, V]; row j predicts ``targets[j]``.
        targets: int64 [S], on the logits' device.
        temperatures: float32 [S], each row's T.

    Returns:
        float32 [S] on the device, in row order.
    """
    return torch.log_softmax(logits / temperatures[:, None], dim=-1).gather(1, targets[:, None])[:, 0]


def unpack_top_logprobs(counts: Sequence[int], host: Sequence[float]) -> list[tuple[list[int], list[float]]] | None:
    """Each sampled row's top logprobs from the tail of a step's packed results.

    Args:
        counts: each sampled row's ``num_top_logprobs`` (0: none), in row order.
        host: the ids then the logprobs of ``TopLogprobs``, R x K each, row-major, for the R rows
            whose count is > 0 (K, the widest count capped at the vocabulary, follows from the length).

    Returns:
        Per sampled row: (ids, logprobs) of its first ``counts[row]`` alternatives, most likely first, or
        ``([], [])`` for a row that asked for none; None when no row asked.
    """
    asked = sum(1 for c in counts if c > 0)
    if not asked:
        return None
    k = len(host) // (2 * asked)
    ids, values = host[: asked * k], host[asked * k : 2 * asked * k]
    out: list[tuple[list[int], list[float]]] = []
    j = 0
    for c in counts:
        if c > 0:
            n = min(c, k)
            out.append(([int(t) for t in ids[j * k : j * k + n]], list(values[j * k : j * k + n])))
            j += 1
        else:
            out.append(([], []))
    return out
