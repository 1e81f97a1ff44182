"""Structured outputs in the sampler: grammars compiled once per spec, one matcher per request, a token bitmask per row.

The grammar engine is xgrammar (vLLM's and SGLang's default structured-output backend): ``GrammarCompiler`` compiles a
``StructuredOutputs`` against the tokenizer's vocabulary once (``GrammarCache``, keyed by the spec), a
``GrammarMatcher`` per request follows the tokens the request generated (``new_matcher``; the request advances it as it
appends a token: ``Request.append_token``), and in the step's one sampling pass ``apply_grammar_masks`` fills a
bitmask of the allowed next tokens for each constrained row on the CPU and sets the others' logits to -inf, before
temperature, top-k and top-p. Free rows are not touched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from rollout.structured_outputs import StructuredOutputs, import_xgrammar

__all__ = ["GrammarCache", "allows_a_first_token", "apply_grammar_masks", "new_matcher"]


class GrammarCache:
    """Compiled grammars of one tokenizer, one per distinct ``StructuredOutputs`` (``StructuredOutputs.key``).

    A spec is compiled once, by the first thread that asks for it, outside the cache's lock: a thread that asks for a
    spec already compiled (the loop readying a request) never waits for another spec's compile, and threads that ask
    for the spec being compiled wait for that one compile. The cache is bounded (``max_bytes`` of compiled grammars,
    least recently used dropped first; a request keeps its own grammar through its matcher), since a server that is
    sent a new schema per request would otherwise grow without end (vLLM bounds xgrammar's cache the same way).

    Args:
        tokenizer: a ``transformers`` tokenizer (xgrammar's ``TokenizerInfo.from_huggingface`` reads its vocabulary,
            its kind (byte-level, byte-fallback, raw) and its end-of-sequence token).
        vocab_size: the model's logits width V (>= the tokenizer's vocabulary; ids past it are never allowed).
        max_bytes: the most bytes of compiled grammars kept (xgrammar's ``memory_size_bytes``); the one just compiled
            is kept whatever its size.

    Attributes:
        tokenizer: as given.

    Raises:
        ImportError: xgrammar is not installed (the message names the ``structured`` extra).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_bytes: int = 512 * 2**20) -> None:
        xgr = import_xgrammar()
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # One compiler thread: the engine's CPU threads are the step's. xgrammar's own cache is off: this one is
        # bounded and compiles each spec once.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # spec key -> the compile's future (done once compiled), least recently used first.
        self._compiled: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # requests are checked in their callers' threads

    def compile(self, spec: StructuredOutputs) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec``, compiled on its first use.

        Raises:
            RuntimeError: xgrammar cannot compile it (``StructuredOutputs`` parsed it already, so this is rare).
        """
        key = spec.key
        with self._lock:
            future = self._compiled.get(key)
            owner = future is None
            if owner:
                future = self._compiled[key] = Future()
            else:
                self._compiled.move_to_end(key)
        if not owner:
            return future.result()
        try:
            compiled = self._compiler.compile_grammar(spec.to_grammar())
        except BaseException as e:
            with self._lock:
                self._compiled.pop(key, None)
            future.set_exception(e)
            raise
        future.set_result(compiled)
        with self._lock:
            self._bytes += compiled.memory_size_bytes
            self._evict(keep=key)
        return compiled

    def _evict(self, keep: tuple[str, str, bool]) -> None:
        """Drop compiled grammars, least recently used first, until they fit ``max_bytes`` (``keep`` and compiles in
        progress stay). Called under the lock."""
        for key in list(self._compiled):
            if self._bytes <= self.max_bytes:
                return
            future = self._compiled[key]
            if key != keep and future.done():
                del self._compiled[key]
                self._bytes -= future.result().memory_size_bytes

    def __len__(self) -> int:
        """The number of distinct specs compiled (or being compiled) and kept."""
        return len(self._compiled)


def new_matcher(compiled: Any, eos_token_ids: Sequence[int], generated: Sequence[int] = ()) -> Any:
    """A request's ``xgrammar.GrammarMatcher``, advanced over the tokens it already generated.

    Args:
        compiled: the request's ``CompiledGrammar`` (``GrammarCache.compile``).
        eos_token_ids: the request's end-of-sequence ids: the only tokens allowed where the grammar may end, and
            only there (empty: the tokenizer's end-of-sequence token, as xgrammar detects it).
        generated: tokens the request generated before it got this matcher (a request restored with its output).

    Returns:
        The matcher; ``fill_next_token_bitmask`` gives its allowed next tokens, ``accept_token`` advances it.

    Raises:
        ValueError: a token of ``generated`` does not follow the grammar.
    """
    xgr = import_xgrammar()
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(eos_token_ids) or None)
    for i, token in enumerate(generated):
        if not matcher.accept_token(int(token)):
            raise ValueError(f"structured_outputs: generated token {i} ({token}) does not follow the grammar")
    return matcher


def allows_a_first_token(compiled: Any, eos_token_ids: Sequence[int], vocab_size: int) -> bool:
    """Whether a fresh matcher of ``compiled`` allows any token of the vocabulary (an end-of-sequence id included).

    A grammar whose text the tokenizer cannot spell (a choice of a control byte a small vocabulary lacks) allows none:
    every logit of its row would be masked, and whatever the sampler then drew would be outside the grammar.

    Args:
        compiled: a ``CompiledGrammar`` (``GrammarCache.compile``).
        eos_token_ids: the request's end-of-sequence ids (``new_matcher``'s).
        vocab_size: the logits width V.
    """
    xgr = import_xgrammar()
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    new_matcher(compiled, eos_token_ids).fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
    return bool(torch.isfinite(logits).any())


def apply_grammar_masks(
    logits: torch.Tensor, matchers: Sequence[Any | None], copy: bool, unprocessed: torch.Tensor | None = None
) -> torch.Tensor:
    """Set to -inf the logits of the tokens each constrained row's grammar does not allow next.

    Args:
        logits: float32 [B, V]; row b belongs to the request whose matcher is ``matchers[b]``.
        matchers: per row, the request's ``xgrammar.GrammarMatcher`` (not terminated), or None for a free row.
        copy: mask a copy (the caller still reads ``logits``: the raw logits that logprobs are taken from), not
            ``logits`` itself.
        unprocessed: the logits before the logits processors (float32 [B, V]), when ``logits`` are processed ones. A
            processor may ban every token the grammar allows (``min_new_tokens`` or ``min_length`` the end-of-sequence
            id where the grammar must end, ``bad_words_ids``, ``no_repeat_ngram_size``): such a row is the grammar's
            mask of its unprocessed logits instead, so the token drawn still follows the grammar (the grammar wins).

    Returns:
        float32 [B, V]: ``logits`` itself when no row is constrained; else the masked tensor (a copy with ``copy``),
        in which free rows are unchanged.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    xgr = import_xgrammar()
    B, V = logits.shape
    bitmask = xgr.allocate_token_bitmask(B, V)  # int32 [B, ceil(V / 32)] on the CPU, every token allowed
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.clone() if copy else logits
    bitmask = bitmask.to(out.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=V, indices=rows)
    if unprocessed is not None and unprocessed is not logits:
        index = torch.tensor(rows, device=out.device)
        masked = out.index_select(0, index)
        fallback = unprocessed.index_select(0, index)  # a copy
        xgr.apply_token_bitmask_inplace(fallback, bitmask.index_select(0, index), vocab_size=V)
        banned_all = torch.isneginf(masked).all(dim=-1, keepdim=True)
        out.index_copy_(0, index, torch.where(banned_all, fallback, masked))
    return out
