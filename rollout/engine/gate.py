"""The engine's door for requests (``RequestGate``): the one check of a request against what the engine can run, and a
checked request readied for the scheduler.

A request is checked once, where it enters, by ``RequestGate.check``: ``Engine.add_request`` for code that drives an
engine directly, the manager's intake (``manager.intake.check_fits``), ``generate_batch`` and the offline scorer. Its
prompt and parameters were checked at the public boundary already; the gate adds what only the engine knows: the
model's context, the cache's blocks, whether logprobs are recorded (the spec's), the tokenizer that stop strings are
read with and structured outputs compiled against (each distinct spec once, in the caller's thread: the loop does not
wait for a compile), and the adapters loaded. ``ready`` then gives a request what the step needs (its stop-string
matcher, its grammar matcher, its adapter) as it is queued; it checks nothing again. vLLM v1's ``InputProcessor``
plays this part beside its engine core.
"""

from __future__ import annotations

from rollout.checks import FieldError
from rollout.engine.sample.structured import GrammarCache, allows_a_first_token, new_matcher
from rollout.engine.spec import EngineSpec
from rollout.lora import LoadedAdapter, LoraSlots
from rollout.requests import Request
from rollout.sampling_params import SamplingParams
from rollout.stop_strings import StopStringMatcher, check_tokenizer, token_texts

__all__ = ["RequestGate"]


class RequestGate:
    """Checks requests against one engine and readies them for its scheduler.

    Args:
        spec: the engine's resolved settings (its context, cache, logprobs and vocabulary).
        tokenizer: the model's tokenizer, for stop strings and structured outputs; None refuses them. Replaceable (a
            manager may set one later: ``Engine.tokenizer``).
        lora: the engine's LoRA adapters, which requests select by name (``SamplingParams.lora``); None refuses them.

    Attributes:
        tokenizer: see Args.
    """

    def __init__(self, spec: EngineSpec, tokenizer: object | None, lora: LoraSlots | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.lora = lora
        # The stop-string matchers, one per (stop_strings, stop): built once over the tokenizer's spellings.
        self._stop_matchers: dict[tuple[tuple[str, ...], tuple[str, ...]], StopStringMatcher] = {}
        # The compiled grammars of structured outputs, over the tokenizer they were compiled for.
        self._grammars: GrammarCache | None = None

    def check(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        """Raise if the engine can never run this request; changes nothing but the matcher cache.

        Past the context a RoPE model runs on with degraded output for as long as it is asked (``model.generate`` only
        warns); rollout refuses, as vLLM refuses a request past ``max_model_len``.

        Args:
            request_id: named in the messages (None: the manager checks some before it assigns an id).
            num_prompt_tokens: the prompt's length.
            params: the request's sampling parameters (``max_new_tokens`` counts).
            scoring: a scoring request (it generates nothing: the prompt alone must fit the context).

        Raises:
            FieldError: it asks for top logprobs (``num_top_logprobs``) from an engine that records no logprobs; the
                prompt plus ``max_new_tokens`` is past the model's context (the message names ``max_new_tokens``, the
                prompt's length and the context; ``field`` is ``input_ids`` when the prompt alone is too long, else
                ``max_new_tokens``); it needs more blocks than the cache has (``max_new_tokens``); it has stop strings
                and the engine no tokenizer (``stop_strings`` or ``stop``); it has ``structured_outputs`` and the engine
                no tokenizer, or xgrammar cannot compile them (``structured_outputs``); its ``lora`` is not a loaded
                adapter.
            ValueError: it names a ``lora`` and the engine serves no adapters.
            ImportError: it has ``structured_outputs`` and xgrammar is not installed.
        """
        spec = self.spec
        # A request is named once it has an id (the manager checks some before it assigns one).
        name = f"request {request_id!r}" if request_id is not None else None
        who = f"{name}: " if name is not None else ""
        if params.num_top_logprobs > 0 and not spec.return_logprobs:
            raise FieldError(
                "num_top_logprobs",
                f"num_top_logprobs: {name or 'the request'} asks for {params.num_top_logprobs} top "
                "logprobs per token, but the engine records no logprobs; pass "
                "ContinuousBatchingConfig(return_logprobs=True)",
            )
        total = num_prompt_tokens + params.max_new_tokens
        context = spec.context_length
        if context is not None and (num_prompt_tokens if scoring else total) > context:
            if scoring or num_prompt_tokens >= context:
                fix = f"shorten the prompt to at most {context - (0 if scoring else 1)} tokens"
            else:
                fix = f"lower max_new_tokens to at most {context - num_prompt_tokens} or shorten the prompt"
            what = "" if scoring else f"max_new_tokens: {who}"
            raise FieldError(
                "input_ids" if scoring or num_prompt_tokens >= context else "max_new_tokens",
                f"{what}prompt ({num_prompt_tokens} tokens)"
                + ("" if scoring else f" plus max_new_tokens ({params.max_new_tokens})")
                + f" is past the model's context of {context} tokens (max_position_embeddings); {fix}",
            )
        needed = spec.layout.max_blocks_needed(total, spec.max_batch_tokens, spec.block_size)
        if needed > spec.num_blocks:
            raise FieldError(
                "max_new_tokens",
                f"{who}prompt ({num_prompt_tokens} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) needs {needed} blocks of {spec.block_size} tokens, but the cache "
                f"has {spec.num_blocks}; raise num_blocks or max_memory_percent, or lower max_new_tokens",
            )
        if params.needs_tokenizer:
            self._stop_matcher(params)
        if params.structured_outputs is not None:
            width = self.spec.logits_width or self.spec.vocab_size
            if not allows_a_first_token(self._compiled_grammar(params), params.eos_token_ids, width):
                raise FieldError(
                    "structured_outputs",
                    "structured_outputs: no token of the tokenizer's vocabulary can begin "
                    f"{params.structured_outputs.kind} (it cannot spell the grammar's text); nothing generated could "
                    "follow it",
                )
        if params.lora is not None:
            self.adapter(params.lora)

    def ready(self, request: Request) -> None:
        """Give a checked request what its steps need as it is queued: its ``logprobs_mode``, the matchers of its stop
        strings and its grammar, and its adapter (bound now unless a manager bound it when it accepted the request:
        ``Engine.bind_adapter``).

        Raises:
            ValueError: the adapter it was accepted under is gone (an engine rebuilt since); FieldError: it has stop
                strings and no tokenizer, or its ``lora`` is no longer loaded (a request not checked here).
        """
        params = request.params
        request.logprobs_mode = self.spec.logprobs_mode if self.spec.return_logprobs else None
        if params.needs_tokenizer:
            request.stop_matcher = self._stop_matcher(params)
        if params.structured_outputs is not None and request.grammar is None:
            # Kept by a request queued again (preempted, or moved to a rebuilt engine): it follows its tokens already.
            compiled = self._compiled_grammar(params)
            request.grammar = new_matcher(compiled, params.eos_token_ids, request.generated_tokens)
        if params.lora is not None and request.lora_id == 0:  # resolved now: the name may be reloaded later
            self.adapter(params.lora).bind(request)
        elif request.lora_id and (self.lora is None or not self.lora.holds(request.lora_id)):
            # Accepted by a manager under an adapter of an engine since rebuilt (its uids are gone with it).
            raise ValueError(f"lora {params.lora!r}: the adapter this request was accepted under is gone")

    def adapter(self, name: str) -> LoadedAdapter:
        """The loaded adapter ``name`` (``LoadedAdapter.bind`` binds a request to it).

        Raises:
            ValueError: the engine serves no adapters; FieldError (``lora``): none of that name is loaded.
        """
        if self.lora is None:
            raise ValueError(f"lora={name!r}: the engine was built without enable_lora=True")
        return self.lora.get(name)

    def _compiled_grammar(self, params: SamplingParams) -> object:
        """The compiled grammar of a request's ``structured_outputs``, compiled once per spec and tokenizer.

        Raises:
            FieldError: the engine has no tokenizer, or xgrammar cannot compile the spec (``structured_outputs``).
            ImportError: xgrammar is not installed.
        """
        spec = params.structured_outputs
        assert spec is not None
        if self.tokenizer is None:
            raise FieldError(
                "structured_outputs",
                "structured_outputs: the engine has no tokenizer, which the grammar is compiled against; pass the "
                "model's tokenizer (tokenizer= of generate_batch, init_continuous_batching or Engine)",
            )
        if self._grammars is None or self._grammars.tokenizer is not self.tokenizer:
            self._grammars = GrammarCache(self.tokenizer, self.spec.logits_width or self.spec.vocab_size)
        try:
            return self._grammars.compile(spec)
        except RuntimeError as e:
            raise FieldError("structured_outputs", f"structured_outputs: xgrammar cannot compile it: {e}") from e

    def _stop_matcher(self, params: SamplingParams) -> StopStringMatcher:
        """The matcher of a request's stop strings, built once per set of strings (the first spells the tokenizer's
        vocabulary: ``stop_strings.token_texts``).

        Raises:
            FieldError: the engine has no tokenizer (``stop_strings.check_tokenizer``).
        """
        key = (params.stop_strings, params.stop)
        matcher = self._stop_matchers.get(key)
        if matcher is None:
            check_tokenizer(params.stop_strings, params.stop, self.tokenizer)
            texts = token_texts(self.tokenizer, self.spec.vocab_size)
            matcher = self._stop_matchers[key] = StopStringMatcher(texts, params.stop_strings, params.stop)
        return matcher
