"""Two CPU processes train together (DDP over gloo through accelerate): the weights are identical on both
ranks after every step, and the ranks trained on different prompts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.tiny_models import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]

# A template that keeps the message text as tiny-tokenizer words.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def low_token_reward(prompts, completions, completion_ids, **kwargs):
    """Fraction of completion tokens with id < 100 (varies across samples of a tiny random model)."""
    return [sum(1.0 for t in ids if t < 100) / len(ids) for ids in completion_ids]


DRIVER = textwrap.dedent(
    """
    import hashlib, json, sys
    sys.path.insert(0, {repo!r})
    from trainers import grpo
    sys.path.insert(0, {scripts!r})
    import train_grpo

    record = {record!r}

    class Recording(grpo.GRPOTrainer):
        def _rows_for_batch(self, j):
            rows = super()._rows_for_batch(j)
            with open(f"{{record}}/prompts{{self.rank}}.jsonl", "a") as f:
                f.write(json.dumps([r["question"] for r in rows]) + "\\n")
            return rows

        def train_step(self, step):
            row = super().train_step(step)
            h = hashlib.sha256()
            for name, p in sorted(self.unwrapped.named_parameters()):
                h.update(name.encode())
                h.update(p.detach().cpu().numpy().tobytes())
            with open(f"{{record}}/rank{{self.rank}}.jsonl", "a") as f:
                f.write(json.dumps({{"step": step, "sha": h.hexdigest(), "world": self.world_size}}) + "\\n")
            return row

    grpo.GRPOTrainer = Recording
    sys.exit(train_grpo.main(sys.argv[1:]))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_and_data(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny model folder (its tokenizer with a chat template) and a GSM8K-format file of 32 questions."""
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"question": f"t{5 + i} t{40 + i % 9} t{70 + i % 4}", "answer": f"#### {i}"}) for i in range(32)
        )
    )
    return model_dir, data


def launch_two_processes(driver: Path, args: list[str]) -> None:
    """``accelerate launch`` ``driver`` with ``args`` in two CPU processes (configs/accelerate/cpu_2proc.yaml, on
    a free port); fails the test with the tail of their output when the launch does not exit 0."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs/accelerate/cpu_2proc.yaml"),
        "--main_process_port",
        str(_free_port()),
        str(driver),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_two_cpu_processes_keep_identical_weights(tmp_path):
    model_dir, data = tiny_model_and_data(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            model: {model_dir}
            dataset: {data}
            reward_funcs: ["tests.test_grpo_distributed:low_token_reward"]
            num_generations: 4
            batch_size: 8
            max_new_tokens: 8
            temperature: 0.7
            learning_rate: 1.0e-2
            micro_batch_size: 3
            async_rollouts: true
            max_staleness: 1
            max_steps: 3
            eval_size: 4
            engine: {{num_blocks: 64}}
            """
        )
    )
    record = tmp_path / "record"
    record.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), scripts=str(REPO / "scripts"), record=str(record)))
    out = tmp_path / "out"
    launch_two_processes(driver, ["--config", str(config), "--output_dir", str(out)])

    ranks = [[json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [row["step"] for row in ranks[0]] == [0, 1, 2] == [row["step"] for row in ranks[1]]
    assert all(row["world"] == 2 for rows in ranks for row in rows)
    for a, b in zip(*ranks):
        assert a["sha"] == b["sha"], f"weights differ across ranks after step {a['step']}"
    assert len({row["sha"] for row in ranks[0]}) == 3, "the weights should change at every step"

    prompts = [
        [q for line in (record / f"prompts{r}.jsonl").read_text().splitlines() for q in json.loads(line)]
        for r in (0, 1)
    ]
    assert prompts[0] and not set(prompts[0]) & set(prompts[1])

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # Both ranks evaluate their half of the 4 held-out problems; the row holds the total.
    assert [("eval_accuracy" in r) for r in rows] == [True, False, False, True]
    samples = [json.loads(line) for line in (out / "eval_completions.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 and {s["step"] for s in samples} == {0, 3}
    assert sorted(s["question"] for s in samples[:4]) == sorted(s["question"] for s in samples[4:])
    assert all(r["staleness_max"] <= 1 for r in rows[1:])
    assert (out / "model.safetensors").exists()
