"""Time rollout's paged CPU attention kernel on one decode step's layer, with its inputs in the core's caches (hot)
and after 64 MB of other data are read between calls (cold, as in an engine step, where every layer's keys come
from memory while the layers' weights stream through the caches),
beside this machine's memory read bandwidth (a ``sum`` over 256 MB). docs/profile.md quotes it.

    python scripts/bench_cpu_attention.py [--requests 32] [--context 150] [--repeats 30]
    python scripts/bench_cpu_attention.py --requests 64 --forks 8 --prefix 96   # GRPO: 8 prompts x 8 samples

The shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, float32) on 32-token blocks. With
``--forks G`` the requests come in runs of G prompt forks whose tables begin with the same blocks for their first
``--prefix`` keys (the kernel reads those once per run), timed beside the same step with every block its own.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from rollout.engine.attention import cpu as cpu_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--context", type=int, default=150, help="keys per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--forks", type=int, default=1, help="requests per run sharing a prefix (default: %(default)s)")
    p.add_argument("--prefix", type=int, default=96, help="keys the forks share, a multiple of 32 (default: 96)")
    args = p.parse_args()
    if args.forks < 1 or args.prefix % 32 or not 0 < args.prefix < args.context:
        p.error("--forks must be >= 1 and --prefix a multiple of 32 between 0 and --context")
    reason = cpu_attention.load_kernel()
    if reason is not None:
        raise SystemExit(reason)
    torch.manual_seed(0)
    B, H, Hkv, D, page = args.requests, 9, 3, 64, 32
    width = -(-args.context // page)
    num_blocks = 4 * B * width  # blocks scattered over a cache 4x the step's reads
    k_cache = torch.randn(num_blocks, page, Hkv, D)
    v_cache = torch.randn(num_blocks, page, Hkv, D)
    tables = torch.randperm(num_blocks)[: B * width].view(B, width).int()
    lengths = torch.full((B,), args.context, dtype=torch.int32)
    q = torch.randn(B, 1, H, D)
    junk = torch.randn(16 * 1024 * 1024)  # 64 MB

    # Each run of forks reads its first member's blocks for the shared prefix.
    shared_tables = tables.clone()
    for b in range(B):
        shared_tables[b, : args.prefix // page] = tables[b - b % args.forks, : args.prefix // page]

    def median_ms(flush: bool, table: torch.Tensor = tables) -> float:
        times = []
        for _ in range(args.repeats):
            if flush:
                junk.sum()
            start = time.perf_counter()
            cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lengths, table)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    median_ms(False)
    hot, cold = median_ms(False), median_ms(True)
    read_mb = 2 * B * args.context * Hkv * D * 4 / 1e6
    big = torch.randn(64 * 1024 * 1024)
    big.sum()
    start = time.perf_counter()
    big.sum()
    bandwidth = big.numel() * 4 / (time.perf_counter() - start) / 1e9
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"decode layer: {B} requests x {args.context} keys, {read_mb:.1f} MB of keys and values")
    print(f"kernel hot {hot:.3f} ms, cold (64 MB read between calls) {cold:.3f} ms = {read_mb / cold:.1f} GB/s")
    print(f"memory read bandwidth (sum over 256 MB): {bandwidth:.1f} GB/s")
    if args.forks > 1:
        alone, forks = median_ms(True), median_ms(True, shared_tables)
        print(f"runs of {args.forks} forks sharing {args.prefix} keys: cold {forks:.3f} ms against {alone:.3f} ms with")
        print(f"every block its own ({alone / forks:.2f}x)")


if __name__ == "__main__":
    main()
