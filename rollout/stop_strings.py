"""Stop strings: does the text of a request's last tokens contain one of its stop strings?

The tokenizer spells each token id once (``token_texts``, cached per tokenizer) and a ``StopStringMatcher`` reads
those spellings after each sampled token. The test is ``model.generate``'s: a stop string matches when it occurs in
the text of the last tokens and ends inside the newest token's, so each is found the first time it is complete (one
already complete in the prompt does not match again).

Each token is spelled as the bytes it adds after other text: for byte-level BPE vocabularies (GPT-2, Llama-3,
SmolLM2) the bytes its characters stand for (a stop string may end inside a multi-byte character); for byte-fallback
tokens (``<0x0A>``) their byte; otherwise the UTF-8 of its text decoded after a fixed prefix (keeping the leading
space of SentencePiece's ``▁`` tokens). Special tokens are spelled as written. Leaf module (no rollout imports).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

from rollout.checks import FieldError

# Text the tokenizer decodes before a token to read that token's spelling in running text.
_ANCHOR = "abcdef"

_TEXTS_CACHE: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte -> that byte.

    Bytes of printable Latin-1 characters stand for themselves; the other 68 bytes, in
    increasing order, take the characters from U+0100 on.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_of = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(256 + n)
    return {c: b for b, c in char_of.items()}


def _decoder_types(config: Any) -> set[str]:
    """Every ``"type"`` value in a (nested) tokenizers decoder configuration."""
    if isinstance(config, dict):
        found = {config["type"]} if isinstance(config.get("type"), str) else set()
        return found.union(*(_decoder_types(v) for v in config.values()))
    if isinstance(config, list):
        return set().union(*(_decoder_types(v) for v in config))
    return set()


def spelling_mode(tokenizer: Any) -> str:
    """How the tokenizer's vocabulary spells text: ``"byte_level"``, ``"byte_fallback"`` or ``"text"``.

    Read from the decoder of a fast tokenizer's backend; a slow tokenizer spells ``"text"``.
    """
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return "text"
    if type(decoder).__name__ == "ByteLevel":
        return "byte_level"
    try:
        state = decoder.__getstate__()
        types = _decoder_types(json.loads(state.decode() if isinstance(state, bytes) else state))
    except (AttributeError, TypeError, ValueError):
        return "text"
    if "ByteFallback" in types:  # its <0xNN> tokens are explicit bytes, even beside a ByteLevel step
        return "byte_fallback"
    return "byte_level" if "ByteLevel" in types else "text"


def token_texts(tokenizer: Any, vocab_size: int = 0) -> list[bytes]:
    """The spelling of every token id of a tokenizer, in bytes (see the module docstring).

    Built once per tokenizer object (about a second for a 50k vocabulary spelled as text, less
    for byte-level ones) and cached while the tokenizer lives.

    Args:
        tokenizer: a ``transformers`` tokenizer (``get_vocab``, ``convert_tokens_to_string``).
        vocab_size: the model's vocabulary size; ids the tokenizer lacks are spelled ``b""``.

    Returns:
        A list indexed by token id, of length max(vocab_size, largest id + 1); do not change it.
    """
    try:
        cached = _TEXTS_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and len(cached) >= vocab_size:
        return cached
    vocab = tokenizer.get_vocab()
    texts = [b""] * max(vocab_size, max(vocab.values()) + 1)
    mode = spelling_mode(tokenizer)
    alphabet = byte_level_alphabet() if mode == "byte_level" else {}
    anchor_ids = tokenizer(_ANCHOR, add_special_tokens=False)["input_ids"]
    anchor = tokenizer.convert_ids_to_tokens(anchor_ids)
    for token, token_id in vocab.items():
        if mode == "byte_level" and all(c in alphabet for c in token):
            texts[token_id] = bytes(alphabet[c] for c in token)
        elif mode == "byte_fallback" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            texts[token_id] = bytes([int(token[3:5], 16)])
        else:
            text = tokenizer.convert_tokens_to_string([*anchor, token])
            at = text.find(_ANCHOR)
            # A tokenizer that cannot spell the anchor: the token's own decoded text.
            text = text[at + len(_ANCHOR) :] if at >= 0 else tokenizer.convert_tokens_to_string([token])
            texts[token_id] = text.encode("utf-8")
    try:
        _TEXTS_CACHE[tokenizer] = texts
    except TypeError:
        pass
    return texts


def check_tokenizer(stop_strings: Sequence[str], stop: Sequence[str], tokenizer: Any) -> None:
    """Refuse stop strings when there is no tokenizer to spell the tokens.

    Raises:
        FieldError: ``stop_strings`` or ``stop`` is non-empty and ``tokenizer`` is None; ``field`` and the
            message name the field(s) (the first in ``field``) and the message says where a tokenizer goes.
    """
    if tokenizer is not None or not (stop_strings or stop):
        return
    names = [name for name, value in (("stop_strings", stop_strings), ("stop", stop)) if value]
    raise FieldError(
        names[0],
        f"{' and '.join(names)} {'need' if len(names) > 1 else 'needs'} a tokenizer to read the text of the "
        "tokens: pass tokenizer= to generate_batch, init_continuous_batching or ContinuousBatchingManager",
    )


class StopStringMatcher:
    """The stop strings of one kind of request, over one tokenizer's spellings.

    Stateless, so the requests that share their stop strings share one matcher.

    Args:
        texts: the spelling of each token id (``token_texts``).
        stop_strings: transformers' ``stop_strings``: the text read may begin in the prompt.
        stop: vLLM-style ``stop``: only the generated tokens' text is read.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, texts: Sequence[bytes], stop_strings: Sequence[str] = (), stop: Sequence[str] = ()) -> None:
        if not all(stop_strings) or not all(stop):
            raise ValueError("stop strings must be non-empty")
        self.texts = texts
        self.stop_strings = tuple(s.encode("utf-8") for s in stop_strings)
        self.stop = tuple(s.encode("utf-8") for s in stop)
        # Tokens to read back: every token of a match but the first spells at least one byte of it
        # (transformers reads as many tokens as the longest stop string has characters).
        self._window = max((len(s) for s in self.stop_strings), default=0)
        self._window_generated = max((len(s) for s in self.stop), default=0)

    def matches(self, token_ids: Sequence[int], num_prompt_tokens: int) -> bool:
        """True when the newest token completes a stop string.

        Args:
            token_ids: the request's prompt then generated tokens; the last one is the newest.
            num_prompt_tokens: how many of them are the prompt.
        """
        n = len(token_ids)
        if self.stop_strings and self._ends_with(token_ids[max(0, n - self._window) :], self.stop_strings):
            return True
        start = max(num_prompt_tokens, n - self._window_generated)
        return bool(self.stop) and start < n and self._ends_with(token_ids[start:], self.stop)

    def _ends_with(self, ids: Sequence[int], patterns: tuple[bytes, ...]) -> bool:
        texts = self.texts
        tail = b"".join([texts[t] for t in ids])
        newest_starts = len(tail) - len(texts[ids[-1]])
        # An occurrence starting at i ends inside the newest token when i + len(s) > newest_starts.
        return any(tail.find(s, max(0, newest_starts - len(s) + 1)) >= 0 for s in patterns)
