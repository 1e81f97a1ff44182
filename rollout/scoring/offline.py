"""Logprob scoring: per-token logprobs of given completions, teacher-forced through the engine.

Each row (prompt, completion) becomes one prefill-only *scoring request*: the engine computes the row's tokens
through the paged cache and records ``log_softmax(logits / T)`` at every completion token; nothing is sampled.
Against a padded ``model(...)`` forward per batch of rows this gives no padding (rows packed into the token budget,
long rows chunked), prefix sharing (rows grouped by prompt find its full blocks in the prefix cache; hits are capped
below the first scored position) and an LM head over the scored positions only.

Decisions:
    - Prompt logprobs (``include_prompt=True``) do not depend on the completion (causal attention): computed once
      per distinct prompt, by the first row of the group, and copied to the others.
    - Identical (prompt, completion) rows are scored once; an empty completion costs no engine work (unless its
      prompt's logprobs are asked for and no other row of that prompt computes them).
    - Every input is checked before the engine is built: a bad row fails the whole call with a ``ValueError``
      naming the row, and nothing is computed.
    - Requests are fed in a bounded window (``MAX_IN_FLIGHT``), so the queue stays bounded and the KV cache is
      sized for a few steps' worth of rows, not for the whole dataset.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedModel

from rollout.checks import check_int, check_number, token_ids
from rollout.config import ContinuousBatchingConfig, resolve_continuous_batching_config
from rollout.engine import Engine, is_driver_rank
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams
from rollout.weights.model_info import model_context_length, vocab_size

# Most scoring requests queued in the engine at once (submitted, not finished).
MAX_IN_FLIGHT = 512


@dataclass
class ScoreOutput:
    """Logprobs of one (prompt, completion) row.

    Attributes:
        completion_logprobs: float [len(completion)]; entry i is log p(completion[i] | prompt,
            completion[:i]) under ``log_softmax(logits / temperature)``, in nats.
        prompt_logprobs: with ``include_prompt=True``, float [len(prompt) - 1]: the logprobs of prompt
            tokens 1..end (the first token has no context); else None.
        logprob_sum: sum of ``completion_logprobs`` (0.0 for an empty completion), in nats.
        num_tokens: number of completion tokens scored (0 for an empty or skipped row).
        skipped: True when the row was longer than the model's context and ``skip_too_long=True``;
            its lists are then empty and ``logprob_sum`` is 0.0.
    """

    completion_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    logprob_sum: float = 0.0
    num_tokens: int = 0
    skipped: bool = False


@dataclass
class _Job:
    """One engine request and the rows it answers.

    Attributes:
        request_id: the engine request's id (``score_<first row>``).
        tokens: prompt + completion token ids.
        prompt_len: number of prompt tokens.
        score_from: 1 when the job also computes its prompt's logprobs, else ``prompt_len``.
        rows: the input rows with this exact (prompt, completion).
        group: index of the job's distinct prompt.
    """

    request_id: str
    tokens: list[int]
    prompt_len: int
    score_from: int
    rows: list[int]
    group: int


@dataclass
class _Plan:
    """A scoring call's checked rows and the jobs that answer them (what the driver sends to every rank).

    Attributes:
        jobs: the jobs in submission order.
        row_group: int [N]; the prompt group of each row (-1 if skipped).
        prompts, completions: the N rows as int lists (``validate_rows``).
        skipped: bool [N]; True for a row too long for the context, skipped.
        include_prompt: the prompts' logprobs are asked for too.
    """

    jobs: list[_Job]
    row_group: list[int]
    prompts: list[list[int]]
    completions: list[list[int]]
    skipped: list[bool]
    include_prompt: bool


def validate_rows(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    skip_too_long: bool = False,
) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """Check every row before any work; return the rows as int lists and which rows to skip.

    Args:
        model: the model; its input-embedding size is the vocabulary, its ``max_position_embeddings``
            the context length.
        prompts: N prompts, each a non-empty sequence of token ids.
        completions: N completions, each a (possibly empty) sequence of token ids.
        skip_too_long: mark rows longer than the context as skipped instead of raising.

    Returns:
        (prompts, completions, skipped): the rows as lists of ints, and bool [N], True for a row
        that is too long and skipped.

    Raises:
        ValueError: prompts and completions differ in length, a prompt is empty, a row is not a
            sequence of integer ids, an id lies outside the vocabulary, or (without ``skip_too_long``)
            len(prompt) + len(completion) exceeds the model's context. The message names the row.
    """
    for name, rows in (("prompts", prompts), ("completions", completions)):
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
            raise ValueError(f"{name} must be a list of token-id lists, got {type(rows).__name__}")
    if len(prompts) != len(completions):
        raise ValueError(
            f"prompts and completions must have the same length, got {len(prompts)} prompts and "
            f"{len(completions)} completions"
        )
    vocab = vocab_size(model)
    context = model_context_length(model)
    out_prompts: list[list[int]] = []
    out_completions: list[list[int]] = []
    skipped: list[bool] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt = token_ids(p, f"prompts[{i}]", vocab, allow_empty=True)
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty; every row needs at least one prompt token")
        completion = token_ids(c, f"completions[{i}]", vocab, allow_empty=True)
        too_long = context is not None and len(prompt) + len(completion) > context
        if too_long and not skip_too_long:
            raise ValueError(
                f"row {i} has {len(prompt)} prompt + {len(completion)} completion tokens, more than the model's "
                f"context of {context} tokens (max_position_embeddings); shorten it or pass skip_too_long=True"
            )
        out_prompts.append(prompt)
        out_completions.append(completion)
        skipped.append(too_long)
    return out_prompts, out_completions, skipped


def _plan_jobs(
    prompts: list[list[int]], completions: list[list[int]], skipped: list[bool], include_prompt: bool
) -> _Plan:
    """Group rows by prompt (in order of first appearance) and make one job per distinct row.

    The jobs of one prompt follow each other, so the later ones find the prompt's blocks in the
    prefix cache. With ``include_prompt`` the first job of a prompt scores from position 1 and
    the other rows of the prompt copy its prompt logprobs; a prompt whose completions are all
    empty gets one prompt-only job for them.

    Returns:
        The plan: the jobs in submission order and the prompt group of each row, with the rows.
    """
    groups: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}
    row_group = [-1] * len(prompts)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if not skipped[i]:
            by_completion = groups.setdefault(tuple(p), {})
            by_completion.setdefault(tuple(c), []).append(i)
    jobs: list[_Job] = []
    for g, (prompt, by_completion) in enumerate(groups.items()):
        n = len(prompt)
        group_jobs: list[_Job] = []
        for completion, rows in by_completion.items():
            for row in rows:
                row_group[row] = g
            if completion:
                group_jobs.append(_Job(f"score_{rows[0]}", list(prompt + completion), n, n, rows, g))
        if include_prompt and n > 1:
            if group_jobs:
                group_jobs[0].score_from = 1
            else:
                rows = by_completion[()]
                group_jobs.append(_Job(f"score_{rows[0]}", list(prompt), n, 1, [], g))
        jobs.extend(group_jobs)
    return _Plan(jobs, row_group, prompts, completions, skipped, include_prompt)


def _cache_tokens_hint(jobs: list[_Job], max_batch_tokens: int, block_size: int) -> int:
    """Tokens the KV cache is sized for: the whole input, or at most a few steps' worth of rows.

    Scoring requests hold blocks only while they are computed, plus the prompts kept in the prefix
    cache for the next rows of their group, so the cache need not hold the dataset: 8 step budgets
    plus 4 longest rows plus 64 blocks of per-request rounding is plenty.
    """
    total = sum(len(j.tokens) + block_size for j in jobs)
    longest = max((len(j.tokens) for j in jobs), default=0)
    window = 8 * max_batch_tokens + 4 * longest + 64 * block_size
    return max(1, min(total, window))


def score_with_engine(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    include_prompt: bool = False,
    temperature: float = 1.0,
    skip_too_long: bool = False,
    progress_bar: bool = False,
) -> list[ScoreOutput]:
    """Score rows on an existing engine, whose prefix cache and ``stats`` then show the work done.

    Same arguments, results and errors as ``score`` (the engine's own configuration replaces
    ``batch_tokens`` and ``continuous_batching_config``), tensor parallelism included. The engine must
    hold no unfinished request; it is stepped until the rows are done and is left open.

    Raises:
        ValueError: see ``score``.
        RuntimeError: the engine is closed or has unfinished requests.
    """
    check_number("temperature", temperature, minimum=0, min_open=True)
    rows_p, rows_c, skipped = validate_rows(engine.model, prompts, completions, skip_too_long)
    if engine.closed:
        raise RuntimeError("the engine is closed")
    if engine.has_unfinished():
        raise RuntimeError("score_with_engine needs an engine with no unfinished requests")
    plan = _plan_jobs(rows_p, rows_c, skipped, include_prompt)
    return _run_on_ranks(engine, plan, temperature, progress_bar)


def _run_on_ranks(engine: Engine, plan: _Plan, temperature: float, progress_bar: bool) -> list[ScoreOutput]:
    """``_run`` on every rank of a tensor-parallel engine with the driver's plan; [] except on the driver."""
    plan = engine.from_driver(plan)
    driver = engine.is_driver
    results = _run(engine, plan, float(temperature), progress_bar and driver)
    return results if driver else []


def _run(engine: Engine | None, plan: _Plan, temperature: float, progress_bar: bool) -> list[ScoreOutput]:
    """Queue the plan's jobs in a bounded window, step the engine until all are done, assemble the results."""
    jobs, row_group, completions, skipped = plan.jobs, plan.row_group, plan.completions, plan.skipped
    params = SamplingParams(max_new_tokens=1)
    if jobs:
        assert engine is not None
        for job in jobs:  # every job fits the cache, checked before any is queued
            try:
                engine.gate.check(job.request_id, len(job.tokens), params, scoring=True)
            except ValueError as e:
                raise ValueError(f"row {job.request_id.removeprefix('score_')}: {e}") from e

    n = len(plan.prompts)
    results: list[ScoreOutput | None] = [None] * n
    for i in range(n):
        if skipped[i] or not completions[i]:
            results[i] = ScoreOutput(prompt_logprobs=[] if plan.include_prompt else None, skipped=skipped[i])
    group_prompt_lp: dict[int, list[float]] = {}

    bar = tqdm(total=n, desc="score", unit="row", disable=not progress_bar)
    bar.update(sum(r is not None for r in results))
    in_flight: dict[str, _Job] = {}
    next_job = 0
    try:
        if jobs:
            assert engine is not None
            t0 = time.perf_counter()
            computed0 = engine.stats.num_tokens_computed
            while next_job < len(jobs) or in_flight:
                while next_job < len(jobs) and len(in_flight) < MAX_IN_FLIGHT:
                    job = jobs[next_job]
                    engine.enqueue(Request(job.request_id, job.tokens, params, False, job.score_from, temperature))
                    in_flight[job.request_id] = job
                    next_job += 1
                if not engine.has_unfinished():
                    raise RuntimeError(f"the engine stopped with {len(in_flight)} scoring requests unanswered")
                for req in engine.step():
                    job = in_flight.pop(req.request_id, None)
                    if job is None:
                        continue
                    if req.status != RequestStatus.FINISHED:
                        raise RuntimeError(f"scoring request of row {job.rows[0]} ended {req.status.name}: {req.error}")
                    prompt_lp, completion_lp = _split_logprobs(job, req)
                    if job.score_from == 1:
                        group_prompt_lp[job.group] = prompt_lp
                    for row in job.rows:
                        results[row] = ScoreOutput(
                            completion_logprobs=list(completion_lp),
                            logprob_sum=math.fsum(completion_lp),
                            num_tokens=len(completion_lp),
                        )
                    bar.update(len(job.rows))
                if progress_bar:
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    tok_s = (engine.stats.num_tokens_computed - computed0) / elapsed
                    bar.set_postfix(tok_s=f"{tok_s:.0f}", refresh=False)
    finally:
        bar.close()
        if engine is not None:
            for rid in in_flight:  # an error left requests behind: take them out of the engine
                engine.finish_request(rid, RequestStatus.CANCELLED)
    if plan.include_prompt:
        for i, result in enumerate(results):
            if not skipped[i]:
                result.prompt_logprobs = list(group_prompt_lp.get(row_group[i], []))  # type: ignore[union-attr]
    return results  # type: ignore[return-value]


def _split_logprobs(job: _Job, req: Request) -> tuple[list[float], list[float]]:
    """A finished job's logprobs split into (prompt tokens 1..end or [], completion tokens)."""
    expected = len(job.tokens) - job.score_from
    lp = req.prompt_logprobs
    if len(lp) != expected:
        raise RuntimeError(
            f"row {job.rows[0] if job.rows else job.request_id}: the engine returned {len(lp)} "
            f"logprobs, expected {expected}"
        )
    lp = list(lp)
    num_prompt_scored = job.prompt_len - job.score_from
    return lp[:num_prompt_scored], lp[num_prompt_scored:]


def score(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    batch_tokens: int | None = None,
    include_prompt: bool = False,
    temperature: float = 1.0,
    skip_too_long: bool = False,
    progress_bar: bool = False,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
) -> list[ScoreOutput]:
    """Per-token logprobs of ``completions`` given ``prompts``, computed through the paged engine.

    Row i is the sequence ``prompts[i] + completions[i]``; each completion token is scored with
    ``log_softmax(logits / temperature)`` (fp32) at the position before it, as one teacher-forced
    forward of the row would. Rows are packed into the engine's token budget without padding, rows
    longer than the budget are chunked, and the completions of one prompt share the prompt's cached
    KV blocks (rows are submitted grouped by prompt, whatever their input order).

    Args:
        model: a ``transformers`` decoder-only causal LM (see ``Engine``); its attention
            implementation is restored when this returns or raises.
        prompts: N prompts, each a non-empty list of token ids in [0, vocab_size).
        completions: N completions, each a list of token ids (may be empty).
        batch_tokens: token budget of one engine step (``max_batch_tokens``, >= 1); None keeps the
            config's (512 on CPU, 2048 on CUDA by default).
        include_prompt: also return the logprobs of prompt tokens 1..end.
        temperature: logits are divided by this before the log-softmax (finite, > 0).
        skip_too_long: a row longer than the model's context (``max_position_embeddings``) gets a
            ``ScoreOutput`` with ``skipped=True`` instead of raising.
        progress_bar: show a tqdm bar of scored rows and computed tokens/s.
        continuous_batching_config: engine configuration (block size, cache size, prefix caching),
            rollout's or a ``transformers.ContinuousBatchingConfig`` (converted). When its
            ``num_blocks`` is None the cache is sized for a few steps of rows, not for the whole input.

    Tensor parallelism: on a model loaded with a ``tp_plan`` under ``torchrun`` every rank calls this
    with the same rows; every rank computes the driver's rows, and only the driver (TP rank 0) returns
    their scores (an empty list elsewhere, the rule of ``generate_batch``).

    Returns:
        N ``ScoreOutput`` in input order: ``completion_logprobs`` float [len(completions[i])] in nats,
        ``prompt_logprobs`` float [len(prompts[i]) - 1] or None, ``logprob_sum``, ``num_tokens``. An
        empty list on a tensor-parallel rank other than the driver.

    Raises:
        ValueError: prompts and completions differ in length; an empty prompt; a token id outside
            the vocabulary; a row longer than the model's context (without ``skip_too_long``); a row
            that can never fit the KV cache; batch_tokens or temperature out of range. Every row is
            checked before any forward, and the message names the row index.
        UnsupportedModelError: the model cannot run on the paged engine.
    """
    check_int("batch_tokens", batch_tokens, minimum=1, allow_none=True)
    check_number("temperature", temperature, minimum=0, min_open=True)
    rows_p, rows_c, skipped = validate_rows(model, prompts, completions, skip_too_long)
    config = resolve_continuous_batching_config(continuous_batching_config)
    if batch_tokens is not None:
        config = dataclasses.replace(config, max_batch_tokens=batch_tokens)
    plan = _plan_jobs(rows_p, rows_c, skipped, include_prompt)
    if not plan.jobs:  # empty completions and skipped rows only: no forward needed
        if not is_driver_rank(model):
            return []
        return _run(None, plan, float(temperature), progress_bar)
    device_type = next(model.parameters()).device.type
    hint = _cache_tokens_hint(
        plan.jobs, config.resolved_max_batch_tokens(device_type), config.resolved_page_size(device_type)
    )
    engine = Engine(model, config, max_tokens_hint=hint)
    try:
        return _run_on_ranks(engine, plan, temperature, progress_bar)
    finally:
        engine.close()
