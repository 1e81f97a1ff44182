"""The engine: the step loop over scheduler and model runner.

``Engine.step()`` is three calls, as in nano-vllm and vLLM v1: ``scheduler.schedule()`` ->
``runner.execute(scheduler_output)`` (forward, then sampling) -> ``scheduler.update_from_output``
(counts, tokens, statuses, finished requests and their blocks). The engine builds the parts,
queues requests and keeps statistics; it changes no request itself. The background manager,
``generate_batch`` and ``score`` all drive this class; it holds no global state.

With async batching (``ContinuousBatchingConfig.use_async_batching``) the scheduler is an
``AsyncScheduler`` and the step function, chosen once, is vLLM v1's ``step_with_batch_queue`` with a queue of
two: each call schedules and launches the next step while the one in flight runs (its tokens are
placeholders, filled on the device), then waits for the one in flight and applies its results. On CPU the
steps run in the runner's worker thread. Nothing scheduled is taken back (see ``async_scheduler``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from .async_scheduler import AsyncScheduler
from .attention_registry import enable_paged_attention, restore_attention
from .block_manager import BlockManager
from .checks import check_int, check_number, token_ids
from .config import ContinuousBatchingConfig
from .cpu_offload import CPUOffloadPool
from .engine_spec import EngineSpec
from .engine_stats import EngineStats
from .kv_cache import PagedKVCache
from .kv_cache_manager import KVCacheManager
from .model_runner import LaunchedStep, ModelRunner
from .models import UnsupportedModelError, check_model_supported
from .requests import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import RunnerOutput, Scheduler, SchedulerOutput
from .static_step import mark_warmed, warm_key, warmed_before, warmup_shapes
from .stop_strings import StopStringMatcher, check_tokenizer, token_texts

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "UnsupportedModelError"]

T = TypeVar("T")


@dataclass
class _InFlight:
    """The step launched and not yet collected (async batching)."""

    launched: LaunchedStep
    launched_at: float  # time.perf_counter()


class Engine:
    """Continuous-batching engine for one model replica.

    Args:
        model: a ``transformers`` decoder-only causal LM. Its attention implementation is
            switched to rollout's paged dispatcher until ``close()``; forwards without
            engine metadata still run the original implementation. The KV cache holds the
            dtype the attention computes in (``models.attention_dtype``: autocast's for a model
            prepared by accelerate with ``mixed_precision``) and keeps each layer's tensors on
            the device that layer runs on (``models.layer_devices``: a ``device_map``-sharded model
            gets its cache sharded the same way). On CUDA the steps use flash-attn's paged kernels
            when ``attention.flash_support`` finds nothing against it, else SDPA (with a log line):
            decode-only steps ``flash_attn_with_kvcache`` (up to ``max_blocks_per_request``), the
            others ``flash_attn_varlen_func``.
            A model sharded by a ``tp_plan`` under ``torchrun`` runs one engine per rank in lockstep
            (``distributed.TensorParallel``): each rank's cache holds its own KV heads, the cache size
            is the smallest any rank measured, and the driver's sampled tokens are every rank's.
        config: engine configuration.
        max_tokens_hint: when ``config.num_blocks`` is None, the cache is no larger than
            what holds this many tokens (an int), or these requests of that many tokens each
            (a sequence: the whole job of ``generate_batch``), memory permitting.
        tokenizer: the model's ``transformers`` tokenizer, needed by requests with stop strings
            (``stop_strings``, ``stop``) to read the text of their tokens; None refuses them.
        fallback_compile_config: the generation config's ``compile_config`` (None when the user set
            none: transformers' ``GenerationConfig`` defaults it to None): compiles the paths that
            have no compile config of their own when ``default_compile_level`` is 0.

    Compiled and CUDA-graphed paths (``EngineSpec.compile_configs``, ``EngineSpec.cuda_graphs``) run
    the static-shape step (``static_step``): the cache gets one padding block more than the block
    manager hands out; ``warmup()`` compiles or captures before the first request.

    With ``spec.async_batching`` true, a step is in flight between calls of ``step()`` (see the
    module docstring): ``in_flight`` says so and ``drain()`` finishes it. A request cancelled or stopped
    meanwhile has its row of that step computed and dropped. Weight changes (``set_weight_version``,
    ``recompute_in_flight``), ``warmup()`` and ``close()`` finish it first. It composes with compiled and
    CUDA-graphed paths (placeholder tokens are written into the padded batch on the device before the
    forward or the graph's replay) and with every KV layer group. It is off under tensor parallelism
    (``ContinuousBatchingConfig.resolved_async_batching``).

    Raises:
        UnsupportedModelError: the model cannot be paged (see ``models.check_model_supported``), or a
            layer's weights are on the meta device with no accelerate hook saying where it runs.
        ValueError: a tensor-parallel model's ``num_key_value_heads`` is not divisible by its TP size;
            ``use_cuda_graph`` asks for CUDA graphs off CUDA, or together with a compile mode that
            captures CUDA graphs itself; a compiled or graphed path on a model whose layers span several
            devices;
            ``use_async_batching=True`` on a tensor-parallel model. Raised before anything is allocated.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig | None = None,
        max_tokens_hint: int | Sequence[int] | None = None,
        tokenizer: object | None = None,
        fallback_compile_config: CompileConfig | None = None,
    ) -> None:
        check_model_supported(model)
        self.config = config or ContinuousBatchingConfig()
        self.spec = spec = EngineSpec.resolve(model, self.config, max_tokens_hint, fallback_compile_config)
        self.model = model
        self.tokenizer = tokenizer
        self._stop_matchers: dict[tuple[tuple[str, ...], tuple[str, ...]], StopStringMatcher] = {}
        # The spec's values that callers read off the engine.
        self.device, self.tp, self.async_batching = spec.device, spec.tp, spec.async_batching
        self.block_size, self.max_batch_tokens, self.num_blocks = (
            spec.block_size,
            spec.max_batch_tokens,
            spec.num_blocks,
        )
        self.context_length, self.vocab_size, self.use_flash = spec.context_length, spec.vocab_size, spec.use_flash
        self.cache = PagedKVCache(
            spec.shape, spec.num_blocks + int(spec.static), spec.block_size, spec.device, spec.layer_devices
        )
        self.offload_pool: CPUOffloadPool | None = None
        if spec.offload_gib > 0:
            pin = spec.device.type == "cuda"
            self.offload_pool = CPUOffloadPool(spec.shape, spec.offload_gib, spec.block_size, pin, self.cache.layout)
        self.block_manager = BlockManager(spec.num_blocks, spec.block_size, self.config.allow_block_sharing)
        self.kv_cache_manager = KVCacheManager(
            self.block_manager, spec.safety_margin, self.offload_pool, self.cache.layout.sliding_windows
        )
        scheduler_class = AsyncScheduler if spec.async_batching else Scheduler
        self.scheduler = scheduler_class(
            self.kv_cache_manager, spec.max_batch_tokens, self.config.max_requests_per_batch, self.config.scheduler_type
        )
        self.runner = ModelRunner(
            model,
            self.cache,
            spec.use_flash,
            self.offload_pool,
            seed=self.config.seed,
            logprobs_mode=self.config.logprobs_mode,
            return_logprobs=self.config.return_logprobs,
            max_blocks_per_request=spec.max_blocks_per_request,
            compile_configs=spec.compile_configs,
            cuda_graphs=spec.cuda_graphs,
            padding=spec.padding,
            async_batching=spec.async_batching,
        )
        self._counts = EngineStats()  # the step loop's own counters (the others are read from their owners)
        self._warmed_up = False
        self._compiles_at_warmup = 0
        self._captures_at_warmup = 0
        self._in_flight: _InFlight | None = None
        self._completed: list[Request] = []  # updated by a drain, returned by the next step()
        self._last_step_end = 0.0
        self._arrivals = 0
        self._last_log = (time.perf_counter(), 0)  # (time, generated tokens) of the last progress log
        self._step_fn = self._step_async if spec.async_batching else self._step_sync  # chosen once, as vLLM's
        self._original_attn = enable_paged_attention(model)
        self._closed = False

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, read now from their owners (vLLM's ``make_stats``): the scheduler
        (preemptions), the KV cache manager and block pool (offloads, block copies, prefix hits), the runner
        (fast-path steps, compilations, CUDA graphs), the cache (bytes) and the step loop (the rest). A
        snapshot: it does not change as the engine steps on (its lists do: they are the loop's own)."""
        counts, runner = self._counts, self.runner
        compiles = runner.compile_counter.count
        captures = runner.graphs.num_captures if runner.graphs is not None else 0
        warm = self._warmed_up
        return dataclasses.replace(
            counts,
            num_preemptions=self.scheduler.num_preemptions,
            num_offloads=self.kv_cache_manager.num_offloads,
            num_prefix_cache_hit_blocks=self.block_manager.num_prefix_cache_hit_blocks,
            num_block_copies=self.kv_cache_manager.num_block_copies,
            num_decode_fast_path_steps=runner.num_decode_fast_path_steps,
            kv_cache_bytes=self.cache.size_bytes,
            kv_cache_capacity_tokens={g.name: self.num_blocks * self.block_size for g in self.cache.groups},
            num_compiles=compiles,
            num_compiles_after_warmup=compiles - self._compiles_at_warmup if warm else 0,
            num_cuda_graph_captures=captures,
            num_cuda_graph_captures_after_warmup=captures - self._captures_at_warmup if warm else 0,
        )

    def use_device_in_this_thread(self) -> None:
        """Make the engine's CUDA device the current device of the calling thread (nothing on CPU).

        A new thread starts on cuda:0; kernels and allocations that follow the current device (CUDA
        streams, pinned copies, flash-attn's capability query) must use the model's GPU, e.g. rank 1's
        under accelerate. The manager's loop calls it when its thread starts.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # ------------------------------------------------------------------ tensor parallelism
    @property
    def is_driver(self) -> bool:
        """True unless this is a tensor-parallel rank other than the driver (TP rank 0)."""
        return self.tp is None or self.tp.is_driver

    def from_driver(self, obj: T) -> T:
        """The driver's ``obj`` on every rank of a tensor-parallel engine (a collective); ``obj`` itself otherwise.

        ``generate_batch`` and ``score`` pass their planned requests through it, so that every rank
        runs what the driver decided even if a caller gave its ranks different inputs.
        """
        return obj if self.tp is None else self.tp.broadcast_object(obj)

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id (the scheduler's; do not change it)."""
        return self.scheduler.requests

    def check_request(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        """Raise ValueError if this engine can never run a request; changes nothing.

        The prompt and parameters are trusted (they were checked at the public boundary); this
        adds what only the engine knows: whether the prompt plus ``max_new_tokens`` fits the model's
        context (``max_position_embeddings``) and the cache. Past the context a RoPE model runs on with
        degraded output for as long as it is asked (``model.generate`` only warns); rollout refuses, as
        vLLM refuses a request past ``max_model_len``.

        Args:
            request_id: named in the message.
            num_prompt_tokens: the prompt's length.
            params: the request's sampling parameters (``max_new_tokens`` counts).
            scoring: a scoring request (it generates nothing: the prompt alone must fit the context).

        Raises:
            ValueError: the prompt plus ``max_new_tokens`` is past the model's context (the message
                names ``max_new_tokens``, the prompt's length and the context), the request needs more
                blocks than the cache has, it has stop strings and the engine no tokenizer, or it asks for
                top logprobs (``num_top_logprobs``) from an engine that records no logprobs.
        """
        if params.num_top_logprobs > 0 and not self.config.return_logprobs:
            raise ValueError(
                f"num_top_logprobs: request {request_id!r} asks for {params.num_top_logprobs} top logprobs per "
                "token, but the engine records no logprobs; pass ContinuousBatchingConfig(return_logprobs=True)"
            )
        if params.needs_tokenizer:
            self.stop_matcher(params)
        total = num_prompt_tokens + params.max_new_tokens
        context = self.context_length
        if context is not None and (num_prompt_tokens if scoring else total) > context:
            if scoring or num_prompt_tokens >= context:
                fix = f"shorten the prompt to at most {context - (0 if scoring else 1)} tokens"
            else:
                fix = f"lower max_new_tokens to at most {context - num_prompt_tokens} or shorten the prompt"
            what = "" if scoring else f"max_new_tokens: request {request_id!r}: "
            raise ValueError(
                f"{what}prompt ({num_prompt_tokens} tokens)"
                + ("" if scoring else f" plus max_new_tokens ({params.max_new_tokens})")
                + f" is past the model's context of {context} tokens (max_position_embeddings); {fix}"
            )
        needed = self.kv_cache_manager.max_blocks_needed(total, self.max_batch_tokens)
        if needed > self.num_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt ({num_prompt_tokens} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) needs {needed} blocks of {self.block_size} tokens, but the cache "
                f"has {self.num_blocks}; raise num_blocks or max_memory_percent, or lower max_new_tokens"
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
        """Check and queue a request; returns its state object.

        The entry point for code that drives an engine directly: everything is checked here,
        once. (``generate_batch``, the manager and ``score`` check at their own boundary, then
        ``check_request`` and ``enqueue`` the requests they built.)

        Args:
            prompt_ids: the prompt's token ids (a list, tuple, 1-D tensor or array of ints).
            params: sampling parameters.
            request_id: unique id (default ``req_<n>``).
            record_timestamps: record a timestamp per generated token.
            score_from: make this a scoring request: no token is generated, and the
                logprobs of ``prompt_ids[score_from:]`` are recorded in
                ``prompt_logprobs`` (1 <= score_from <= len(prompt_ids)).
            score_temperature: logits are divided by this before the log-softmax (> 0).

        Raises:
            ValueError: an empty prompt, a token id outside [0, vocab_size), an eos id outside
                the vocabulary, a duplicate request id, a request that can never fit the cache,
                or score_from / score_temperature out of range.
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
            ValueError: its id is already in use by an unfinished request, or it has stop strings and
                the engine no tokenizer.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        if request.params.needs_tokenizer:
            request.stop_matcher = self.stop_matcher(request.params)
        self.scheduler.add_request(request)
        self._arrivals += 1

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End a request with a final status (cancel, fail), freeing its blocks. None if unknown.

        With a step in flight (async batching), the request's row of that step is computed and dropped.
        """
        return self.scheduler.finish_request(request_id, status, error)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, a step is in flight, or a drained step's updates are not
        returned by ``step()`` yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._completed)

    @property
    def in_flight(self) -> bool:
        """True while a launched step is not collected (async batching: between calls of ``step()``)."""
        return self._in_flight is not None

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        """Version recorded with new tokens and new cached blocks."""
        return self.scheduler.weight_version

    def bump_weight_version(self) -> int:
        """Record a weight update: blocks hashed from now on carry the new version."""
        self.set_weight_version(self.weight_version + 1)
        return self.weight_version

    def set_weight_version(self, version: int) -> None:
        """Set the version recorded with new tokens and new cached blocks (after finishing the step in flight,
        whose tokens were sampled under the old weights)."""
        self._quiesce()
        self.scheduler.weight_version = version

    def recompute_in_flight(self) -> None:
        """Drop the KV of every unfinished request so it is re-prefilled under the current weights (after
        finishing the step in flight)."""
        self._quiesce()
        self.scheduler.recompute_all()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one engine step: schedule, execute, update.

        With async batching, the step whose results this call applies is the one launched by the previous
        call; this call launches the next (see the module docstring). The first call launches the first
        step and applies nothing.

        Returns:
            The requests that got a new token in the step applied, and the requests that finished (status
            FINISHED, blocks freed), in batch order (after those of a ``drain`` not returned yet).

        Raises:
            Whatever the forward raises. The engine is then unusable (its requests' counts and blocks may
            not match their KV): every caller closes it or fails the manager.
        """
        return self._step_fn()

    def _step_sync(self) -> list[Request]:
        scheduler_output = self.scheduler.schedule()
        t0 = time.perf_counter()
        runner_output = self.runner.execute(scheduler_output)
        if self.tp is not None:
            runner_output = self.tp.share_output(runner_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._record_stats(scheduler_output, runner_output, time.perf_counter() - t0)
        return updated

    def _step_async(self) -> list[Request]:
        """``step`` with async batching (vLLM v1's ``step_with_batch_queue``, a queue of two): schedule and
        launch the next step behind the one in flight, then wait for that one and apply its results."""
        updated, self._completed = self._completed, []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # Its KV copies (offloads of preempted requests), if any, run after the step in flight.
            if self._in_flight is not None:
                updated += self._complete()
            self.runner.execute(scheduler_output)
            self._record_stats(scheduler_output, RunnerOutput(), 0.0)
            return updated
        previous = self._in_flight
        prepared = self.runner.prepare_step(scheduler_output)  # overlaps the step in flight
        launched = self.runner.launch(prepared, previous.launched if previous is not None else None)
        if previous is not None:
            self._counts.num_async_steps += 1
            updated += self._complete()
        self._in_flight = _InFlight(launched, time.perf_counter())
        return updated

    def drain(self) -> list[Request]:
        """Finish the step in flight, if any, and apply its results; launch nothing (async batching).

        The manager's loop calls it before a pause: then nothing runs on the model until the next
        ``step()``. A no-op for a synchronous engine.

        Returns:
            The requests updated since the last ``step()`` returned, in batch order.

        Raises:
            Whatever the step's forward raised (see ``step``).
        """
        updated, self._completed = self._completed, []
        if self._in_flight is not None:
            updated += self._complete()
        return updated

    def _quiesce(self) -> None:
        """Finish the step in flight; its updates are returned by the next ``step()``."""
        if self._in_flight is not None:
            self._completed = self.drain()

    def _complete(self) -> list[Request]:
        """Wait for the step in flight and apply its results (async batching)."""
        flight = self._in_flight
        assert flight is not None
        self._in_flight = None
        scheduler_output = flight.launched.prepared.scheduler_output
        runner_output = self.runner.collect(flight.launched)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.perf_counter()
        self._record_stats(scheduler_output, runner_output, now - max(flight.launched_at, self._last_step_end))
        self._last_step_end = now
        return updated

    def _record_stats(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float) -> None:
        """Count a step in the loop's own counters (see ``stats``)."""
        if scheduler_output.is_empty:
            return
        counts = self._counts
        counts.num_steps += 1
        if ModelRunner.path_of(scheduler_output.scheduled) in self.runner.static_paths:
            counts.num_padded_steps += 1
        counts.num_tokens_computed += scheduler_output.total_num_scheduled_tokens
        counts.num_prompt_tokens_computed += scheduler_output.num_scheduled_prompt_tokens
        counts.num_generated_tokens += len(runner_output.sampled_token_ids)
        counts.num_forks += len(scheduler_output.forks)
        if scheduler_output.is_decode_only:
            counts.decode_step_seconds.append(seconds)
            counts.decode_step_batch.append(len(scheduler_output.scheduled))
        self._log_progress()

    def _log_progress(self) -> None:
        """Debug log of throughput every ``config.progress_log_interval`` seconds."""
        now = time.perf_counter()
        if now - self._last_log[0] < self.config.progress_log_interval:
            return
        tokens = self._counts.num_generated_tokens - self._last_log[1]
        logger.debug(
            "%.1f generated tokens/s; %d running, %d waiting, %d free blocks",
            tokens / (now - self._last_log[0]),
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.block_manager.num_free_blocks,
        )
        self._last_log = (now, self._counts.num_generated_tokens)

    # ------------------------------------------------------------------ warmup
    def warmup_plan(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (path, padded shape) pairs ``warmup`` runs: two per compiled or graphed path
        (``static_step.warmup_shapes``); empty when every path is eager."""
        rule = self.runner.padding
        if rule is None:
            return []
        return [(path, shape) for path in self.runner.static_paths for shape in warmup_shapes(path, rule)]

    def warmup(self, progress_bar: bool = True) -> float:
        """Compile (and on CUDA capture) the step shapes before the first request.

        Runs each shape of ``warmup_plan`` once on a synthetic batch that touches only the padding
        block (``ModelRunner.warmup``): requests, blocks, the prefix cache, the random generators and
        the request counters of ``stats`` are as they were. Compilations made by later steps are
        counted in ``stats.num_compiles_after_warmup``. A no-op (logged at debug) when no path is
        compiled or graphed, when it already ran, and when an earlier engine on the same model object
        warmed up the same ``dynamic=True`` compile configs and padding (``static_step.warm_key``: its
        graphs serve any cache size; ``generate_batch`` builds an engine per call). Not thread-safe
        against ``step()``: the manager pauses its loop first.

        Args:
            progress_bar: show a tqdm bar over the shapes.

        Returns:
            The seconds it took (0.0 when there was nothing to do).

        Raises:
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        self._quiesce()  # a step in flight would run beside the warmup's forwards
        plan = self.warmup_plan()
        if not plan:
            logger.debug("warmup: no path is compiled or CUDA-graphed; nothing to do")
            return 0.0
        if self._warmed_up:
            logger.debug("warmup: already done for this engine")
            return 0.0
        runner = self.runner
        assert runner.padding is not None  # a plan means a static path, which has a padding rule
        key = warm_key(runner.compile_configs, runner.cuda_graph_paths, runner.padding)
        if warmed_before(self.model, key):
            # dynamic=True graphs compiled by an earlier engine on this model: nothing to compile here.
            logger.debug("warmup: these step shapes were compiled by an earlier engine on this model")
            self._warmed_up = True
            self._counts.warmup_seconds = 0.0
            return 0.0
        t0 = time.perf_counter()
        # On CUDA, on the engine's device whatever the calling thread's current device is.
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device, tqdm(total=len(plan), desc="rollout warmup", unit="shape", disable=not progress_bar) as bar:
            self.runner.warmup(plan, lambda: bar.update(1))
        seconds = time.perf_counter() - t0
        stats = self.stats
        self._warmed_up = True
        self._compiles_at_warmup = stats.num_compiles
        self._captures_at_warmup = stats.num_cuda_graph_captures
        self._counts.warmup_seconds = seconds
        mark_warmed(self.model, key)
        logger.info(
            "warmup: %d step shapes of the %s path(s) in %.1f s (%d compilations, %d CUDA graphs captured)",
            len(plan),
            " and ".join(self.runner.static_paths),
            seconds,
            stats.num_compiles,
            stats.num_cuda_graph_captures,
        )
        return seconds

    @property
    def warmed_up(self) -> bool:
        """True once ``warmup()`` has run with something to compile or capture."""
        return self._warmed_up

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the model's original attention implementation and unpin the offload pool. Idempotent.

        A step in flight is waited for and its results are dropped; the runner's worker thread ends.
        """
        if not self._closed:
            self._closed = True
            self._in_flight = None  # the worker thread finishes it (runner.close); its results are dropped
            self.runner.close()
            restore_attention(self.model, self._original_attn)
            if self.offload_pool is not None:
                self.offload_pool.close()

    @property
    def closed(self) -> bool:
        return self._closed
