"""Per-request sampling parameters, and the one function that builds them.

``SamplingParams`` is checked when constructed, so a value that exists is valid (only the end-of-sequence ids wait
for the vocabulary size: ``check_vocab``). ``build_sampling_params`` is the one place that turns user input into it:
a ``transformers.GenerationConfig`` (the model's, overridden by the caller's, as ``model.generate`` does) or a
``SamplingParams``, plus per-request overrides in ``model.generate``'s keyword names; it is called once at the public
boundary and the result is passed down whole.

The logits processors and stop strings follow ``model.generate``'s meaning of the ``GenerationConfig`` fields;
``stop`` is vLLM's per-request stop strings. A field whose processor rollout lacks is dropped with one warning, or
refused (``drop_unsupported_processors=False``; ``unsupported_processor_fields``). Leaf module but for ``checks``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig

from rollout.checks import FieldError, check_bool, check_int, check_number, is_int, is_number
from rollout.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# transformers' default when neither the model's nor the caller's generation config sets max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 20
# Most alternatives a request may ask for per token (vLLM's default ``max_logprobs``): each costs a top-k
# over the vocabulary and two floats per token on the way back to the host.
MAX_TOP_LOGPROBS = 20

# The fields that shape or draw the next-token distribution. With
# ``ContinuousBatchingConfig(per_request_processors=False)`` a request may not change them (transformers:
# "all requests use the default values"); max_new_tokens, eos ids, seeds and stop strings stay per request.
PROCESSOR_FIELDS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_new_tokens",
    "min_length",
    "bad_words_ids",
)


def _is_set(value: Any) -> bool:
    return value is not None


def _open_unit(value: Any) -> bool:
    return value is not None and 0.0 < value < 1.0


# GenerationConfig fields whose logits processor rollout does not implement, with the condition under
# which ``model.generate`` builds that processor (``GenerationMixin._get_logits_processor`` in
# transformers 5.24). The second table only counts when sampling: transformers applies those warpers
# with do_sample=True alone.
UNSUPPORTED_PROCESSOR_FIELDS: dict[str, Callable[[Any], bool]] = {
    "guidance_scale": lambda v: v is not None and v != 1,
    "sequence_bias": _is_set,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
    "encoder_no_repeat_ngram_size": lambda v: v is not None and v > 0,
    "forced_bos_token_id": _is_set,
    "forced_eos_token_id": _is_set,
    "remove_invalid_values": lambda v: v is True,
    "exponential_decay_length_penalty": _is_set,
    "suppress_tokens": _is_set,
    "begin_suppress_tokens": _is_set,
    "watermarking_config": _is_set,
}
UNSUPPORTED_SAMPLING_FIELDS: dict[str, Callable[[Any], bool]] = {
    "top_h": _is_set,
    "typical_p": lambda v: v is not None and v < 1.0,
    "epsilon_cutoff": _open_unit,
    "eta_cutoff": _open_unit,
}
_warned_unsupported: set[str] = set()  # fields already warned about in this process


def _as_strings(value: Any) -> Any:
    """A str becomes a 1-tuple, a list or tuple a tuple; anything else is left for validation to refuse."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _as_token_sequences(value: Any) -> Any:
    """A list of token-id lists becomes a tuple of tuples of ints; anything else is left for validation."""
    if isinstance(value, (list, tuple)) and all(isinstance(seq, (list, tuple)) for seq in value):
        return tuple(tuple(int(t) if is_int(t) else t for t in seq) for seq in value)
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated at construction.

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        do_sample: False means greedy decoding, whatever the temperature.
        temperature: > 0 to sample; 0 means greedy.
        top_k: keep the k most likely tokens (None or 0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        seed: seed of this request's own random stream (``sampling.seeded_uniforms``: token t of
            the completion draws number t); the completion then does not depend on the other
            requests of the batch.
        eos_token_ids: token ids that end the request (the stop token is kept in the output).
            An int or a list is accepted and stored as a tuple.
        repetition_penalty: > 0; 1.0 is none. Every token id already in the sequence (prompt and
            generated) has its logit divided by it when positive, multiplied when negative.
        no_repeat_ngram_size: n >= 0; 0 is none. A token that would repeat an n-gram already in the
            sequence (prompt included) is banned.
        min_p: in [0, 1], or None. When sampling, after top-k and top-p, tokens whose probability is
            below ``min_p`` times the top token's are dropped. Greedy requests ignore it, as
            ``model.generate`` does.
        min_new_tokens: >= 0; the end-of-sequence ids are banned until this many tokens are generated.
        min_length: >= 0; the end-of-sequence ids are banned while prompt plus generated tokens are
            fewer than this.
        bad_words_ids: token-id sequences never to generate: the last token of a sequence is banned
            when the sequence so far ends with the others. A one-token sequence equal to an
            end-of-sequence id is ignored, as in transformers. Lists are stored as tuples.
        stop_strings: ``GenerationConfig.stop_strings``: the request ends (finish reason "stop")
            once the text of its last tokens contains one of them, ending inside the last token;
            the text may start in the prompt. Needs the engine's tokenizer. A str is one string.
        stop: vLLM-style per-request stop strings: the same test on the generated tokens' text only.
            The token that completes a stop string is kept in the output, for both.
        num_top_logprobs: in [0, ``MAX_TOP_LOGPROBS``]; for each generated token, also record the
            ids and logprobs of the this-many most likely tokens, most likely first, from the same
            distribution as the sampled token's logprob (``ContinuousBatchingConfig.logprobs_mode``).
            vLLM's ``SamplingParams.logprobs``, renamed: rollout's ``logprobs`` already means the
            sampled token's own logprob (``GenerationOutput.logprobs``). Needs
            ``ContinuousBatchingConfig(return_logprobs=True)``. 0 costs nothing.
        lora: the name of the LoRA adapter this request runs under (one the engine has loaded: ``Engine.load_lora``;
            vLLM's ``LoRARequest``, carried with the request's other values so that every path passes it down
            whole), or None for the base model.
        structured_outputs: what the output must match (``StructuredOutputs``: a JSON schema, regex, choice or EBNF
            grammar; a dict of its fields is converted), or None. Needs the engine's tokenizer; the returned logprobs
            stay the model's (the mask only restricts which token is drawn).

    Raises:
        FieldError: a value out of its range; ``field`` names the field, and the message starts with it.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_p: float | None = None
    min_new_tokens: int = 0
    min_length: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    num_top_logprobs: int = 0
    lora: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # True when a logits processor that reads the sequence may change this request's logits
    # (set at construction; the sampler skips every other request at no cost).
    uses_logits_processors: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        eos = self.eos_token_ids
        if is_int(eos):
            eos = (eos,)
        elif isinstance(eos, Sequence) and not isinstance(eos, (str, bytes, tuple)):
            eos = tuple(eos)
        object.__setattr__(self, "eos_token_ids", eos)
        object.__setattr__(self, "bad_words_ids", _as_token_sequences(self.bad_words_ids))
        object.__setattr__(self, "stop_strings", _as_strings(self.stop_strings))
        object.__setattr__(self, "stop", _as_strings(self.stop))
        object.__setattr__(self, "structured_outputs", StructuredOutputs.coerce(self.structured_outputs))
        self.validate()
        # Plain Python types from here on: numpy scalars and ints are common in user input.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        if self.min_p is not None:
            object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))
        uses = (
            self.repetition_penalty != 1.0
            or self.no_repeat_ngram_size > 0
            or bool(self.bad_words_ids)
            or (bool(self.eos_token_ids) and (self.min_new_tokens > 0 or self.min_length > 0))
        )
        object.__setattr__(self, "uses_logits_processors", uses)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (of the processed logits) at every step."""
        return (not self.do_sample) or self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_tokenizer(self) -> bool:
        """True when the request has stop strings, which are read from the tokenizer's token texts."""
        return bool(self.stop_strings or self.stop)

    @functools.cached_property
    def banned_tokens(self) -> tuple[int, ...]:
        """The one-token bad words, less the end-of-sequence ids (transformers drops those)."""
        return tuple(seq[0] for seq in self.bad_words_ids if len(seq) == 1 and seq[0] not in self.eos_token_ids)

    @functools.cached_property
    def bad_word_prefixes(self) -> dict[int, dict[tuple[int, ...], tuple[int, ...]]]:
        """Bad words of two or more tokens: prefix length -> prefix -> the last tokens it bans."""
        table: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for seq in self.bad_words_ids:
            if len(seq) > 1:
                by_prefix = table.setdefault(len(seq) - 1, {})
                by_prefix[seq[:-1]] = by_prefix.get(seq[:-1], ()) + (seq[-1],)
        return table

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise FieldError naming the field when a value is out of its allowed range.

        Construction already runs this without a vocabulary; pass ``vocab_size`` to also bound
        the end-of-sequence ids (or call ``check_vocab``).
        """
        check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_bool("do_sample", self.do_sample)
        check_number("temperature", self.temperature, minimum=0)
        check_int("top_k", self.top_k, minimum=0, allow_none=True)
        check_number("top_p", self.top_p, 0, 1, min_open=True, allow_none=True)
        check_int("seed", self.seed, allow_none=True)
        check_number("repetition_penalty", self.repetition_penalty, minimum=0, min_open=True)
        check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, minimum=0)
        check_number("min_p", self.min_p, 0, 1, allow_none=True)
        check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        check_int("min_length", self.min_length, minimum=0)
        check_int("num_top_logprobs", self.num_top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS)
        for name in ("stop_strings", "stop"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
                raise FieldError(name, f"{name} must be a non-empty str or a list of non-empty str, got {value!r}")
        if self.lora is not None and not (isinstance(self.lora, str) and self.lora):
            raise FieldError("lora", f"lora must be an adapter's name (a non-empty str) or None, got {self.lora!r}")
        self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int | None) -> None:
        """Raise FieldError unless every end-of-sequence and bad-word id lies in ``[0, vocab_size)``.

        With ``vocab_size`` None only the lower bound (and the type) is checked.
        """

        def in_vocab(tok: Any) -> bool:
            return is_int(tok) and tok >= 0 and (vocab_size is None or tok < vocab_size)

        bound = vocab_size if vocab_size is not None else "vocab_size"
        eos = self.eos_token_ids
        if not isinstance(eos, tuple) or not all(in_vocab(tok) for tok in eos):
            raise FieldError(
                "eos_token_ids",
                f"eos_token_ids must be token ids in [0, {bound}) (eos_token_id of a GenerationConfig), got {eos!r}",
            )
        bad = self.bad_words_ids
        if not isinstance(bad, tuple) or not all(
            isinstance(seq, tuple) and seq and all(in_vocab(tok) for tok in seq) for seq in bad
        ):
            raise FieldError(
                "bad_words_ids",
                f"bad_words_ids must be a list of non-empty lists of token ids in [0, {bound}), got {bad!r}",
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


def unsupported_processor_fields(generation_config: GenerationConfig) -> list[str]:
    """The fields of a ``GenerationConfig`` for which ``model.generate`` would build a logits processor
    that rollout does not implement, in the config's field order.

    Args:
        generation_config: a (resolved) generation config.

    Returns:
        Field names, e.g. ``["typical_p", "suppress_tokens"]``; empty when everything it asks for is honoured.
    """
    tables = [UNSUPPORTED_PROCESSOR_FIELDS]
    if generation_config.do_sample:
        tables.append(UNSUPPORTED_SAMPLING_FIELDS)
    return [
        name for table in tables for name, active in table.items() if active(getattr(generation_config, name, None))
    ]


def _from_generation_config(gc: GenerationConfig, drop_unsupported_processors: bool) -> dict[str, Any]:
    """The ``SamplingParams`` values a ``GenerationConfig`` asks for (unset fields mean transformers' defaults)."""
    unsupported = unsupported_processor_fields(gc)
    if unsupported and not drop_unsupported_processors:
        shown = ", ".join(f"{name}={getattr(gc, name)!r}" for name in unsupported)
        raise FieldError(
            unsupported[0],
            f"generation_config sets {shown}: rollout does not implement the logits processor of "
            f"{'this field' if len(unsupported) == 1 else 'these fields'}; unset it, or pass "
            "ContinuousBatchingConfig(drop_unsupported_processors=True) to drop it with a warning",
        )
    new = [name for name in unsupported if name not in _warned_unsupported]
    if new:
        _warned_unsupported.update(new)
        logger.warning(
            "generation_config sets %s, whose logits processor rollout does not implement: dropped "
            "(ContinuousBatchingConfig(drop_unsupported_processors=False) refuses it instead)",
            ", ".join(f"{name}={getattr(gc, name)!r}" for name in new),
        )

    def value(name: str, default: Any) -> Any:
        v = getattr(gc, name, None)
        return default if v is None else v

    return {
        "max_new_tokens": value("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
        "do_sample": bool(gc.do_sample),
        "temperature": value("temperature", 1.0),
        "top_k": gc.top_k,
        "top_p": gc.top_p,
        "seed": None,
        "eos_token_ids": value("eos_token_id", ()),
        "repetition_penalty": value("repetition_penalty", 1.0),
        "no_repeat_ngram_size": value("no_repeat_ngram_size", 0),
        "min_p": gc.min_p,
        "min_new_tokens": value("min_new_tokens", 0),
        "min_length": value("min_length", 0),
        "bad_words_ids": value("bad_words_ids", ()),
        "stop_strings": value("stop_strings", ()),
    }


def build_sampling_params(
    base: SamplingParams | GenerationConfig | None = None,
    *,
    vocab_size: int | None = None,
    drop_unsupported_processors: bool = True,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    min_p: float | None = None,
    min_new_tokens: int | None = None,
    min_length: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    stop: str | Sequence[str] | None = None,
    num_top_logprobs: int | None = None,
    lora: str | None = None,
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None,
) -> SamplingParams:
    """Build validated ``SamplingParams`` from defaults and per-request overrides.

    Args:
        base: the defaults: a (resolved) ``GenerationConfig`` (max_new_tokens, do_sample,
            temperature, top_k, top_p, eos_token_id, repetition_penalty, no_repeat_ngram_size,
            min_p, min_new_tokens, min_length, bad_words_ids, stop_strings; unset fields take
            transformers' defaults: max_new_tokens 20, temperature 1.0, no processor), an existing
            ``SamplingParams``, or None for ``SamplingParams()``.
        vocab_size: when given, the end-of-sequence and bad-word ids must lie in ``[0, vocab_size)``.
        drop_unsupported_processors: for a ``GenerationConfig`` that asks for a logits processor rollout
            does not implement (see ``unsupported_processor_fields``): True drops the field with one
            warning per field and process, False raises.
        max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_id, repetition_penalty,
            no_repeat_ngram_size, min_p, min_new_tokens, min_length, bad_words_ids, stop_strings:
            overrides in ``model.generate``'s names; None keeps the default (``eos_token_id=[]`` means no
            stop token, ``stop_strings=[]`` none). A temperature given without ``do_sample`` implies
            ``do_sample = temperature > 0``.
        stop: vLLM-style stop strings of the request (see ``SamplingParams.stop``).
        num_top_logprobs: alternatives recorded per generated token (see ``SamplingParams.num_top_logprobs``).
        lora: the LoRA adapter's name (see ``SamplingParams.lora``); None keeps the default's.
        structured_outputs: the output's constraint (see ``SamplingParams.structured_outputs``); None keeps the
            default's.

    Returns:
        The parameters; ``base`` itself when it is a ``SamplingParams`` and nothing overrides it.

    Raises:
        FieldError: a value out of range, or an unsupported processor field with
            ``drop_unsupported_processors=False``; ``field`` names it, and so does the message.
    """
    given = {
        "max_new_tokens": max_new_tokens,
        "do_sample": None if do_sample is None else bool(do_sample),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "eos_token_ids": eos_token_id,
        "repetition_penalty": repetition_penalty,
        "no_repeat_ngram_size": no_repeat_ngram_size,
        "min_p": min_p,
        "min_new_tokens": min_new_tokens,
        "min_length": min_length,
        "bad_words_ids": bad_words_ids,
        "stop_strings": stop_strings,
        "stop": stop,
        "num_top_logprobs": num_top_logprobs,
        "lora": lora,
        "structured_outputs": structured_outputs,
    }
    if isinstance(base, GenerationConfig):
        values = _from_generation_config(base, drop_unsupported_processors)
    else:
        params = base if base is not None else SamplingParams()
        if all(v is None for v in given.values()):
            params.check_vocab(vocab_size)
            return params
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    values.update({k: v for k, v in given.items() if v is not None})
    if temperature is not None and do_sample is None and is_number(temperature):
        # A per-request temperature > 0 asks for sampling, 0 for greedy (a bad one fails below).
        values["do_sample"] = temperature > 0
    params = SamplingParams(**values)
    params.check_vocab(vocab_size)
    return params


def check_processors_unchanged(params: SamplingParams, defaults: SamplingParams) -> None:
    """Refuse a request whose logits-processor values differ from the defaults.

    What ``ContinuousBatchingConfig(per_request_processors=False)`` means: every request uses the
    generation config's processor values (``PROCESSOR_FIELDS``); max_new_tokens, eos ids, seeds and
    stop strings may still differ per request.

    Raises:
        FieldError: naming every field of ``PROCESSOR_FIELDS`` that differs, with both values (``field``: the first).
    """
    differ = [name for name in PROCESSOR_FIELDS if getattr(params, name) != getattr(defaults, name)]
    if differ:
        mine = ", ".join(f"{name}={getattr(params, name)!r}" for name in differ)
        theirs = ", ".join(f"{name}={getattr(defaults, name)!r}" for name in differ)
        raise FieldError(
            differ[0],
            f"{mine}: per_request_processors is False, so every request uses the generation config's "
            f"logits-processor values ({theirs}); pass ContinuousBatchingConfig(per_request_processors=True) "
            "to set them per request",
        )
