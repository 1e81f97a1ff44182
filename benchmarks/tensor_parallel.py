"""Tensor-parallel generation throughput: ``generate_batch`` in one process (tp=1) or on every rank of a
``torchrun`` launch (tp=N, the model loaded with ``tp_plan="auto"``).

The workload is gsm8k-greedy's (chat-templated questions of the project's sample file, or of
``--gsm8k``), greedy, ``--max-new-tokens`` each; with ``--random-prompts``, prompts of the same lengths
(60 to 148 tokens) of seeded random ids, and no end-of-sequence token, for a model saved without a
tokenizer. After a short warmup call, one timed ``generate_batch`` over all prompts; the driver (rank 0)
prints and writes the JSON: generated tokens, wall seconds, tokens/s, the TP size, torch threads per
process, the machine's load average before and after (the numbers of a shared machine mean little
without it), and a sha256 of the generated tokens, so that runs with different TP sizes can be checked
to generate the same greedy tokens.

SmolLM2-135M has 9 attention heads and 3 KV heads: it shards over 3 ranks, not 2. ``--make-random-model
DIR`` saves a Llama of SmolLM2's size (576 hidden, 30 layers, 49,152 tokens) with 8 heads and 4 KV heads
and random weights, which shards over 2 or 4.

Usage (``python scripts/bench_tp.py`` takes the same arguments):
    python scripts/bench_tp.py --make-random-model /tmp/llama-135m-kv4
    python scripts/bench_tp.py --model /tmp/llama-135m-kv4 --random-prompts --threads 2 --json tp1.json
    torchrun --nproc_per_node 2 scripts/bench_tp.py --tp --model /tmp/llama-135m-kv4 --random-prompts \
        --threads 1 --json tp2.json
    torchrun --nproc_per_node 3 scripts/bench_tp.py --tp --threads 1 --json smollm2_tp3.json
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
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

import rollout
from benchmarks.report import machine_info
from benchmarks.workloads import SAMPLE_QUESTIONS, WORKLOADS, load_questions, select_questions
from trainers.prompts import encode_prompt


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
    p.add_argument("--random-prompts", action="store_true", help="seeded random prompts, no end-of-sequence token")
    p.add_argument(
        "--make-random-model", type=Path, default=None, metavar="DIR", help="save the random 4-KV-head Llama and exit"
    )
    p.add_argument("--json", type=Path, default=None, dest="json_path", metavar="OUT")
    args = p.parse_args(argv)
    if args.tp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        p.error(
            "--tp shards the model over the processes of a torchrun launch: run it under torchrun --nproc_per_node N"
        )
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.threads < 0:
        p.error("--num-prompts and --max-new-tokens must be >= 1, --threads >= 0")
    return args


def save_random_model(path: Path) -> None:
    """Save a Llama of SmolLM2-135M's size with 8 heads and 4 KV heads (head dim 72), random weights (seed 0)."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=72,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    print(f"saved a random Llama (8 heads, 4 KV heads, {config.num_hidden_layers} layers) to {path}")


def random_prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of 60 to 148 seeded random ids in [3, vocab) (gsm8k-greedy's prompt lengths)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(60, 149, (num,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def run(args: argparse.Namespace) -> dict | None:
    """Load, warm up, time one ``generate_batch``; the result on the driver (printed, written), None elsewhere."""
    if args.threads:
        torch.set_num_threads(args.threads)
    tp_plan = "auto" if args.tp else None
    start = None
    if args.random_prompts:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, tp_plan=tp_plan).eval()
        prompts = random_prompts(args.num_prompts, model.get_input_embeddings().num_embeddings)
        sampling = {"do_sample": False, "eos_token_id": []}  # every request generates max_new_tokens
    else:
        model, tokenizer = rollout.load_model(args.model, tp_plan=tp_plan)
        source = args.gsm8k or SAMPLE_QUESTIONS
        questions, start = select_questions(load_questions(source), WORKLOADS["gsm8k-greedy"].start, args.num_prompts)
        prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q}]) for q in questions]
        sampling = {"do_sample": False}
    cfg = rollout.ContinuousBatchingConfig(num_blocks=1024)
    rollout.generate_batch(model, prompts[:2], GenerationConfig(max_new_tokens=4, **sampling), cfg)  # warmup
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    outputs = rollout.generate_batch(
        model, prompts, GenerationConfig(max_new_tokens=args.max_new_tokens, **sampling), cfg
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
        "random_prompts": args.random_prompts,
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
    if args.make_random_model is not None:
        save_random_model(args.make_random_model)
        return 0
    try:
        run(args)
    finally:
        if dist.is_initialized():  # an orderly end: gloo aborts a process that exits with open groups
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
