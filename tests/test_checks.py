"""The shared input checks: messages name the argument and show the value; token-id lists in every accepted form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.checks import check_bool, check_choice, check_int, check_number, token_ids


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_int("n", 0, minimum=1), "n must be an int >= 1, got 0"),
        (lambda: check_int("n", True, minimum=0), "n must be an int >= 0, got True"),
        (lambda: check_int("n", 0, minimum=1, allow_none=True), "n must be None or an int >= 1, got 0"),
        (lambda: check_int("k", 6, minimum=1, maximum=5), "k must be an int in [1, 5], got 6"),
        (lambda: check_number("t", float("nan"), minimum=0), "t must be a finite number >= 0, got nan"),
        (lambda: check_number("t", 0, minimum=0, min_open=True), "t must be a finite number > 0, got 0"),
        (
            lambda: check_number("p", 0.0, 0, 1, min_open=True, allow_none=True),
            "p must be None or a finite number in (0, 1], got 0.0",
        ),
        (lambda: check_number("m", 1.0, 0, 1, max_open=True), "m must be a finite number in [0, 1), got 1.0"),
        (lambda: check_bool("b", 1), "b must be a bool, got 1"),
        (lambda: check_choice("c", "x", ("a", "b")), "c must be one of ('a', 'b'), got 'x'"),
    ],
)
def test_messages_name_the_argument_and_show_the_value(call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == message


def test_boundaries_and_none_are_accepted() -> None:
    check_int("n", 1, minimum=1)
    check_int("n", np.int64(5), minimum=1, maximum=5)
    check_int("n", None, minimum=1, allow_none=True)
    check_number("t", 0, minimum=0)
    check_number("p", 1.0, 0, 1, min_open=True)
    check_number("p", None, allow_none=True)


@pytest.mark.parametrize(
    "value",
    [[5, 6, 7], (5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int32(5), 6, torch.tensor(7).item()]],
)
def test_token_ids_accepts_sequences_tensors_and_arrays_of_ints(value) -> None:  # noqa: ANN001
    out = token_ids(value, "inputs[0]", vocab_size=8)
    assert out == [5, 6, 7] and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    ("value", "kwargs", "match"),
    [
        ([], {}, r"^inputs\[0\] must be a non-empty list of token ids, got an empty list"),
        ("abc", {}, r"^inputs\[0\] must be a non-empty list of token ids, got str"),
        (None, {}, r"^inputs\[0\] must be a non-empty list"),
        ("abc", {"allow_empty": True}, r"^inputs\[0\] must be a list of token ids"),
        ([5, 6.0], {}, r"^inputs\[0\] holds 6.0, which is not an integer.*must hold integer token ids"),
        ([5, True], {}, r"holds True, which is not an integer"),
        ([5, 8], {"vocab_size": 8}, r"^inputs\[0\] holds token id 8 outside the vocabulary \[0, 8\)"),
        ([-1, 5], {"vocab_size": 8}, r"holds token id -1 outside the vocabulary"),
        (torch.tensor([[5, 6]]), {}, r"must be a 1-D non-empty list of token ids, got shape \(1, 2\)"),
    ],
)
def test_token_ids_refuses_bad_prompts_naming_them(value, kwargs: dict, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        token_ids(value, "inputs[0]", **kwargs)


def test_an_empty_completion_is_allowed_when_asked() -> None:
    assert token_ids([], "completions[0]", vocab_size=8, allow_empty=True) == []
