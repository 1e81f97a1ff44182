"""GRPO and PPO on a fleet (``rollout_server: URL,URL`` behind ``rollout_router``). GRPO: two
``python -m rollout.serve`` processes and vLLM's router; one replica is SIGKILLed in the middle of the run, the run
finishes, the dead replica is dropped from the pool and the router, and the survivor serves the trained model's greedy
tokens. PPO: two replicas behind the router both end on the trainer's weights at one version."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from rollout import ContinuousBatchingConfig
from tests.fleet_utils import vllm_router
from tests.serve_utils import free_port, running_server
from tests.test_grpo import low_token_reward, tiny_config, token_dataset
from tests.test_ppo import tiny_trainer as tiny_ppo_trainer
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy
from trainers.grpo import GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 20, 40, 7, 9]


@contextlib.contextmanager
def serve_processes(model_dir: Path, n: int) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``n`` rollout-serve processes on ``model_dir`` (started together), once all are healthy."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = []
    for _ in range(n):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.serve", "--model", str(model_dir), "--port", str(port), "--enable-control",
             "--num-blocks", "128", "--page-size", "16", "--log-level", "warning", "--weight-transfer-timeout", "30"],
            cwd=REPO, env=env,
        )  # fmt: skip
        procs.append((f"http://127.0.0.1:{port}", proc))
    try:
        deadline = time.monotonic() + 240
        for url, proc in procs:
            while True:
                assert proc.poll() is None, f"the server at {url} exited"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"the server at {url} did not become healthy"
                time.sleep(0.5)
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _version(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/weight_transfer", timeout=2).json()["weight_version"])
    except httpx.HTTPError:
        return -1


@pytest.mark.slow  # two server processes, the router and four GRPO steps: a few minutes on 2 shared cores
def test_a_replica_killed_mid_run_is_dropped_and_the_run_finishes_on_the_survivor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    with serve_processes(model_dir, 2) as procs, vllm_router([url for url, _ in procs]) as router:
        (survivor, _), (victim, victim_proc) = procs
        killed = threading.Event()

        def kill_after_the_first_step() -> None:
            # Version 1 is the trainer's first send; version 2 the first step's: kill in the middle of the run.
            deadline = time.monotonic() + 600
            while _version(victim) < 2 and time.monotonic() < deadline and victim_proc.poll() is None:
                time.sleep(0.05)
            victim_proc.send_signal(signal.SIGKILL)
            killed.set()

        killer = threading.Thread(target=kill_after_the_first_step, daemon=True)
        killer.start()
        trainer = GRPOTrainer(
            tiny_config(tmp_path, rollout_server=f"{survivor},{victim}", rollout_router=router, max_steps=4),
            model=tiny_llama(),
            tokenizer=tiny_tokenizer(),
            train_dataset=token_dataset(),
            reward_funcs=[low_token_reward],
        )
        with caplog.at_level("WARNING", logger="rollout.fleet.pool"):
            rows = trainer.train()
        killer.join(10)
        assert killed.is_set() and victim_proc.wait(10) == -signal.SIGKILL
        assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
        assert f"rollout server {victim} dropped from the pool" in caplog.text
        assert httpx.get(f"{router}/list_workers").json()["urls"] == [survivor]
        assert _version(survivor) == 5  # the first send and one per step, none lost to the failure
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
        choice = httpx.post(f"{router}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["token_ids"] == reference_greedy(trainer.unwrapped, PROMPT, 8, None)
        assert choice["weight_versions"] == [5] * 8


@pytest.mark.slow  # two in-process servers, the router and three PPO steps: about a minute on 2 shared cores
def test_ppo_on_two_replicas_behind_the_router_ends_with_the_trainers_weights_on_both(tmp_path: Path) -> None:
    config = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
    served = [tiny_llama(seed=3), tiny_llama(seed=4)]  # both start from other weights: the first send replaces them
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running_server(m, tiny_tokenizer(), config)) for m in served]
        router = stack.enter_context(vllm_router([s.url for s in servers]))
        trainer = tiny_ppo_trainer(
            tmp_path,
            rollout_server=",".join(s.url for s in servers),
            rollout_router=router,
            max_steps=3,
            async_rollouts=True,
            max_staleness=1,
        )
        rows = trainer.train()
        assert [r["weight_version"] for r in rows] == [1, 2, 3]
        assert all(r["staleness_max"] <= 1 for r in rows)
        assert rows[0]["logprob_diff_max"] < 1e-3  # step 1: the replicas' logprobs are the trainer's, same weights
        assert [s.manager.weight_version for s in servers] == [4, 4]  # the first send, then one per step, on both
        assert all(sum(s.service.finished.values()) > 0 for s in servers)  # the prompts' sessions use both replicas
        for model in served:
            for (name, trained), (_, live) in zip(trainer.policy.named_parameters(), model.named_parameters()):
                assert torch.equal(trained, live), name
