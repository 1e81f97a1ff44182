"""``rollout-fleet`` (``python -m rollout.fleet.cli``): N local replicas and vLLM's router, their URLs printed, a routed
completion answered, and everything stopped on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout.config import DEFAULT_MEMORY_PERCENT_CPU
from rollout.fleet.cli import build_parser, cpu_memory_share
from tests.serve_utils import free_port
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

REPO = Path(__file__).resolve().parents[1]


def test_bad_flags_are_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout.fleet.cli import main

    bad = [(["--model", "m", "--replicas", "0"], "--replicas"), (["--model", "m", "--", "--port", "1"], "--port")]
    for argv, flag in bad:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert build_parser().parse_args(["--model", "m"]).replicas == 2


@pytest.mark.slow  # two rollout-serve processes and the router start: about a minute on 2 shared cores
def test_cpu_replicas_split_one_servers_memory_share_unless_the_flags_size_the_cache() -> None:
    assert DEFAULT_MEMORY_PERCENT_CPU == 0.25
    assert cpu_memory_share(1, []) == ["--max-memory-percent", "0.25"]
    assert cpu_memory_share(4, ["--page-size", "16"]) == ["--max-memory-percent", "0.0625"]
    assert cpu_memory_share(3, []) == ["--max-memory-percent", "0.0833333"]
    assert cpu_memory_share(4, ["--num-blocks", "64"]) == []
    assert cpu_memory_share(4, ["--max-memory-percent=0.5"]) == []


def test_the_launcher_prints_the_urls_routes_a_completion_and_stops_everything_on_sigint(tmp_path: Path) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.fleet.cli", "--model", str(tmp_path / "model"), "--replicas", "2", "--port",
         str(port), "--", "--num-blocks", "64", "--page-size", "16", "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = dict(proc.stdout.readline().strip().split("=", 1) for _ in range(2))
        servers = lines["server_urls"].split(",")
        assert servers == [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
        assert lines["router_url"] == f"http://127.0.0.1:{port}"
        body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
        session = {"X-Session-ID": "s"}
        routed = httpx.post(f"{lines['router_url']}/v1/completions", json=body, headers=session, timeout=60)
        assert routed.json()["choices"][0]["token_ids"] == reference_greedy(model, [5, 6, 7], 5, None)
        assert all(httpx.post(f"{u}/pause", timeout=10).status_code == 200 for u in servers)  # control is on
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
        for url in [*servers, lines["router_url"]]:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
