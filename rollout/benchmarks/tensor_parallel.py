"""Tensor-parallel generation throughput: ``generate_batch`` in one process (tp=1) or on every rank of a
``torchrun`` launch (tp=N, the model loaded with ``tp_plan="auto"``).

The workload is gsm8k-greedy's (chat-templated questions of the project's sample file, or of
``--gsm8k``), greedy, ``--max-new-tokens`` each. After a short warmup call, one timed
``generate_batch`` over all prompts; the driver (rank 0) prints and writes the JSON: generated tokens,
wall seconds, tokens/s, the TP size, torch threads per process, the machine's load average before and
after (the numbers of a shared machine mean little without it), and a sha256 of the generated tokens,
so that runs with different TP sizes can be checked to generate the same greedy tokens.

Usage (``python scripts/bench_tp.py`` takes the same arguments):
    python -m rollout.benchmarks.tensor_parallel --threads 2 --json bench_results/tp1.json
    torchrun --nproc_per_node 2 -m rollout.benchmarks.tensor_parallel --tp --threads 1 --json bench_results/tp2.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GenerationConfig

import rollout
from trainers.prompts import encode_prompt

from .report import machine_info
from .workloads import SAMPLE_QUESTIONS, WORKLOADS, load_questions, select_questions


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local folder (default: %(default)s)")
    p.add_argument("--gsm8k", type=Path, default=None, help="questions jsonl (default: the project's sample file)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--tp",
        action="store_true",
        help="load the model with tp_plan='auto' over the processes of the torchrun launch (WORLD_SIZE > 1)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    p.add_argument("--json", type=Path, default=None, dest="json_path", metavar="OUT")
    args = p.parse_args(argv)
    if args.tp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        p.error(
            "--tp shards the model over the processes of a torchrun launch: run it under torchrun --nproc_per_node N"
        )
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.threads < 0:
        p.error("--num-prompts and --max-new-tokens must be >= 1, --threads >= 0")
    return args


def run(args: argparse.Namespace) -> dict | None:
    """Load, warm up, time one ``generate_batch``; the result on the driver (printed, written), None elsewhere."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = rollout.load_model(args.model, tp_plan="auto" if args.tp else None)
    workload = WORKLOADS["gsm8k-greedy"]
    source = args.gsm8k or SAMPLE_QUESTIONS
    questions, start = select_questions(load_questions(source), workload.start, args.num_prompts)
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    cfg = rollout.ContinuousBatchingConfig(num_blocks=1024)
    rollout.generate_batch(model, prompts[:2], GenerationConfig(max_new_tokens=4, do_sample=False), cfg)  # warmup
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    outputs = rollout.generate_batch(
        model, prompts, GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False), cfg
    )
    seconds = time.perf_counter() - t0
    if not outputs:  # a tensor-parallel rank other than the driver
        return None
    tokens = [out.generated_tokens for out in outputs.values()]
    num_tokens = sum(len(t) for t in tokens)
    result = {
        "model": args.model,
        "tp_size": int(os.environ.get("WORLD_SIZE", "1")) if args.tp else 1,
        "threads_per_process": torch.get_num_threads(),
        "prompts": len(prompts),
        "question_start": start,
        "max_new_tokens": args.max_new_tokens,
        "generated_tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": machine_info("cpu"),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if args.json_path:
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); 0 when it ran. Ends the process group of a TP launch."""
    args = parse_args(argv)
    try:
        run(args)
    finally:
        if dist.is_initialized():  # an orderly end: gloo aborts a process that exits with open groups
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
