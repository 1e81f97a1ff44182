"""Stop strings: token spellings equal transformers' for three kinds of vocabulary, and the matcher's rule."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.generation.stopping_criteria import StopStringCriteria

from rollout.stop_strings import (
    StopStringMatcher,
    byte_level_alphabet,
    check_tokenizer,
    spelling_mode,
    token_texts,
)
from tests.tiny_models import VOCAB_SIZE, tiny_byte_level_tokenizer

WORDS = ["▁st", "op", "▁stop", "opera", "sto", "pper", "▁las", "topper", "▁s", "to", "pped", "at", "tion", "é"]


def sentencepiece_tokenizer(byte_fallback: bool) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: "▁" marks a space, optionally <0xNN> tokens for bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if byte_fallback:
        vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", *WORDS]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=byte_fallback))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    steps = [decoders.Replace("▁", " ")] + ([decoders.ByteFallback()] if byte_fallback else [])
    backend.decoder = decoders.Sequence([*steps, decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def transformers_spellings(tokenizer: PreTrainedTokenizerFast) -> dict[int, bytes]:
    mode = StopStringCriteria._get_stop_string_matching_mode(tokenizer)
    tokens, ids = StopStringCriteria.clean_tokenizer_vocab(tokenizer, stop_string_matching_mode=mode)
    return {i: t if isinstance(t, bytes) else t.encode("utf-8") for t, i in zip(tokens, ids)}


def test_byte_level_alphabet_is_gpt2s() -> None:
    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


@pytest.mark.parametrize(
    ("build", "mode"),
    [
        (tiny_byte_level_tokenizer, "byte_level"),
        (lambda: sentencepiece_tokenizer(byte_fallback=True), "byte_fallback"),
        (lambda: sentencepiece_tokenizer(byte_fallback=False), "text"),
    ],
    ids=["byte_level", "byte_fallback", "text"],
)
def test_token_spellings_equal_transformers_stop_string_vocabulary(build, mode: str) -> None:  # noqa: ANN001
    tokenizer = build()
    assert spelling_mode(tokenizer) == mode
    texts = token_texts(tokenizer)
    expected = transformers_spellings(tokenizer)
    assert {i: texts[i] for i in expected} == expected
    if mode != "byte_level":
        # The leading space of a "▁" piece is kept; a byte token is that byte.
        assert texts[tokenizer.get_vocab()["▁stop"]] == b" stop"
    if mode == "byte_fallback":
        assert texts[tokenizer.get_vocab()["<0x0A>"]] == b"\n"


def test_token_texts_cover_the_models_vocabulary_and_are_cached_per_tokenizer() -> None:
    tokenizer = tiny_byte_level_tokenizer()
    texts = token_texts(tokenizer, vocab_size=VOCAB_SIZE + 10)
    assert len(texts) == VOCAB_SIZE + 10 and texts[-1] == b""  # ids the tokenizer lacks spell nothing
    assert token_texts(tokenizer, vocab_size=VOCAB_SIZE) is texts
    assert (texts[5], texts[3] + texts[4]) == ("é".encode(), "é".encode())  # "Ã©", and "Ã" then "©"


# ---------------------------------------------------------------------------------------- the matching rule

PIECES = ["st", "op", "stop", "opera", "sto", "pper", "las", "topper", "s", "to", "pped", "at", "tion", "x"]
SPELLED = [p.encode() for p in PIECES]


def ids(*pieces: str) -> list[int]:
    return [PIECES.index(p) for p in pieces]


@pytest.mark.parametrize(
    "pieces",
    [["st", "op"], ["stop"], ["st", "opera"], ["sto", "pper"], ["las", "topper"], ["s", "to", "pped"], ["x", "stop"]],
)
def test_stop_string_matches_when_it_ends_inside_the_newest_token(pieces: list[str]) -> None:
    # transformers' own examples of a match for "stop" (StopStringCriteria's docstring).
    assert StopStringMatcher(SPELLED, stop_strings=["stop"]).matches(ids(*pieces), num_prompt_tokens=0)


@pytest.mark.parametrize("pieces", [["stop", "at"], ["st", "op", "at"], ["st", "opera", "tion"], ["s", "to"]])
def test_stop_string_does_not_match_once_a_later_token_follows_it_or_when_incomplete(pieces: list[str]) -> None:
    assert not StopStringMatcher(SPELLED, stop_strings=["stop"]).matches(ids(*pieces), num_prompt_tokens=0)


def test_stop_strings_read_the_prompt_and_stop_reads_only_generated_tokens() -> None:
    sequence = ids("x", "st", "opera")  # prompt "xst", then "opera" was generated
    assert StopStringMatcher(SPELLED, stop_strings=["stop"]).matches(sequence, num_prompt_tokens=2)
    assert not StopStringMatcher(SPELLED, stop=["stop"]).matches(sequence, num_prompt_tokens=2)
    assert StopStringMatcher(SPELLED, stop=["stop"]).matches(sequence, num_prompt_tokens=1)  # "st" generated


def test_any_of_several_stop_strings_and_multibyte_characters_split_over_tokens() -> None:
    texts = token_texts(tiny_byte_level_tokenizer())
    matcher = StopStringMatcher(texts, stop=["zz", "é"])
    assert matcher.matches([7, 3, 4], num_prompt_tokens=1)  # "Ã" then "©": the two bytes of "é"
    assert not matcher.matches([7, 3], num_prompt_tokens=1)


def test_check_tokenizer_names_the_fields_that_need_one() -> None:
    check_tokenizer((), (), None)
    check_tokenizer(("a",), (), object())
    with pytest.raises(ValueError, match=r"^stop needs a tokenizer.*tokenizer="):
        check_tokenizer((), ("a",), None)
    with pytest.raises(ValueError, match=r"^stop_strings and stop need a tokenizer"):
        check_tokenizer(("a",), ("b",), None)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(SPELLED, stop=[""])
