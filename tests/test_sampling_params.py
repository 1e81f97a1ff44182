"""SamplingParams, checked at construction, and build_sampling_params (from a GenerationConfig, with overrides)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transformers import GenerationConfig

from rollout.sampling_params import (
    DEFAULT_MAX_NEW_TOKENS,
    SamplingParams,
    build_sampling_params,
    resolve_generation_config,
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


# ---------------------------------------------------------------------------------------- build_sampling_params


def test_build_from_generation_config_reads_every_field_and_defaults_unset_ones() -> None:
    gc = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, eos_token_id=[2, 3])
    assert build_sampling_params(gc) == SamplingParams(
        max_new_tokens=7, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=None, eos_token_ids=(2, 3)
    )
    bare = GenerationConfig()
    bare.max_new_tokens = None
    bare.temperature = None
    params = build_sampling_params(bare)
    assert params.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and params.temperature == 1.0
    assert params.eos_token_ids == ()


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
