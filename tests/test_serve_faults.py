"""rollout-serve's guards and failures, each on a server of its own: the API key, control routes off by
default, an engine that fails, and the console entry point stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from rollout import ContinuousBatchingConfig, RolloutClient
from rollout.serve import ServerSettings
from rollout.serve.cli import build_parser, config_from_args
from rollout.serve.service import MAX_SEQUENCES_PER_JOB
from tests.serve_utils import free_port, running_server, wait_until
from tests.tiny_models import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONFIG = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True)


def test_api_key_guards_v1_and_control_routes_and_control_is_off_by_default() -> None:
    settings = ServerSettings(api_key="sekret", enable_control=False)
    with running_server(tiny_llama(), tiny_tokenizer(), CONFIG, settings) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes carry no key
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/pause")]:
            refused = httpx.request(method, f"{srv.url}{path}", json={"prompt": [5]})
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            wrong = httpx.request(
                method, f"{srv.url}{path}", json={"prompt": [5]}, headers={"Authorization": "Bearer x"}
            )
            assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, temperature=0).choices[0].text
        gated = httpx.post(f"{srv.url}/pause", headers={"Authorization": "Bearer sekret"})
        assert gated.status_code == 404 and "--enable-control" in gated.json()["error"]["message"]
        # The queue is unbounded here (--max-queue-size 0): one request still cannot ask for more sequences than
        # MAX_SEQUENCES_PER_JOB (n = 1,000,000 had the server killed for memory).
        huge = httpx.post(
            f"{srv.url}/v1/completions",
            json={"prompt": [[5], [6]], "max_tokens": 2, "n": MAX_SEQUENCES_PER_JOB // 2 + 1},
            headers={"Authorization": "Bearer sekret"},
        )
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "n"
        assert f"{MAX_SEQUENCES_PER_JOB + 2} requests (prompts x n)" in huge.json()["error"]["message"]
        assert not srv.manager.engine.requests


def test_an_engine_failure_answers_500_to_every_pending_request_and_health_turns_unhealthy() -> None:
    model = tiny_llama()
    with running_server(model, tiny_tokenizer(), CONFIG) as srv:
        assert httpx.get(f"{srv.url}/health").status_code == 200

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("simulated device fault")

        model.model.layers[0].mlp.down_proj.forward = broken  # called by transformers' layer and the fused one
        answers: list[httpx.Response] = []
        body = {"prompt": [5, 6, 7], "max_tokens": 5}
        callers = [
            threading.Thread(
                target=lambda: answers.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60))
            )
            for _ in range(3)
        ]
        for t in callers:
            t.start()
        for t in callers:
            t.join(60)
        assert [a.status_code for a in answers] == [500, 500, 500]
        assert all("simulated device fault" in a.json()["error"]["message"] for a in answers)
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "simulated device fault" in health.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 500


def test_a_value_the_engine_refuses_is_a_400_naming_the_field_its_check_named() -> None:
    """``--per-request-processors false``: the manager's own check refuses a request's processor values. Its
    ``FieldError`` names the field; every such refusal was answered as ``max_tokens`` before."""
    model = tiny_llama()
    model.generation_config.do_sample, model.generation_config.top_p = True, 1.0  # OpenAI's defaults
    config = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True, per_request_processors=False)
    with running_server(model, tiny_tokenizer(), config) as srv:
        url = f"{srv.url}/v1/completions"
        assert httpx.post(url, json={"prompt": [5, 6], "max_tokens": 2}, timeout=60).status_code == 200
        for field, value in [("repetition_penalty", 1.3), ("min_tokens", 1), ("top_k", 5)]:
            refused = httpx.post(url, json={"prompt": [5, 6], "max_tokens": 2, field: value}, timeout=60)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == field and error["message"].startswith(f"{field}: ")
            assert "per_request_processors is False" in error["message"]
        assert not srv.manager.engine.requests


def test_engine_flags_are_config_fields_and_the_server_turns_logprobs_on() -> None:
    args = build_parser().parse_args(
        ["--max-batch-tokens", "64", "--allow-block-sharing", "false", "--max-queue-size", "7"]
    )
    config = config_from_args(args)
    assert (config.max_batch_tokens, config.allow_block_sharing, config.max_queue_size) == (64, False, 7)
    assert config.return_logprobs is True
    assert config_from_args(build_parser().parse_args(["--return-logprobs", "false"])).return_logprobs is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--scheduler-type", "lifo"])


def _start_server(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``python -m rollout.serve`` on a free port of 127.0.0.1 (unless ``flags`` give a host), healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model", str(model_dir), "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            return False

    wait_until(up, timeout=180, interval=0.2)
    return proc, url


def _save_tiny(folder: Path, context: int = 512) -> Path:
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    model.config.max_position_embeddings = context
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_python_m_rollout_serve_serves_and_shuts_down_gracefully_on_sigterm(tmp_path: Path) -> None:
    proc, url = _start_server(
        _save_tiny(tmp_path / "model"), "--served-model-name", "tiny", "--host", "0.0.0.0", "--num-blocks", "64",
        "--shutdown-timeout", "20",
    )  # fmt: skip
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
        ids: list[int] = []
        finish = []
        refused = None
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not ids:  # in flight: stop the server now; the stream must still complete
                    proc.send_signal(signal.SIGTERM)
                    time.sleep(0.2)
                    with pytest.raises(httpx.ConnectError) as refused:  # the listening socket is closed
                        httpx.get(f"{url}/health", timeout=5)
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice["token_ids"]
                    finish.append(choice["finish_reason"])
        assert len(ids) == 200 and finish[-1] == "length" and refused is not None
        assert proc.wait(timeout=60) == 0  # a clean exit: the signal is not re-raised
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read() if proc.stdout else ""
    assert "without --api-key" in output  # bound to 0.0.0.0 with no key: warned
    assert "Application shutdown complete" in output  # the lifespan ran: the manager was stopped and destroyed
    assert "Traceback" not in output


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_ends_streams_with_a_final_event_and_exits_cleanly_with_a_transfer_group_open(
    tmp_path: Path, signals: int
) -> None:
    """One SIGINT: in-flight requests get --shutdown-timeout seconds, then end with finish reason abort (a stream
    used to be cut by uvicorn without a final event, and a KeyboardInterrupt traceback followed). A second: they end
    at once (it used to force uvicorn's exit past the manager: a traceback, exit -2, or SIGABRT mid-step)."""
    proc, url = _start_server(
        _save_tiny(tmp_path / "model", context=8192), "--num-blocks", "400", "--enable-control",
        "--shutdown-timeout", "2" if signals == 1 else "120",
    )  # fmt: skip
    client = RolloutClient(url, timeout=60)
    try:
        client.init_weight_transfer()
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        t0 = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        reader.join(60)
        assert proc.wait(timeout=60) == 0
        assert time.monotonic() - t0 < 30  # not the 120 s of --shutdown-timeout with two signals
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    output = proc.stdout.read() if proc.stdout else ""
    for crash in ("Traceback", "KeyboardInterrupt", "terminate called"):
        assert crash not in output, output[-3000:]
    assert "Application shutdown complete" in output


def test_a_missing_model_folder_a_misspelt_alias_and_a_busy_port_answer_one_line_before_loading(
    tmp_path: Path,
) -> None:
    """A new user's mistakes: an 80-line traceback for a missing folder, 51 s of Hub retries for `smollm2-135m`,
    and a busy port found after the model and its cache were loaded."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = {
        "--model": ([str(tmp_path / "missing")], ["no such folder", "'smollm2-135m-instruct'"]),
        "--model ": (["smollm2-135m"], ["did you mean 'smollm2-135m-instruct'?"]),
        "--port": ([str(_save_tiny(tmp_path / "model")), "--port", str(port)], [f"{port} is already in use"]),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = {
        flag: subprocess.Popen(
            [sys.executable, "-m", "rollout.serve", "--model", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for flag, (args, _) in cases.items()
    }
    try:
        for flag, proc in runs.items():
            out, err = proc.communicate(timeout=150)
            lines = err.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, err[-3000:]
            assert lines[0].startswith(f"rollout-serve: error: {flag.strip()} ")
            assert all(says in lines[0] for says in cases[flag][1]), lines[0]
            assert "loading" not in out + err  # answered before the model is loaded
    finally:
        busy.close()
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()


def test_a_kv_cache_that_cannot_be_allocated_is_one_line_naming_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's allocation fails (torch's CPU allocator raises a plain RuntimeError): rollout-serve exits with
    status 2 and one line naming --max-memory-percent (what was asked) and --num-blocks, the allocator's own words and
    the GiB usable now, no traceback. (A --num-blocks past the memory is refused before allocating:
    tests/test_fleet_cli.py.)"""
    import rollout.engine.build
    from rollout.serve.cli import main

    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 409600000000 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(rollout.engine.build, "PagedKVCache", no_memory)  # the engine's cache allocation
    model = str(_save_tiny(tmp_path / "model"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", model, "--port", str(free_port()), "--max-memory-percent", "0.5", "--log-level", "error"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and line.startswith(
        "rollout-serve: error: --max-memory-percent 0.5: the KV cache of 0.5 of the usable memory could not be "
        "allocated ([enforce fail at alloc_cpu.cpp:127]"
    ), err
    assert "you tried to allocate 409600000000 bytes" in line and "GiB are usable on cpu now" in line
    assert line.endswith("lower --num-blocks or --max-memory-percent")
