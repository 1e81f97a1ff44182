"""Requests: their status, their engine-side state, and their output.

A request's status, tokens and ``num_computed_tokens`` are written by the scheduler only (admission,
preemption, ``update_from_output``, ``finish_request``); its blocks by the KV cache manager only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rollout.stop_strings import StopStringMatcher
    from rollout.structured_outputs import TokenMatcher


class RequestStatus(enum.IntEnum):
    """Life cycle of a request, named and ordered as in ``transformers``' continuous batching.

    An ``IntEnum`` with transformers' values (PENDING 0 ... FAILED 4), so ``status >= FINISHED``
    reads "ended" in both; CANCELLED (5, rollout's own: ``cancel_request``) is final too.
    """

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def is_final(self) -> bool:
        """True for FINISHED, FAILED and CANCELLED."""
        return self >= RequestStatus.FINISHED


# ``GenerationOutput.finish_reason`` values.
FINISH_STOP = "stop"  # a stop token (eos_token_ids) was sampled, or a stop string completed; the token is kept
FINISH_LENGTH = "length"  # max_new_tokens were generated
FINISH_SCORED = "scored"  # a scoring (prefill-only) request computed all its tokens; nothing was sampled
FINISH_CANCELLED = "cancelled"  # cancel_request, or the request was taken out of the engine
FINISH_ERROR = "error"  # the request failed (a failing step, a hard stop)
# The finish reason of a request ended from outside with a final status.
FINISH_REASON_OF_STATUS = {RequestStatus.CANCELLED: FINISH_CANCELLED, RequestStatus.FAILED: FINISH_ERROR}


@dataclass
class GenerationOutput:
    """The result (or a streamed snapshot) of one request.

    Attributes:
        request_id: the request's id.
        prompt_ids: the prompt's token ids.
        generated_tokens: the generated token ids, the stop token included when one ended it.
        logprobs: one float per generated token when logprobs were asked for, else empty.
        status: the request's status when this output was taken.
        error: the error message of a FAILED or CANCELLED request, else None.
        timestamps: ``time.perf_counter()`` seconds at which each token was generated,
            when timestamps were asked for, else empty.
        weight_versions: per token, the weight version that names the weights which sampled it: the version at which
            the base weights, or the request's LoRA adapter if it was loaded later, were last set (a LoRA load is a new
            version of the model, but not of the base weights or of another adapter).
        finish_reason: "stop" (a stop token or stop string), "length" (max_new_tokens), "scored" (a scoring
            request whose tokens are all computed), "cancelled", "error", or None while the
            request runs.
        created_time: ``time.perf_counter()`` seconds when the request was added.
        num_cached_prompt_tokens: prompt tokens whose KV came from the prefix cache, or from the
            request with the same prompt that this one was forked from (then the whole prompt).
        prompt_logprobs: for scoring requests, the logprobs of the scored prompt tokens.
        top_token_ids: with ``SamplingParams.num_top_logprobs`` = N > 0, per generated token the ids of
            the N most likely tokens at its position, most likely first (the sampled token may or may
            not be among them); else empty.
        top_logprobs: their logprobs, N floats per generated token, in the distribution of ``logprobs``.
        lifespan: ``time.perf_counter()`` seconds (first scheduled, ended), as in transformers;
            -1 for a moment that has not come (or never came: a request cancelled while waiting).
        logprobs_mode: the distribution ``logprobs`` and ``top_logprobs`` come from, the engine's
            ``ContinuousBatchingConfig.logprobs_mode``: "temperature", "raw" (the unprocessed model's; vLLM's
            ``raw_logprobs``) or "sampled" (the processed distribution the token was drawn from, a structured-output
            mask included; vLLM's ``processed_logprobs``); None when the engine records no logprobs.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    timestamps: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    created_time: float = 0.0
    num_cached_prompt_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    lifespan: tuple[float, float] = (-1.0, -1.0)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    logprobs_mode: str | None = None

    def is_finished(self) -> bool:
        """True once the request reached a final status."""
        return self.status.is_final


class Request:
    """Engine-side state of one sequence.

    The scheduling rule is vLLM v1's: ``num_computed_tokens`` catches up with ``num_tokens`` (prompt plus generated
    tokens); a step that brings it level samples one new token.

    Attributes:
        request_id: unique id.
        prompt_ids: prompt token ids.
        params: sampling parameters.
        token_ids: prompt followed by the generated tokens.
        num_computed_tokens: tokens whose KV is in this request's blocks.
        kv_version: the weight version that computed all of the request's KV (the scheduler writes it when it
            schedules tokens), or None while the KV mixes versions (a request that spans a weight update without
            recompute keeps its KV): then none of its blocks is published in the prefix cache, so no other request
            ever reads KV that its version does not name (DESIGN.md, section 3). Offloaded KV keeps its version.
        lora_id: the uid of the LoRA adapter it runs under (``lora.LoadedAdapter.uid``, unique per loaded tensors),
            0 for the base model: part of every prefix-cache key and prompt-fork key of its KV, so no request reads
            KV computed under other adapter weights. Set when it is accepted (``params.lora`` resolved then: an
            unload or a same-name reload afterwards does not change the adapter it runs under).
        lora_slot: that adapter's slot in the engine's ``LoraSlots`` (-1: the base model), each query token's index.
        lora_version: the weight version that loaded that adapter (``LoadedAdapter.version``; 0 for the base model):
            each token records ``max(lora_version, the base weights' version)`` (``Scheduler.token_version``).
        block_tables: one block table per layer group of the cache (``engine.kv.cache.CacheLayout``): the
            physical block ids, in sequence order; a sliding-window group has ``NULL_BLOCK`` where a
            block fell out of its window.
        block_table: ``block_tables[0]``, the only table of a cache whose layers form one group.
        group_block_hashes: per layer group, the prefix-cache hashes of the request's full blocks, in
            order (None for a ``NULL_BLOCK`` taken from a prefix hit).
        block_hashes: ``group_block_hashes[0]``.
        score_from: for a scoring request, the index of the first token whose logprob is
            wanted (>= 1); None for a generation request.
        prompt_logprobs: a scoring request's logprobs of token_ids[score_from:].
        stop_matcher: decides whether a sampled token completes one of the request's stop strings;
            set by the engine when the request is queued (None: no stop strings).
        grammar: with ``params.structured_outputs``, the grammar matcher that follows the generated tokens (xgrammar's
            ``GrammarMatcher``, set by the engine when the request is queued, kept through preemption); it is advanced
            here, once per appended token, and the request ends (reason "stop") when it terminates. None: no
            constraint.
        fork_parent: while this request waits for another request's prefill of the same tokens (a
            "parked" fork, see ``Scheduler``), that request; None otherwise.
        forks: the requests parked on this one; they are forked from it when its prefill completes.
        logprobs_mode: the engine's ``logprobs_mode`` when it records logprobs, else None (set when it is queued).
        num_output_placeholders: tokens that steps in flight will sample for the request and that ``token_ids``
            does not hold yet (vLLM v1's count; ``async_scheduler.AsyncScheduler``); 0 with the synchronous one.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        record_timestamps: bool = False,
        score_from: int | None = None,
        score_temperature: float = 1.0,
    ) -> None:
        self.request_id = request_id
        # Scoring (prefill-only) requests: logprobs of token_ids[score_from:] under the
        # model, no sampling; they finish when their tokens are all computed.
        self.score_from = score_from
        self.score_temperature = score_temperature
        self.prompt_logprobs: list[float] = []
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.record_timestamps = record_timestamps
        self.token_ids: list[int] = list(prompt_ids)
        self.num_computed_tokens = 0
        self.kv_version: int | None = None
        self.lora_id = 0
        self.lora_slot = -1
        self.lora_version = 0
        self.block_tables: list[list[int]] = [[]]
        self.group_block_hashes: list[list[bytes | None]] = [[]]
        self.status = RequestStatus.PENDING
        self.generated_logprobs: list[float] = []
        # With params.num_top_logprobs > 0: per generated token, the top ids and their logprobs.
        self.top_token_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.timestamps: list[float] = []
        self.weight_versions: list[int] = []
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.created_time = time.perf_counter()
        # (first scheduled, ended) in perf_counter seconds; the scheduler sets both.
        self.lifespan: tuple[float, float] = (-1.0, -1.0)
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        # Offload preemption: (CPU pool block ids, tokens they hold) while the KV is off the device.
        self.offloaded: tuple[list[int], int] | None = None
        self.stop_matcher: StopStringMatcher | None = None
        self.grammar: TokenMatcher | None = None
        # Prompt forking (the scheduler writes both): the G samples of one prompt are prefilled once.
        self.fork_parent: Request | None = None
        self.forks: list[Request] = []
        self.num_output_placeholders = 0
        self.logprobs_mode: str | None = None

    @property
    def block_table(self) -> list[int]:
        """The block table of layer group 0 (the only one of a cache whose layers form one group)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def block_hashes(self) -> list[bytes | None]:
        """The block hashes of layer group 0."""
        return self.group_block_hashes[0]

    @block_hashes.setter
    def block_hashes(self, hashes: list[bytes | None]) -> None:
        self.group_block_hashes[0] = hashes

    @property
    def prefill_only(self) -> bool:
        """True for scoring requests, which compute their tokens and sample nothing."""
        return self.score_from is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated_tokens(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    def append_token(
        self,
        token: int,
        logprob: float | None,
        weight_version: int,
        top: tuple[list[int], list[float]] | None = None,
    ) -> None:
        """Record a sampled token, its logprob, weight version and top logprobs ((ids, logprobs); ignored for
        a request with ``num_top_logprobs`` 0), and decide whether the request is done.

        Stop strings count only once the request is as long as ``min_new_tokens`` and ``min_length`` ask, as its
        end-of-sequence ids (banned until then by the logits processors): vLLM's rule (vllm-project/vllm PR 22014).
        ``model.generate`` differs here: its stop-string criterion ignores the minimum lengths."""
        self.token_ids.append(token)
        if logprob is not None:
            self.generated_logprobs.append(logprob)
        if top is not None and self.params.num_top_logprobs > 0:
            self.top_token_ids.append(top[0])
            self.top_logprobs.append(top[1])
        self.weight_versions.append(weight_version)
        if self.record_timestamps:
            self.timestamps.append(time.perf_counter())
        if self.grammar is not None and not self.grammar.accept_token(token):
            # Refused: only a token the mask allowed can be sampled (a row whose logits processors ban every allowed
            # token is masked from its unprocessed logits: ``apply_grammar_masks``), so the grammar allows no token of
            # the vocabulary here (text the tokenizer cannot spell). The token is taken back: no output holds a token
            # outside the grammar, and the request ends in error rather than as if it matched.
            self._take_back_last_token(top is not None and self.params.num_top_logprobs > 0, logprob is not None)
            self.error = (
                f"structured_outputs: after {self.num_generated_tokens} tokens the grammar allows no token of the "
                "vocabulary (its text cannot be spelt by the tokenizer)"
            )
            self.finish_reason = FINISH_ERROR
        elif self.grammar is not None and self.grammar.is_terminated():
            # It accepted an end-of-sequence id where the grammar may end.
            self.finish_reason = FINISH_STOP
        elif token in self.params.eos_token_ids:
            self.finish_reason = FINISH_STOP
        elif (
            self.stop_matcher is not None
            and self.num_generated_tokens >= self.params.min_new_tokens
            and self.num_tokens >= self.params.min_length
            and self.stop_matcher.matches(self.token_ids, len(self.prompt_ids))
        ):
            self.finish_reason = FINISH_STOP
        elif self.num_generated_tokens >= self.params.max_new_tokens:
            self.finish_reason = FINISH_LENGTH

    def _take_back_last_token(self, had_top: bool, had_logprob: bool) -> None:
        """Undo ``append_token``'s records of the token just appended (a token the grammar refused)."""
        self.token_ids.pop()
        if had_logprob:
            self.generated_logprobs.pop()
        if had_top:
            self.top_token_ids.pop()
            self.top_logprobs.pop()
        self.weight_versions.pop()
        if self.record_timestamps:
            self.timestamps.pop()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def to_output(self) -> GenerationOutput:
        """A snapshot that never changes after it is returned."""
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            generated_tokens=self.generated_tokens,
            logprobs=list(self.generated_logprobs),
            status=self.status,
            error=self.error,
            timestamps=list(self.timestamps),
            weight_versions=list(self.weight_versions),
            finish_reason=self.finish_reason,
            created_time=self.created_time,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            prompt_logprobs=list(self.prompt_logprobs),
            lifespan=self.lifespan,
            top_token_ids=list(self.top_token_ids),
            top_logprobs=list(self.top_logprobs),
            logprobs_mode=self.logprobs_mode,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={'/'.join(str(len(t)) for t in self.block_tables)})"
        )
