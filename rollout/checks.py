"""The checks of user input, written once: bools, ints, numbers, choices and token-id lists.

Every public entry point (the config, ``SamplingParams``, ``generate_batch``, the manager's ``add_request(s)``,
``score``) validates its input with these helpers, once, and passes the checked values down. Each failure is a
``FieldError`` (a ``ValueError``) that carries the argument's name in ``field``, and whose message starts with it and
shows the bad value: a caller that must name the field elsewhere (the HTTP server's ``param``) reads ``field``, never
the text. Leaf module.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


class FieldError(ValueError):
    """A bad value of one named argument or field, raised where the check is made.

    Args:
        field: the argument's or field's name as the caller spelled it (``"temperature"``, ``"inputs[3]"``,
            ``"update_info.shapes"``); what the message is about.
        message: the whole message; by convention it starts with ``field``.

    Attributes:
        field: as given.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (``True`` is not a token count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for a finite real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_bool(name: str, value: Any) -> None:
    """Raises FieldError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise FieldError(name, f"{name} must be a bool, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Raises FieldError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise FieldError(name, f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_int(
    name: str, value: Any, minimum: int | None = None, maximum: int | None = None, allow_none: bool = False
) -> None:
    """Raises FieldError unless ``value`` is an int in ``[minimum, maximum]`` (or None when allowed).

    The message reads, for example, ``max_new_tokens must be an int >= 1, got 0`` or
    ``batch_tokens must be None or an int >= 1, got 0``.
    """
    if value is None and allow_none:
        return
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return
    bound = _bound_text(minimum, maximum, min_open=False, max_open=False)
    raise FieldError(name, f"{name} must be {'None or ' if allow_none else ''}an int{bound}, got {value!r}")


def check_number(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    min_open: bool = False,
    max_open: bool = False,
    allow_none: bool = False,
) -> None:
    """Raises FieldError unless ``value`` is a finite number in the given range (or None when allowed).

    Args:
        name: the argument's name, first word of the message.
        value: the value to check.
        minimum, maximum: the bounds; None for no bound.
        min_open, max_open: exclude the bound itself (``(0, 1]`` is ``min_open=True``).
        allow_none: accept None.

    Raises:
        FieldError: e.g. ``temperature must be a finite number >= 0, got nan`` (field ``temperature``).
    """
    if value is None and allow_none:
        return
    if is_number(value):
        above = minimum is None or (value > minimum if min_open else value >= minimum)
        below = maximum is None or (value < maximum if max_open else value <= maximum)
        if above and below:
            return
    bound = _bound_text(minimum, maximum, min_open=min_open, max_open=max_open)
    raise FieldError(name, f"{name} must be {'None or ' if allow_none else ''}a finite number{bound}, got {value!r}")


def _bound_text(minimum: float | None, maximum: float | None, *, min_open: bool, max_open: bool) -> str:
    """The range of a check's message: `` in (0, 1]``, `` >= 1``, `` <= 2`` or nothing."""
    if minimum is not None and maximum is not None:
        return f" in {'(' if min_open else '['}{minimum}, {maximum}{')' if max_open else ']'}"
    if minimum is not None:
        return f" {'>' if min_open else '>='} {minimum}"
    if maximum is not None:
        return f" {'<' if max_open else '<='} {maximum}"
    return ""


def token_ids(value: Any, name: str, vocab_size: int | None = None, allow_empty: bool = False) -> list[int]:
    """A prompt (or completion) as a list of Python ints, checked against the vocabulary.

    Accepts lists, tuples and other sequences of integers, and 1-D torch tensors and numpy arrays.
    A list of plain ``int`` takes a fast path: one type scan and a C-level ``min``/``max`` for the
    vocabulary, with no per-token Python work beyond the scan.

    Args:
        value: the token ids.
        name: how the message names the argument (``"inputs[3]"``).
        vocab_size: ids must lie in ``[0, vocab_size)``; None skips the vocabulary check.
        allow_empty: accept an empty list (a completion may be empty, a prompt may not).

    Returns:
        A new list of Python ints.

    Raises:
        FieldError: not a 1-D sequence of integers, empty when that is not allowed, or an id outside
            the vocabulary; ``field`` is ``name``.
    """
    kind = "list of token ids" if allow_empty else "non-empty list of token ids"
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        if getattr(value, "ndim", 1) != 1:
            raise FieldError(name, f"{name} must be a 1-D {kind}, got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise FieldError(name, f"{name} must be a {kind}, got {type(value).__name__}: {value!r:.60}")
    if not value and not allow_empty:
        raise FieldError(name, f"{name} must be a {kind}, got an empty list")
    if all(type(tok) is int for tok in value):
        out = list(value)
    else:
        out = []
        for tok in value:
            if not is_int(tok):
                raise FieldError(
                    name,
                    f"{name} holds {tok!r}, which is not an integer ({type(tok).__name__}); "
                    f"{name} must hold integer token ids",
                )
            out.append(int(tok))
    if vocab_size is not None and out and (min(out) < 0 or max(out) >= vocab_size):
        bad = next(tok for tok in out if not 0 <= tok < vocab_size)
        raise FieldError(name, f"{name} holds token id {bad} outside the vocabulary [0, {vocab_size})")
    return out
