"""GRPO with TRL's ``GRPOTrainer``, generating with rollout's manager (``trainers.trl_plugin``).

The policy is SmolLM2-135M-Instruct (``rollout.load_model()``); the data the default task of the main
job (``trainers.tasks``: generated arithmetic word problems) and its held-out split; the reward
``trainers.rewards.correctness_reward``. Each step samples ``--prompts_per_step`` prompts x
``--num_generations`` completions on the manager, which runs on the policy model itself; TRL applies
its importance-sampling correction to the manager's logprobs and logs ``sampling/*``. Runs on CPU
(bf16 off, gradient checkpointing off); on a GPU machine the Trainer places the model on the GPU and
the manager follows it.

Before and after training it measures the held-out accuracy exactly as the main job does
(``trainers.evaluate``: greedy, the last number of the completion against the answer). At the end it
prints one JSON line (accuracy before/after, timings, the manager's statistics), writes it to
``OUTPUT_DIR/trl_report.json``, and saves the trained model to ``--output_dir`` (default
``$ROLLOUT_HOME/runs/grpo-trl``).

Example:
    python scripts/train_grpo_trl.py --max_steps 3 --output_dir /tmp/grpo-trl
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

from trl import GRPOConfig

import rollout
from rollout import ContinuousBatchingConfig
from trainers.evaluate import evaluate_model
from trainers.grpo import source_commit
from trainers.rewards import correctness_reward
from trainers.tasks import build_datasets
from trainers.trl_plugin import RolloutGRPOTrainer

logger = logging.getLogger("train_grpo_trl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="rollout.load_model name or local folder")
    p.add_argument("--output_dir", default=None, help="default: $ROLLOUT_HOME/runs/grpo-trl")
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--num_prompts", type=int, default=2000, help="size of the arithmetic training set")
    p.add_argument("--eval_size", type=int, default=200, help="held-out problems (0: no evaluation)")
    p.add_argument("--prompts_per_step", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=4, help="G completions per prompt")
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--block_size", type=int, default=None, help="KV block size (default: rollout's per device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_save", action="store_true", help="do not save the trained model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    output_dir = Path(args.output_dir) if args.output_dir else rollout.rollout_home() / "runs" / "grpo-trl"
    t0 = time.perf_counter()
    model, tokenizer = rollout.load_model(args.model)
    load_s = time.perf_counter() - t0
    dataset, heldout = build_datasets("arithmetic", size=args.num_prompts, seed=args.seed, eval_size=args.eval_size)

    def held_out_accuracy() -> dict:
        if heldout is None:
            return {}
        result = evaluate_model(model, tokenizer, heldout, max_new_tokens=96)
        logger.info("held-out accuracy %.3f, completions of %.1f tokens", result.accuracy, result.completion_len_mean)
        return {"eval_accuracy": result.accuracy, "eval_completion_len": result.completion_len_mean}

    before = held_out_accuracy()
    batch = args.prompts_per_step * args.num_generations
    # Size the KV cache for one generation batch instead of a share of free memory.
    block_size = args.block_size or 32
    longest_prompt = max(
        len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for row in dataset
    )
    blocks_per_sequence = math.ceil((longest_prompt + args.max_completion_length) / block_size)
    cb_config = ContinuousBatchingConfig(page_size=block_size, num_blocks=batch * blocks_per_sequence + 4)

    config = GRPOConfig(
        output_dir=str(output_dir),
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
    after = held_out_accuracy()
    if not args.no_save:
        trainer.save_model(str(output_dir))

    logs = [e for e in trainer.state.log_history if "step_time" in e]
    summary = trainer.rollout_summary or {}
    gen_s = summary.get("generation_seconds", 0.0)
    report = {
        "commit": source_commit(),
        "model": args.model,
        "steps": trainer.state.global_step,
        "completions_per_step": batch,
        "eval_before": before,
        "eval_after": after,
        "load_s": round(load_s, 2),
        "train_s": round(train_s, 2),
        "step_time_s": [round(e["step_time"], 2) for e in logs],
        "generation_s": round(gen_s, 2),
        "generated_tokens": summary.get("num_generated_tokens"),
        "generated_tokens_per_s": round(summary.get("num_generated_tokens", 0) / gen_s, 1) if gen_s else None,
        "prefix_cache_hit_blocks": summary.get("prefix_cache_hit_blocks"),
        "num_forks": summary.get("num_forks"),
        "weight_version": summary.get("weight_version"),
        "reward": [round(e["reward"], 3) for e in logs],
        "importance_sampling_ratio_mean": [round(e["sampling/importance_sampling_ratio/mean"], 5) for e in logs],
        "sampling_logp_difference_max": [e["sampling/sampling_logp_difference/max"] for e in logs],
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "trl_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
