"""Helpers of the fleet tests: vLLM's router (``vllm-router``, the ``fleet`` extra) in a process of its own on
127.0.0.1, in front of rollout-serve replicas."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence

import pytest

from benchmarks.fleet import router_subprocess


@contextlib.contextmanager
def vllm_router(worker_urls: Sequence[str], policy: str = "consistent_hash") -> Iterator[str]:
    """Start ``vllm-router`` over ``worker_urls`` (skips the test when it is not installed); yields its URL once it
    routes to every worker, and stops it on exit (``benchmarks.fleet.router_subprocess``)."""
    if shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[fleet]')")
    # Retries off: a failed worker is the pool's to handle (it drops it); the router's own retry would mask it.
    extra = ["--disable-retries", "--health-check-interval-secs", "1"]
    with router_subprocess(worker_urls, policy, extra, timeout=60) as url:
        yield url
