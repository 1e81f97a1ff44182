"""The command-line entry points: ``rollout-train-grpo`` / scripts/train_grpo.py (``trainers.cli``: bad config,
tracker, the real default job) and ``rollout-plot`` / scripts/plot_metrics.py (``trainers.plotting``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainers.cli as train_grpo
import trainers.plotting as plot_metrics
from tests.test_grpo import REQUIRED_METRICS, tiny_trainer

REPO = Path(__file__).resolve().parents[1]


def test_script_rejects_unknown_key_naming_it(capsys):
    assert train_grpo.main(["--set", "learning_rat=1e-5"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'learning_rat'" in err and "did you mean 'learning_rate'" in err


def test_script_rejects_batch_not_divisible_by_g(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("batch_size: 6\nnum_generations: 4\n")
    assert train_grpo.main(["--config", str(config)]) == 2
    assert "batch_size (6) must be a multiple of num_generations (4)" in capsys.readouterr().err


def test_plot_metrics_writes_a_png(tmp_path):
    rows = [
        {
            "step": i + 1,
            "reward_mean": 0.1 * i,
            "rewards/format": 0.05 * i,
            "rollout_tokens_per_s": 50.0 + i,
            "step_time_s": 20.0,
        }
        for i in range(6)
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "curve.png"
    assert plot_metrics.main([str(metrics), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics.moving_average([1.0, 3.0, float("nan"), 5.0], 2) == [1.0, 2.0, 3.0, 5.0]


def test_tensorboard_tracker_logs_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    tiny_trainer(tmp_path, max_steps=2, log_with="tensorboard").train()
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events, "no tensorboard event file"


@pytest.mark.slow
def test_default_job_runs_with_accelerate_launch_on_the_real_model(tmp_path):
    """The README's main command, `accelerate launch --config_file configs/accelerate/one_process.yaml
    scripts/train_grpo.py`, on SmolLM2-135M-Instruct and the default task, prints no accelerate warning;
    smaller batches and evaluation than the default so CI stays short."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/one_process.yaml",
        "scripts/train_grpo.py",
        "--max_steps",
        "2",
        "--output_dir",
        str(out),
        "--set",
        "batch_size=8",
        "--set",
        "max_new_tokens=24",
        "--eval_size",
        "8",
        "--eval_max_new_tokens",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "were not passed to `accelerate launch`" not in proc.stderr, proc.stderr[:2000]
    assert f"writing metrics, samples and the final model to {out}" in proc.stderr
    assert "held-out eval_accuracy" in proc.stderr and f"outputs in {out}" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1]
    timing = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    rows = [{**t, **r} for r, t in zip(rows[1:], timing[1:])]
    for key in REQUIRED_METRICS:
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert abs(rows[0]["is_ratio_max"] - 1) < 1e-3  # step 1: the rollout's weights are the trained weights
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert plot_metrics.main([str(out / "metrics.jsonl")]) == 0
    assert (out / "reward_curve.png").exists()


def test_plot_refuses_a_file_that_is_not_metrics(tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match=r"gsm.jsonl: not a trainer's metrics.jsonl \(rows without a 'step'\)"):
        plot_metrics.read_metrics(data)


def test_output_dir_holding_a_run_or_being_a_file_is_refused(tmp_path):
    from trainers.config import ConfigError, GRPOConfig
    from trainers.grpo import resolve_output_dir

    run = tmp_path / "run"
    run.mkdir()
    assert resolve_output_dir(GRPOConfig(output_dir=str(run)), 1) == run  # an empty folder is fine
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl\); pass --overwrite_output_dir"):
        resolve_output_dir(GRPOConfig(output_dir=str(run)), 1)
    assert resolve_output_dir(GRPOConfig(output_dir=str(run), overwrite_output_dir=True), 1) == run
    afile = tmp_path / "data.jsonl"
    afile.write_text("{}\n")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        resolve_output_dir(GRPOConfig(output_dir=str(afile), overwrite_output_dir=True), 1)


def test_a_model_path_that_does_not_load_is_a_config_error(tmp_path, capsys):
    code = train_grpo.main(["--model", str(tmp_path / "nomodel"), "--output_dir", str(tmp_path / "out")])
    assert code == 2
    assert f"error: bad config: model: cannot load '{tmp_path / 'nomodel'}'" in capsys.readouterr().err


# ---------------------------------------------------------------------- one entry for both recipes (issue 43)
@pytest.fixture
def recipes(monkeypatch):
    """Replace the four trainers' entry points by recorders: which recipe ran, with which config."""
    import trainers.grpo
    import trainers.multiturn
    import trainers.ppo

    ran = []
    for module, name in (
        (trainers.grpo, "train_grpo"),
        (trainers.ppo, "train_ppo"),
        (trainers.multiturn, "train_multiturn_grpo"),
        (trainers.multiturn, "train_multiturn_ppo"),
    ):
        monkeypatch.setattr(module, name, lambda config, name=name: ran.append((name, config)))
    return ran


def test_the_grpo_command_runs_a_config_with_an_environment_as_the_multi_turn_recipe(recipes):
    from trainers.multiturn import MultiTurnGRPOConfig, MultiTurnPPOConfig

    assert train_grpo.main(["--config", str(REPO / "configs" / "grpo_multiturn.yaml"), "--max_steps", "3"]) == 0
    name, config = recipes.pop()
    assert name == "train_multiturn_grpo" and type(config) is MultiTurnGRPOConfig
    assert config.environment == "retry_arithmetic" and config.max_episode_tokens == 192 and config.max_steps == 3
    # --environment alone picks the multi-turn recipe's own file; --set environment=... too.
    for argv in (["--environment", "retry_arithmetic"], ["--set", "environment=retry_arithmetic"]):
        assert train_grpo.main(argv) == 0
        name, config = recipes.pop()
        assert name == "train_multiturn_grpo" and config.max_turns == 2 and config.max_episode_tokens == 192
    # Without an environment: single-turn GRPO, as before.
    assert train_grpo.main(["--max_steps", "3"]) == 0
    name, config = recipes.pop()
    assert name == "train_grpo" and not isinstance(config, MultiTurnGRPOConfig)
    # The PPO command likewise.
    assert train_grpo.ppo_main(["--environment", "retry_arithmetic", "--max_steps", "2"]) == 0
    name, config = recipes.pop()
    assert name == "train_multiturn_ppo" and type(config) is MultiTurnPPOConfig and config.max_steps == 2
    assert train_grpo.ppo_main(["--max_steps", "2"]) == 0
    assert recipes.pop()[0] == "train_ppo"


def test_scripts_train_grpo_reads_the_multi_turn_recipe_s_keys():
    """The script as a user runs it: the multi-turn file's keys are known (a bad value of one is refused by the
    multi-turn config, before any model loads), not "unknown key 'environment'"."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "scripts/train_grpo.py", "--config", "configs/grpo_multiturn.yaml", "--max_turns", "0"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "error: bad config: max_turns must be >= 1, got 0" in result.stderr and "unknown key" not in result.stderr
