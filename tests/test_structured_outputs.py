"""Structured outputs (``rollout.structured_outputs``, ``engine.sample.structured``): JSON schema, regex, choice and
EBNF grammar per request through xgrammar, on the tiny Llama with a byte-level tokenizer that can spell JSON."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.checks import FieldError
from rollout.engine import Engine
from rollout.engine.sample.structured import GrammarCache, apply_grammar_masks, new_matcher
from rollout.manager.manager import ContinuousBatchingManager
from rollout.structured_outputs import StructuredOutputs
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, tiny_json_tokenizer, tiny_llama
from tests.utils import assert_close, run_engine, teacher_forced_logprobs

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2}"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _check_schema(value: object) -> None:
    """``value`` validates against ``SCHEMA`` (jsonschema when installed, else by hand)."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == {"answer", "ok"}
        assert type(value["answer"]) is int and 0 <= value["answer"] <= 99 and type(value["ok"]) is bool
    else:
        jsonschema.validate(value, SCHEMA)


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _run(engine: Engine, jobs: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Queue the jobs on the engine, run it to the end and close it; the outputs by id."""
    try:
        for rid, prompt, params in jobs:
            engine.add_request(prompt, params, request_id=rid)
        return run_engine(engine)
    finally:
        engine.close()


def test_json_schema_n8_samples_at_temperature_1_parse_and_validate() -> None:
    tokenizer = tiny_json_tokenizer()
    gc = GenerationConfig(max_new_tokens=96, do_sample=True, temperature=1.0, num_return_sequences=8)
    cfg = ContinuousBatchingConfig(seed=0, num_blocks=64)
    out = generate_batch(tiny_llama(), [PROMPTS[0]], gc, cfg, tokenizer=tokenizer, structured_outputs={"json": SCHEMA})
    texts = [_text(tokenizer, out[f"req_0_{g}"].generated_tokens) for g in range(8)]
    for g, text in enumerate(texts):
        assert out[f"req_0_{g}"].finish_reason == "stop", text
        assert out[f"req_0_{g}"].generated_tokens[-1] == EOS_TOKEN_ID  # ended by the EOS where the grammar may end
        _check_schema(json.loads(text))
    assert len(set(texts)) > 1  # 8 samples, not one repeated
    # The first sample prefilled the prompt and the 7 others were forked from it, each with a matcher of its own.
    assert [out[f"req_0_{g}"].num_cached_prompt_tokens for g in range(8)] == [0] + [len(PROMPTS[0])] * 7


def test_regex_output_fully_matches() -> None:
    tokenizer = tiny_json_tokenizer()
    gc = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=1.0)
    cfg = ContinuousBatchingConfig(seed=3, num_blocks=64)
    out = generate_batch(tiny_llama(), PROMPTS, gc, cfg, tokenizer=tokenizer, structured_outputs={"regex": REGEX})
    for r in out.values():
        assert re.fullmatch(REGEX, _text(tokenizer, r.generated_tokens)), r.generated_tokens
        assert r.finish_reason == "stop"


def test_choice_output_is_one_of_the_choices() -> None:
    tokenizer = tiny_json_tokenizer()
    choices = ["yes", "no", "maybe so", 'say "hi"']
    gc = GenerationConfig(max_new_tokens=32, do_sample=True, temperature=1.0, num_return_sequences=4)
    cfg = ContinuousBatchingConfig(seed=5, num_blocks=64)
    out = generate_batch(tiny_llama(), PROMPTS, gc, cfg, tokenizer=tokenizer, structured_outputs={"choice": choices})
    for r in out.values():
        assert _text(tokenizer, r.generated_tokens) in choices


def test_ebnf_grammar_output_matches() -> None:
    tokenizer = tiny_json_tokenizer()
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'
    params = SamplingParams(max_new_tokens=40, do_sample=True, seed=7, structured_outputs={"grammar": grammar})
    out = _run(
        Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer), [("g", PROMPTS[0], params)]
    )
    text = _text(tokenizer, out["g"].generated_tokens)
    if out["g"].finish_reason == "stop":
        assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", text), text
    else:  # cut by max_new_tokens: a prefix of the language
        assert re.fullmatch(r"\([a-c]*(,[a-c]*)*", text), text


def test_constrained_and_free_requests_share_a_step_and_the_free_one_is_unchanged() -> None:
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    cfg = ContinuousBatchingConfig(num_blocks=64)
    free = SamplingParams(max_new_tokens=12)
    constrained = SamplingParams(max_new_tokens=12, structured_outputs=StructuredOutputs(regex=REGEX))
    alone = _run(Engine(model, cfg, tokenizer=tokenizer), [("free", PROMPTS[0], free)])
    engine = Engine(model, cfg, tokenizer=tokenizer)
    together = _run(engine, [("free", PROMPTS[0], free), ("json", PROMPTS[0], constrained)])
    assert engine.stats.num_steps <= 1 + 12  # one prefill step and the decode steps, the two rows side by side
    assert together["free"].generated_tokens == alone["free"].generated_tokens
    assert re.fullmatch(REGEX, _text(tokenizer, together["json"].generated_tokens))
    # The same prompt unconstrained gives something else: the mask did change the constrained row.
    assert together["json"].generated_tokens != alone["free"].generated_tokens[: len(together["json"].generated_tokens)]


@pytest.mark.parametrize("logprobs_mode", ["temperature", "raw", "raw_logprobs"])
def test_constrained_greedy_logprobs_equal_teacher_forced_raw_logits(logprobs_mode: str) -> None:
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    cfg = ContinuousBatchingConfig(num_blocks=64, return_logprobs=True, logprobs_mode=logprobs_mode)
    params = SamplingParams(max_new_tokens=40, structured_outputs={"json": SCHEMA})
    out = _run(Engine(model, cfg, tokenizer=tokenizer), [("r", PROMPTS[1], params)])["r"]
    _check_schema(json.loads(_text(tokenizer, out.generated_tokens)))
    expected = teacher_forced_logprobs(model, PROMPTS[1], out.generated_tokens)
    assert_close(out.logprobs, expected, atol=1e-4)
    # The mask removed probability mass: the renormalised masked distribution would give larger logprobs.
    assert sum(expected) < -1.0


@pytest.mark.parametrize("logprobs_mode", ["sampled", "processed_logprobs"])
def test_processed_logprobs_equal_the_masked_renormalised_distribution(logprobs_mode: str) -> None:
    """ "sampled" (vLLM's ``processed_logprobs``, accepted as its alias): each logprob is log_softmax of the
    teacher-forced logits with the grammar's disallowed tokens masked (renormalised over the allowed ones), to 1e-5;
    the output says which mode gave them."""
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    cfg = ContinuousBatchingConfig(num_blocks=64, return_logprobs=True, logprobs_mode=logprobs_mode)
    params = SamplingParams(
        max_new_tokens=40, do_sample=True, temperature=1.0, seed=4, structured_outputs={"json": SCHEMA}
    )
    out = _run(Engine(model, cfg, tokenizer=tokenizer), [("r", PROMPTS[1], params)])["r"]
    assert out.logprobs_mode == "sampled" and cfg.logprobs_mode == "sampled"
    tokens = out.generated_tokens
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1] + tokens])).logits[0, len(PROMPTS[1]) - 1 : -1].float()
    grammar = GrammarCache(tokenizer, logits.shape[-1]).compile(StructuredOutputs(json=SCHEMA))
    matcher = new_matcher(grammar, params.eos_token_ids)
    expected = []
    for token, row in zip(tokens, logits):
        masked = apply_grammar_masks(row[None].clone(), [matcher], copy=False)[0]
        expected.append(torch.log_softmax(masked, dim=-1)[token].item())
        assert matcher.accept_token(token)
    assert_close(out.logprobs, expected, atol=1e-5)
    # Not the raw ones: the mask removed mass, so the renormalised logprobs are larger.
    raw = teacher_forced_logprobs(model, PROMPTS[1], tokens)
    assert sum(out.logprobs) > sum(raw) + 1.0


def test_outputs_name_their_logprobs_mode_and_none_without_logprobs() -> None:
    model = tiny_llama()
    params = SamplingParams(max_new_tokens=3)
    for cfg, mode in [
        (ContinuousBatchingConfig(num_blocks=64, return_logprobs=True, logprobs_mode="raw_logprobs"), "raw"),
        (ContinuousBatchingConfig(num_blocks=64, return_logprobs=True), "temperature"),
        (ContinuousBatchingConfig(num_blocks=64), None),
    ]:
        assert _run(Engine(model, cfg), [("r", PROMPTS[0], params)])["r"].logprobs_mode == mode
    with pytest.raises(FieldError, match="logprobs_mode must be one of"):
        ContinuousBatchingConfig(logprobs_mode="raw_logits")


def test_bad_specs_raise_field_error_naming_the_field_before_anything_is_queued() -> None:
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    manager = ContinuousBatchingManager(
        model, GenerationConfig(max_new_tokens=6), ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer
    )
    manager.start()
    try:
        first = manager.add_request(PROMPTS[0], structured_outputs={"regex": REGEX})
        bad = [
            ({"regex": "[0-9"}, "structured_outputs.regex", "regular expression"),
            ({"json": {"type": "foo"}}, "structured_outputs.json", "JSON schema"),
            ({"json": "{not json"}, "structured_outputs.json", "JSON schema"),
            ({"grammar": "root ::= x"}, "structured_outputs.grammar", "EBNF grammar"),
            ({"regex": REGEX, "choice": ["a"]}, "structured_outputs", "exactly one of"),
            ({}, "structured_outputs", "exactly one of"),
            ({"choice": []}, "structured_outputs.choice", "non-empty list"),
            ({"regexp": REGEX}, "structured_outputs.regexp", "allowed"),
        ]
        for spec, field, words in bad:
            with pytest.raises(FieldError, match=words) as info:
                manager.add_requests([PROMPTS[0], PROMPTS[1]], structured_outputs=spec)
            assert info.value.field == field and str(info.value).startswith(field)
        assert manager.get_result(first, timeout=60).generated_tokens  # the request accepted before is not lost
        assert manager.get_result(timeout=0.5) is None  # and nothing of the bad batches was queued
    finally:
        manager.destroy()


def test_structured_outputs_without_tokenizer_raise_field_error() -> None:
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=64))
    try:
        with pytest.raises(FieldError, match="tokenizer") as info:
            engine.add_request(PROMPTS[0], SamplingParams(structured_outputs={"regex": REGEX}))
        assert info.value.field == "structured_outputs" and not engine.has_unfinished()
    finally:
        engine.close()


@pytest.mark.parametrize("preemption_mode", ["recompute", "offload"])
def test_preempted_constrained_requests_keep_their_matcher(preemption_mode: str) -> None:
    # 6 requests of 10 prompt + up to 24 tokens in blocks of 4: the 12 blocks hold two or three at a time.
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    prompts = [[3 + i, 40 + i, 7, 8, 9, 10, 11, 12, 13, 14] for i in range(6)]
    jobs = [
        (
            f"r{i}",
            p,
            SamplingParams(max_new_tokens=24, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
        )
        for i, p in enumerate(prompts)
    ]
    roomy = _run(Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=128), tokenizer=tokenizer), jobs)
    tight_cfg = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=12,
        safety_margin=0.0,
        preemption_mode=preemption_mode,
        cpu_offload_space=0.01 if preemption_mode == "offload" else 0,
    )
    engine = Engine(model, tight_cfg, tokenizer=tokenizer)
    tight = _run(engine, jobs)
    assert engine.stats.num_preemptions > 0
    for rid in roomy:
        _check_schema(json.loads(_text(tokenizer, tight[rid].generated_tokens)))
        # A matcher advanced twice or reset by the preemption would mask other tokens: greedy outputs would differ.
        assert tight[rid].generated_tokens == roomy[rid].generated_tokens


def test_async_batching_constrained_and_free_match_synchronous() -> None:
    model, tokenizer = tiny_llama(), tiny_json_tokenizer()
    jobs = [
        ("free", PROMPTS[0], SamplingParams(max_new_tokens=10)),
        ("re", PROMPTS[1], SamplingParams(max_new_tokens=10, structured_outputs={"regex": REGEX})),
    ]
    sync = _run(Engine(model, ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer), jobs)
    cfg = ContinuousBatchingConfig(num_blocks=64, use_async_batching=True)
    asynchronous = _run(Engine(model, cfg, tokenizer=tokenizer), jobs)
    assert {k: v.generated_tokens for k, v in asynchronous.items()} == {k: v.generated_tokens for k, v in sync.items()}
    assert re.fullmatch(REGEX, _text(tokenizer, asynchronous["re"].generated_tokens))


def test_structured_outputs_spec_normalises_and_keys() -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.kind == "json" and json.loads(spec.json) == {"type": "object", "properties": {"b": {}, "a": {}}}
    assert list(json.loads(spec.json)["properties"]) == ["b", "a"]  # property order kept
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputs(regex="a+").key != StructuredOutputs(grammar='root ::= "a"+').key
    params = SamplingParams(structured_outputs={"json_object": True})
    assert params.structured_outputs == StructuredOutputs(json_object=True)
    hash(params)  # still hashable
    with pytest.raises(FieldError, match="structured_outputs must be") as info:
        SamplingParams(structured_outputs="json")
    assert info.value.field == "structured_outputs"


def test_grammar_cache_compiles_each_spec_once_and_matchers_follow_a_prefix() -> None:
    cache = GrammarCache(tiny_json_tokenizer(), VOCAB_SIZE)
    spec = StructuredOutputs(regex=REGEX)
    assert cache.compile(spec) is cache.compile(StructuredOutputs(regex=REGEX)) and len(cache) == 1
    tokenizer = cache.tokenizer
    digits = tokenizer.convert_tokens_to_ids(["1", "2", "3", "-"])
    matcher = new_matcher(cache.compile(spec), (EOS_TOKEN_ID,), digits)  # a restored request's output
    logits = torch.zeros(2, VOCAB_SIZE)
    masked = apply_grammar_masks(logits, [None, matcher], copy=True)
    allowed = set(torch.nonzero(masked[1] > float("-inf")).flatten().tolist())
    assert allowed == set(
        tokenizer.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz"))
        + [tokenizer.convert_tokens_to_ids(t) for t in ("an", "sw", "er", "ok", "ab", "cd")]
    )
    assert torch.equal(masked[0], logits[0]) and torch.equal(logits, torch.zeros(2, VOCAB_SIZE))  # copy: raw unchanged
    with pytest.raises(ValueError, match="does not follow the grammar"):
        new_matcher(cache.compile(spec), (EOS_TOKEN_ID,), tokenizer.convert_tokens_to_ids(["a"]))


def test_missing_xgrammar_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an environment without it gives
    with pytest.raises(ImportError, match=r"rollout\[structured\]"):
        StructuredOutputs(regex=REGEX)
    SamplingParams(max_new_tokens=4)  # requests without structured outputs do not need it
