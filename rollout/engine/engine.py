"""The engine: the step loop over scheduler and model runner.

``Engine.step()`` is three calls, as in nano-vllm and vLLM v1: ``scheduler.schedule()`` ->
``runner.execute(scheduler_output)`` (forward, then sampling) -> ``scheduler.update_from_output`` (counts, tokens,
statuses, finished requests and their blocks). The engine builds the parts, queues requests (through the part that
checks and builds them, ``engine_requests.EngineRequests``) and keeps statistics; it changes no request itself. The
background manager, ``generate_batch`` and ``score`` all drive this class; it holds no global state.

With async batching (``ContinuousBatchingConfig.use_async_batching``) the scheduler is an ``AsyncScheduler`` and the
step function, chosen once, is ``BatchQueue.step`` (vLLM v1's ``step_with_batch_queue``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.attention.registry import enable_paged_attention, restore_attention
from rollout.engine.batch_queue import BatchQueue
from rollout.engine.kv.block_pool import BlockManager
from rollout.engine.kv.cache import PagedKVCache
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.engine.requests import EngineRequests, bind_adapter
from rollout.engine.sched.async_scheduler import AsyncScheduler
from rollout.engine.sched.output import RunnerOutput, SchedulerOutput
from rollout.engine.sched.scheduler import Scheduler
from rollout.engine.spec import EngineSpec
from rollout.engine.stats import EngineStats, ProgressLog
from rollout.engine.worker.forward import mark_warmed, warm_key, warmed_before, warmup_shapes
from rollout.engine.worker.runner import ModelRunner
from rollout.lora import LoadedAdapter, LoraAdapter, LoraSlots
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams, build_sampling_params
from rollout.stop_strings import StopStringMatcher
from rollout.weights.model_info import UnsupportedModelError, check_model_supported
from rollout.weights.versions import watch_of

__all__ = ["Engine", "EngineStats", "UnsupportedModelError"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Engine:
    """Continuous-batching engine for one model replica.

    Args:
        model: a ``transformers`` decoder-only causal LM. Its attention implementation is switched to rollout's paged
            dispatcher until ``close()`` (forwards without engine metadata still run the original). The KV cache holds
            the dtype attention computes in (``models.attention_dtype``: autocast's under accelerate's
            ``mixed_precision``), each layer's on that layer's device (a ``device_map``-sharded model gets its cache
            sharded the same way). On CUDA the steps use flash-attn's paged kernels when ``flash.flash_support``
            finds nothing against it, else SDPA (logged). A model sharded by a ``tp_plan`` under ``torchrun`` runs one
            engine per rank in lockstep (``distributed.TensorParallel``).
        config: engine configuration.
        max_tokens_hint: when ``config.num_blocks`` is None, the cache is no larger than what holds this many tokens (an
            int), or these requests of that many tokens each (a sequence: the whole job of ``generate_batch``), memory
            permitting.
        tokenizer: the model's ``transformers`` tokenizer, needed by requests with stop strings (``stop_strings``,
            ``stop``) to read the text of their tokens; None refuses them.
        fallback_compile_config: the generation config's ``compile_config`` (None when the user set none: transformers'
            ``GenerationConfig`` defaults it to None): compiles the paths that have no compile config of their own when
            ``default_compile_level`` is 0.

    Compiled and CUDA-graphed paths run padded (``static_step``): the cache gets one padding block more than the
    block manager hands out; ``warmup()`` compiles or captures before the first request.

    With ``spec.async_batching`` true, a step is in flight between calls of ``step()`` (``batch_queue``):
    ``in_flight`` says so and ``drain()`` finishes it; ``set_weight_version``, ``recompute_in_flight``, ``warmup()``
    and ``close()`` finish it first. A request cancelled or stopped meanwhile has its row computed and dropped.

    Raises:
        UnsupportedModelError: the model cannot be paged (see ``models.check_model_supported``), or a layer's weights
            are on the meta device with no accelerate hook saying where it runs.
        ValueError: a tensor-parallel model's ``num_key_value_heads`` is not divisible by its TP size;
            ``use_cuda_graph`` asks for CUDA graphs off CUDA, or together with a compile mode that captures CUDA graphs
            itself; a compiled or graphed path on a model whose layers span several devices; ``use_async_batching=True``
            on a tensor-parallel model; ``enable_lora=True`` on a tensor-parallel model. Raised before anything is
            allocated.
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
        # The spec's values that callers read off the engine.
        self.device, self.tp, self.num_blocks = spec.device, spec.tp, spec.num_blocks
        self.block_size, self.max_batch_tokens = spec.block_size, spec.max_batch_tokens
        self.async_batching, self.use_flash = spec.async_batching, spec.use_flash
        self.context_length, self.vocab_size = spec.context_length, spec.vocab_size
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
        if self.config.enable_lora and spec.tp is not None:
            raise ValueError("enable_lora=True: LoRA adapters are not served on a tensor-parallel model yet")
        # The LoRA adapters (enable_lora): hooks on the targeted linear layers, each token under its request's.
        self.lora: LoraSlots | None = None
        if self.config.enable_lora:
            self.lora = LoraSlots(model, self.config.max_loras, self.config.max_lora_rank)
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
            lora=self.lora,
        )
        self._intake = EngineRequests(spec, self.scheduler, tokenizer, self.lora)  # checks, builds and queues requests
        self._counts = EngineStats()  # the step loop's own counters (the others are read from their owners)
        # What the warmup found: whether it ran, its seconds, the compilations and captures at its end.
        self._warm_done = False
        self._warm_seconds: float | None = None
        self._warm_counts = (0, 0)
        self._queue = BatchQueue(self.scheduler, self.runner, self._record_stats) if spec.async_batching else None
        self._progress = ProgressLog(self.config.progress_log_interval)
        self._step_fn = self._queue.step if self._queue is not None else self._step_sync  # chosen once, as vLLM's
        # The model's weight version, shared with every engine on it: weights changed since the last check (by any
        # means: check_weight_contents) make a new one before this engine starts at it.
        self._watch = watch_of(model)
        self._watch.bump_if_changed(None, self.config.check_weight_contents)
        self.scheduler.weight_version = self._watch.version
        self.scheduler.base_version = self._watch.base_version
        self._original_attn = enable_paged_attention(model)
        self._closed = False

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, read now from their owners (vLLM's ``make_stats``): the scheduler, the KV cache
        manager and block pool, the runner, the cache, the warmup, the batch queue and the step loop. A snapshot: it
        does not change as the engine steps on (its lists do: they are the loop's own)."""
        compiles, captures = self._compile_counts()
        warm_compiles, warm_captures = self._warm_counts
        return dataclasses.replace(
            self._counts,
            num_preemptions=self.scheduler.num_preemptions,
            num_offloads=self.kv_cache_manager.num_offloads,
            num_prefix_cache_hit_blocks=self.block_manager.num_prefix_cache_hit_blocks,
            num_block_copies=self.kv_cache_manager.num_block_copies,
            num_decode_fast_path_steps=self.runner.num_decode_fast_path_steps,
            kv_cache_bytes=self.cache.size_bytes,
            kv_cache_capacity_tokens={g.name: self.num_blocks * self.block_size for g in self.cache.groups},
            num_compiles=compiles,
            num_compiles_after_warmup=compiles - warm_compiles if self._warm_done else 0,
            num_cuda_graph_captures=captures,
            num_cuda_graph_captures_after_warmup=captures - warm_captures if self._warm_done else 0,
            warmup_seconds=self._warm_seconds,
            num_async_steps=self._queue.num_async_steps if self._queue is not None else 0,
        )

    def use_device_in_this_thread(self) -> None:
        """Make the engine's CUDA device the current device of the calling thread (nothing on CPU).

        A new thread starts on cuda:0; kernels and allocations that follow the current device (CUDA streams, pinned
        copies, flash-attn's capability query) must use the model's GPU. The manager's loop calls it.
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

        ``generate_batch`` and ``score`` pass their planned requests through it, so that every rank runs what the driver
        decided even if a caller gave its ranks different inputs.
        """
        return obj if self.tp is None else self.tp.broadcast_object(obj)

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id (the scheduler's; do not change it)."""
        return self.scheduler.requests

    @property
    def tokenizer(self) -> object | None:
        """The tokenizer requests with stop strings need (None refuses them); a manager may set it later."""
        return self._intake.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: object | None) -> None:
        self._intake.tokenizer = tokenizer

    def check_request(
        self, request_id: str | None, num_prompt_tokens: int, params: SamplingParams, scoring: bool = False
    ) -> None:
        """Raise ValueError if this engine can never run a request (``EngineSpec.check_request``: the context, the
        cache, top logprobs), or if it has stop strings and the engine no tokenizer; changes nothing."""
        self._intake.check_request(request_id, num_prompt_tokens, params, scoring)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        record_timestamps: bool = False,
        score_from: int | None = None,
        score_temperature: float = 1.0,
        lora: str | None = None,
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
            lora: the loaded LoRA adapter it runs under (sets ``params.lora``); None keeps ``params.lora``.

        Raises:
            ValueError: an empty prompt, a token id outside [0, vocab_size), an eos id outside the vocabulary, a
                duplicate request id, a request that can never fit the cache, or score_from / score_temperature out of
                range, or a ``lora`` that is not a loaded adapter.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        if lora is not None:
            params = build_sampling_params(params, lora=lora)
        return self._intake.add_request(
            prompt_ids, params, request_id, record_timestamps, score_from, score_temperature
        )

    def stop_matcher(self, params: SamplingParams) -> StopStringMatcher:
        """The matcher of a request's stop strings, built once per set of strings.

        The first call for a tokenizer spells its vocabulary (``stop_strings.token_texts``).

        Raises:
            ValueError: the engine has no tokenizer.
        """
        return self._intake.stop_matcher(params)

    def enqueue(self, request: Request) -> None:
        """Queue a request built and checked by the caller (see ``check_request``).

        Raises:
            ValueError: its id is already in use by an unfinished request, or it has stop strings and the engine no
                tokenizer.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        self._intake.enqueue(request)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End a request with a final status (cancel, fail), freeing its blocks. None if unknown.

        With a step in flight (async batching), the request's row of that step is computed and dropped.
        """
        return self.scheduler.finish_request(request_id, status, error)

    def has_unfinished(self) -> bool:
        """True while a request waits or runs, a step is in flight, or a drained step's updates are not returned by
        ``step()`` yet."""
        return self.scheduler.has_unfinished() or (self._queue is not None and self._queue.busy)

    @property
    def in_flight(self) -> bool:
        """True while a launched step is not collected (async batching: between calls of ``step()``)."""
        return self._queue is not None and self._queue.in_flight

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        """Version recorded with new tokens and new cached blocks."""
        return self.scheduler.weight_version

    def set_weight_version(self, version: int) -> None:
        """Set the version recorded with new tokens and new cached blocks (after finishing the step in flight, whose
        tokens were sampled under the old weights), and drop the packed copies of the old weights.

        The model's ``WeightWatch`` (``weights.watch_of``) makes new versions; this engine raises the model's to
        ``version`` if it is behind, and adopts the model's before each step (``sync_weight_version``); a
        tensor-parallel rank adopts its driver's instead. Moving past a version whose update asked for recompute
        (``WeightWatch.recompute_version``) re-prefills the in-flight requests (``recompute_in_flight``), but under
        tensor parallelism, where the manager has every rank do it at the same point of its loop.
        """
        self._quiesce()
        old = self.scheduler.weight_version
        self.scheduler.weight_version = version
        if self.runner.packs is not None:
            self.runner.packs.clear()  # the copies of the old weights (each is remade on its next use)
        self._watch.publish(version)
        # A tensor-parallel rank serves no adapter: every version is its base weights'.
        self.scheduler.base_version = min(self._watch.base_version, version) if self.tp is None else version
        if self.tp is None and old < self._watch.recompute_version <= version:
            self.scheduler.recompute_all()

    def sync_weight_version(self) -> None:
        """Adopt the model's weight version if another engine or manager on the same model moved it (an
        ``update_weights`` through another manager, a change another engine's check found); ``step()`` calls it
        first. A tensor-parallel engine keeps its driver's (``tp_loop``)."""
        version = self._watch.version
        if version != self.scheduler.weight_version and self.tp is None:
            self.set_weight_version(version)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(
        self, adapter: LoraAdapter, replace: bool = False, queued: Iterable[int] = (), version: int = 0
    ) -> LoadedAdapter:
        """Load a LoRA adapter into a free slot (after finishing the step in flight); requests select it by name
        (``SamplingParams.lora``). The base weights are not touched. The weight version is not bumped here: the
        adapter's own uid keys its KV (``Request.lora_id``); the manager's ``load_lora`` makes it a new version too.

        Args:
            adapter: the adapter (its tensors are copied into the slot).
            replace: unload an adapter loaded under the same name first (vLLM's ``load_inplace``); requests accepted
                under it keep it. Checked before anything changes: a refused load leaves the old one loaded.
            queued: uids of adapters that requests accepted but not yet handed to this engine run under (the
                manager's inbox): their slots stay taken.
            version: the weight version this load makes (``LoadedAdapter.version``, what its tokens record).

        Raises:
            ValueError: ``enable_lora`` is off. FieldError (a ValueError) naming the field when the adapter cannot be
                loaded (``LoraSlots.check``: its name is loaded, its rank above ``max_lora_rank``, a target module the
                engine cannot adapt, tensors of another base model, every slot taken); nothing changes then.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        lora = self._lora_slots("load_lora")
        self._quiesce()
        in_use = {r.lora_id for r in self.scheduler.requests.values()} | set(queued)
        return lora.load(adapter, in_use, replace, version)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``: new requests cannot select it; unfinished ones finish under it (its slot is reused
        once they are done).

        Raises:
            ValueError: ``enable_lora`` is off.
            KeyError: no adapter of that name is loaded.
        """
        self._lora_slots("unload_lora").unload(name)

    def bind_adapter(self, request: Request) -> None:
        """Resolve ``request.params.lora`` now (a request accepted by a manager, before it is queued here): the request
        runs under that adapter until it ends, whatever is unloaded or loaded under the name meanwhile. No-op for a
        base-model request.

        Raises:
            ValueError: the engine serves no adapters; FieldError (``lora``): none of that name is loaded.
        """
        if request.params.lora is not None:
            bind_adapter(request, self._intake.adapter(request.params.lora))

    @property
    def lora_adapters(self) -> dict[str, LoadedAdapter]:
        """The loaded adapters by name (empty without ``enable_lora``)."""
        return dict(self.lora.loaded) if self.lora is not None else {}

    def _lora_slots(self, what: str) -> LoraSlots:
        if self.lora is None:
            raise ValueError(f"{what}: the engine was built without enable_lora=True (ContinuousBatchingConfig)")
        return self.lora

    def recompute_in_flight(self) -> None:
        """Drop the KV of every unfinished request so it is re-prefilled under the current weights (after finishing the
        step in flight)."""
        self._quiesce()
        self.scheduler.recompute_all()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one engine step: schedule, execute, update.

        With async batching, this call applies the step launched by the previous call and launches the next
        (``BatchQueue.step``); the first call applies nothing.

        Returns:
            The requests that got a new token in the step applied, and the requests that finished (status
            FINISHED, blocks freed), in batch order (after those of a ``drain`` not returned yet).

        Raises:
            Whatever the forward raises. The engine is then unusable (its requests' counts and blocks may
            not match their KV): every caller closes it or fails the manager.
        """
        self.sync_weight_version()  # one version per model: an update through another engine is this one's too
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

    def drain(self) -> list[Request]:
        """Finish the step in flight, if any, and apply its results; launch nothing (async batching).

        The manager's loop calls it before a pause, so that nothing runs on the model until the next ``step()``.

        Returns:
            The requests updated since the last ``step()`` returned, in batch order.

        Raises:
            Whatever the step's forward raised (see ``step``).
        """
        return self._queue.drain() if self._queue is not None else []

    def _quiesce(self) -> None:
        """Finish the step in flight, if any; its updates are returned by the next ``step()``."""
        if self._queue is not None:
            self._queue.quiesce()

    def _record_stats(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float) -> None:
        """Count a step in the loop's own counters (see ``stats``) and log progress now and then."""
        if scheduler_output.is_empty:
            return
        padded = ModelRunner.path_of(scheduler_output.scheduled) in self.runner.static_paths
        self._counts.count_step(scheduler_output, runner_output, seconds, padded)
        waiting, free = len(self.scheduler.waiting), self.block_manager.num_free_blocks
        self._progress.tick(self._counts.num_generated_tokens, len(self.scheduler.running), waiting, free)

    # ------------------------------------------------------------------ warmup
    def _compile_counts(self) -> tuple[int, int]:
        """The runner's dynamo compilations and CUDA graph captures so far, warmup included."""
        graphs = self.runner.graphs
        return self.runner.compile_counter.count, graphs.num_captures if graphs is not None else 0

    def warmup_plan(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (path, padded shape) pairs ``warmup`` runs: two per compiled or graphed path
        (``static_step.warmup_shapes``); empty when every path is eager."""
        rule = self.runner.padding
        if rule is None:
            return []
        return [(path, shape) for path in self.runner.static_paths for shape in warmup_shapes(path, rule)]

    def warmup(self, progress_bar: bool = True) -> float:
        """Compile (and on CUDA capture) the step shapes before the first request.

        Runs each shape of ``warmup_plan`` once on a synthetic batch that touches only the padding block
        (``ModelRunner.warmup``): requests, blocks, the prefix cache, the random generators and the request counters of
        ``stats`` are as they were. A no-op (logged at debug) when there is nothing to compile, when it already ran, or
        when an earlier engine on the same model warmed up the same ``dynamic=True`` configs and padding
        (``static_step.warm_key``). Not thread-safe against ``step()``: the manager pauses its loop first.

        Args:
            progress_bar: show a tqdm bar over the shapes.

        Returns:
            The seconds it took (0.0 when there was nothing to do).

        Raises:
            RuntimeError: the engine is closed.
        """
        self._check_open()
        plan = self.warmup_plan()
        if not plan or self._warm_done:
            logger.debug(
                "warmup: %s", "already done for this engine" if plan else "no compiled or graphed path; nothing to do"
            )
            return 0.0
        runner = self.runner
        assert runner.padding is not None  # a plan means a static path, which has a padding rule
        key = warm_key(runner.compile_configs, runner.cuda_graph_paths, runner.padding)
        if warmed_before(self.model, key):
            logger.debug("warmup: these step shapes were compiled by an earlier engine on this model")
            self._warm_done, self._warm_seconds = True, 0.0
            return 0.0
        self._quiesce()  # a step in flight would run beside the warmup's forwards
        t0 = time.perf_counter()
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device, tqdm(total=len(plan), desc="rollout warmup", unit="shape", disable=not progress_bar) as bar:
            runner.warmup(plan, lambda: bar.update(1))
        self._warm_seconds = time.perf_counter() - t0
        self._warm_done = True
        self._warm_counts = self._compile_counts()
        mark_warmed(self.model, key)
        logger.info(
            "warmup: %d step shapes of the %s path(s) in %.1f s (%d compilations, %d CUDA graphs captured)",
            len(plan),
            " and ".join(runner.static_paths),
            self._warm_seconds,
            *self._warm_counts,
        )
        return self._warm_seconds

    @property
    def warmed_up(self) -> bool:
        """True once ``warmup()`` has run with something to compile or capture."""
        return self._warm_done

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the model's original attention implementation and unpin the offload pool. Idempotent.

        A step in flight is waited for and its results are dropped; the runner's worker thread ends.
        """
        if not self._closed:
            self._closed = True
            if self._queue is not None:
                self._queue.drop()  # the worker thread finishes it (runner.close); its results are dropped
            self.runner.close()
            if self.lora is not None:
                self.lora.close()  # the hooks go: the model is left as it was found
            restore_attention(self.model, self._original_attn)
            if self.offload_pool is not None:
                self.offload_pool.close()

    @property
    def closed(self) -> bool:
        return self._closed
