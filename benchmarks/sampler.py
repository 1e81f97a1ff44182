"""Time the sampler's draw on CPU with and without rollout's kernel: ``sample_tokens`` on one GRPO decode step's
logits (64 rows of SmolLM2's 49,152-token vocabulary, every row sampled at temperature 1, as gsm8k-grpo), with
``cpu_kernel=True`` (``rollout_cpu::inverse_cdf_sample``) and ``False`` (``torch.cumsum`` + ``torch.searchsorted``),
in alternating rounds, in a second thread as the engine's steps run. Checks that both draw the same tokens.
rollout/engine/sample/sampler.py and docs/bench.md quote it.

    python scripts/bench_sampler.py [--rows 64] [--vocab 49152] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from rollout.engine.attention.cpu import load_kernel
from rollout.engine.sample.sampler import sample_tokens
from rollout.requests import SamplingParams


def measure(rows: int, vocab: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds per ``sample_tokens`` call, each way, one entry per round (rounds alternate the two ways).

    Raises:
        RuntimeError: rollout's CPU extension does not load, or the two ways draw different tokens.
    """
    why = load_kernel()
    if why is not None:
        raise RuntimeError(f"rollout's CPU extension does not load: {why}")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g) * 3
    params = [SamplingParams(do_sample=True, temperature=1.0) for _ in range(rows)]
    uniform = np.random.default_rng(0).random(rows)
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    tokens: dict[str, torch.Tensor] = {}

    def run() -> None:
        for _ in range(2):  # warm: allocator, OpenMP pool of this thread
            for kernel in (False, True):
                sample_tokens(logits, params, return_logprobs=False, uniform=uniform, cpu_kernel=kernel)
        for _ in range(repeats):
            for name, kernel in (("torch", False), ("kernel", True)):
                start = time.perf_counter()
                out = sample_tokens(logits, params, return_logprobs=False, uniform=uniform, cpu_kernel=kernel)
                times[name].append(1e3 * (time.perf_counter() - start))
                tokens[name] = out.tokens

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if not torch.equal(tokens["torch"], tokens["kernel"]):
        raise RuntimeError("the kernel drew other tokens than the torch ops")
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="sampled rows (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="rounds (default: %(default)s)")
    args = p.parse_args(argv)
    for name in ("rows", "vocab", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    times = measure(args.rows, args.vocab, args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"sample_tokens, {args.rows} x {args.vocab}, every row sampled, {torch.get_num_threads()} threads, {commit}:")
    for name, values in times.items():
        print(f"  {name:6s} median {statistics.median(values):.2f} ms (min {min(values):.2f}, max {max(values):.2f})")
    ratio = statistics.median(times["torch"]) / statistics.median(times["kernel"])
    print(f"  torch / kernel {ratio:.2f}x, same tokens")
    return 0
