"""Sliding-window layer groups: how many requests the same KV-cache memory admits at once.

``python scripts/bench_sliding_window.py`` builds a random Gemma-3-style model (Gemma 3's pattern: 5
sliding-window layers, window 64, to 1 global layer; no download), queues N requests with prompts of
1,000 random tokens on a fresh ``rollout.engine.Engine`` and steps it to the end, twice with the same
``num_blocks`` (the same bytes of KV cache): once with the cache per layer group
(``sliding_window_cache=True``: a sliding layer keeps only its window's blocks), once with every layer
keeping every position (``sliding_window_cache=False``, the cache before layer groups). Reported for
each: the cache's bytes, the most requests running at once (admitted, after a step: the figure the
memory decides), preemptions, steps and seconds; then the ratio of the peaks, and whether every greedy
output equals ``model.generate`` token for token (``--no-check`` skips that reference).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import rollout
import rollout.engine


def build_model(window: int, sliding_layers: int, hidden: int, vocab: int, seed: int) -> Gemma3ForCausalLM:
    """A random fp32 Gemma-3 text model on CPU in eval mode: ``sliding_layers`` sliding-window layers
    (window ``window``) then one full-attention layer; 4 query heads and 2 KV heads of dim hidden / 4."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=sliding_layers + 1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        layer_types=["sliding_attention"] * sliding_layers + ["full_attention"],
        sliding_window=window,
        query_pre_attn_scalar=hidden // 4,
        initializer_range=0.2,  # peaked logits: greedy outputs vary and are not near-ties
        tie_word_embeddings=False,
    )
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None  # every request runs to max_new_tokens, in both references
    return model


def run(
    model: Gemma3ForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_blocks: int,
    sliding_window_cache: bool,
) -> dict:
    """One engine over all the prompts (greedy, no EOS), stepped to the end; its peak of running requests."""
    config = rollout.ContinuousBatchingConfig(num_blocks=num_blocks, sliding_window_cache=sliding_window_cache)
    engine = rollout.engine.Engine(model, config)
    try:
        params = rollout.SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=())
        requests = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        peak = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    stats = engine.stats
    return {
        "sliding_window_cache": sliding_window_cache,
        "kv_cache_bytes": stats.kv_cache_bytes,
        "block_ids": engine.num_blocks,
        "groups": list(stats.kv_cache_capacity_tokens),
        "peak_running": peak,
        "preemptions": stats.num_preemptions,
        "steps": stats.num_steps,
        "seconds": seconds,
        "outputs": [r.generated_tokens for r in requests],
    }


def reference(model: Gemma3ForCausalLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """``model.generate`` greedy on one prompt, no EOS: the generated tokens."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and print one row per cache layout and the ratio of peaks; ``--json PATH`` also writes them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--full-requests",
        type=int,
        default=6,
        help="size the cache (num_blocks) to hold this many requests with every layer keeping every position",
    )
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sliding-layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 keeps torch's default")
    parser.add_argument("--no-check", action="store_true", help="skip the model.generate reference")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.window, args.sliding_layers, args.hidden, args.vocab, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(3, args.vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_requests)
    ]
    block_size = rollout.ContinuousBatchingConfig().resolved_page_size("cpu")
    per_request = -(-(args.prompt_len + args.max_new_tokens) // block_size)
    # The fifo safety margin (0.15) is kept free when admitting: size so that --full-requests fit.
    num_blocks = int(args.full_requests * per_request / 0.85) + 1
    rows = [run(model, prompts, args.max_new_tokens, num_blocks, on) for on in (True, False)]
    expected = None if args.no_check else [reference(model, p, args.max_new_tokens) for p in prompts]
    print(
        f"{args.num_requests} requests x {args.prompt_len}-token prompts + {args.max_new_tokens} new tokens, "
        f"{args.sliding_layers} sliding layers (window {args.window}) to 1 global, page {block_size}, "
        f"num_blocks {num_blocks}"
    )
    for row in rows:
        row["equal_to_generate"] = None if expected is None else row["outputs"] == expected
        layout = "per layer group" if row["sliding_window_cache"] else "all layers full"
        print(
            f"  {layout:16s} cache {row['kv_cache_bytes'] / 2**20:.2f} MiB ({row['block_ids']} block ids, "
            f"{len(row['groups'])} groups): peak running {row['peak_running']}, preemptions {row['preemptions']}, "
            f"{row['steps']} steps, {row['seconds']:.1f} s, outputs equal model.generate: {row['equal_to_generate']}"
        )
    ratio = rows[0]["peak_running"] / max(1, rows[1]["peak_running"])
    print(f"  same bytes, {ratio:.2f}x the requests running at once")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "num_blocks": num_blocks, "ratio": ratio, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
