"""LoRA served unmerged (``scripts/bench_lora.py``): generated tokens/s of the base model against one and four adapters
in the batch, and an adapter's sync (``manager.load_lora`` from tensors in memory) against a full weight sync
(``manager.update_weights`` with every parameter), measured in the same run on the same prompts.

Adapters: rank ``--rank`` on every linear layer of the decoder (q, k, v, o, gate, up, down), random A and B. The
prompts are the default model's, random token ids (``--prompts`` of ``--prompt-len`` tokens), greedy, ``--new-tokens``
each, all queued at once on one manager; with four adapters request i runs under adapter i % 4. The tables:
docs/lora.md (``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import machine_info
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, LoraAdapter, SamplingParams, load_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model: torch.nn.Module, name: str, rank: int, seed: int) -> LoraAdapter:
    """A rank-``rank`` adapter on every ``TARGETS`` layer of ``model``, A and B drawn with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=g) / math.sqrt(module.in_features)
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            tensors[f"base_model.model.{module_name}.lora_A.weight"] = a
            tensors[f"base_model.model.{module_name}.lora_B.weight"] = b
    return LoraAdapter.from_tensors(name, tensors, r=rank, lora_alpha=2 * rank)


def tokens_per_second(manager: ContinuousBatchingManager, prompts: list[list[int]], loras: list[str | None]) -> float:
    """Generated tokens per second of one batch (every request queued at once)."""
    t0 = time.perf_counter()
    ids = [manager.add_request(p, lora=lora) for p, lora in zip(prompts, loras)]
    tokens = sum(len(manager.get_result(rid, timeout=3600).generated_tokens) for rid in ids)
    return tokens / (time.perf_counter() - t0)


def measure(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, rank: int, repeats: int
) -> dict[str, Any]:
    """Tokens/s of the base model, one adapter and four adapters on ``prompts`` (each best of ``repeats``, the
    three cases alternated within a round), and the seconds of ``load_lora`` against ``update_weights``.

    Returns:
        ``tokens_per_s`` (case -> list of float, one per round), ``adapter_sync_s`` (list, one per adapter),
        ``full_sync_s`` (list, one per round), ``adapter_bytes`` and ``full_bytes`` (int).
    """
    config = ContinuousBatchingConfig(enable_lora=True, max_loras=4, max_lora_rank=rank)
    manager = ContinuousBatchingManager(model, SamplingParams(max_new_tokens=new_tokens), config)
    manager.start()
    try:
        adapters = [random_adapter(model, f"a{i}", rank, seed=i) for i in range(4)]
        sync = []
        for adapter in adapters:
            t0 = time.perf_counter()
            manager.load_lora(adapter)
            sync.append(time.perf_counter() - t0)
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
        full = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            manager.update_weights(state)
            full.append(time.perf_counter() - t0)
        cases = {
            "base": [None] * len(prompts),
            "1 adapter": ["a0"] * len(prompts),
            "4 adapters": [f"a{i % 4}" for i in range(len(prompts))],
        }
        rates: dict[str, list[float]] = {name: [] for name in cases}
        tokens_per_second(manager, prompts[:2], [None, "a0"])  # warm: the first step of each kind
        for _ in range(repeats):
            for name, loras in cases.items():
                manager.reset_prefix_cache()
                rates[name].append(tokens_per_second(manager, prompts, loras))
    finally:
        manager.stop(block=True)
    return {
        "tokens_per_s": rates,
        "adapter_sync_s": sync,
        "full_sync_s": full,
        "adapter_bytes": adapters[0].num_bytes,
        "full_bytes": sum(t.numel() * t.element_size() for t in state.values()),
    }


def markdown(result: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    """The two tables of ``measure``'s result, headed by the command, the commit and the CPU."""
    rates = result["tokens_per_s"]
    base = max(rates["base"])
    adapter_s, full_s = min(result["adapter_sync_s"]), min(result["full_sync_s"])
    adapter_bytes, full_bytes = result["adapter_bytes"], result["full_bytes"]
    lines = [
        f"LoRA served unmerged: `{args.model}`, rank {args.rank} on {len(TARGETS)} projections of every layer; commit "
        f"`{machine['git_commit']}`, {machine['cpu_model']}, {machine['torch_num_threads']} torch threads, torch "
        f"{machine['torch']}. {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} greedy tokens "
        f"each, all queued at once; best of {args.repeats} rounds (the three batches alternate within a round).",
        "",
        "| batch | tokens/s | vs base |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {max(values):.1f} | {max(values) / base:.2f} |" for name, values in rates.items()]
    lines += [
        "",
        "| sync | bytes | seconds | vs full |",
        "| --- | ---: | ---: | ---: |",
        f"| full weights (`update_weights`) | {full_bytes / 1e6:.1f} MB | {full_s:.3f} | 1.00 |",
        f"| adapter (`load_lora`, in memory) | {adapter_bytes / 1e6:.2f} MB ({100 * adapter_bytes / full_bytes:.2f}%) "
        f"| {adapter_s:.3f} | {adapter_s / full_s:.2f} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an alias or a model folder")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best one")
    parser.add_argument("--json", type=Path, help="write the measurements and the machine here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    args = parser.parse_args(argv)
    model, _ = load_model(args.model)
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    result = measure(model, prompts, args.new_tokens, args.rank, args.repeats)
    machine = machine_info("cpu")
    text = markdown(result, args, machine)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine,
                                         **result}, indent=1) + "\n")  # fmt: skip
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0
