"""The engine's request intake: check, build and queue requests (``EngineRequests``, a base class of ``Engine``).

``Engine`` builds the pieces these methods work through (the annotations below) and runs the steps; what an engine can
never run is the spec's to say (``EngineSpec.check_request``), stop strings need the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from .checks import check_int, check_number, token_ids
from .engine_spec import EngineSpec
from .requests import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .stop_strings import StopStringMatcher, check_tokenizer, token_texts

__all__ = ["EngineRequests"]


class EngineRequests:
    """``add_request``, ``check_request``, ``enqueue`` and the stop-string matchers, of the engine."""

    # Set by Engine.__init__.
    spec: EngineSpec
    scheduler: Scheduler
    tokenizer: object | None
    vocab_size: int
    _closed: bool
    _arrivals: int  # requests queued so far (default ids count them)
    _stop_matchers: dict[tuple[tuple[str, ...], tuple[str, ...]], StopStringMatcher]

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id (the scheduler's; do not change it)."""
        return self.scheduler.requests

    def check_request(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        """Raise ValueError if this engine can never run a request (``EngineSpec.check_request``: the context, the
        cache, top logprobs), or if it has stop strings and the engine no tokenizer; changes nothing."""
        self.spec.check_request(request_id, num_prompt_tokens, params, scoring)
        if params.needs_tokenizer:
            self.stop_matcher(params)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        record_timestamps: bool = False,
        score_from: int | None = None,
        score_temperature: float = 1.0,
    ) -> Request:
        """Check and queue a request; returns its state object.

        The entry point for code that drives an engine directly: everything is checked here, once (``generate_batch``,
        the manager and ``score`` check at their own boundary, then ``check_request`` and ``enqueue`` the requests they
        built).

        Args:
            prompt_ids: the prompt's token ids (a list, tuple, 1-D tensor or array of ints).
            params: sampling parameters.
            request_id: unique id (default ``req_<n>``).
            record_timestamps: record a timestamp per generated token.
            score_from: make this a scoring request: no token is generated, and the logprobs of
                ``prompt_ids[score_from:]`` are recorded in ``prompt_logprobs`` (1 <= score_from <= len(prompt_ids)).
            score_temperature: logits are divided by this before the log-softmax (> 0).

        Raises:
            ValueError: an empty prompt, a token id outside [0, vocab_size), an eos id outside the vocabulary, a
                duplicate request id, a request that can never fit the cache, or score_from / score_temperature out of
                range.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        prompt = token_ids(prompt_ids, f"input_ids of request {request_id!r}", self.vocab_size)
        params.check_vocab(self.vocab_size)
        if score_from is not None:
            check_int("score_from", score_from, minimum=1, maximum=len(prompt))
            check_number("score_temperature", score_temperature, minimum=0, min_open=True)
        if request_id is None:
            request_id = f"req_{self._arrivals}"
            while request_id in self.requests:
                request_id += "_"
        self.check_request(request_id, len(prompt), params)
        req = Request(request_id, prompt, params, record_timestamps, score_from, score_temperature)
        self.enqueue(req)
        return req

    def stop_matcher(self, params: SamplingParams) -> StopStringMatcher:
        """The matcher of a request's stop strings, built once per set of strings.

        The first call for a tokenizer spells its vocabulary (``stop_strings.token_texts``).

        Raises:
            ValueError: the engine has no tokenizer.
        """
        key = (params.stop_strings, params.stop)
        matcher = self._stop_matchers.get(key)
        if matcher is None:
            check_tokenizer(params.stop_strings, params.stop, self.tokenizer)
            texts = token_texts(self.tokenizer, self.vocab_size)
            matcher = self._stop_matchers[key] = StopStringMatcher(texts, params.stop_strings, params.stop)
        return matcher

    def enqueue(self, request: Request) -> None:
        """Queue a request built and checked by the caller (see ``check_request``).

        Raises:
            ValueError: its id is already in use by an unfinished request, or it has stop strings and the engine no
                tokenizer.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        if request.params.needs_tokenizer:
            request.stop_matcher = self.stop_matcher(request.params)
        self.scheduler.add_request(request)
        self._arrivals += 1
