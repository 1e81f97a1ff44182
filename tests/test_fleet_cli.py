"""``rollout-fleet`` (``python -m rollout.fleet.cli``): N local replicas and vLLM's router, their URLs and PIDs
printed, a routed completion answered, the router quiet per request, a KV cache too large for the machine said in one
line, and everything stopped on SIGINT."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rollout.config import DEFAULT_MEMORY_PERCENT_CPU
from rollout.fleet.cli import build_parser, cpu_memory_share
from tests.serve_utils import free_port
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

REPO = Path(__file__).resolve().parents[1]


def _fleet(model_dir: Path, port: int, replicas: int, *serve_args: str) -> subprocess.Popen:
    """``python -m rollout.fleet.cli`` over ``model_dir`` (this checkout's rollout on PYTHONPATH), stdout and stderr
    piped (binary)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RUST_LOG", None)  # the launcher's default router level is under test
    return subprocess.Popen(
        [sys.executable, "-m", "rollout.fleet.cli", "--model", str(model_dir), "--replicas", str(replicas), "--port",
         str(port), "--", "--page-size", "16", "--log-level", "warning", *serve_args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _stop_fleet(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """SIGTERM the launcher (it stops its replicas and router, which hold its pipes) and read its output; SIGKILL it
    after 120 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _read_lines(stream: object, count: int, timeout: float) -> list[str]:
    """The first ``count`` lines of a binary pipe; AssertionError when they do not come within ``timeout`` s."""
    fd, data, deadline = stream.fileno(), b"", time.monotonic() + timeout  # type: ignore[attr-defined]
    while data.count(b"\n") < count:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"{count} lines expected, got {data!r}"
        chunk = os.read(fd, 4096)
        assert chunk, f"the stream ended after {data!r}"
        data += chunk
    return data.decode().splitlines()[:count]


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fleet") / "model"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


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


def test_the_launcher_prints_its_processes_pids_and_the_router_logs_no_line_per_request(
    tiny_model_folder: Path,
) -> None:
    """The PIDs of the replica and the router are printed with their ports as each starts (stderr) and once the fleet
    is ready (stdout, ``key=value``); they are the running processes, gone after SIGINT. Requests through the router
    leave no line of its own in the output (vllm-router logs three per request at INFO), nor do its startup prints."""
    port = free_port()
    proc = _fleet(tiny_model_folder, port, 1, "--num-blocks", "64")
    try:
        lines = dict(line.split("=", 1) for line in _read_lines(proc.stdout, 4, timeout=300))
        assert lines["server_urls"] == f"http://127.0.0.1:{port + 1}"
        assert lines["router_url"] == f"http://127.0.0.1:{port}"
        replica, router = int(lines["server_pids"]), int(lines["router_pid"])
        assert _parent_pid(replica) == proc.pid and _parent_pid(router) == proc.pid
        assert "rollout.serve" in Path(f"/proc/{replica}/cmdline").read_text()
        body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        for session in ("a", "b", "c"):
            routed = httpx.post(f"{lines['router_url']}/v1/completions", json=body, headers={"X-Session-ID": session})
            assert routed.status_code == 200, routed.text
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            _stop_fleet(proc)
    stderr = err.decode()
    assert f"rollout-fleet: replica 0: pid {replica}, http://127.0.0.1:{port + 1}" in stderr
    assert f"rollout-fleet: router: pid {router}, http://127.0.0.1:{port}" in stderr
    assert "CONSISTENT_HASH" not in stderr and "DEBUG:" not in stderr and " INFO " not in stderr, stderr
    for pid in (replica, router):
        assert not Path(f"/proc/{pid}").exists()


def test_a_replica_whose_kv_cache_cannot_fit_says_so_in_one_line_naming_the_flags(tiny_model_folder: Path) -> None:
    """``--num-blocks`` past the machine's memory: each replica that gets that far writes one line naming
    ``--num-blocks`` and ``--max-memory-percent`` with what was asked and what is usable (no traceback), and the
    launcher stops with its own one-line summary (exit status 1)."""
    proc = _fleet(tiny_model_folder, free_port(), 2, "--num-blocks", "100000000")
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            _stop_fleet(proc)
    stderr = err.decode()
    assert proc.returncode == 1 and out == b"" and "Traceback" not in stderr, stderr
    refusals = [line for line in stderr.splitlines() if line.startswith("rollout-serve: error: --num-blocks 100000000")]
    assert 1 <= len(refusals) <= 2, stderr
    for refusal in refusals:
        assert "GiB) does not fit" in refusal and "GiB are usable on cpu" in refusal, refusal
        assert "--max-memory-percent" in refusal, refusal
    summary = [line for line in stderr.splitlines() if line.startswith("rollout-fleet: a replica:")]
    assert len(summary) == 1 and summary[0].endswith("exited with status 2"), stderr
