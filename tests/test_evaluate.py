"""Held-out evaluation: the split never overlaps training, the scoring rule, and the trainer's eval rows."""

from __future__ import annotations

import json

import datasets
import pytest
from transformers import GenerationConfig

import rollout
from tests.tiny_models import tiny_llama, tiny_tokenizer
from trainers.evaluate import evaluate_greedy, evaluate_model, is_correct, last_number
from trainers.tasks import arithmetic_dataset, build_datasets, heldout_arithmetic_dataset, split_heldout


def test_heldout_arithmetic_problems_never_appear_in_training():
    train, heldout = build_datasets("arithmetic", size=2000, seed=0, eval_size=200, eval_seed=1234)
    assert len(train) == 2000 and len(heldout) == 200
    assert not set(train["question"]) & set(heldout["question"])
    assert len(set(heldout["question"])) == 200
    # The seed alone would repeat some training problems: the split removed them.
    raw = arithmetic_dataset(200, 1234)
    assert set(raw["question"]) & set(train["question"]), "expected the raw seed to overlap training"
    assert heldout.to_list() == build_datasets("arithmetic", 2000, 0, eval_size=200, eval_seed=1234)[1].to_list()


def test_heldout_arithmetic_skips_excluded_questions():
    first = heldout_arithmetic_dataset(5, seed=7, exclude=[])
    skipped = heldout_arithmetic_dataset(4, seed=7, exclude=[first[0]["question"]])
    assert skipped["question"] == first["question"][1:5]


def _gsm8k_file(path, questions):
    path.write_text(
        "".join(json.dumps({"question": q, "answer": f"x\n#### {i}"}) + "\n" for i, q in enumerate(questions))
    )
    return str(path)


def test_gsm8k_file_holds_out_its_last_rows_and_their_duplicates(tmp_path):
    path = _gsm8k_file(tmp_path / "g.jsonl", ["a?", "b?", "c?", "b?", "d?", "e?"])
    train, heldout = build_datasets(path, eval_size=2)
    assert heldout["question"] == ["d?", "e?"]
    assert train["question"] == ["a?", "b?", "c?", "b?"]
    train, heldout = split_heldout(datasets.Dataset.from_list([{"question": q} for q in "abcb"]), 1)
    assert heldout["question"] == ["b"] and train["question"] == ["a", "c"]
    with pytest.raises(ValueError, match="cannot hold out 6 of 6"):
        build_datasets(path, eval_size=6)


def test_gsm8k_eval_file_is_removed_from_training(tmp_path):
    train_path = _gsm8k_file(tmp_path / "train.jsonl", ["a?", "b?", "c?"])
    test_path = _gsm8k_file(tmp_path / "test.jsonl", ["b?", "z?", "y?"])
    train, heldout = build_datasets(train_path, eval_dataset=test_path, eval_size=2)
    assert heldout["question"] == ["b?", "z?"] and train["question"] == ["a?", "c?"]
    assert build_datasets(train_path, eval_size=0)[1] is None


@pytest.mark.parametrize(
    ("text", "answer", "right"),
    [
        ("Tom has 3 + 4 = 7 apples.", "7", True),
        ("Answer: 7", "7", True),
        ("Answer: 7 (3 + 4)", "7", False),  # the last number counts, not the Answer line
        ("1,200 in total", "1200", True),
        ("so 7.0", "7", True),
        ("no number", "0", False),
    ],
)
def test_is_correct_takes_the_last_number(text, answer, right):
    assert is_correct(text, answer) is right
    assert last_number("no digits") is None


def test_evaluate_greedy_equals_generate_batch_and_counts_right_answers():
    model, tok = tiny_llama(), tiny_tokenizer()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    reference = rollout.generate_batch(
        model, prompts, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=2)
    )
    texts = [tok.decode(o.generated_tokens, skip_special_tokens=True) for o in reference.values()]
    answers = [last_number(texts[0]) or "1", "999", "998"]
    manager = rollout.ContinuousBatchingManager(
        model, GenerationConfig(max_new_tokens=6, do_sample=True), rollout.ContinuousBatchingConfig(num_blocks=64)
    )
    manager.start()
    try:
        result = evaluate_greedy(manager, tok, prompts, answers, max_new_tokens=6, eos_token_ids=[2])
    finally:
        manager.destroy()
    assert [s["completion"] for s in result.samples] == texts
    assert result.num_problems == 3
    assert result.num_tokens == sum(len(o.generated_tokens) for o in reference.values())
    assert result.num_correct == sum(is_correct(t, a) for t, a in zip(texts, answers))


def test_evaluate_model_runs_its_own_manager_and_restores_the_model():
    model, tok = tiny_llama(), tiny_tokenizer()
    heldout = datasets.Dataset.from_list([{"prompt": f"t{5 + i} t{9 + i}", "answer": "1"} for i in range(3)])
    attn = model.config._attn_implementation
    result = evaluate_model(model, tok, heldout, max_new_tokens=5)
    assert result.num_problems == 3 and 3 <= result.num_tokens <= 15
    assert model.config._attn_implementation == attn
    reference = rollout.generate_batch(
        model, [[5, 9], [6, 10], [7, 11]], generation_config=GenerationConfig(max_new_tokens=5, do_sample=False)
    )
    assert [s["completion"] for s in result.samples] == [
        tok.decode(o.generated_tokens, skip_special_tokens=True) for o in reference.values()
    ]
