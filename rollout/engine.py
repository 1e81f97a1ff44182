"""The engine: one synchronous step loop over scheduler, model runner and sampler.

``Engine.step()`` reads as three lines (nano-vllm's shape): schedule, run the model,
sample and update the requests. The background manager and ``generate_batch`` both
drive this class; it holds no thread and no global state.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from .attention import enable_paged_attention, flash_attn_available, restore_attention
from .block_manager import BlockManager
from .config import ContinuousBatchingConfig
from .kv_cache import CacheShape, CPUOffloadPool, PagedKVCache, num_blocks_for_memory
from .model_runner import LogitsPlan, ModelRunner
from .models import UnsupportedModelError, check_model_supported, text_config
from .requests import Request, RequestStatus
from .sampling_params import SamplingParams
from .sampling import sample_tokens
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "UnsupportedModelError", "normalize_prompt", "params_from_kwargs"]

def normalize_prompt(prompt: object, name: str) -> list[int]:
    """A prompt as a list of Python ints: lists, tuples, 1-D tensors and numpy arrays of integers.

    Raises:
        ValueError: not a non-empty 1-D sequence of integer token ids (the message names ``name``).
    """
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
        if getattr(prompt, "ndim", 1) != 1:
            raise ValueError(f"{name} must be a 1-D list of token ids, got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError(f"{name} must be a non-empty list of token ids, got {type(prompt).__name__}: {prompt!r:.60}")
    out = []
    for tok in prompt:
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral):
            raise ValueError(f"{name} must hold integer token ids, got {tok!r} ({type(tok).__name__})")
        out.append(int(tok))
    return out


def params_from_kwargs(
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> SamplingParams:
    """SamplingParams from transformers-style values (eos_token_id an int or a list)."""
    if eos_token_id is None:
        eos: tuple[int, ...] = ()
    elif isinstance(eos_token_id, int):
        eos = (eos_token_id,)
    else:
        eos = tuple(eos_token_id)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        do_sample=bool(do_sample),
        temperature=float(temperature),
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_ids=eos,
    )


@dataclass
class EngineStats:
    """Counters of an engine since it was built.

    Attributes:
        num_steps: forwards run.
        num_prompt_tokens_computed: prompt tokens whose KV was computed (prefix-cache
            hits are not computed; recompute after preemption is).
        num_tokens_computed: all query tokens computed.
        num_generated_tokens: tokens sampled.
        num_preemptions: requests evicted for lack of blocks.
        num_offloads: preempted requests whose KV went to the CPU pool (not recomputed).
        num_cached_blocks_hit: blocks handed to requests from the prefix cache.
        decode_step_seconds: wall time of steps that only decoded (one token per request).
        decode_step_batch: the batch size of each of those steps.
    """

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_offloads: int = 0
    num_cached_blocks_hit: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)
    decode_step_batch: list[int] = field(default_factory=list)


class Engine:
    """Continuous-batching engine for one model replica.

    Args:
        model: a ``transformers`` decoder-only causal LM. Its attention implementation is
            switched to rollout's paged dispatcher until ``close()``; forwards without
            engine metadata still run the original implementation.
        config: engine configuration.
        max_tokens_hint: when ``config.num_blocks`` is None, the cache is no larger than
            what holds this many tokens (an int), or these requests of that many tokens each
            (a sequence: the whole job of ``generate_batch``), memory permitting.

    Raises:
        UnsupportedModelError: the model cannot be paged (see ``check_model_supported``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig | None = None,
        max_tokens_hint: int | Sequence[int] | None = None,
    ) -> None:
        check_model_supported(model)
        self.model = model
        self.config = config or ContinuousBatchingConfig()
        param = next(model.parameters())
        self.device = param.device
        dtype = param.dtype
        dev_type = self.device.type
        self.block_size = self.config.resolved_block_size(dev_type)
        shape = CacheShape.from_config(model.config, dtype)
        num_blocks = self.config.num_blocks
        if num_blocks is None:
            num_blocks = num_blocks_for_memory(
                shape, self.block_size, self.device, self.config.resolved_memory_percent(dev_type)
            )
            if max_tokens_hint is not None:
                hints = [max_tokens_hint] if isinstance(max_tokens_hint, int) else list(max_tokens_hint)
                # Each request rounds up to whole blocks; one spare block for slack.
                num_blocks = min(num_blocks, sum(-(-t // self.block_size) for t in hints) + 1)
        self.num_blocks = num_blocks
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions: int | None = getattr(text_config(model.config), "max_position_embeddings", None)
        self._warned_context = False
        self.use_flash = dev_type == "cuda" and flash_attn_available() and dtype in (torch.float16, torch.bfloat16)
        if self.use_flash and self.block_size % 256 != 0:
            logger.warning("flash-attn paged kernels need block_size % 256 == 0; using the SDPA path")
            self.use_flash = False
        self.cache = PagedKVCache(shape, num_blocks, self.block_size, self.device)
        self.block_manager = BlockManager(num_blocks, self.block_size, self.config.allow_block_sharing)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.resolved_max_batch_tokens(dev_type),
            self.config.max_requests_per_batch,
            self.config.scheduler_type,
            self.config.resolved_safety_margin(),
            offload=self.config.preemption_mode == "offload",
        )
        self.offload_pool: CPUOffloadPool | None = None
        if self.config.preemption_mode == "offload":
            self.offload_pool = CPUOffloadPool(
                shape, self.config.cpu_offload_space, self.block_size, pin=dev_type == "cuda"
            )
        self.generator = torch.Generator(device="cpu")
        if self.config.seed is not None:
            self.generator.manual_seed(self.config.seed)
        else:
            self.generator.seed()
        self.weight_version = 0
        self.runner = ModelRunner(model, self.cache, self.use_flash)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._arrivals = 0
        self._last_log = (time.perf_counter(), 0)  # (time, generated tokens) of the last progress log
        self._original_attn = enable_paged_attention(model)
        self._closed = False

    # ------------------------------------------------------------------ requests
    def validate_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> None:
        """Raise ValueError (naming the argument) if the request can never run; changes nothing.

        Raises:
            ValueError: empty prompt, a token id outside [0, vocab_size), invalid
                sampling values, a duplicate request id, or a prompt plus max_new_tokens
                that can never fit the cache.
        """
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = normalize_prompt(prompt_ids, f"input_ids of request {request_id!r}")
        for tok in prompt_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"input_ids of request {request_id!r} hold token id {tok!r} outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        params.validate(self.vocab_size)
        total = len(prompt_ids) + params.max_new_tokens
        if self.max_positions is not None and total > self.max_positions and not self._warned_context:
            # model.generate does not refuse this either; RoPE models run past it, with degraded output.
            self._warned_context = True
            logger.warning(
                "request %r: prompt plus max_new_tokens (%d tokens) exceeds the model's max_position_embeddings (%d)",
                request_id,
                total,
                self.max_positions,
            )
        needed = self.block_manager.blocks_needed(total)
        if needed > self.num_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) needs {needed} blocks of {self.block_size} tokens, but the cache has "
                f"{self.num_blocks}; raise num_blocks or max_memory_percent, or lower max_new_tokens"
            )

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        record_timestamps: bool = False,
        score_from: int | None = None,
        score_temperature: float = 1.0,
    ) -> Request:
        """Validate and queue a request; returns its state object.

        Args:
            prompt_ids: the prompt's token ids.
            params: sampling parameters.
            request_id: unique id (default ``req_<n>``).
            record_timestamps: record a timestamp per generated token.
            score_from: make this a scoring request: no token is generated, and the
                logprobs of ``prompt_ids[score_from:]`` are recorded in
                ``prompt_logprobs`` (1 <= score_from <= len(prompt_ids)).
            score_temperature: logits are divided by this before the log-softmax (> 0).

        Raises:
            ValueError: see ``validate_request``; or score_from / score_temperature out of range.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        if score_from is not None:
            if isinstance(score_from, bool) or not isinstance(score_from, int) or not 1 <= score_from <= len(prompt_ids):
                raise ValueError(f"score_from must be an int in [1, {len(prompt_ids)}], got {score_from!r}")
            if not score_temperature > 0:
                raise ValueError(f"score_temperature must be > 0, got {score_temperature!r}")
        self.validate_request(prompt_ids, params, request_id)
        if request_id is None:
            request_id = f"req_{self._arrivals}"
            while request_id in self.requests:
                request_id += "_"
        req = Request(request_id, list(prompt_ids), params, record_timestamps, score_from, score_temperature)
        self._arrivals += 1
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End a request with a final status (cancel, fail), freeing its blocks. None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req)
        self._drop_offloaded(req)
        req.status = status
        req.error = error
        if status == RequestStatus.CANCELLED:
            req.finish_reason = "cancelled"
        elif status == RequestStatus.FAILED:
            req.finish_reason = "error"
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ weights
    def bump_weight_version(self) -> int:
        """Record a weight update: blocks hashed from now on carry the new version."""
        self.set_weight_version(self.weight_version + 1)
        return self.weight_version

    def set_weight_version(self, version: int) -> None:
        """Set the version recorded with new tokens and new cached blocks."""
        self.weight_version = version
        self.scheduler.weight_version = version

    def recompute_in_flight(self) -> None:
        """Drop the KV of every running request so it is re-prefilled under the current weights."""
        sched = self.scheduler
        for req in sched.waiting:
            if req.offloaded is not None:
                self._drop_offloaded(req)
                req.num_computed_tokens = 0
        sched.requeue_running()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one engine step.

        Returns:
            The requests that got a new token this step (finished ones included, with
            status FINISHED and their blocks freed).

        Raises:
            Whatever the forward raises; blocks hashed for this step are dropped from the
            prefix cache first, since their KV may be incomplete.
        """
        out = self.scheduler.schedule()
        self._move_offloaded_kv(out)
        if out.is_empty:
            return []
        t0 = time.perf_counter()
        try:
            logits, plan = self.runner.run(out.scheduled)
        except BaseException:
            for entry in out.scheduled:
                self.block_manager.uncache(entry.request.block_table)
            raise
        updated = self._postprocess(out.scheduled, logits, plan)
        elapsed = time.perf_counter() - t0
        self.stats.num_steps += 1
        self._log_progress()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.num_cached_blocks_hit = self.block_manager.num_cache_hits
        if all(e.num_query_tokens == 1 and e.sample for e in out.scheduled):
            self.stats.decode_step_seconds.append(elapsed)
            self.stats.decode_step_batch.append(len(out.scheduled))
        return updated

    def _log_progress(self) -> None:
        """Debug log of throughput every ``config.progress_log_interval`` seconds."""
        now = time.perf_counter()
        if now - self._last_log[0] < self.config.progress_log_interval:
            return
        tokens = self.stats.num_generated_tokens - self._last_log[1]
        logger.debug(
            "%.1f generated tokens/s; %d running, %d waiting, %d free blocks",
            tokens / (now - self._last_log[0]),
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.block_manager.num_free_blocks,
        )
        self._last_log = (now, self.stats.num_generated_tokens)

    def _move_offloaded_kv(self, out: SchedulerOutput) -> None:
        """Copy preempted requests' KV to the CPU pool, and restored requests' KV back.

        Offloads first: a victim's freed blocks may already be handed to a restored
        request in the same step; nothing writes them before the forward.
        """
        pool = self.offload_pool
        if pool is None:
            return
        for req, blocks, num_tokens in out.offloads:
            if pool.can_hold(len(blocks)):
                req.offloaded = (pool.store(self.cache, blocks), num_tokens)
                self.stats.num_offloads += 1
        for req, blocks in out.restores:
            assert req.offloaded is not None
            pool.load(self.cache, req.offloaded[0], blocks)
            req.offloaded = None

    def _drop_offloaded(self, req: Request) -> None:
        if req.offloaded is not None and self.offload_pool is not None:
            self.offload_pool.free(req.offloaded[0])
        req.offloaded = None

    def _postprocess(self, scheduled: list[ScheduledRequest], logits: torch.Tensor, plan: LogitsPlan) -> list[Request]:
        sampled: list[Request] = []
        scored: list[Request] = []
        for entry in scheduled:
            req, n = entry.request, entry.num_query_tokens
            c = req.num_computed_tokens
            self.stats.num_prompt_tokens_computed += max(0, min(c + n, req.num_prompt_tokens) - c)
            self.stats.num_tokens_computed += n
            req.num_computed_tokens = c + n
            if entry.sample:
                sampled.append(req)
            elif req.prefill_only and req.num_computed_tokens == req.num_tokens:
                scored.append(req)
        if plan.score_segments:
            self._record_scores(logits[plan.num_sample_rows :], plan)
        for req in scored:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "length"
            self.requests.pop(req.request_id, None)
            self.scheduler.finish(req)
        if not sampled:
            return scored
        tokens, logprobs = sample_tokens(
            logits[: plan.num_sample_rows],
            [r.params for r in sampled],
            [r.generator for r in sampled],
            self.generator,
            self.config.logprobs_mode,
            self.config.return_logprobs,
        )
        tok_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else [None] * len(sampled)
        for req, tok, lp in zip(sampled, tok_list, lp_list):
            req.append_token(tok, lp, self.weight_version)
            self.stats.num_generated_tokens += 1
            if req.done:
                req.status = RequestStatus.FINISHED
                self.requests.pop(req.request_id, None)
                self.scheduler.finish(req)
            else:
                req.status = RequestStatus.DECODING
        return sampled + scored

    def _record_scores(self, logits: torch.Tensor, plan: LogitsPlan) -> None:
        targets = torch.tensor(plan.score_targets, dtype=torch.int64, device=logits.device)
        temps = torch.tensor(
            [req.score_temperature for req, count in plan.score_segments for _ in range(count)],
            dtype=torch.float32,
            device=logits.device,
        )
        lp = torch.log_softmax(logits / temps[:, None], dim=-1).gather(1, targets[:, None])[:, 0].tolist()
        i = 0
        for req, count in plan.score_segments:
            req.prompt_logprobs.extend(lp[i : i + count])
            i += count

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the model's original attention implementation. Idempotent."""
        if not self._closed:
            self._closed = True
            restore_attention(self.model, self._original_attn)

    @property
    def closed(self) -> bool:
        return self._closed
