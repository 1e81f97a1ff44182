"""Tasks and rewards: the generated arithmetic task, the GSM8K jsonl loader, the reward functions and
TRL's None rule."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.utils import assert_close
from trainers.rewards import (
    compute_rewards,
    correctness_reward,
    extract_answer,
    format_if_correct_reward,
    format_reward,
    required_columns,
    resolve_reward_func,
)
from trainers.tasks import (
    INSTRUCTION,
    arithmetic_dataset,
    build_dataset,
    gsm8k_final_answer,
    load_gsm8k_jsonl,
    normalize_number,
)


def test_arithmetic_dataset_is_deterministic_and_answers_are_right():
    a = arithmetic_dataset(size=200, seed=3)
    b = arithmetic_dataset(size=200, seed=3)
    assert a.to_list() == b.to_list()
    assert arithmetic_dataset(size=200, seed=4).to_list() != a.to_list()
    assert set(a.column_names) == {"prompt", "question", "answer"}
    ops = set()
    for row in a:
        x, y = (int(n) for n in re.findall(r"\d+", row["question"]))
        sub = any(w in row["question"] for w in ("gives", "takes"))
        ops.add(sub)
        assert int(row["answer"]) == (x - y if sub else x + y)
        assert int(row["answer"]) >= 0
        assert row["prompt"] == [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
    assert ops == {True, False}


def test_gsm8k_jsonl_loader(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    lines = [
        {"question": "Ann has 2 cats and 3 dogs. How many pets?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
        {"question": "A car costs $1,200 more than 800. Price?", "answer": "1200 + 800 = 2000\n#### 2,000", "id": 7},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = load_gsm8k_jsonl(path)
    assert ds["answer"] == ["5", "2000"]
    assert ds[0]["prompt"][0]["content"].startswith("Ann has 2 cats")
    assert ds[1]["solution"] == lines[1]["answer"]
    assert build_dataset(str(path))["answer"] == ["5", "2000"]
    assert build_dataset(f"gsm8k:{path}")["question"] == [x["question"] for x in lines]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q"}', "line 2: missing string field 'answer'"),
        ('{"question": "q", "answer": "7"}', "line 2: .*####"),
        ("not json", "line 2: not valid JSON"),
    ],
)
def test_gsm8k_loader_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_gsm8k_jsonl(path)


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="neither 'arithmetic'"):
        build_dataset("no-such-dataset.jsonl")


def test_numbers_are_normalised():
    assert normalize_number(" 1,234 ") == "1234"
    assert normalize_number("7.0") == "7"
    assert normalize_number("$3.50") == "3.5"
    assert gsm8k_final_answer("so 18 in all #### 18") == "18"


def test_extract_answer_prefers_the_answer_line():
    assert extract_answer("3 + 4 = 7 and 9.\nAnswer: 7") == "7"
    assert extract_answer("first 5 then 12") == "12"
    assert extract_answer("answer: **1,024**.") == "1024"
    assert extract_answer("no number") is None


def test_correctness_and_format_rewards():
    completions = [
        [{"role": "assistant", "content": "2 + 3 = 5\nAnswer: 5"}],  # right, final line
        [{"role": "assistant", "content": "Answer: 6 because 2 + 4"}],  # wrong number after Answer, mid text
        [{"role": "assistant", "content": "It is 5."}],  # right (last number), no format
        [{"role": "assistant", "content": "no idea"}],
    ]
    answers = ["5", "5", "5", "5"]
    assert correctness_reward(None, completions, None, answer=answers) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(None, completions, None) == [1.0, 0.5, 0.0, 0.0]
    assert format_reward(None, ["x\n answer: 12.\n"], None) == [1.0]
    # Formatting counts only on a right answer: the second completion has the format but the wrong number.
    assert format_if_correct_reward(None, completions, None, answer=answers) == [1.0, 0.0, 0.0, 0.0]
    assert format_if_correct_reward(None, ["Answer: 5 apples"], None, answer=["5"]) == [0.5]


def test_compute_rewards_treats_none_like_trl():
    def sometimes(prompts, completions, completion_ids, **kw):
        return [None, 1.0, None, 0.5]

    def never(prompts, completions, completion_ids, **kw):
        return [None, None, 2.0, None]

    rewards, per_func = compute_rewards(
        [sometimes, never], [1.0, 0.5], ["p"] * 4, ["c"] * 4, [[1]] * 4, {}, trainer_state=None
    )
    assert_close(rewards[1:], [1.0, 1.0, 0.5], atol=1e-7)
    assert math.isnan(rewards[0].item())  # nobody scored it: no reward, advantage 0
    assert torch.isnan(per_func[:, 0]).tolist() == [True, False, True, False]


def test_compute_rewards_passes_columns_and_checks_lengths():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(answer=answer, keys=sorted(kw))
        return [0.0] * len(completions)

    compute_rewards([spy], [1.0], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]}, trainer_state=None)
    assert seen == {"answer": ["1", "2"], "keys": ["trainer_state"]}
    with pytest.raises(ValueError, match="returned 1 rewards for 2"):
        compute_rewards([lambda **kw: [1.0]], [1.0], ["p", "q"], ["a", "b"], [[1], [2]], {})


def test_required_columns_and_resolution():
    assert required_columns(correctness_reward) == ["answer"]
    assert required_columns(format_reward) == []
    assert resolve_reward_func("correctness") is correctness_reward
    assert resolve_reward_func("trainers.rewards:format_reward") is format_reward
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward_func("nope")
    with pytest.raises(ValueError, match="cannot import 'trainers.rewards:missing'"):
        resolve_reward_func("trainers.rewards:missing")
