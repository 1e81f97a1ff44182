"""SamplingParams, checked at construction, and build_sampling_params (from a GenerationConfig, with overrides)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
from transformers import GenerationConfig

from rollout import sampling_params as sampling_params_module
from rollout.sampling_params import (
    DEFAULT_MAX_NEW_TOKENS,
    PROCESSOR_FIELDS,
    SamplingParams,
    build_sampling_params,
    check_processors_unchanged,
    resolve_generation_config,
    unsupported_processor_fields,
)
from tests.tiny_models import tiny_llama

INVALID_SAMPLING_PARAMS = [
    ("max_new_tokens", {"max_new_tokens": 0}),
    ("max_new_tokens", {"max_new_tokens": True}),
    ("temperature", {"temperature": -1.0}),
    ("top_k", {"top_k": -1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("seed", {"seed": "x"}),
    ("eos_token_ids", {"eos_token_ids": (10,)}),  # out of a vocab of 10
    ("eos_token_ids", {"eos_token_ids": (-1,)}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": float("inf")}),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": -1}),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": 2.0}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("min_length", {"min_length": None}),
    ("bad_words_ids", {"bad_words_ids": ((3,), ())}),  # an empty sequence
    ("bad_words_ids", {"bad_words_ids": [3, 4]}),  # not a list of lists
    ("bad_words_ids", {"bad_words_ids": ((3, 10),)}),  # out of a vocab of 10
    ("bad_words_ids", {"bad_words_ids": ((True,),)}),
    ("stop_strings", {"stop_strings": ("",)}),
    ("stop_strings", {"stop_strings": 5}),
    ("stop", {"stop": ("</answer>", None)}),
    ("num_top_logprobs", {"num_top_logprobs": -1}),
    ("num_top_logprobs", {"num_top_logprobs": 21}),  # past MAX_TOP_LOGPROBS
    ("num_top_logprobs", {"num_top_logprobs": 2.0}),
]


@pytest.mark.parametrize(
    ("field", "kwargs"), INVALID_SAMPLING_PARAMS, ids=[str(kw) for _, kw in INVALID_SAMPLING_PARAMS]
)
def test_invalid_sampling_params_raise_value_error_naming_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate(vocab_size=10)
    message = str(info.value)
    assert message.startswith(f"{field} must be"), message
    assert repr(next(iter(kwargs.values()))) in message, message


def test_eos_error_message_names_the_eos_token_ids_field() -> None:
    with pytest.raises(ValueError, match=r"^eos_token_ids must be"):
        SamplingParams(eos_token_ids=(10,)).validate(vocab_size=10)


def test_eos_token_id_equal_to_vocab_size_is_rejected_and_last_id_accepted() -> None:
    with pytest.raises(ValueError, match=r"\[0, 10\) \(eos_token_id of a GenerationConfig\), got \(3, 10\)"):
        SamplingParams(eos_token_ids=(3, 10)).validate(vocab_size=10)
    SamplingParams(eos_token_ids=(3, 9)).validate(vocab_size=10)
    # Without a vocab size only the lower bound is checked.
    SamplingParams(eos_token_ids=(10_000,)).validate()


def test_boundary_sampling_params_are_accepted() -> None:
    SamplingParams(max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, seed=0, eos_token_ids=(0,)).validate(1)
    SamplingParams(top_p=1e-6, top_k=None).validate(vocab_size=None)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({}, True),
        ({"do_sample": True}, False),
        ({"do_sample": True, "temperature": 0.0}, True),
        ({"do_sample": True, "top_k": 1}, True),
        ({"do_sample": True, "top_k": 2, "top_p": 0.5}, False),
        ({"do_sample": False, "temperature": 0.7, "top_k": 5}, True),
    ],
)
def test_greedy_property_is_true_without_sampling_zero_temperature_or_top_k_one(
    kwargs: dict[str, Any], greedy: bool
) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_construction_normalises_eos_and_plain_types() -> None:
    assert SamplingParams(eos_token_ids=3).eos_token_ids == (3,)
    assert SamplingParams(eos_token_ids=[np.int64(3), 4]).eos_token_ids == (3, 4)
    params = SamplingParams(temperature=1)
    assert params.temperature == 1.0 and type(params.temperature) is float


def test_construction_normalises_processor_values_to_hashable_plain_types() -> None:
    params = SamplingParams(
        repetition_penalty=2, min_p=0, bad_words_ids=[[np.int64(3)], [4, 5]], stop_strings="</a>", stop=["x", "y"]
    )
    assert params.bad_words_ids == ((3,), (4, 5)) and type(params.bad_words_ids[0][0]) is int
    assert (params.stop_strings, params.stop) == (("</a>",), ("x", "y"))
    assert type(params.repetition_penalty) is float and type(params.min_p) is float
    assert params == dataclasses.replace(params) and hash(params) == hash(dataclasses.replace(params))


@pytest.mark.parametrize(
    ("kwargs", "uses"),
    [
        ({}, False),
        ({"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_p": 0.5, "stop": "x"}, False),
        ({"min_new_tokens": 3}, False),  # no eos id: nothing to ban
        ({"min_new_tokens": 3, "eos_token_ids": 2}, True),
        ({"min_length": 3, "eos_token_ids": 2}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"no_repeat_ngram_size": 2}, True),
        ({"bad_words_ids": [[5]]}, True),
    ],
)
def test_uses_logits_processors_only_when_a_processor_can_change_the_logits(kwargs: dict[str, Any], uses: bool) -> None:
    assert SamplingParams(**kwargs).uses_logits_processors is uses


def test_bad_words_split_into_banned_tokens_and_prefix_tables() -> None:
    params = SamplingParams(bad_words_ids=[[3], [2], [4, 5], [6, 4, 7], [4, 8]], eos_token_ids=(2,))
    assert params.banned_tokens == (3,)  # [2] is the eos id: ignored
    assert params.bad_word_prefixes == {1: {(4,): (5, 8)}, 2: {(6, 4): (7,)}}


# ---------------------------------------------------------------------------------------- build_sampling_params


def test_build_from_generation_config_reads_every_field_and_defaults_unset_ones() -> None:
    gc = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, eos_token_id=[2, 3])
    assert build_sampling_params(gc) == SamplingParams(
        max_new_tokens=7, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=None, eos_token_ids=(2, 3)
    )
    gc = GenerationConfig(
        repetition_penalty=1.2,
        no_repeat_ngram_size=3,
        min_p=0.05,
        min_new_tokens=4,
        min_length=9,
        bad_words_ids=[[7], [8, 9]],
        stop_strings="</answer>",
    )
    params = build_sampling_params(gc)
    assert (params.repetition_penalty, params.no_repeat_ngram_size, params.min_p) == (1.2, 3, 0.05)
    assert (params.min_new_tokens, params.min_length) == (4, 9)
    assert (params.bad_words_ids, params.stop_strings, params.stop) == (((7,), (8, 9)), ("</answer>",), ())
    bare = GenerationConfig()
    bare.max_new_tokens = None
    bare.temperature = None
    params = build_sampling_params(bare)
    assert params.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and params.temperature == 1.0
    assert params.eos_token_ids == ()
    assert not params.uses_logits_processors and params.min_p is None and params.stop_strings == ()


def test_build_without_overrides_returns_the_base_itself() -> None:
    base = SamplingParams(max_new_tokens=3)
    assert build_sampling_params(base) is base


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"temperature": 0.5}, {"temperature": 0.5, "do_sample": True}),  # a temperature alone asks to sample
        ({"temperature": 0.0}, {"temperature": 0.0, "do_sample": False}),
        ({"temperature": 0.5, "do_sample": False}, {"temperature": 0.5, "do_sample": False}),
        ({"eos_token_id": 4}, {"eos_token_ids": (4,)}),
        ({"eos_token_id": []}, {"eos_token_ids": ()}),  # an empty list means no stop token
        ({"max_new_tokens": 9, "seed": 1}, {"max_new_tokens": 9, "seed": 1}),
        ({"repetition_penalty": 1.3, "min_p": 0.1}, {"repetition_penalty": 1.3, "min_p": 0.1}),
        ({"no_repeat_ngram_size": 2, "min_new_tokens": 3}, {"no_repeat_ngram_size": 2, "min_new_tokens": 3}),
        ({"bad_words_ids": [[5, 6]], "min_length": 4}, {"bad_words_ids": ((5, 6),), "min_length": 4}),
        ({"stop": "</answer>", "stop_strings": ["a", "b"]}, {"stop": ("</answer>",), "stop_strings": ("a", "b")}),
    ],
)
def test_overrides_replace_only_what_they_name(overrides: dict[str, Any], expected: dict[str, Any]) -> None:
    base = SamplingParams(max_new_tokens=3, top_k=5, eos_token_ids=(2,))
    params = build_sampling_params(base, **overrides)
    for name, value in {"max_new_tokens": 3, "top_k": 5, "eos_token_ids": (2,), **expected}.items():
        assert getattr(params, name) == value, name


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"seed": "x"}, "seed must be None or an int"),
        ({"eos_token_id": 10}, r"eos_token_ids must be token ids in \[0, 10\)"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be a finite number > 0"),
        ({"min_p": 2.0}, r"min_p must be None or a finite number in \[0, 1\]"),
        ({"bad_words_ids": [[10]]}, r"bad_words_ids must be a list of non-empty lists of token ids in \[0, 10\)"),
        ({"stop": [""]}, "stop must be a non-empty str or a list of non-empty str"),
    ],
)
def test_bad_overrides_raise_naming_the_field(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_sampling_params(SamplingParams(), vocab_size=10, **overrides)


def test_resolve_generation_config_overrides_the_models_values_with_the_callers() -> None:
    model = tiny_llama()
    model.generation_config.eos_token_id = 2
    model.generation_config.top_k = 7
    before = model.generation_config.to_dict()
    gc = resolve_generation_config(model, GenerationConfig(max_new_tokens=5, do_sample=True))
    assert (gc.max_new_tokens, gc.do_sample, gc.eos_token_id, gc.top_k) == (5, True, 2, 7)
    assert model.generation_config.to_dict() == before  # the model's own config is not changed


# ---------------------------------------------------------------------------------------- unsupported processors

UNSUPPORTED = [
    ({"suppress_tokens": [5]}, ["suppress_tokens"]),
    ({"sequence_bias": [[[5], 1.0]]}, ["sequence_bias"]),
    ({"forced_eos_token_id": 2, "begin_suppress_tokens": [3]}, ["forced_eos_token_id", "begin_suppress_tokens"]),
    ({"do_sample": True, "typical_p": 0.9, "epsilon_cutoff": 0.1}, ["typical_p", "epsilon_cutoff"]),
    ({"do_sample": False, "typical_p": 0.9}, []),  # a warper: model.generate ignores it without sampling
    ({"do_sample": True, "typical_p": 1.0, "eta_cutoff": 0.0, "guidance_scale": 1.0}, []),  # the no-op values
    ({"renormalize_logits": True, "repetition_penalty": 1.2, "min_p": 0.1}, []),  # supported (or changes nothing)
]


@pytest.mark.parametrize(("kwargs", "fields"), UNSUPPORTED, ids=[str(kw) for kw, _ in UNSUPPORTED])
def test_unsupported_processor_fields_are_those_model_generate_would_build_a_processor_for(
    kwargs: dict[str, Any], fields: list[str]
) -> None:
    assert unsupported_processor_fields(GenerationConfig(**kwargs)) == fields


def test_unsupported_field_is_dropped_with_one_warning_per_field(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sampling_params_module, "_warned_unsupported", set())
    gc = GenerationConfig(max_new_tokens=3, suppress_tokens=[5], repetition_penalty=1.5)
    with caplog.at_level(logging.WARNING, logger="rollout.sampling_params"):
        first = build_sampling_params(gc)
        second = build_sampling_params(gc)
    warnings = [r.getMessage() for r in caplog.records if r.name == "rollout.sampling_params"]
    assert len(warnings) == 1 and "suppress_tokens=[5]" in warnings[0] and "dropped" in warnings[0]
    assert first == second and first.repetition_penalty == 1.5  # the supported processor stays


def test_unsupported_field_is_refused_naming_it_without_drop_unsupported_processors() -> None:
    gc = GenerationConfig(do_sample=True, typical_p=0.5)
    with pytest.raises(ValueError, match=r"typical_p=0.5.*drop_unsupported_processors=True"):
        build_sampling_params(gc, drop_unsupported_processors=False)


# ---------------------------------------------------------------------------------------- per_request_processors


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"temperature": 0.5}, "do_sample=True, temperature=0.5"),  # a temperature alone implies sampling
        ({"temperature": 0.5, "do_sample": False}, "temperature=0.5"),
        ({"top_k": 3}, "top_k=3"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"bad_words_ids": [[4]]}, "bad_words_ids=((4,),)"),
        ({"min_new_tokens": 2, "min_p": 0.1}, "min_p=0.1, min_new_tokens=2"),
    ],
)
def test_check_processors_unchanged_names_every_processor_field_that_differs(
    overrides: dict[str, Any], named: str
) -> None:
    defaults = SamplingParams(max_new_tokens=5)
    with pytest.raises(ValueError) as info:
        check_processors_unchanged(build_sampling_params(defaults, **overrides), defaults)
    assert str(info.value).startswith(f"{named}: per_request_processors is False"), str(info.value)


def test_check_processors_unchanged_lets_lengths_seeds_eos_and_stop_strings_vary() -> None:
    defaults = SamplingParams(max_new_tokens=5, repetition_penalty=1.2)
    other = build_sampling_params(
        defaults, max_new_tokens=9, seed=3, eos_token_id=[4], stop=["x"], stop_strings=["y"], repetition_penalty=1.2
    )
    check_processors_unchanged(other, defaults)
    assert "seed" not in PROCESSOR_FIELDS and "stop" not in PROCESSOR_FIELDS
