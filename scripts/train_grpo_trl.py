#!/usr/bin/env python
"""GRPO with TRL's ``GRPOTrainer``, generating with rollout's manager (``trainers.trl_plugin``).

The policy is SmolLM2-135M-Instruct (``rollout.load_model()``), the data a small arithmetic set built
here (``What is 17 + 25?``, with the answer kept in an ``answer`` column), the reward 1.0 when the
last integer of the completion equals the answer and 0.0 otherwise. Each step samples
``--prompts_per_step`` prompts x ``--num_generations`` completions on the manager, which runs on
the policy model itself; TRL applies its importance-sampling correction to the manager's logprobs
and logs ``sampling/*``. Runs on CPU (bf16 off, gradient checkpointing off); on a GPU machine the
Trainer places the model on the GPU and the manager follows it.

At the end it prints one JSON line with the timings (per optimizer step as TRL measures it, the
manager's generation time, generated tokens/s) and the manager's statistics, and saves the trained
model to ``--output_dir``.

Example:
    python scripts/train_grpo_trl.py --max_steps 3 --output_dir /tmp/grpo-trl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import random
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("rollout") is None or importlib.util.find_spec("trainers") is None:
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without `pip install -e .`

from datasets import Dataset
from trl import GRPOConfig

import rollout
from rollout import ContinuousBatchingConfig
from trainers.trl_plugin import RolloutGRPOTrainer

logger = logging.getLogger("train_grpo_trl")

INSTRUCTION = "Answer with just the number."
_INT = re.compile(r"-?\d+")


def arithmetic_dataset(num_prompts: int, seed: int) -> Dataset:
    """Conversational prompts ``What is a op b? Answer with just the number.`` with their answers.

    Operands are 1..50 for + and -, 2..12 for *; ``answer`` holds the result as a string.
    """
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(num_prompts):
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 50), rng.randint(1, 50))
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompts.append([{"role": "user", "content": f"What is {a} {op} {b}? {INSTRUCTION}"}])
        answers.append(str(result))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last integer equals the answer, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = _INT.findall(text.replace(",", ""))
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="rollout.load_model name or local folder")
    p.add_argument("--output_dir", default="outputs/grpo-trl-smollm2")
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--num_prompts", type=int, default=64, help="size of the arithmetic dataset")
    p.add_argument("--prompts_per_step", type=int, default=2)
    p.add_argument("--num_generations", type=int, default=4, help="G completions per prompt")
    p.add_argument("--max_completion_length", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning_rate", type=float, default=5e-6)
    p.add_argument("--block_size", type=int, default=None, help="KV block size (default: rollout's per device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_save", action="store_true", help="do not save the trained model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    model, tokenizer = rollout.load_model(args.model)
    load_s = time.perf_counter() - t0
    dataset = arithmetic_dataset(args.num_prompts, args.seed)

    batch = args.prompts_per_step * args.num_generations
    # Size the KV cache for one generation batch instead of a share of free memory.
    block_size = args.block_size or 32
    longest_prompt = max(
        len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for row in dataset
    )
    blocks_per_sequence = math.ceil((longest_prompt + args.max_completion_length) / block_size)
    cb_config = ContinuousBatchingConfig(block_size=block_size, num_blocks=batch * blocks_per_sequence + 4)

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=batch,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        seed=args.seed,
    )
    trainer = RolloutGRPOTrainer(
        model=model,
        reward_funcs=correctness_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        continuous_batching_config=cb_config,
    )
    t1 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t1
    if not args.no_save:
        trainer.save_model(args.output_dir)

    logs = [e for e in trainer.state.log_history if "step_time" in e]
    summary = trainer.rollout_summary or {}
    gen_s = summary.get("generation_seconds", 0.0)
    report = {
        "model": args.model,
        "steps": trainer.state.global_step,
        "completions_per_step": batch,
        "load_s": round(load_s, 2),
        "train_s": round(train_s, 2),
        "step_time_s": [round(e["step_time"], 2) for e in logs],
        "generation_s": round(gen_s, 2),
        "generated_tokens": summary.get("num_generated_tokens"),
        "generated_tokens_per_s": round(summary.get("num_generated_tokens", 0) / gen_s, 1) if gen_s else None,
        "prefix_cache_hit_blocks": summary.get("prefix_cache_hit_blocks"),
        "weight_version": summary.get("weight_version"),
        "reward": [round(e["reward"], 3) for e in logs],
        "importance_sampling_ratio_mean": [round(e["sampling/importance_sampling_ratio/mean"], 5) for e in logs],
        "sampling_logp_difference_max": [e["sampling/sampling_logp_difference/max"] for e in logs],
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
