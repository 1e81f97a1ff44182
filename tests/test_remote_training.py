"""GRPO and PPO with their rollouts on a rollout-serve in another process (``rollout_server``): the trainer's weights
reach the server after every step. In-process runs check the weights and the staleness bound; a two-process run
(``python -m rollout.serve`` and ``accelerate launch scripts/train_grpo.py --rollout_server URL``) checks that after
the last step the server's greedy tokens and logprobs equal the saved model's forward.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from rollout import ContinuousBatchingConfig
from tests.serve_utils import free_port, running_server
from tests.test_grpo import low_token_reward, tiny_config, token_dataset
from tests.test_ppo import tiny_trainer as tiny_ppo_trainer
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs
from trainers.grpo import GRPOTrainer

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 20, 40, 7, 9]


def test_in_process_server_ends_with_the_trainers_weights_and_staleness_stays_bounded(tmp_path: Path) -> None:
    served = tiny_llama(seed=3)  # the server starts from other weights: the first send replaces them
    config = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
    with running_server(served, tiny_tokenizer(), config) as srv:
        trainer = GRPOTrainer(
            tiny_config(tmp_path, rollout_server=srv.url, max_steps=3, async_rollouts=True, max_staleness=1),
            model=tiny_llama(),
            tokenizer=tiny_tokenizer(),
            train_dataset=token_dataset(),
            reward_funcs=[low_token_reward],
        )
        rows = trainer.train()
        assert [r["weight_version"] for r in rows] == [1, 2, 3]
        assert all(r["staleness_max"] <= 1 for r in rows)
        assert abs(rows[0]["is_ratio_max"] - 1) < 1e-3  # step 1 trains on the weights that sampled it
        assert srv.manager.weight_version == 4  # the first send, then one per step
        for (name, trained), (_, live) in zip(trainer.unwrapped.named_parameters(), served.named_parameters()):
            assert torch.equal(trained, live), name


def test_ppo_on_an_in_process_server_ends_with_the_trainers_weights_and_staleness_stays_bounded(tmp_path: Path) -> None:
    """Issue 31: PPO takes ``rollout_server`` through the same backend as GRPO."""
    served = tiny_llama(seed=3)
    config = ContinuousBatchingConfig(num_blocks=128, page_size=16, return_logprobs=True)
    with running_server(served, tiny_tokenizer(), config) as srv:
        trainer = tiny_ppo_trainer(tmp_path, rollout_server=srv.url, max_steps=3, async_rollouts=True, max_staleness=1)
        rows = trainer.train()
        assert [r["weight_version"] for r in rows] == [1, 2, 3]
        assert all(r["staleness_max"] <= 1 for r in rows)
        assert rows[0]["logprob_diff_max"] < 1e-3  # step 1: the server's logprobs are the trainer's, same weights
        assert srv.manager.weight_version == 4  # the first send, then one per step
        for (name, trained), (_, live) in zip(trainer.policy.named_parameters(), served.named_parameters()):
            assert torch.equal(trained, live), name


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not become healthy")


def test_two_processes_server_greedy_equals_the_saved_models_forward_after_training(tmp_path: Path) -> None:
    model_dir, out = tmp_path / "model", tmp_path / "run"
    initial = tiny_llama()
    initial.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    (tmp_path / "grpo.yaml").write_text(
        "\n".join(
            [
                f"model: {model_dir}",
                "dataset_size: 64",
                "eval_size: 0",
                "batch_size: 8",
                "num_generations: 4",
                "max_prompt_length: 32",
                "max_new_tokens: 8",
                "micro_batch_size: 8",
                "learning_rate: 0.01",
                "temperature: 0.7",
                "max_steps: 2",
                "reward_funcs: ['tests.test_grpo:low_token_reward']",
                "weight_sync_bucket_mb: 1",
            ]
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "rollout.serve", "--model", str(model_dir), "--port", str(port), "--enable-control",
         "--num-blocks", "128", "--page-size", "16", "--log-level", "warning"],
        cwd=REPO, env=env,
    )  # fmt: skip
    try:
        _wait_healthy(url, server)
        train = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/one_process.yaml",
             "scripts/train_grpo.py", "--config", str(tmp_path / "grpo.yaml"), "--rollout_server", url,
             "--output_dir", str(out)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert train.returncode == 0, train.stderr[-4000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["weight_version"] for r in rows] == [1, 2]
        saved = AutoModelForCausalLM.from_pretrained(out).eval()
        assert any(not torch.equal(a, b) for a, b in zip(saved.parameters(), initial.parameters()))  # it trained
        choice = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "return_token_ids": True,
                  "ignore_eos": True},
            timeout=60,
        ).json()["choices"][0]  # fmt: skip
        assert choice["token_ids"] == reference_greedy(saved, PROMPT, 8, None)
        assert_close(
            choice["logprobs"]["token_logprobs"], teacher_forced_logprobs(saved, PROMPT, choice["token_ids"]), 1e-4
        )
        assert choice["weight_versions"] == [3] * 8  # the first send and two steps
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
