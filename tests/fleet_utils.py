"""Helpers of the fleet tests: vLLM's router (``vllm-router``, the ``fleet`` extra) in a process of its own on
127.0.0.1, in front of rollout-serve replicas."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest

from tests.serve_utils import free_port


@contextlib.contextmanager
def vllm_router(worker_urls: Sequence[str], policy: str = "consistent_hash") -> Iterator[str]:
    """Start ``vllm-router`` over ``worker_urls`` (skips the test when it is not installed); yields its URL once it
    routes to every worker, and stops it on exit."""
    binary = shutil.which("vllm-router")
    if binary is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[fleet]')")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Retries off: a failed worker is the pool's to handle (it drops it); the router's own retry would mask it.
    proc = subprocess.Popen(
        [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
         "--log-level", "warning", "--disable-retries", "--health-check-interval-secs", "1",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "vllm-router exited"
            with contextlib.suppress(httpx.HTTPError):
                if len(httpx.get(f"{url}/list_workers", timeout=2).json()["urls"]) == len(worker_urls):
                    break
            if time.monotonic() > deadline:
                raise AssertionError("vllm-router did not come up")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
