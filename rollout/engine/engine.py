"""The engine: requests in through one door, and the step loop over scheduler and model runner.

``Engine.step()`` is three calls, as in nano-vllm and vLLM v1: ``scheduler.schedule()`` ->
``runner.execute(scheduler_output)`` (forward, then sampling) -> ``scheduler.update_from_output`` (counts, tokens,
statuses, finished requests and their blocks). The engine holds the parts ``build.build_parts`` makes from the spec,
queues requests (checked once where they enter, by its ``gate.RequestGate``) and keeps statistics; it changes no request
itself. The background manager, ``generate_batch`` and ``score`` all drive this class; it holds no global state.

With async batching (``ContinuousBatchingConfig.use_async_batching``) the scheduler is an ``AsyncScheduler`` and the
step function, chosen once, is ``BatchQueue.step`` (vLLM v1's ``step_with_batch_queue``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from rollout.checks import check_int, check_number, token_ids
from rollout.config import ContinuousBatchingConfig
from rollout.engine.attention.registry import enable_paged_attention, restore_attention
from rollout.engine.batch_queue import BatchQueue
from rollout.engine.build import build_parts
from rollout.engine.gate import RequestGate
from rollout.engine.stats import EngineStats, StepMeter, read_stats
from rollout.engine.warmup import Warmup
from rollout.engine.worker.regions import uninstall
from rollout.lora import LoadedAdapter, LoraAdapter, LoraSlots
from rollout.requests import Request, RequestStatus
from rollout.sampling_params import SamplingParams, build_sampling_params
from rollout.weights.model_info import UnsupportedModelError

__all__ = ["Engine", "EngineStats", "UnsupportedModelError"]

T = TypeVar("T")


class Engine:
    """Continuous-batching engine for one model replica.

    Args:
        model: a ``transformers`` decoder-only causal LM. Its attention implementation is switched to rollout's paged
            dispatcher until ``close()`` (forwards without engine metadata still run the original). The KV cache holds
            the dtype attention computes in (autocast's under accelerate's ``mixed_precision``), each layer's on that
            layer's device (``device_map``). On CUDA the steps use flash-attn's paged kernels when
            ``flash.flash_support`` finds nothing against it, else SDPA (logged). A model sharded by a ``tp_plan``
            under ``torchrun`` runs one engine per rank in lockstep (``worker.distributed.TensorParallel``).
        config: engine configuration.
        max_tokens_hint: when ``config.num_blocks`` is None, the cache is no larger than what holds this many tokens (an
            int), or these requests of that many tokens each (a sequence: the whole job of ``generate_batch``), memory
            permitting.
        tokenizer: the model's ``transformers`` tokenizer, needed by requests with stop strings (``stop_strings``,
            ``stop``) to read the text of their tokens; None refuses them. A manager may set ``tokenizer`` later.
        fallback_compile_config: the generation config's ``compile_config`` (None when the user set none: transformers'
            ``GenerationConfig`` defaults it to None): compiles the paths that have no compile config of their own when
            ``default_compile_level`` is 0.

    Compiled and CUDA-graphed paths run padded (``worker.forward``): the cache gets one padding block more than the
    block manager hands out; ``warmup()`` compiles or captures before the first request.

    With ``spec.async_batching`` true, a step is in flight between calls of ``step()`` (``batch_queue``):
    ``in_flight`` says so and ``drain()`` finishes it; ``set_weight_version``, ``recompute_in_flight``, ``warmup()``
    and ``close()`` finish it first. A request cancelled or stopped meanwhile has its row computed and dropped.

    Raises:
        UnsupportedModelError, ValueError: what ``build.build_parts`` refuses (a model that cannot be paged, KV heads
            not divisible by the TP size, CUDA graphs off CUDA or under a compile mode that captures its own, a static
            path across devices, async batching or LoRA under tensor parallelism), before anything is allocated.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig | None = None,
        max_tokens_hint: int | Sequence[int] | None = None,
        tokenizer: object | None = None,
        fallback_compile_config: CompileConfig | None = None,
    ) -> None:
        self.config = config or ContinuousBatchingConfig()
        parts = build_parts(model, self.config, max_tokens_hint, fallback_compile_config)
        self.model, self.spec, self.cache, self.offload_pool = model, parts.spec, parts.cache, parts.offload_pool
        self.block_manager, self.kv_cache_manager = parts.block_manager, parts.kv_cache_manager
        self.lora, self.scheduler, self.runner, self._watch = parts.lora, parts.scheduler, parts.runner, parts.watch
        spec = self.spec  # its values that callers read off the engine:
        self.device, self.tp, self.num_blocks = spec.device, spec.tp, spec.num_blocks
        self.block_size, self.max_batch_tokens = spec.block_size, spec.max_batch_tokens
        self.async_batching, self.use_flash = spec.async_batching, spec.use_flash
        self.context_length, self.vocab_size = spec.context_length, spec.vocab_size
        self.gate = RequestGate(spec, tokenizer, self.lora)  # the one check of a request, and readying it
        self._num_queued = 0  # requests queued so far (default ids count them)
        self._meter = StepMeter(self.scheduler, self.runner, self.config.progress_log_interval)  # the loop's counters
        self._warmup = Warmup(model, self.runner)
        self._queue = BatchQueue(self.scheduler, self.runner, self._meter.record) if spec.async_batching else None
        self._step_fn = self._queue.step if self._queue is not None else self._step_sync  # chosen once, as vLLM's
        self._original_attn = enable_paged_attention(model)
        self._closed = False
        # regional_compile: the dispatchers come off the model at close(), or when the engine is collected unclosed.
        self._uninstall = weakref.finalize(self, uninstall, model) if self.runner.regional else None
        if self._uninstall is not None:
            try:
                self._warmup.compile_regions()  # before any step: steps never compile
            except BaseException:
                self.close()  # the model as it was found: its attention and its modules' calls
                raise

    @property
    def stats(self) -> EngineStats:
        """The engine's counters, read now from their owners (``stats.read_stats``); a snapshot."""
        parts = (self.scheduler, self.kv_cache_manager, self.runner, self.cache)
        return read_stats(self._meter.counts, *parts, self._warmup, self._queue)

    def use_device_in_this_thread(self) -> None:
        """Make the engine's CUDA device the current device of the calling thread (nothing on CPU). A new thread starts
        on cuda:0; kernels and allocations that follow the current device (CUDA streams, pinned copies, flash-attn's
        capability query) must use the model's GPU. The manager's loop calls it."""
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
        decided even if a caller gave its ranks different inputs."""
        return obj if self.tp is None else self.tp.broadcast_object(obj)

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request, by id (the scheduler's; do not change it)."""
        return self.scheduler.requests

    @property
    def tokenizer(self) -> object | None:
        """The tokenizer requests with stop strings need (None refuses them): the gate's; a manager may set it later."""
        return self.gate.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: object | None) -> None:
        self.gate.tokenizer = tokenizer

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
        """Check and queue a request; returns its state object. The door of code that drives an engine directly: the
        arguments are checked here, then the request (``gate.check``), once. ``generate_batch``, the manager and
        ``score`` check at their own boundary (the gate's check too), then ``enqueue`` the requests they built.

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
                duplicate request id, score_from / score_temperature out of range, or what ``RequestGate.check``
                raises (a request that can never fit, stop strings without a tokenizer, a ``lora`` not loaded).
            RuntimeError: the engine is closed.
        """
        self._check_open()
        if lora is not None:
            params = build_sampling_params(params, lora=lora)
        prompt = token_ids(prompt_ids, f"input_ids of request {request_id!r}", self.vocab_size)
        params.check_vocab(self.vocab_size)
        if score_from is not None:
            check_int("score_from", score_from, minimum=1, maximum=len(prompt))
            check_number("score_temperature", score_temperature, minimum=0, min_open=True)
        if request_id is None:
            request_id = f"req_{self._num_queued}"
            while request_id in self.scheduler.requests:
                request_id += "_"
        self.gate.check(request_id, len(prompt), params)
        request = Request(request_id, prompt, params, record_timestamps, score_from, score_temperature)
        self.enqueue(request)
        return request

    def enqueue(self, request: Request) -> None:
        """Queue a request built and checked by the caller (``gate.check``), readied by ``RequestGate.ready`` (its
        stop-string matcher, its adapter).

        Raises:
            ValueError: its id is already in use by an unfinished request, or what ``RequestGate.ready`` raises.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        self.gate.ready(request)
        self.scheduler.add_request(request)
        self._num_queued += 1

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def finish_request(self, request_id: str, status: RequestStatus, error: str | None = None) -> Request | None:
        """End a request with a final status (cancel, fail), freeing its blocks. None if unknown. With a step in flight
        (async batching), the request's row of that step is computed and dropped."""
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

        The model's ``WeightWatch`` (``weights.versions.watch_of``) makes new versions; this engine raises the model's
        to ``version`` if it is behind, and adopts the model's before each step (``sync_weight_version``); a
        tensor-parallel rank adopts its driver's instead. Moving past a version whose update asked for recompute
        (``WeightWatch.recompute_version``) re-prefills the in-flight requests (``recompute_in_flight``), but under
        tensor parallelism, where the manager has every rank do it at the same point of its loop.
        """
        self._quiesce()
        old = self.scheduler.weight_version
        self.scheduler.weight_version = version
        if self.runner.packs is not None:
            self.runner.packs.clear()  # the copies of the old weights (each is remade on its next use)
        if self.runner.invariant_packs is not None:
            self.runner.invariant_packs.clear()
        self._watch.publish(version)
        # A tensor-parallel rank serves no adapter: every version is its base weights'.
        self.scheduler.base_version = min(self._watch.base_version, version) if self.tp is None else version
        if self.tp is None and old < self._watch.recompute_version <= version:
            self.scheduler.recompute_all()

    def sync_weight_version(self) -> None:
        """Adopt the model's weight version if another engine or manager on the same model moved it (an
        ``update_weights`` through another manager, a change another engine's check found); ``step()`` calls it
        first. A tensor-parallel engine keeps its driver's (the manager's tensor-parallel loop)."""
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
            ValueError: ``enable_lora`` is off. FieldError naming the field the adapter breaks (``LoraSlots.check``);
                nothing changes then.
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
            self.gate.adapter(request.params.lora).bind(request)

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
        """Run one engine step: schedule, execute, update. With async batching, this call applies the step launched by
        the previous call and launches the next (``BatchQueue.step``); the first call applies nothing.

        Returns:
            The requests that got a new token in the step applied, and the requests that finished (status FINISHED,
            blocks freed), in batch order (after those of a ``drain`` not returned yet).

        Raises:
            Whatever the forward raises. The engine is then unusable (its requests' counts and blocks may not match
            their KV): every caller closes it or fails the manager.
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
        self._meter.record(scheduler_output, runner_output, time.perf_counter() - t0)
        return updated

    def drain(self) -> list[Request]:
        """Finish the step in flight, if any, and apply its results; launch nothing (async batching). The manager's loop
        calls it before a pause, so that nothing runs on the model until the next ``step()``.

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

    # ------------------------------------------------------------------ warmup
    def warmup_plan(self) -> list[tuple[str, tuple[int, ...]]]:
        """The (path, padded shape) pairs ``warmup`` runs (``Warmup.plan``); empty when every path is eager."""
        return self._warmup.plan()

    def warmup(self, progress_bar: bool = True) -> float:
        """Compile (and on CUDA capture) the step shapes before the first request, with a tqdm bar if ``progress_bar``
        (``Warmup.run``); returns its seconds (0.0, logged at debug, when there was nothing to do). Not thread-safe
        against ``step()``: the manager pauses its loop first.

        Raises:
            RuntimeError: the engine is closed.
        """
        self._check_open()
        return self._warmup.run(progress_bar, self._quiesce)

    @property
    def warmed_up(self) -> bool:
        """True once ``warmup()`` has run with something to compile or capture."""
        return self._warmup.done

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Restore the model's original attention implementation and unpin the offload pool. Idempotent. A step in
        flight is waited for and its results are dropped; the runner's worker thread ends."""
        if not self._closed:
            self._closed = True
            if self._queue is not None:
                self._queue.drop()  # the worker thread finishes it (runner.close); its results are dropped
            self.runner.close()
            if self.lora is not None:
                self.lora.close()  # the hooks go: the model is left as it was found
            restore_attention(self.model, self._original_attn)
            if self._uninstall is not None:
                self._uninstall()  # the last engine's close leaves the layers as they were (once: a finalizer)
            if self.offload_pool is not None:
                self.offload_pool.close()

    @property
    def closed(self) -> bool:
        return self._closed
