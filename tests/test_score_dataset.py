"""scripts/score_dataset.py end to end on a tiny llama saved to disk with the tiny word-level tokenizer."""

from __future__ import annotations

import csv
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import benchmarks.scoring as bench
import rollout.scoring.cli as score_dataset
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close, teacher_forced_logprobs

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "score_dataset.py"
ATOL = 1e-4

# Texts of the tiny tokenizer: "tN" is token N, words split on whitespace.
ROWS = [
    {"prompt": "t5 t6 t7 t8 t9 t10 t11 t12 t13 t14", "completion": " t20 t21 t22 t23 t24 t25 t26", "id": "a"},
    {"prompt": "t40 t41 t42", "completion": " t50 t51", "id": "b"},
    {"prompt": "t5 t6 t7 t8 t9 t10 t11 t12 t13 t14", "completion": " t30 t31 t32", "id": "c"},
    {"prompt": "t60 t61", "completion": "", "id": "d"},
]
TOKENS = [  # (prompt ids, completion ids) of ROWS
    (list(range(5, 15)), list(range(20, 27))),
    ([40, 41, 42], [50, 51]),
    (list(range(5, 15)), [30, 31, 32]),
    ([60, 61], []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    tokenizer = tiny_tokenizer()
    # A chat template in the tiny vocabulary: t3 <user text> t4, then t5 opens the assistant turn.
    tokenizer.chat_template = (
        "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5 {% endif %}"
    )
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _argv(model_dir: Path, dataset: Path, output: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model_dir), "--dataset", str(dataset), "--prompt-column", "prompt",
        "--completion-column", "completion", "--output", str(output), *extra,
    ]  # fmt: skip


def _check_scores(model, rows: list[dict], tokens: list[tuple[list[int], list[int]]]) -> None:
    for row, (p, c) in zip(rows, tokens):
        assert row["completion_num_tokens"] == len(c)
        if c:
            expected = teacher_forced_logprobs(model, p, c)
            assert_close(row["completion_logprobs"], expected, atol=ATOL)
            assert row["completion_logprob_sum"] == pytest.approx(sum(expected), abs=ATOL * len(c))
        else:
            assert row["completion_logprobs"] == [] and row["completion_logprob_sum"] == 0.0


def test_csv_input_jsonl_output_matches_teacher_forcing(model_dir: Path, model, tmp_path: Path) -> None:
    dataset = _write_csv(tmp_path / "in.csv", ROWS)
    output = tmp_path / "out" / "scored.jsonl"
    assert score_dataset.main(_argv(model_dir, dataset, output, "--batch-tokens", "8")) == 0
    rows = _read_jsonl(output)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d"]
    # csv reads the empty completion of row "d" as null: an empty completion, not an error.
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    _check_scores(model, rows, TOKENS)


def test_jsonl_input_parquet_output_matches_teacher_forcing(model_dir: Path, model, tmp_path: Path) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    output = tmp_path / "scored.parquet"
    assert score_dataset.main(_argv(model_dir, dataset, output)) == 0
    table = pq.read_table(output)
    assert table.column_names == ["prompt", "completion", "id", *score_dataset.OUTPUT_COLUMNS]
    _check_scores(model, table.to_pylist(), TOKENS)


def test_temperature_flag(model_dir: Path, model, tmp_path: Path) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    output = tmp_path / "scored.jsonl"
    assert score_dataset.main(_argv(model_dir, dataset, output, "--temperature", "0.5")) == 0
    for row, (p, c) in zip(_read_jsonl(output), TOKENS):
        assert_close(row["completion_logprobs"], teacher_forced_logprobs(model, p, c, temperature=0.5), atol=ATOL)


def test_chat_template_prompt_and_appended_completion(model_dir: Path, model, tmp_path: Path) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "t10 t11", "completion": "t20 t21 t22"}])
    output = tmp_path / "scored.jsonl"
    assert score_dataset.main(_argv(model_dir, dataset, output, "--chat-template")) == 0
    # "t3 t10 t11 t4 t5 " + "t20 t21 t22"
    _check_scores(model, _read_jsonl(output), [([3, 10, 11, 4, 5], [20, 21, 22])])


def test_boundary_merge_falls_back_to_separate_completion_with_warning(
    model_dir: Path, model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "t5 t7" + "t8" is "t5 t7t8": the joint tokens [5, 0] do not start with [5, 7].
    dataset = _write_jsonl(tmp_path / "in.jsonl", [ROWS[1], {"prompt": "t5 t7", "completion": "t8", "id": "e"}])
    output = tmp_path / "scored.jsonl"
    with caplog.at_level(logging.WARNING):
        assert score_dataset.main(_argv(model_dir, dataset, output)) == 0
    assert "1 of 2 rows (first: row 1)" in caplog.text
    assert "tokenized separately" in caplog.text
    _check_scores(model, _read_jsonl(output), [TOKENS[1], ([5, 7], [8])])


def test_too_long_row_errors_or_is_skipped_with_nulls(
    model_dir: Path, model, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    long_prompt = " ".join(f"t{3 + i % 250}" for i in range(520))  # the tiny context is 512
    dataset = _write_jsonl(tmp_path / "in.jsonl", [ROWS[1], {"prompt": long_prompt, "completion": " t9", "id": "x"}])
    output = tmp_path / "scored.jsonl"
    assert score_dataset.main(_argv(model_dir, dataset, output)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: row 1 has 520 prompt + 1 completion tokens, more than the model's context of 512 tokens; "
        "pass --skip-too-long to skip such rows"
    ]
    assert not output.exists()
    assert score_dataset.main(_argv(model_dir, dataset, output, "--skip-too-long")) == 0
    rows = _read_jsonl(output)
    _check_scores(model, rows[:1], TOKENS[1:2])
    assert [rows[1][c] for c in score_dataset.OUTPUT_COLUMNS] == [None, None, None]


def test_missing_column_error_lists_columns_present(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", [{"question": "t5", "answer": " t6", "id": 1}])
    assert score_dataset.main(_argv(model_dir, dataset, tmp_path / "o.jsonl")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: column 'prompt' not found in {dataset}; columns present: question, answer, id"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", '{"prompt": "t5", \n', "error: cannot read {path} as json: "),
        ("bad.parquet", "not parquet", "error: cannot read {path} as parquet: "),
        ("missing.jsonl", None, "error: dataset file {path} does not exist"),
        ("data.txt", "t5", "error: cannot read {path}: unsupported extension '.txt'"),
    ],
)
def test_unreadable_dataset_is_one_line_error(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert score_dataset.main(_argv(model_dir, path, tmp_path / "o.jsonl")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message.format(path=path))


@pytest.mark.parametrize(
    "extra",
    [
        ["--batch-tokens", "0"],
        ["--temperature", "-1"],
        ["--temperature", "nan"],
        ["--bogus"],
        ["--chat-template", "--separator", " "],
    ],
)
def test_bad_flags_exit_2(model_dir: Path, tmp_path: Path, extra: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        score_dataset.main(_argv(model_dir, tmp_path / "in.jsonl", tmp_path / "o.jsonl", *extra))
    assert info.value.code == 2
    flag = next(arg for arg in reversed(extra) if arg.startswith("--"))
    assert flag in capsys.readouterr().err  # the message names the flag


def test_bad_output_extension_exits_2(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        score_dataset.main(_argv(model_dir, tmp_path / "in.jsonl", tmp_path / "o.csv"))
    assert info.value.code == 2


def test_tp_needs_a_torchrun_launch(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        score_dataset.main(_argv(model_dir, tmp_path / "in.jsonl", tmp_path / "o.jsonl", "--tp"))
    assert info.value.code == 2


def test_tp_under_torchrun_matches_teacher_forcing_and_rank_0_alone_writes(
    model_dir: Path, model, tmp_path: Path
) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", ROWS)
    output = tmp_path / "scored.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    launch += ["--master_port", str(port), str(SCRIPT), "--tp", *_argv(model_dir, dataset, output)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(launch, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stderr.count("wrote 4 rows to") == 1
    rows = _read_jsonl(output)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d"]
    _check_scores(model, rows, TOKENS)


def test_script_runs_from_checkout_and_prints_no_traceback(model_dir: Path, tmp_path: Path) -> None:
    dataset = _write_jsonl(tmp_path / "in.jsonl", [{"question": "t5", "answer": " t6"}])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *_argv(model_dir, dataset, tmp_path / "o.jsonl")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: column 'prompt' not found in {dataset}; columns present: question, answer"
    ]


def test_bench_scoring_agrees_with_padded_forwards_on_tiny_model(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}t5 "
    words = " ".join(f"t{i}" for i in range(10, 40))
    gsm8k = _write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [{"question": f"t{7 + q} {words}", "answer": f"t50 t51 t52 t53\nt54 t55 t56\n#### {q}"} for q in range(3)],
    )
    report = bench.bench_scoring(tiny_llama(), tokenizer, gsm8k, num_questions=3, batch_tokens=16, padded_batch_size=3)
    assert report["num_rows"] == 12 and report["agree"] and report["max_abs_diff"] <= ATOL
    # Across linear kernels (oneDNN in the engine, MKL in the timed padded forward) the logprobs still
    # agree closely on a tiny model; the check itself is on one kernel.
    assert 0.0 <= report["max_abs_diff_across_kernels"] <= ATOL
    # Prompts of 34 tokens: a question's later completions reuse its first block (32 tokens), and
    # rows whose tokens are identical (unknown words all map to token 0) are computed once.
    assert report["rollout_tokens_computed"] <= report["row_tokens"] - 3 * 32
    assert report["ratio"] == pytest.approx(report["padded_s"] / report["rollout_s"])
    assert bench.answer_variants("a b c d\ne f\n#### 12") == [
        "a b c d\ne f\n#### 12",
        "a b c",
        "a b c d\ne f\n#### 13",
        "#### 12",
    ]


def test_prompt_text_that_starts_with_bos_gets_one_bos() -> None:
    # Issue 10, case 6: a Llama-3-style tokenizer adds its BOS to every text; a prompt that already
    # starts with the BOS text got a second one.
    from tests.tiny_models import BOS_TOKEN_ID, LLAMA3_BOS, llama3_style_tokenizer

    tokenizer = llama3_style_tokenizer()
    prompts = [f"{LLAMA3_BOS}t5 t6", "t5 t6", f"{LLAMA3_BOS} t7"]
    prompt_ids, completion_ids, fallback = score_dataset.tokenize_rows(tokenizer, prompts, [" t8", " t8", " t9"])
    assert prompt_ids == [[BOS_TOKEN_ID, 5, 6], [BOS_TOKEN_ID, 5, 6], [BOS_TOKEN_ID, 7]]
    assert completion_ids == [[8], [8], [9]] and fallback == []
    chat = llama3_style_tokenizer(chat_template=True)  # the template writes the BOS text itself
    prompt_ids, completion_ids, _ = score_dataset.tokenize_rows(chat, ["t5 t6"], ["t8"], chat_template=True)
    assert prompt_ids == [[BOS_TOKEN_ID, 5, 6, 2, 9]] and completion_ids == [[8]]
