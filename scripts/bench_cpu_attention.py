"""Time rollout's paged CPU attention kernel on one decode step's layer, with its inputs in the core's caches (hot)
and after 64 MB of other data are read between calls (cold, as in an engine step, where every layer's keys come
from memory while the layers' weights stream through the caches),
beside this machine's memory read bandwidth (a ``sum`` over 256 MB). docs/profile.md quotes it.

    python scripts/bench_cpu_attention.py [--requests 32] [--context 150] [--repeats 30]

The shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64, float32) on 32-token blocks.
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
    args = p.parse_args()
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

    def median_ms(flush: bool) -> float:
        times = []
        for _ in range(args.repeats):
            if flush:
                junk.sum()
            start = time.perf_counter()
            cpu_attention.flash_attn_with_kvcache(q, k_cache, v_cache, lengths, tables)
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


if __name__ == "__main__":
    main()
