"""Benchmark of logprob scoring: rollout's engine against padded ``model(...)`` forwards.

Workload: GSM8K (question, answer) pairs. Each question becomes one chat prompt (the model's chat
template of a user message, assistant turn opened) with ``completions_per_question`` completions:

1. the reference answer;
2. the answer truncated to its first half (cut at a word boundary);
3. the answer with a different final number (``#### N`` becomes ``#### N+1``);
4. the final line alone ("#### N"), i.e. the answer without its reasoning.

Systems, on the same model object and the same token ids:

- ``rollout``: ``rollout.scoring.offline.score_with_engine``: prefill-only requests packed into the step's
  token budget (no padding), the completions of a question sharing its prompt's cached KV blocks,
  only the scored positions through the LM head.
- ``padded``: what a trainer does without an engine: batches of ``padded_batch_size`` rows in input
  order, right padding with an attention mask, one ``model(input_ids, attention_mask, logits_to_keep)``
  forward per batch (LM head only from the shortest prompt's end on, as TRL keeps only completion
  logits), then ``log_softmax`` (fp32) and ``gather`` at the completion positions.

Throughput is counted in *row tokens* (prompt + completion tokens of the rows, padding and prefix
reuse excluded: the work the user asked for) per wall second; completion (scored) tokens per second
are reported too. Each system runs once untimed on a few rows first (warmup), then ``repeats`` timed
runs, interleaved; the fastest run counts (the machine may be shared). The two systems' logprobs must
agree within ``atol`` (1e-4, fp32), the padded forward computed again (untimed) on the engine's linear
kernel (oneDNN on CPU); the difference to the timed (MKL) padded forward is reported too.

Example (``python scripts/bench_scoring.py`` takes the same arguments):
    rollout-bench-scoring --gsm8k /work/shared/data/gsm8k/train.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.arguments import DEFAULT_BATCH_TOKENS, DEFAULT_PADDED_BATCH_SIZE, scoring_parser
from benchmarks.workloads import SAMPLE_QUESTIONS
from rollout import ContinuousBatchingConfig, load_model, score_with_engine
from rollout.engine import Engine
from rollout.engine.worker.onednn import OneDNNLinear, PackedWeights, linear_plan, packed_kernel, sibling_groups
from trainers.prompts import encode_prompt

ATOL = 1e-4

_FINAL = re.compile(r"####\s*(-?[\d,\.]+)\s*$")


# ----------------------------------------------------------------------------------------------- workload


def load_pairs(path: str | Path | None, num_questions: int) -> tuple[list[tuple[str, str]], Path]:
    """The first ``num_questions`` (question, answer) pairs of a GSM8K-style jsonl.

    Args:
        path: the jsonl; None means the project's sample file ``rollout/data/sample_questions.jsonl``.
        num_questions: pairs to read (>= 1).

    Returns:
        The pairs and the path read.

    Raises:
        FileNotFoundError: no path was given and the sample file is missing, or the path does not exist.
        ValueError: the file holds fewer than ``num_questions`` pairs.
    """
    source = Path(path) if path is not None else SAMPLE_QUESTIONS
    if not source.is_file():
        raise FileNotFoundError(f"questions file {source} not found; pass a GSM8K jsonl (question, answer)")
    pairs = []
    with source.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                pairs.append((row["question"], row["answer"]))
                if len(pairs) == num_questions:
                    return pairs, source
    raise ValueError(f"{source} holds {len(pairs)} questions, fewer than the {num_questions} asked for")


def answer_variants(answer: str, count: int = 4) -> list[str]:
    """``count`` (1-4) distinct completions derived from a GSM8K answer (see the module docstring)."""
    answer = answer.strip()
    match = _FINAL.search(answer)
    final = match.group(1).replace(",", "") if match else "0"
    try:
        wrong = str(int(float(final)) + 1)
    except ValueError:
        wrong = final + "1"
    half = answer[: max(1, len(answer) // 2)]
    half = half.rsplit(" ", 1)[0] if " " in half else half
    changed = _FINAL.sub(f"#### {wrong}", answer) if match else f"{answer}\n#### {wrong}"
    variants = [answer, half, changed, f"#### {final}"][:count]
    for i in range(1, len(variants)):  # keep them distinct: identical rows would be scored once
        while variants[i] in variants[:i]:
            variants[i] += " ."
    return variants


def build_rows(
    tokenizer, pairs: Sequence[tuple[str, str]], completions_per_question: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the workload: the chat prompt of each question, repeated for each of its completions.

    Returns:
        (prompts, completions): N = len(pairs) * completions_per_question rows, the completions of one
        question next to each other.
    """
    prompts, completions = [], []
    for question, answer in pairs:
        prompt = encode_prompt(tokenizer, [{"role": "user", "content": question}])
        for variant in answer_variants(answer, completions_per_question):
            prompts.append(list(prompt))
            completions.append(tokenizer(variant, add_special_tokens=False)["input_ids"])
    return prompts, completions


# ----------------------------------------------------------------------------------------------- systems


@torch.inference_mode()
def padded_logprobs(
    model,
    prompts: Sequence[list[int]],
    completions: Sequence[list[int]],
    batch_size: int = DEFAULT_PADDED_BATCH_SIZE,
    pad_token_id: int = 0,
) -> tuple[list[list[float]], int]:
    """Completion logprobs from right-padded batched forwards (the baseline).

    Args:
        model: a causal LM.
        prompts, completions: N rows of token ids.
        batch_size: rows per forward, taken in input order.
        pad_token_id: id written in the padding (masked out).

    Returns:
        (logprobs, padded_tokens): float lists [len(completions[i])] per row, and the number of
        token positions the forwards computed, padding included.
    """
    device = next(model.parameters()).device
    out: list[list[float]] = []
    padded_tokens = 0
    for start in range(0, len(prompts), batch_size):
        rows = [p + c for p, c in zip(prompts[start : start + batch_size], completions[start : start + batch_size])]
        width = max(len(r) for r in rows)
        padded_tokens += width * len(rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r)
            mask[b, : len(r)] = 1
        # Only positions from the shortest prompt's last token on can predict a completion token:
        # keep those logits alone (what TRL does with logits_to_keep), K = width - first.
        first = min(len(p) for p in prompts[start : start + batch_size]) - 1
        keep = torch.arange(first, width - 1, device=device)
        logits = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=keep
        ).logits  # [B, K, V]
        b_idx, pos, targets, counts = [], [], [], []
        for b, (p, c) in enumerate(zip(prompts[start : start + batch_size], completions[start : start + batch_size])):
            b_idx += [b] * len(c)
            pos += range(len(p) - 1 - first, len(p) + len(c) - 1 - first)  # position t predicts token t + 1
            targets += c
            counts.append(len(c))
        selected = logits[torch.tensor(b_idx, device=device), torch.tensor(pos, device=device)].float()  # [N, V]
        lp = torch.log_softmax(selected, dim=-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].tolist()
        i = 0
        for n in counts:
            out.append(lp[i : i + n])
            i += n
    return out, padded_tokens


def rollout_logprobs(
    model, prompts: Sequence[list[int]], completions: Sequence[list[int]], batch_tokens: int
) -> tuple[list[list[float]], dict]:
    """Completion logprobs through rollout's engine; also the engine's counters."""
    total = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    engine = Engine(model, ContinuousBatchingConfig(max_batch_tokens=batch_tokens), max_tokens_hint=total)
    try:
        results = score_with_engine(engine, prompts, completions)
    finally:
        engine.close()
    stats = {"num_steps": engine.stats.num_steps, "tokens_computed": engine.stats.num_tokens_computed}
    return [r.completion_logprobs for r in results], stats


def _max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """The largest |a - b| over every position of every row (0.0 for no positions)."""
    return max((abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y)), default=0.0)


def _timed(fn):
    """(wall seconds, process CPU seconds over all threads, fn's result)."""
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, time.process_time() - c0, result


# ----------------------------------------------------------------------------------------------- bench


def bench_scoring(
    model,
    tokenizer,
    gsm8k_path: str | Path | None = None,
    num_questions: int = 16,
    completions_per_question: int = 4,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    padded_batch_size: int = DEFAULT_PADDED_BATCH_SIZE,
    repeats: int = 1,
    atol: float = ATOL,
) -> dict:
    """Measure scoring throughput of rollout against padded batched forwards on GSM8K pairs.

    Args:
        model: a causal LM (fp32 for the 1e-4 agreement check).
        tokenizer: its tokenizer, with a chat template.
        gsm8k_path: GSM8K jsonl (question, answer); None uses ``rollout/data/sample_questions.jsonl``.
        num_questions: questions (prompts) in the workload.
        completions_per_question: completions per question (1-4; see ``answer_variants``).
        batch_tokens: rollout's token budget per step (``max_batch_tokens``).
        padded_batch_size: rows per padded forward.
        repeats: timed runs of each system (interleaved); the fastest counts.
        atol: largest allowed |rollout - padded| logprob difference.

    Returns:
        A JSON-able dict: ``rollout_tokens_per_s``, ``padded_tokens_per_s`` (row tokens / s),
        ``ratio`` (rollout / padded), the same for completion tokens, wall seconds (best and all runs),
        process CPU seconds and their ratio (``cpu_time_ratio``, less sensitive to a shared machine), token counts
        (row, completion, padded forward positions, tokens rollout computed), ``max_abs_diff`` (against
        the padded forward on the engine's linear kernels: oneDNN on packed weights or MKL on a float32 CPU model,
        see ``rollout/onednn.py``), ``agree`` (max_abs_diff <= atol) and ``max_abs_diff_across_kernels`` (against
        the timed padded forward, MKL).

    Raises:
        FileNotFoundError, ValueError: see ``load_pairs``; ValueError for completions_per_question
            outside 1-4.
    """
    if not 1 <= completions_per_question <= 4:
        raise ValueError(f"completions_per_question must be in 1..4, got {completions_per_question}")
    pairs, source = load_pairs(gsm8k_path, num_questions)
    prompts, completions = build_rows(tokenizer, pairs, completions_per_question)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    row_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    completion_tokens = sum(len(c) for c in completions)

    warm = min(len(prompts), completions_per_question)
    rollout_logprobs(model, prompts[:warm], completions[:warm], batch_tokens)
    padded_logprobs(model, prompts[:warm], completions[:warm], padded_batch_size, pad_id)
    rollout_s, padded_s, rollout_cpu, padded_cpu = [], [], [], []
    for _ in range(max(1, repeats)):
        t, cpu, (ours, stats) = _timed(lambda: rollout_logprobs(model, prompts, completions, batch_tokens))
        rollout_s.append(t)
        rollout_cpu.append(cpu)
        t, cpu, (theirs, padded_tokens) = _timed(
            lambda: padded_logprobs(model, prompts, completions, padded_batch_size, pad_id)
        )
        padded_s.append(t)
        padded_cpu.append(cpu)
    kernel_diff = _max_abs_diff(ours, theirs)
    # The engine runs its float32 CPU linear layers on packed weights (engine/worker/onednn.py) and the padded
    # forward (as a trainer runs it) on MKL: another summation order, up to ~1e-4 over SmolLM2's 30 layers. The
    # agreement check compares the engine with the padded forward on the engine's kernels (``linear_plan``; untimed),
    # so it tests the engine's batching, attention and prefix reuse; the difference against MKL is reported beside it.
    onednn, pack = linear_plan(model, model.device)
    if onednn:
        packs = PackedWeights(sibling_groups(model), kernel=packed_kernel()) if pack else None
        with OneDNNLinear(), packs.active() if packs is not None else contextlib.nullcontext():
            theirs, _ = padded_logprobs(model, prompts, completions, padded_batch_size, pad_id)
    diff = _max_abs_diff(ours, theirs)
    best_r, best_p = min(rollout_s), min(padded_s)
    return {
        "source": str(source),
        "num_questions": len(pairs),
        "num_rows": len(prompts),
        "batch_tokens": batch_tokens,
        "padded_batch_size": padded_batch_size,
        "row_tokens": row_tokens,
        "completion_tokens": completion_tokens,
        "padded_forward_tokens": padded_tokens,
        "rollout_tokens_computed": stats["tokens_computed"],
        "rollout_steps": stats["num_steps"],
        "rollout_s": best_r,
        "padded_s": best_p,
        "rollout_s_all": rollout_s,
        "padded_s_all": padded_s,
        "rollout_cpu_s": min(rollout_cpu),
        "padded_cpu_s": min(padded_cpu),
        "cpu_time_ratio": min(padded_cpu) / min(rollout_cpu),
        "rollout_tokens_per_s": row_tokens / best_r,
        "padded_tokens_per_s": row_tokens / best_p,
        "ratio": best_p / best_r,
        "rollout_completion_tokens_per_s": completion_tokens / best_r,
        "padded_completion_tokens_per_s": completion_tokens / best_p,
        "max_abs_diff": diff,
        "agree": diff <= atol,
        "max_abs_diff_across_kernels": kernel_diff,
        "threads": torch.get_num_threads(),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``rollout-bench-scoring``'s flags (``arguments.scoring_parser``)."""
    return scoring_parser().parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Run ``bench_scoring`` on a model and print (and optionally save) the report; return it."""
    model, tokenizer = load_model(args.model, device=args.device)
    report = bench_scoring(
        model,
        tokenizer,
        args.gsm8k,
        num_questions=args.num_questions,
        completions_per_question=args.completions_per_question,
        batch_tokens=args.batch_tokens,
        padded_batch_size=args.padded_batch_size,
        repeats=args.repeats,
    )
    report["model"] = args.model
    print(
        f"{report['num_rows']} rows ({report['num_questions']} questions), {report['row_tokens']} row tokens, "
        f"{report['completion_tokens']} completion tokens\n"
        f"  rollout: {report['rollout_tokens_per_s']:8.1f} tokens/s  ({report['rollout_s']:.2f} s, "
        f"{report['rollout_tokens_computed']} tokens computed, {report['rollout_steps']} steps)\n"
        f"  padded:  {report['padded_tokens_per_s']:8.1f} tokens/s  ({report['padded_s']:.2f} s, "
        f"{report['padded_forward_tokens']} positions incl. padding)\n"
        f"  ratio rollout/padded: {report['ratio']:.2f}x (CPU time: {report['cpu_time_ratio']:.2f}x)   "
        f"max |diff| {report['max_abs_diff']:.2e} "
        f"({'agree' if report['agree'] else 'DISAGREE'} within {ATOL}; "
        f"{report['max_abs_diff_across_kernels']:.2e} against the padded forward on MKL)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark from this module (see its docstring); 0 when it ran. The console script is
    ``cli.bench_scoring_main``, which parses the flags before importing this module."""
    run(parse_args(argv))
    return 0
