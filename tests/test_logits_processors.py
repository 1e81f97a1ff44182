"""Logits processors and stop strings through the engine, against ``model.generate`` in greedy mode.

Each processor's tokens equal ``model.generate``'s with the same settings on the tiny models, alone, side
by side with requests that have other settings or none, and through the manager. Every case also checks
that the processor changes the plain greedy completion of at least one prompt, so an engine that ignored
it would fail. Stop strings use the byte-level tiny tokenizer, which transformers' ``StopStringCriteria``
can read (the word-level one cannot spell its vocabulary).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import rollout
import rollout.engine
from rollout import sampling_params as sampling_params_module
from rollout.sampling_params import SamplingParams, build_sampling_params
from tests.tiny_models import EOS_TOKEN_ID, random_prompts, tiny_byte_level_tokenizer, tiny_gemma, tiny_llama
from tests.utils import assert_close, reference_generate, run_engine

MAX_NEW = 40
PROMPTS = random_prompts(12, min_len=4, max_len=12, seed=1)[4:8]  # both tiny models repeat a 3-gram on some
MODELS = {"llama": tiny_llama, "gemma": tiny_gemma}


def reference(model: PreTrainedModel, prompt: list[int], max_new_tokens: int = MAX_NEW, **kwargs: Any) -> list[int]:
    """``model.generate`` greedy on one unpadded prompt with extra settings; the generated tokens."""
    return reference_generate(model, prompt, max_new_tokens, **kwargs)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_plain(request: pytest.FixtureRequest) -> tuple[PreTrainedModel, list[list[int]]]:
    """A tiny model and its plain greedy completions of PROMPTS (eos 2, no processor)."""
    model = MODELS[request.param]()
    return model, [reference(model, p) for p in PROMPTS]


# Each case builds generate()'s keyword arguments from the plain completions, so that the processor bites:
# a token greedy decoding picks becomes a bad word, or the end-of-sequence id a token it picks early.
CASES: dict[str, Callable[[list[list[int]]], dict[str, Any]]] = {
    "repetition_penalty_1.3": lambda plain: {"repetition_penalty": 1.3},
    "repetition_penalty_0.7": lambda plain: {"repetition_penalty": 0.7},
    "no_repeat_ngram_size_1": lambda plain: {"no_repeat_ngram_size": 1},
    "no_repeat_ngram_size_2": lambda plain: {"no_repeat_ngram_size": 2},
    "no_repeat_ngram_size_3": lambda plain: {"no_repeat_ngram_size": 3},
    "bad_words_ids": lambda plain: {"bad_words_ids": [[plain[0][0]], [plain[1][2], plain[1][3]], [plain[2][5]]]},
    "min_new_tokens": lambda plain: {"eos_token_id": plain[0][2], "min_new_tokens": 8},
    "min_length": lambda plain: {"eos_token_id": plain[0][2], "min_length": len(PROMPTS[0]) + 8},
    "all_together": lambda plain: {
        "repetition_penalty": 1.2,
        "no_repeat_ngram_size": 2,
        "bad_words_ids": [[plain[3][1]]],
        "eos_token_id": plain[0][2],
        "min_new_tokens": 5,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_processor_tokens_equal_generate(model_and_plain, case: str) -> None:  # noqa: ANN001
    model, plain = model_and_plain
    kwargs = CASES[case](plain)
    outputs = rollout.generate_batch(
        model, PROMPTS, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    )
    got = [out.generated_tokens for out in outputs.values()]
    assert got == [reference(model, p, **kwargs) for p in PROMPTS]
    if "eos_token_id" in kwargs:  # plain decoding with that eos id stops after 3 tokens
        plain = [reference(model, p, eos_token_id=kwargs["eos_token_id"]) for p in PROMPTS]
    assert got != plain, "the processor changed nothing: the comparison proves nothing"


def test_min_p_is_ignored_by_greedy_requests_as_by_generate(model_and_plain) -> None:  # noqa: ANN001
    model, plain = model_and_plain
    outputs = rollout.generate_batch(model, PROMPTS, GenerationConfig(max_new_tokens=MAX_NEW, min_p=0.5))
    assert (
        [out.generated_tokens for out in outputs.values()] == plain == [reference(model, p, min_p=0.5) for p in PROMPTS]
    )


def test_requests_with_different_processors_and_none_share_one_batch() -> None:
    model = tiny_llama()
    plain = [reference(model, p) for p in PROMPTS]
    eos_early = plain[1][2]
    jobs: list[tuple[list[int], dict[str, Any]]] = [
        (PROMPTS[0], {}),  # no processor, same prompt as the next request (they share its blocks)
        (PROMPTS[0], {"repetition_penalty": 1.4}),
        (PROMPTS[1], {"eos_token_id": eos_early, "min_new_tokens": 6}),
        (PROMPTS[1], {"eos_token_id": eos_early}),  # same eos id without the minimum: stops early
        (PROMPTS[2], {"no_repeat_ngram_size": 2, "bad_words_ids": [[plain[2][0]]]}),
        (PROMPTS[3], {"no_repeat_ngram_size": 3}),
        (PROMPTS[3], {}),
    ]
    engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=64, block_size=8))
    try:
        for i, (prompt, kwargs) in enumerate(jobs):
            overrides = dict(kwargs, eos_token_id=kwargs.get("eos_token_id", EOS_TOKEN_ID))
            params = build_sampling_params(SamplingParams(max_new_tokens=MAX_NEW), **overrides)
            engine.add_request(prompt, params, request_id=f"r{i}")
        outputs = run_engine(engine)
        assert engine.stats.num_steps < 2 * MAX_NEW  # the requests really ran side by side
    finally:
        engine.close()
    for i, (prompt, kwargs) in enumerate(jobs):
        assert outputs[f"r{i}"].generated_tokens == reference(model, prompt, **kwargs), (i, kwargs)
    assert outputs["r0"].generated_tokens == plain[0] != outputs["r1"].generated_tokens
    assert len(outputs["r3"].generated_tokens) == 3 < len(outputs["r2"].generated_tokens)


def test_processors_hold_for_sampled_requests() -> None:
    model = tiny_llama()
    banned = 77
    gc = GenerationConfig(
        max_new_tokens=40, do_sample=True, temperature=1.5, no_repeat_ngram_size=2, bad_words_ids=[[banned]]
    )
    outputs = rollout.generate_batch(model, [PROMPTS[0]] * 8, gc, rollout.ContinuousBatchingConfig(seed=0))
    samples = [out.generated_tokens for out in outputs.values()]
    assert len({tuple(s) for s in samples}) > 1  # it really samples
    for sample in samples:
        sequence = PROMPTS[0] + sample
        bigrams = list(zip(sequence, sequence[1:]))
        assert len(bigrams) == len(set(bigrams)) and banned not in sample


def test_sampled_logprobs_are_the_processed_distribution_and_temperature_logprobs_the_raw_one() -> None:
    model = tiny_llama()
    prompt = PROMPTS[0]
    bad = [[reference(model, prompt)[1]]]
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=1.5, bad_words_ids=bad)
    result = {}
    for mode in ("sampled", "temperature"):
        config = rollout.ContinuousBatchingConfig(return_logprobs=True, logprobs_mode=mode)
        result[mode] = rollout.generate_batch(model, [prompt], gc, config)["req_0"]
    tokens = result["sampled"].generated_tokens
    assert (
        tokens
        == result["temperature"].generated_tokens
        == reference(model, prompt, max_new_tokens=12, repetition_penalty=1.5, bad_words_ids=bad)
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    processed_lp, raw_lp = [], []
    for i, token in enumerate(tokens):
        row = logits[i].clone()
        seen = sorted(set(prompt + tokens[:i]))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.5, row[seen] * 1.5)
        row[bad[0][0]] = float("-inf")
        processed_lp.append(torch.log_softmax(row, dim=-1)[token].item())
        raw_lp.append(torch.log_softmax(logits[i], dim=-1)[token].item())
    assert_close(result["sampled"].logprobs, processed_lp, atol=1e-4)
    assert_close(result["temperature"].logprobs, raw_lp, atol=1e-4)
    assert max(abs(a - b) for a, b in zip(processed_lp, raw_lp)) > 0.1  # the two modes really differ


# ---------------------------------------------------------------------------------------- stop strings


def spelled(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens)


def stop_reference(tokenizer: Any, plain: list[int], stop: list[str]) -> list[int]:
    """vLLM's rule on a greedy completion: cut after the first token whose generated text holds a stop string."""
    for k in range(len(plain)):
        if any(s in spelled(tokenizer, plain[: k + 1]) for s in stop):
            return plain[: k + 1]
    return plain


@pytest.fixture(scope="module")
def llama_plain() -> tuple[PreTrainedModel, list[list[int]], Any]:
    model = tiny_llama()
    return model, [reference(model, p) for p in PROMPTS], tiny_byte_level_tokenizer()


def test_stop_strings_tokens_equal_generate_with_a_tokenizer(llama_plain) -> None:  # noqa: ANN001
    model, plain, tokenizer = llama_plain
    # Strings that span two tokens of the plain completions, ending inside the later one.
    stops = [
        spelled(tokenizer, [plain[0][5]])[-1] + spelled(tokenizer, [plain[0][6]])[:2],
        spelled(tokenizer, [plain[2][9]])[-2:] + spelled(tokenizer, [plain[2][10]])[:1],
    ]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=stops)
    outputs = rollout.generate_batch(model, PROMPTS, gc, tokenizer=tokenizer)
    got = [out.generated_tokens for out in outputs.values()]
    assert got == [reference(model, p, stop_strings=stops, tokenizer=tokenizer) for p in PROMPTS]
    for out, full in zip(outputs.values(), plain):
        assert (out.finish_reason == "stop") == (len(out.generated_tokens) < len(full))
    assert sum(out.finish_reason == "stop" for out in outputs.values()) >= 2


def test_stop_strings_may_start_in_the_prompt_and_stop_reads_only_generated_text(llama_plain) -> None:  # noqa: ANN001
    model, plain, tokenizer = llama_plain
    prompt, full = PROMPTS[1], plain[1]
    across = spelled(tokenizer, prompt)[-1] + spelled(tokenizer, [full[0]])[0]
    assert reference(model, prompt, stop_strings=[across], tokenizer=tokenizer) == full[:1]
    vllm_style = stop_reference(tokenizer, full, [across])
    assert len(vllm_style) > 1  # the string is not in the first generated token's text
    engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=32), tokenizer=tokenizer)
    try:
        base = SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(EOS_TOKEN_ID,))
        engine.add_request(prompt, dataclasses.replace(base, stop_strings=(across,)), request_id="transformers")
        engine.add_request(prompt, dataclasses.replace(base, stop=(across,)), request_id="vllm")
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert outputs["transformers"].generated_tokens == full[:1]
    assert outputs["vllm"].generated_tokens == vllm_style
    assert outputs["vllm"].finish_reason == ("stop" if len(vllm_style) < len(full) else "length")


@pytest.mark.parametrize("field", ["stop", "stop_strings"])
def test_stop_strings_count_only_once_min_new_tokens_are_generated(llama_plain, field: str) -> None:  # noqa: ANN001
    # vLLM's rule (its issue 21987, fixed in PR 22014): a stop string that completes before min_new_tokens
    # tokens exist does not end the request; it used to end it with 2 tokens and finish reason "stop".
    model, _, tokenizer = llama_plain
    prompt = PROMPTS[0]
    full = reference(model, prompt, eos_token_id=None)
    text = spelled(tokenizer, full)
    # The shortest end of the first two tokens' text that ends inside the second and occurs once in the whole text.
    head = spelled(tokenizer, full[:2])
    first = len(spelled(tokenizer, full[:1]))
    stop = next(head[i:] for i in range(len(head) - 1, -1, -1) if i < first and text.count(head[i:]) == 1)
    engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=32), tokenizer=tokenizer)
    try:
        base = SamplingParams(max_new_tokens=MAX_NEW, **{field: (stop,)})
        engine.add_request(prompt, base, request_id="plain")
        engine.add_request(prompt, dataclasses.replace(base, min_new_tokens=10), request_id="min_new_tokens")
        engine.add_request(prompt, dataclasses.replace(base, min_length=len(prompt) + 10), request_id="min_length")
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert outputs["plain"].generated_tokens == full[:2] and outputs["plain"].finish_reason == "stop"
    for rid in ("min_new_tokens", "min_length"):  # the string never completes again: the request runs to its length
        assert outputs[rid].generated_tokens == full and outputs[rid].finish_reason == "length"


def test_stop_strings_without_a_tokenizer_are_refused_before_any_work(llama_plain) -> None:  # noqa: ANN001
    model, _, _ = llama_plain
    attention = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"stop_strings needs a tokenizer.*tokenizer="):
        rollout.generate_batch(model, PROMPTS, GenerationConfig(max_new_tokens=4, stop_strings=["ab"]))
    with pytest.raises(ValueError, match=r"stop_strings needs a tokenizer"):
        rollout.init_continuous_batching(model, GenerationConfig(max_new_tokens=4, stop_strings="ab"))
    assert model.config._attn_implementation == attention
    engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=8))
    try:
        with pytest.raises(ValueError, match=r"stop needs a tokenizer"):
            engine.add_request(PROMPTS[0], SamplingParams(stop=("ab",)))
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_manager_honours_per_request_stop_strings_with_its_tokenizer(llama_plain) -> None:  # noqa: ANN001
    model, plain, tokenizer = llama_plain
    stop = [spelled(tokenizer, [plain[3][4]])[-2:] + spelled(tokenizer, [plain[3][5]])[:1]]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    manager = rollout.init_continuous_batching(model, gc, tokenizer=tokenizer)
    try:
        manager.start()
        with_stop = build_sampling_params(manager.default_params, stop=stop)
        ids = [manager.add_request(PROMPTS[3], sampling_params=with_stop), manager.add_request(PROMPTS[3])]
        results = [manager.get_result(rid, timeout=60) for rid in ids]
    finally:
        manager.destroy()
    assert results[0].generated_tokens == stop_reference(tokenizer, plain[3], stop)
    assert len(results[0].generated_tokens) < len(plain[3]) and results[0].finish_reason == "stop"
    assert results[1].generated_tokens == plain[3]  # the request without stop strings runs on


def test_generate_batch_on_a_persistent_manager_without_tokenizer_gives_it_the_callers(llama_plain) -> None:  # noqa: ANN001
    model, plain, tokenizer = llama_plain
    stop = [spelled(tokenizer, [plain[0][6]])[-1] + spelled(tokenizer, [plain[0][7]])[:2]]
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    with rollout.continuous_batching_context_manager(model, gc, persistent_manager=True) as manager:
        assert manager.tokenizer is None
    try:
        with_stop = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=stop)
        with pytest.raises(ValueError, match="stop_strings needs a tokenizer"):
            rollout.generate_batch(model, PROMPTS[:1], with_stop)
        outputs = rollout.generate_batch(model, PROMPTS[:1], with_stop, tokenizer=tokenizer)
        assert manager.tokenizer is tokenizer
    finally:
        manager.destroy()
    assert outputs["req_0"].generated_tokens == reference(model, PROMPTS[0], stop_strings=stop, tokenizer=tokenizer)
    assert len(outputs["req_0"].generated_tokens) < len(plain[0])


def test_manager_without_tokenizer_refuses_stop_strings_naming_the_field() -> None:
    manager = rollout.init_continuous_batching(tiny_llama(), GenerationConfig(max_new_tokens=4))
    try:
        with pytest.raises(ValueError, match=r"^input_ids: stop needs a tokenizer"):
            manager.add_request(PROMPTS[0], sampling_params=SamplingParams(stop=("x",)))
    finally:
        manager.destroy()


# ---------------------------------------------------------------------------------------- config flags


def test_per_request_processors_false_refuses_other_processor_values_but_not_seeds_or_lengths() -> None:
    model = tiny_llama()
    config = rollout.ContinuousBatchingConfig(per_request_processors=False)
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.3)
    manager = rollout.init_continuous_batching(model, gc, config)
    try:
        with pytest.raises(ValueError, match=r"^do_sample=True, temperature=0.5: per_request_processors is False"):
            manager.add_request(PROMPTS[0], temperature=0.5)
        other = build_sampling_params(manager.default_params, repetition_penalty=1.1)
        with pytest.raises(ValueError, match=r"^repetition_penalty=1.1: per_request_processors is False"):
            manager.add_requests(PROMPTS, sampling_params=other)
        manager.start()
        rid = manager.add_request(PROMPTS[0], max_new_tokens=10, seed=3)  # not processor values
        result = manager.get_result(rid, timeout=60)
    finally:
        manager.destroy()
    assert result.generated_tokens == reference(model, PROMPTS[0], max_new_tokens=10, repetition_penalty=1.3)


def test_per_request_processors_true_gives_each_request_its_own_values() -> None:
    model = tiny_llama()
    manager = rollout.init_continuous_batching(model, GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False))
    try:
        manager.start()
        params = [build_sampling_params(manager.default_params, repetition_penalty=r) for r in (1.0, 1.5, 0.6)]
        ids = [manager.add_request(PROMPTS[2], sampling_params=p) for p in params]
        results = [manager.get_result(rid, timeout=60).generated_tokens for rid in ids]
    finally:
        manager.destroy()
    assert results == [reference(model, PROMPTS[2], repetition_penalty=r) for r in (1.0, 1.5, 0.6)]
    assert len({tuple(r) for r in results}) == 3


def test_unsupported_processor_is_dropped_with_a_warning_or_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sampling_params_module, "_warned_unsupported", set())
    model = tiny_llama()
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, suppress_tokens=[5], repetition_penalty=1.2)
    with caplog.at_level(logging.WARNING, logger="rollout.sampling_params"):
        outputs = rollout.generate_batch(model, PROMPTS[:2], gc)
    assert any("suppress_tokens=[5]" in r.getMessage() for r in caplog.records)
    # Dropped: the supported processor still runs, the unsupported one does not.
    assert [o.generated_tokens for o in outputs.values()] == [
        reference(model, p, max_new_tokens=8, repetition_penalty=1.2) for p in PROMPTS[:2]
    ]
    strict = rollout.ContinuousBatchingConfig(drop_unsupported_processors=False)
    with pytest.raises(ValueError, match=r"suppress_tokens=\[5\].*drop_unsupported_processors"):
        rollout.generate_batch(model, PROMPTS[:2], gc, strict)
    with pytest.raises(ValueError, match=r"suppress_tokens=\[5\]"):
        rollout.init_continuous_batching(model, gc, strict)
