"""Cost of the weight check a pause ends with (``ContinuousBatchingConfig.check_weight_contents``), on SmolLM2-135M.

Measured in one run, on the same model (fp32, on the CPU unless ``--device``), minimum over ``--repeats``:

- the content check a pause ends with when nothing changed (``WeightWatch.bump_if_changed`` with contents): the
  checksum of every parameter and buffer (``weights.weights_contents``; xxh3 on the CPU) and the cheap fingerprint;
- the same with ``check_weight_contents=False`` (the cheap fingerprint alone);
- the device checksum (torch ops, what a CUDA model gets) run on the same tensors;
- for scale: ``manager.update_weights`` of the full state dict (the copy and the version bump), with and without the
  content check, and one greedy ``generate_batch`` of 8 prompts x 8 tokens.

    python scripts/bench_weight_check.py                  # prints a markdown table with the commit it ran on
    python scripts/bench_weight_check.py --repeats 9
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig

import rollout
from rollout import ContinuousBatchingConfig, init_continuous_batching
from rollout.weights.versions import watch_of, weights_contents, weights_fingerprint


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first-touch of pages, thread pools
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model, _ = rollout.load_model()
    model = model.to(args.device)
    tensors = [*model.parameters(), *model.buffers()]
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    threads = torch.get_num_threads()
    watch = watch_of(model)
    rows: list[tuple[str, float]] = []
    rows.append(
        (
            "pause end, check_weight_contents=True (nothing changed)",
            best_seconds(lambda: watch.bump_if_changed(None, True), args.repeats),
        )
    )
    rows.append(
        (
            "pause end, check_weight_contents=False",
            best_seconds(lambda: watch.bump_if_changed(None, False), args.repeats),
        )
    )
    rows.append(
        (
            "  of which: content checksum (xxh3 on CPU tensors)",
            best_seconds(lambda: weights_contents(model), args.repeats),
        )
    )
    rows.append(("  of which: cheap fingerprint", best_seconds(lambda: weights_fingerprint(model), args.repeats)))
    rows.append(
        (
            "device checksum (torch ops, what CUDA tensors get), same tensors",
            best_seconds(lambda: weights_contents(model, on_device=True), max(1, args.repeats // 2)),
        )
    )
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for contents in (True, False):
        m = init_continuous_batching(
            model, GenerationConfig(max_new_tokens=4), ContinuousBatchingConfig(check_weight_contents=contents)
        )
        m.start()
        rows.append(
            (
                f"update_weights(full state dict), check_weight_contents={contents}",
                best_seconds(lambda m=m: m.update_weights(state), args.repeats),
            )
        )
        m.destroy()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 4 + i % 4] * 4 for i in range(8)]
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    rows.append(
        (
            "for scale: one generate_batch (fresh engine), 8 prompts x 8 new tokens",
            best_seconds(lambda: rollout.generate_batch(model, prompts, gc), 1),
        )
    )
    base = rows[0][1]
    print(
        f"SmolLM2-135M-Instruct fp32 on {args.device} ({len(tensors)} tensors, {mib:.0f} MiB), "
        f"{threads} torch threads, commit {commit()}, best of {args.repeats}\n"
    )
    print("| what | ms | ratio to the pause-end check |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
