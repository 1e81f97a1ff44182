"""Per-request sampling parameters, and the one function that builds them.

``SamplingParams`` is checked when it is constructed, so a value that exists is valid (only the
end-of-sequence ids wait for the vocabulary size: see ``check_vocab``). ``build_sampling_params`` is
the one place that turns user input into it: a ``transformers.GenerationConfig`` (the model's own,
overridden by the caller's, as ``model.generate`` does) or an existing ``SamplingParams``, plus
per-request overrides in ``model.generate``'s keyword names. It is called once at the public
boundary (``generate_batch``, the manager's ``add_request(s)``) and the result is passed down whole.

Leaf module: it imports nothing of rollout's but ``checks``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from .checks import check_bool, check_int, check_number, is_int, is_number

# transformers' default when neither the model's nor the caller's generation config sets max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated at construction.

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        do_sample: False means greedy decoding, whatever the temperature.
        temperature: > 0 to sample; 0 means greedy.
        top_k: keep the k most likely tokens (None or 0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        seed: seed of this request's own generator; the completion then does not depend
            on the other requests of the batch.
        eos_token_ids: token ids that end the request (the stop token is kept in the output).
            An int or a list is accepted and stored as a tuple.

    Raises:
        ValueError: a value out of its range; the message starts with the field's name.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        eos = self.eos_token_ids
        if is_int(eos):
            eos = (eos,)
        elif isinstance(eos, Sequence) and not isinstance(eos, (str, bytes, tuple)):
            eos = tuple(eos)
        object.__setattr__(self, "eos_token_ids", eos)
        self.validate()
        # Plain Python types from here on: numpy scalars and ints are common in user input.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return (not self.do_sample) or self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when a value is out of its allowed range.

        Construction already runs this without a vocabulary; pass ``vocab_size`` to also bound
        the end-of-sequence ids (or call ``check_vocab``).
        """
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_bool("do_sample", self.do_sample)
        check_number("temperature", self.temperature, minimum=0)
        check_int("top_k", self.top_k, minimum=0, allow_none=True)
        check_number("top_p", self.top_p, 0, 1, min_open=True, allow_none=True)
        check_int("seed", self.seed, allow_none=True)
        self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise ValueError unless every end-of-sequence id lies in ``[0, vocab_size)``.

        With ``vocab_size`` None only the lower bound (and the type) is checked.
        """
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or not all(
            is_int(tok) and tok >= 0 and (vocab_size is None or tok < vocab_size) for tok in eos
        ):
            bound = vocab_size if vocab_size is not None else "vocab_size"
            raise ValueError(
                f"eos_token_ids must be token ids in [0, {bound}) (eos_token_id of a GenerationConfig), got {eos!r}"
            )


def resolve_generation_config(model: Any, generation_config: GenerationConfig | None) -> GenerationConfig:
    """The model's generation config overridden by the values the caller set explicitly (transformers' rule).

    Args:
        model: a ``transformers`` model; its ``generation_config`` (if any) gives the defaults.
        generation_config: the caller's config, or None.

    Returns:
        A new GenerationConfig; neither input is changed.
    """
    base = getattr(model, "generation_config", None)
    merged = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
    if generation_config is not None:
        merged.update(**generation_config.to_diff_dict())
    return merged


def build_sampling_params(
    base: SamplingParams | GenerationConfig | None = None,
    *,
    vocab_size: int | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> SamplingParams:
    """Build validated ``SamplingParams`` from defaults and per-request overrides.

    Args:
        base: the defaults: a (resolved) ``GenerationConfig`` (max_new_tokens, do_sample,
            temperature, top_k, top_p, eos_token_id; an unset max_new_tokens means 20 and an unset
            temperature 1.0), an existing ``SamplingParams``, or None for ``SamplingParams()``.
        vocab_size: when given, the end-of-sequence ids must lie in ``[0, vocab_size)``.
        max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id: overrides in
            ``model.generate``'s names; None keeps the default (``eos_token_id=[]`` means no stop
            token). A temperature given without ``do_sample`` implies ``do_sample = temperature > 0``.

    Returns:
        The parameters; ``base`` itself when it is a ``SamplingParams`` and nothing overrides it.

    Raises:
        ValueError: a value out of range (the message names the field).
    """
    if isinstance(base, GenerationConfig):
        values: dict[str, Any] = {
            "max_new_tokens": base.max_new_tokens if base.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
            "do_sample": bool(base.do_sample),
            "temperature": base.temperature if base.temperature is not None else 1.0,
            "top_k": base.top_k,
            "top_p": base.top_p,
            "seed": None,
            "eos_token_ids": base.eos_token_id if base.eos_token_id is not None else (),
        }
    else:
        params = base if base is not None else SamplingParams()
        overrides = (max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id)
        if all(v is None for v in overrides):
            params.check_vocab(vocab_size)
            return params
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    given = {
        "max_new_tokens": max_new_tokens,
        "do_sample": None if do_sample is None else bool(do_sample),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "eos_token_ids": eos_token_id,
    }
    values.update({k: v for k, v in given.items() if v is not None})
    if temperature is not None and do_sample is None and is_number(temperature):
        # A per-request temperature > 0 asks for sampling, 0 for greedy (a bad one fails below).
        values["do_sample"] = temperature > 0
    params = SamplingParams(**values)
    params.check_vocab(vocab_size)
    return params
