"""rollout.scoring.offline against teacher-forced transformers forwards: chunking, prefix sharing, validation."""

from __future__ import annotations

import pytest

import rollout.scoring.offline as scoring
from rollout import ContinuousBatchingConfig
from rollout.engine import Engine
from rollout.scoring.offline import ScoreOutput, score, score_with_engine
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import assert_close, teacher_forced_logprobs

ATOL = 1e-4


def _rows_with_shared_prompts(
    prompt_len: int, completion_len: int, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """6 rows over 3 prompts, interleaved (A, B, A, C, B, A), each row prompt_len + ~completion_len tokens."""
    prompts = random_prompts(3, VOCAB_SIZE, min_len=prompt_len, max_len=prompt_len + 2, seed=seed)
    completions = random_prompts(6, VOCAB_SIZE, min_len=completion_len - 3, max_len=completion_len, seed=seed + 1)
    order = [0, 1, 0, 2, 1, 0]
    return [prompts[k] for k in order], completions


def _no_engine(*args, **kwargs):
    raise AssertionError("the engine must not be built")


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding_window"])
def test_completion_logprobs_match_teacher_forcing_chunked_rows_shared_prompts(build) -> None:
    model = build()
    # Rows of ~32-40 tokens against a budget of 16 tokens: every row is chunked over 2-3 steps;
    # gemma's window of 8 is shorter than the rows.
    prompts, completions = _rows_with_shared_prompts(prompt_len=22, completion_len=18, seed=11)
    assert all(len(p) + len(c) > 16 for p, c in zip(prompts, completions))
    outputs = score(
        model, prompts, completions, batch_tokens=16, continuous_batching_config=ContinuousBatchingConfig(block_size=4)
    )
    assert len(outputs) == len(prompts)
    for p, c, out in zip(prompts, completions, outputs):
        expected = teacher_forced_logprobs(model, p, c)
        assert out.num_tokens == len(c)
        assert out.prompt_logprobs is None
        assert not out.skipped
        assert_close(out.completion_logprobs, expected, atol=ATOL)
        assert out.logprob_sum == pytest.approx(sum(expected), abs=ATOL * len(c))
    assert model.config._attn_implementation == "sdpa"  # the engine restored the model


def test_default_config_matches_teacher_forcing_llama() -> None:
    model = tiny_llama()
    prompts, completions = _rows_with_shared_prompts(prompt_len=30, completion_len=40, seed=12)
    outputs = score(model, prompts, completions)
    for p, c, out in zip(prompts, completions, outputs):
        assert_close(out.completion_logprobs, teacher_forced_logprobs(model, p, c), atol=ATOL)


def test_completions_of_one_prompt_share_its_cached_blocks() -> None:
    model = tiny_llama()
    prompt_a, prompt_b = random_prompts(2, VOCAB_SIZE, min_len=24, max_len=24, seed=13)  # 6 blocks of 4
    completions = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=9, seed=14)
    prompts = [prompt_a, prompt_b, prompt_a, prompt_a]

    def run(sharing: bool) -> tuple[Engine, list[ScoreOutput]]:
        config = ContinuousBatchingConfig(block_size=4, num_blocks=64, allow_block_sharing=sharing)
        engine = Engine(model, config)
        try:
            return engine, score_with_engine(engine, prompts, completions)
        finally:
            engine.close()

    shared, out_shared = run(True)
    unshared, out_unshared = run(False)
    row_tokens = [len(p) + len(c) for p, c in zip(prompts, completions)]
    assert unshared.stats.num_tokens_computed == sum(row_tokens)
    # Rows 2 and 3 reuse prompt A's blocks up to the last full block before the first scored
    # position (token 23): 5 blocks = 20 tokens each. Prompt A's 24 tokens are computed once, plus
    # 4 tokens per later completion.
    assert shared.stats.num_tokens_computed == sum(row_tokens) - 2 * 20
    for a, b, p, c in zip(out_shared, out_unshared, prompts, completions):
        assert_close(a.completion_logprobs, b.completion_logprobs, atol=ATOL)
        assert_close(a.completion_logprobs, teacher_forced_logprobs(model, p, c), atol=ATOL)


def test_identical_rows_are_computed_once() -> None:
    model = tiny_llama()
    prompt, completion = random_prompts(2, VOCAB_SIZE, min_len=10, max_len=10, seed=15)
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=64))
    try:
        outputs = score_with_engine(engine, [prompt] * 3, [completion] * 3)
    finally:
        engine.close()
    assert engine.stats.num_tokens_computed == 20
    assert outputs[0] == outputs[1] == outputs[2]
    assert_close(outputs[2].completion_logprobs, teacher_forced_logprobs(model, prompt, completion), atol=ATOL)


def test_include_prompt_matches_teacher_forcing_and_is_computed_once_per_prompt() -> None:
    model = tiny_llama()
    prompts, completions = _rows_with_shared_prompts(prompt_len=14, completion_len=8, seed=16)
    prompts += [prompts[1], [7], [9, 8, 7, 6, 5]]
    completions += [[], [5, 6], []]  # an empty completion, a one-token prompt, a prompt with no completion
    outputs = score(
        model,
        prompts,
        completions,
        include_prompt=True,
        batch_tokens=16,
        continuous_batching_config=ContinuousBatchingConfig(block_size=4),
    )
    for p, c, out in zip(prompts, completions, outputs):
        expected = teacher_forced_logprobs(model, p[:1], p[1:] + c)
        assert len(out.prompt_logprobs) == len(p) - 1
        assert out.num_tokens == len(c)
        assert_close(out.prompt_logprobs + out.completion_logprobs, expected, atol=ATOL)
    assert outputs[6].completion_logprobs == [] and outputs[6].logprob_sum == 0.0
    assert outputs[6].prompt_logprobs == outputs[1].prompt_logprobs
    assert outputs[7].prompt_logprobs == []


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_matches_teacher_forcing(temperature: float) -> None:
    model = tiny_gemma()
    prompts, completions = _rows_with_shared_prompts(prompt_len=12, completion_len=10, seed=17)
    outputs = score(model, prompts, completions, temperature=temperature, include_prompt=True)
    for p, c, out in zip(prompts, completions, outputs):
        expected = teacher_forced_logprobs(model, p[:1], p[1:] + c, temperature=temperature)
        assert_close(out.prompt_logprobs + out.completion_logprobs, expected, atol=ATOL)


def test_empty_completions_need_no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scoring, "Engine", _no_engine)
    outputs = score(tiny_llama(), [[5, 6, 7], [8]], [[], []])
    assert outputs == [ScoreOutput([], None, 0.0, 0), ScoreOutput([], None, 0.0, 0)]
    assert score(tiny_llama(), [], []) == []


def test_empty_completion_next_to_others_costs_nothing() -> None:
    model = tiny_llama()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    completions = [[12, 13], []]
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=16))
    try:
        outputs = score_with_engine(engine, prompts, completions)
    finally:
        engine.close()
    assert engine.stats.num_tokens_computed == 6
    assert outputs[1] == ScoreOutput([], None, 0.0, 0)
    assert_close(outputs[0].completion_logprobs, teacher_forced_logprobs(model, prompts[0], completions[0]), atol=ATOL)


def test_row_longer_than_context_raises_or_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()  # max_position_embeddings 512
    long_prompt = random_prompts(1, VOCAB_SIZE, min_len=500, max_len=500, seed=18)[0]
    prompts = [[5, 6, 7], long_prompt, [8, 9]]
    completions = [[10, 11], list(range(3, 16)), [12]]
    with monkeypatch.context() as m:
        m.setattr(scoring, "Engine", _no_engine)
        with pytest.raises(ValueError, match=r"row 1 has 500 prompt \+ 13 completion tokens.*512"):
            score(model, prompts, completions)
    outputs = score(model, prompts, completions, skip_too_long=True, include_prompt=True)
    assert outputs[1] == ScoreOutput([], [], 0.0, 0, skipped=True)
    for i in (0, 2):
        assert not outputs[i].skipped
        assert_close(
            outputs[i].completion_logprobs, teacher_forced_logprobs(model, prompts[i], completions[i]), atol=ATOL
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(prompts=[[5], [6]], completions=[[7]]),
            r"prompts and completions must have the same length.*2 prompts.*1",
        ),
        (dict(prompts=[[5], []], completions=[[7], [8]]), r"prompts\[1\] is empty"),
        (
            dict(prompts=[[5], [6]], completions=[[7], [8, 256]]),
            r"completions\[1\] holds token id 256 outside .*\[0, 256\)",
        ),
        (dict(prompts=[[5], [-1]], completions=[[7], [8]]), r"prompts\[1\] holds token id -1"),
        (dict(prompts=[[5], [6.0]], completions=[[7], [8]]), r"prompts\[1\] holds 6.0, which is not an integer"),
        (dict(prompts=[[5], "t6"], completions=[[7], [8]]), r"prompts\[1\] must be a list of token ids"),
        (dict(prompts=[[5]], completions=[[7]], temperature=0.0), r"temperature must be a finite number > 0"),
        (dict(prompts=[[5]], completions=[[7]], batch_tokens=0), r"batch_tokens must be None or an int >= 1"),
    ],
)
def test_invalid_inputs_raise_before_any_work(monkeypatch: pytest.MonkeyPatch, kwargs: dict, message: str) -> None:
    monkeypatch.setattr(scoring, "Engine", _no_engine)
    with pytest.raises(ValueError, match=message):
        score(tiny_llama(), **kwargs)


def test_row_that_cannot_fit_the_cache_raises_before_any_step() -> None:
    model = tiny_llama()
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=4))
    try:
        with pytest.raises(ValueError, match=r"row 1: .*blocks"):
            score_with_engine(engine, [[5, 6], list(range(3, 20))], [[7], [8]])
        assert engine.stats.num_steps == 0 and not engine.has_unfinished()
    finally:
        engine.close()


def test_preempted_chunked_rows_match_teacher_forcing() -> None:
    # prefill_first admits a new chunked row before finishing the running ones, so a tight cache
    # preempts them; their logprobs must still be those of one teacher-forced pass.
    model = tiny_llama()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=10, max_len=12, seed=19)
    completions = random_prompts(6, VOCAB_SIZE, min_len=20, max_len=28, seed=20)
    config = ContinuousBatchingConfig(block_size=4, num_blocks=12, max_batch_tokens=16, scheduler_type="prefill_first")
    engine = Engine(model, config)
    try:
        outputs = score_with_engine(engine, prompts, completions)
    finally:
        engine.close()
    assert engine.stats.num_preemptions > 0
    for p, c, out in zip(prompts, completions, outputs):
        assert_close(out.completion_logprobs, teacher_forced_logprobs(model, p, c), atol=ATOL)


@pytest.mark.slow
def test_smollm2_chat_completions_match_teacher_forcing() -> None:
    from rollout.weights.loading import load_model

    model, tokenizer = load_model()
    questions = [
        "What is 17 times 3?",
        "Name a primary color.",
        "Write one sentence about the sea.",
    ]
    answers = [["17 times 3 is 51.", "It is 41.", ""], ["Red.", "Blue is one."], ["The sea is wide and deep."]]
    prompts, completions = [], []
    for q, options in zip(questions, answers):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        for a in options:
            prompts.append(prompt)
            completions.append(tokenizer(a, add_special_tokens=False).input_ids if a else [])
    outputs = score(model, prompts, completions, batch_tokens=64)
    for p, c, out in zip(prompts, completions, outputs):
        assert out.num_tokens == len(c)
        if c:
            assert_close(out.completion_logprobs, teacher_forced_logprobs(model, p, c), atol=ATOL)
    assert model.config._attn_implementation == "sdpa"
