"""Prompt forking: the prompt tokens computed and the wall time of G samples of one prompt.

``python scripts/bench_prompt_fork.py`` (or ``python -m benchmarks.prompt_fork``) queues G
requests with the same prompt on a fresh ``rollout.engine.Engine`` and steps it to the end, for each block
size and for prompt forking on and off (off: the scheduler's ``fork_prompts`` is cleared, so the
samples share only the prompt's full blocks through the prefix cache, as before forking existed).
The model is a randomly initialised Llama built from a config (no download); its size is set by the
arguments, its outputs are meaningless, its cost per token is what is measured.

Reported per (block size, mode): prompt tokens computed (``EngineStats.num_prompt_tokens_computed``),
all tokens computed, steps, forks, copy-on-write block copies, the seconds until every sample has
its first token (the prefill of the group) and until all are done, and whether the greedy outputs
equal those of forking off token for token. Seconds are the minimum over ``--repeats`` runs, of wall
time and of this process's CPU time (``time.process_time``, all threads): on a shared machine the
minimum and the CPU time are the figures that other processes disturb least.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rollout
import rollout.engine


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seed: int) -> LlamaForCausalLM:
    """A random fp32 Llama on CPU in eval mode (``intermediate_size`` 4 x hidden, head_dim hidden / heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaked logits: greedy outputs vary and are not near-ties
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.float32).eval()


def run_group(
    model: LlamaForCausalLM, prompt: Sequence[int], num_samples: int, block_size: int, fork: bool, max_new_tokens: int
) -> dict:
    """One engine, G greedy requests of ``prompt``, stepped to the end; counts, seconds and outputs."""
    num_blocks = num_samples * -(-(len(prompt) + max_new_tokens) // block_size) + 8
    config = rollout.ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=512)
    engine = rollout.engine.Engine(model, config)
    try:
        if not fork:
            engine.scheduler.fork_prompts = False
        params = rollout.SamplingParams(max_new_tokens=max_new_tokens)
        requests = [engine.add_request(prompt, params, request_id=f"s{g}") for g in range(num_samples)]
        t0, c0 = time.perf_counter(), time.process_time()
        first_all = first_all_cpu = None
        while engine.has_unfinished():
            engine.step()
            if first_all is None and all(r.num_generated_tokens > 0 for r in requests):
                first_all, first_all_cpu = time.perf_counter() - t0, time.process_time() - c0
        total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.close()
    stats = engine.stats
    return {
        "prompt_tokens_computed": stats.num_prompt_tokens_computed,
        "tokens_computed": stats.num_tokens_computed,
        "steps": stats.num_steps,
        "forks": getattr(stats, "num_forks", 0),
        "block_copies": getattr(stats, "num_block_copies", 0),
        "first_token_all_s": first_all,
        "first_token_all_cpu_s": first_all_cpu,
        "total_s": total,
        "total_cpu_s": total_cpu,
        "outputs": [r.generated_tokens for r in requests],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one row per (block size, mode); ``--json PATH`` also writes them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=8, help="G, samples of the prompt")
    parser.add_argument("--prompt-len", type=int, default=100, help="prompt tokens")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the minimum seconds are reported")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 (default) is least disturbed by other "
        "processes on a shared machine, 0 keeps torch's default",
    )
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, seed=0)
    prompt = torch.randint(3, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    run_group(model, prompt, 2, args.block_sizes[0], True, 2)  # warm-up: first-call costs out of the rows
    rows = []
    print(
        f"G={args.num_samples}, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens, "
        f"Llama hidden {args.hidden} x {args.layers} layers, {torch.get_num_threads()} threads"
    )
    print(
        f"{'block':>5} {'fork':>4} {'prompt tok':>10} {'all tok':>7} {'steps':>5} {'forks':>5} {'copies':>6} "
        f"{'1st tok s (cpu)':>16} {'total s (cpu)':>16} same-as-off"
    )
    seconds = ("first_token_all_s", "first_token_all_cpu_s", "total_s", "total_cpu_s")
    for block_size in args.block_sizes:
        reference = None
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):  # modes interleaved, so that a busy spell of the machine hits both
            for fork in (False, True):
                runs[fork].append(run_group(model, prompt, args.num_samples, block_size, fork, args.max_new_tokens))
        for fork in (False, True):
            row = {k: v for k, v in runs[fork][0].items() if k not in (*seconds, "outputs")}
            row.update(block_size=block_size, fork=fork)
            row.update({k: min(r[k] for r in runs[fork]) for k in seconds})
            row["median_total_s"] = statistics.median(r["total_s"] for r in runs[fork])
            if reference is None:
                reference = runs[fork][0]["outputs"]
            row["outputs_equal_fork_off"] = all(r["outputs"] == reference for r in runs[fork])
            rows.append(row)
            print(
                f"{block_size:>5} {'on' if fork else 'off':>4} {row['prompt_tokens_computed']:>10} "
                f"{row['tokens_computed']:>7} {row['steps']:>5} {row['forks']:>5} {row['block_copies']:>6} "
                f"{row['first_token_all_s']:>7.3f} ({row['first_token_all_cpu_s']:>6.3f}) "
                f"{row['total_s']:>7.3f} ({row['total_cpu_s']:>6.3f}) {row['outputs_equal_fork_off']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
