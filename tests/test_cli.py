"""The command-line entry points as a user runs them: numbers in every notation, empty dataset files, and
the flag parser of the GRPO trainer (``rollout-train-grpo``, ``rollout-score``, ``accelerate launch``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import tiny_llama, tiny_tokenizer
from trainers.cli import parse_config
from trainers.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _console(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"the console script {name} is not installed (pip install -e .)"
    return path


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUT_HOME": str(cwd / "home")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _gsm8k(path: Path, n: int = 12) -> Path:
    rows = [{"question": f"t{5 + i} t{20 + i} t{40 + i}", "answer": f"t7\n#### {i % 3}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------- numbers (issue: 1e-5 refused)
NOTATIONS = {"learning_rate": "1e-5", "advantage_eps": "1E-5", "epsilon": "2.0e-1", "dataset_size": "5e3"}
EXPECTED = {"learning_rate": 1e-5, "advantage_eps": 1e-5, "epsilon": 0.2, "dataset_size": 5000}


@pytest.mark.parametrize("where", ["file", "set", "flag"])
def test_every_number_notation_parses(tmp_path, where):
    if where == "file":
        path = tmp_path / "c.yaml"
        path.write_text("".join(f"{k}: {v}\n" for k, v in NOTATIONS.items()))
        config = parse_config(["--config", str(path)])
    elif where == "set":
        config = parse_config([a for k, v in NOTATIONS.items() for a in ("--set", f"{k}={v}")])
    else:
        config = parse_config([a for k, v in NOTATIONS.items() for a in (f"--{k}", v)])
    for key, value in EXPECTED.items():
        assert getattr(config, key) == value and type(getattr(config, key)) is type(value), key


def test_engine_numbers_and_mappings_parse():
    config = parse_config(
        ["--engine", "{max_batch_tokens: 1e3, max_memory_percent: 5E-2}", "--set", "engine.block_size=16"]
    )
    given = {k: config.engine[k] for k in ("max_batch_tokens", "max_memory_percent", "block_size")}
    assert given == {"max_batch_tokens": 1000, "max_memory_percent": 0.05, "block_size": 16}
    assert config.engine_config().max_batch_tokens == 1000


@pytest.mark.parametrize(
    "argv",
    [
        ["--mixed_precision", "bf16", "--dtype", "float32"],
        ["--set", "mixed_precision=bf16"],
        ["--set", "mixed_precision=no", "--mixed_precision", "bf16"],  # --set comes last and wins: "no"
    ],
)
def test_precision_options_parse(argv):
    # mixed_precision is accelerate's setting ("no", "bf16", "fp16"); YAML reads an unquoted no as false.
    config = parse_config(argv)
    assert config.mixed_precision == ("no" if "mixed_precision=no" in argv else "bf16")
    assert config.dtype == "float32"
    assert parse_config([]).mixed_precision is None and parse_config([]).dtype == "float32"


def test_precision_options_parse_from_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: no\ndtype: bfloat16\n")
    config = parse_config(["--config", str(path)])
    assert (config.mixed_precision, config.dtype) == ("no", "bfloat16")
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        parse_config(["--mixed_precision", "fp8"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rat", "1e-5"], "did you mean --learning_rate"),
        (["--set", "learning_rat=1e-5"], "did you mean 'learning_rate'"),
        (["--set", "max_steps=2.5"], "max_steps must be an int"),
        (["--set", "learning_rate=fast"], "learning_rate must be a number"),
        (["--set", "nokey"], "--set expects KEY=VALUE"),
    ],
)
def test_bad_arguments_name_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("max_steps: 2.5", "max_steps must be an int, got '2.5'"),
        ("max_steps: [1, 2]", "max_steps must be an int"),
        ("temperature: warm", "temperature must be a number, got 'warm'"),
        ("save_model: maybe", "save_model must be true or false, got 'maybe'"),
        ("loss_type: sum", r"loss_type must be one of \('dapo', 'grpo'\), got 'sum'"),
        ("engine: [1]", "engine must be a YAML mapping"),
        ("max_steps: null", "max_steps must be an int, got 'null'"),
    ],
)
def test_a_file_value_of_the_wrong_type_is_refused_by_the_fields_parser(tmp_path, line, message):
    # The file's values go through the flags' type functions: one rule wherever a value comes from.
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"c.yaml: {message}"):
        parse_config(["--config", str(path)])


def test_null_sets_an_optional_field_from_the_command_line_and_yaml_reads_no_as_text(tmp_path):
    from trainers.ppo_config import PPOConfig

    path = tmp_path / "c.yaml"
    path.write_text("eval_steps: 5\nkl_coef: 0.1\nkl_target: 2.0\nmixed_precision: no\nreward_weights: [1, 0.5]\n")
    config = parse_config(["--config", str(path), "--eval_steps", "null", "--set", "kl_target=null"], PPOConfig)
    assert (config.eval_steps, config.kl_target, config.mixed_precision) == (None, None, "no")
    assert config.reward_weights == [1.0, 0.5] and all(type(w) is float for w in config.reward_weights)


def test_null_unsets_a_list_field_in_a_file_a_flag_and_a_set_item(tmp_path):
    # argparse reads a list flag's "null" as [None]; an optional list field given null is None, as every other field.
    path = tmp_path / "c.yaml"
    path.write_text("reward_weights: null\n")
    assert parse_config(["--config", str(path)]).reward_weights is None
    weighted = tmp_path / "w.yaml"
    weighted.write_text("reward_weights: [1.0, 0.5]\n")
    assert parse_config(["--config", str(weighted), "--reward_weights", "null"]).reward_weights is None
    assert parse_config(["--config", str(weighted), "--set", "reward_weights=null"]).reward_weights is None


def test_a_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*nothere.yaml: no such file"):
        parse_config(["--config", str(tmp_path / "nothere.yaml")])


def test_a_bad_flag_is_not_blamed_on_the_config_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("max_steps: 3\n")
    with pytest.raises(ConfigError) as flag_error:
        parse_config(["--config", str(good), "--max_steps", "-1"])
    assert str(flag_error.value) == "max_steps must be >= 1, got -1"  # no file name: the file is fine
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: -1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: max_steps must be >= 1, got -1"):
        parse_config(["--config", str(bad)])


def test_reward_funcs_on_the_command_line_drop_the_files_weights(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("reward_funcs: [correctness, format]\nreward_weights: [1.0, 0.5]\n")
    config = parse_config(["--config", str(path), "--reward_funcs", "correctness"])
    assert (config.reward_funcs, config.reward_weights) == (["correctness"], None)
    config = parse_config(["--config", str(path), "--set", "reward_funcs=[format]", "--set", "reward_weights=[2.0]"])
    assert (config.reward_funcs, config.reward_weights) == (["format"], [2.0])
    with pytest.raises(ConfigError, match=r"unknown reward 'nonsense'; known: \['correctness', 'format'"):
        parse_config(["--config", str(path), "--reward_funcs", "nonsense"])


def test_eval_of_a_run_saved_without_its_model_says_so(tmp_path, capsys):
    from trainers.cli import eval_main

    (tmp_path / "grpo_config.json").write_text(json.dumps({"max_steps": 1, "save_model": False}))
    assert eval_main(["--model", str(tmp_path)]) == 2
    assert "holds a run but no saved model (the run had save_model: false)" in capsys.readouterr().err


def test_scientific_notation_through_the_console_script_and_accelerate_launch(tmp_path, tiny_model_dir):
    data = _gsm8k(tmp_path / "train.jsonl")
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 1e-5\nadvantage_eps: 1E-5\n")
    common = ["--config", str(config), "--model", str(tiny_model_dir), "--dataset", str(data), "--max_steps", "1"]
    common += ["--set", "epsilon=2.0e-1", "--set", "batch_size=4", "--max_new_tokens", "4", "--eval_size", "2e0"]
    common += ["--save_model", "false"]
    launchers = {
        "console": [_console("rollout-train-grpo")],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file"],
    }
    launchers["accelerate"] += [str(REPO / "configs/accelerate/one_process.yaml"), str(REPO / "scripts/train_grpo.py")]
    for name, launcher in launchers.items():
        out = tmp_path / name
        proc = _run([*launcher, *common, "--output_dir", str(out)], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = json.loads((out / "grpo_config.json").read_text())
        assert (saved["learning_rate"], saved["advantage_eps"], saved["epsilon"], saved["eval_size"]) == (
            1e-5,
            1e-5,
            0.2,
            2,
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and "eval_accuracy" in rows[1]


# ---------------------------------------------------------------------- empty dataset files
EMPTY_CASES = {
    "empty.jsonl": ("", "is empty"),
    "blank.jsonl": ("\n  \n\n", "holds only blank lines"),
}


@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_score_console_script_explains_an_empty_file(tmp_path, tiny_model_dir, name):
    text, message = EMPTY_CASES[name]
    (tmp_path / name).write_text(text)
    cmd = [_console("rollout-score"), "--model", str(tiny_model_dir), "--dataset", name]
    proc = _run([*cmd, "--prompt-column", "p", "--completion-column", "c", "--output", "o.jsonl"], tmp_path)
    assert proc.returncode == 1
    assert message in proc.stderr and "StopIteration" not in proc.stderr, proc.stderr


def test_score_console_script_explains_an_empty_column(tmp_path, tiny_model_dir):
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"p": "t5 t6", "c": ""}) + "\n" + json.dumps({"p": "t7", "c": None}) + "\n"
    )
    cmd = [_console("rollout-score"), "--model", str(tiny_model_dir), "--dataset", "d.jsonl"]
    proc = _run([*cmd, "--prompt-column", "p", "--completion-column", "c", "--output", "o.jsonl"], tmp_path)
    assert proc.returncode == 1
    assert "column 'c' is empty in every row" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_trainer_explains_an_empty_dataset_file(tmp_path, name):
    text, message = EMPTY_CASES[name]
    (tmp_path / name).write_text(text)
    proc = _run([_console("rollout-train-grpo"), "--dataset", name, "--model", "/nonexistent"], tmp_path)
    assert proc.returncode == 2
    assert "bad config: dataset:" in proc.stderr and message in proc.stderr, proc.stderr


def test_trainer_explains_an_empty_question_under_accelerate_launch(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": " ", "answer": "#### 3"}) + "\n")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    launch += [str(REPO / "configs/accelerate/one_process.yaml"), str(REPO / "scripts/train_grpo.py")]
    proc = _run([*launch, "--dataset", "d.jsonl", "--model", "/nonexistent"], tmp_path)
    assert proc.returncode != 0
    assert "line 1: field 'question' is empty" in proc.stderr, proc.stderr[-2000:]
