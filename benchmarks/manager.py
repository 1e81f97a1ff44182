"""Manager benchmark: pause latency and the manager's overhead over ``generate_batch``.

Both run on the same prompts in the same process (the gsm8k-greedy workload of ``rollout-bench``
by default):

- ``generate_batch`` on a fresh engine (the caller's thread steps it);
- the persistent manager: ``add_requests`` then ``get_result`` per request (background thread);
- pause latency: while the manager decodes a batch, another thread asks for ``pause()`` at random
  moments; the time from asking to holding it is reported (median, max) next to the median
  step time, since a pause waits at most for the step in flight.

Usage: ``rollout-bench-manager [--gsm8k PATH] [--num-prompts 32] [--max-new-tokens 96]`` (or
``python scripts/bench_manager.py`` with the same arguments).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig

import rollout
from benchmarks.arguments import manager_parser
from benchmarks.workloads import SAMPLE_QUESTIONS, load_questions, select_questions
from trainers.prompts import encode_prompt


def load_prompts(tokenizer, path: Path, start: int, n: int) -> list[list[int]]:
    """Chat-templated token ids of n questions from a jsonl with a ``question`` field, from index
    ``start`` (from 0 when the file is too short; see ``workloads.select_questions``)."""
    questions, _ = select_questions(load_questions(path), start, n)
    return [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``rollout-bench-manager``'s flags (``arguments.manager_parser``)."""
    return manager_parser().parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Measure, print the result as JSON (and write it to ``--json``), return it."""
    model, tokenizer = rollout.load_model(args.model)
    path = args.gsm8k or SAMPLE_QUESTIONS
    prompts = load_prompts(tokenizer, path, 200 if args.gsm8k else 0, args.num_prompts)
    gc = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)
    cfg = rollout.ContinuousBatchingConfig(num_blocks=2048)

    rollout.generate_batch(model, prompts[:4], GenerationConfig(max_new_tokens=4, do_sample=False), cfg)  # warmup
    t0 = time.perf_counter()
    direct = rollout.generate_batch(model, prompts, gc, cfg)
    t_direct = time.perf_counter() - t0
    n_direct = sum(len(o.generated_tokens) for o in direct.values())

    manager = rollout.init_continuous_batching(model, gc, cfg)
    manager.start()
    t0 = time.perf_counter()
    ids = manager.add_requests(prompts)
    via_manager = [manager.get_result(rid) for rid in ids]
    t_manager = time.perf_counter() - t0
    n_manager = sum(len(o.generated_tokens) for o in via_manager)
    same = [o.generated_tokens for o in direct.values()] == [o.generated_tokens for o in via_manager]

    # Pause latency while a batch decodes.
    long_gc = dict(max_new_tokens=10_000, eos_token_id=[])
    ids = manager.add_requests(prompts, **long_gc)
    time.sleep(2.0)
    steps_before = list(manager.engine.stats.decode_step_seconds)
    latencies = []
    rng = random.Random(0)
    for _ in range(args.pauses):
        time.sleep(rng.uniform(0.0, 0.3))
        t0 = time.perf_counter()
        with manager.pause():
            latencies.append(time.perf_counter() - t0)
    step_times = manager.engine.stats.decode_step_seconds[len(steps_before) :] or steps_before
    for rid in ids:
        manager.cancel_request(rid)
    manager.destroy()

    result = {
        "prompts": len(prompts),
        "generate_batch": {"tokens": n_direct, "seconds": t_direct, "tokens_per_s": n_direct / t_direct},
        "manager": {"tokens": n_manager, "seconds": t_manager, "tokens_per_s": n_manager / t_manager},
        "manager_overhead": t_manager / t_direct - 1.0,
        "same_tokens": same,
        "pause_latency_s": {"median": statistics.median(latencies), "max": max(latencies), "n": len(latencies)},
        "decode_step_s": {"median": statistics.median(step_times), "max": max(step_times)},
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark from this module (see its docstring); 0 when it ran. The console script is
    ``cli.bench_manager_main``, which parses the flags before importing this module."""
    run(parse_args(argv))
    return 0
