"""The engine's request intake (``EngineRequests``, a part the ``Engine`` owns): check, build and queue requests.

What an engine can never run is the spec's to say (``EngineSpec.check_request``); stop strings need the tokenizer,
whose vocabulary is spelled once per engine for their matchers. ``Engine`` checks that it is open and delegates here.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.checks import check_int, check_number, token_ids
from rollout.engine.sched.scheduler import Scheduler
from rollout.engine.spec import EngineSpec
from rollout.lora import LoadedAdapter, LoraSlots
from rollout.requests import Request
from rollout.sampling_params import SamplingParams
from rollout.stop_strings import StopStringMatcher, check_tokenizer, token_texts

__all__ = ["EngineRequests", "bind_adapter"]


class EngineRequests:
    """Checks requests against what an engine can run, builds them and queues them in its scheduler.

    Args:
        spec: the engine's resolved settings (its limits and vocabulary).
        scheduler: the scheduler requests are queued in.
        tokenizer: the model's tokenizer, for stop strings; None refuses them. Replaceable (``Engine.tokenizer``).
        lora: the engine's LoRA adapters, which requests select by name (``SamplingParams.lora``); None refuses them.
    """

    def __init__(
        self, spec: EngineSpec, scheduler: Scheduler, tokenizer: object | None, lora: LoraSlots | None = None
    ) -> None:
        self.spec = spec
        self.lora = lora
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.num_queued = 0  # requests queued so far (default ids count them)
        self._stop_matchers: dict[tuple[tuple[str, ...], tuple[str, ...]], StopStringMatcher] = {}

    def check_request(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        """Raise ValueError if the engine can never run this request (``Engine.check_request``)."""
        self.spec.check_request(request_id, num_prompt_tokens, params, scoring)
        if params.needs_tokenizer:
            self.stop_matcher(params)
        if params.lora is not None:
            self.adapter(params.lora)

    def adapter(self, name: str) -> LoadedAdapter:
        """The loaded adapter ``name``, which a request accepted now runs under until it ends.

        Raises:
            ValueError: the engine serves no adapters; FieldError (``lora``): none of that name is loaded.
        """
        if self.lora is None:
            raise ValueError(f"lora={name!r}: the engine was built without enable_lora=True")
        return self.lora.get(name)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        record_timestamps: bool,
        score_from: int | None,
        score_temperature: float,
    ) -> Request:
        """Check every argument, build the request and queue it (``Engine.add_request``: arguments and errors)."""
        vocab_size = self.spec.vocab_size
        prompt = token_ids(prompt_ids, f"input_ids of request {request_id!r}", vocab_size)
        params.check_vocab(vocab_size)
        if score_from is not None:
            check_int("score_from", score_from, minimum=1, maximum=len(prompt))
            check_number("score_temperature", score_temperature, minimum=0, min_open=True)
        if request_id is None:
            request_id = f"req_{self.num_queued}"
            while request_id in self.scheduler.requests:
                request_id += "_"
        self.check_request(request_id, len(prompt), params)
        req = Request(request_id, prompt, params, record_timestamps, score_from, score_temperature)
        self.enqueue(req)
        return req

    def stop_matcher(self, params: SamplingParams) -> StopStringMatcher:
        """The matcher of a request's stop strings, built once per set of strings (``Engine.stop_matcher``)."""
        key = (params.stop_strings, params.stop)
        matcher = self._stop_matchers.get(key)
        if matcher is None:
            check_tokenizer(params.stop_strings, params.stop, self.tokenizer)
            texts = token_texts(self.tokenizer, self.spec.vocab_size)
            matcher = self._stop_matchers[key] = StopStringMatcher(texts, params.stop_strings, params.stop)
        return matcher

    def enqueue(self, request: Request) -> None:
        """Queue a request built and checked by the caller (``Engine.enqueue``)."""
        if request.params.needs_tokenizer:
            request.stop_matcher = self.stop_matcher(request.params)
        if request.params.lora is not None and request.lora_id == 0:  # resolved now: the name may be reloaded later
            bind_adapter(request, self.adapter(request.params.lora))
        elif request.lora_id and (self.lora is None or not self.lora.holds(request.lora_id)):
            # Accepted by a manager under an adapter of an engine since rebuilt (its uids are gone with it).
            raise ValueError(f"lora {request.params.lora!r}: the adapter this request was accepted under is gone")
        self.scheduler.add_request(request)
        self.num_queued += 1


def bind_adapter(request: Request, loaded: LoadedAdapter) -> None:
    """``request`` runs under ``loaded`` until it ends, whatever is loaded or unloaded under its name meanwhile."""
    request.lora_id, request.lora_slot, request.lora_version = loaded.uid, loaded.slot, loaded.version
