"""The persistent manager: a background thread that runs engine steps for a trainer's whole run.

Threads that add, cancel or read requests (the manager's request methods, from its base class ``RequestAPI``,
``request_api.py``) never touch the engine: they put commands in an inbox (``intake.py``, each request checked once in
the caller's thread, outside the lock) that the loop (``loop.GenerationLoop``, in the manager's thread) drains between
steps, and read results from the per-request handles of an ``OutputRouter`` (``outputs.py``). One condition variable
guards the inbox, the handles, the pause (``pausing.py``) and the lifecycle (``lifecycle.py``: state, stop flags, the
loop's thread).

``pause()`` is the trainer's window on the model: the loop finishes its step and waits while the caller trains the
same model object; on exit the loop resumes with the KV cache and every in-flight request kept. ``update_weights``
copies new tensors in place under a pause and bumps the weight version, which each generated token records and
prefix-cache hashes include; it, the LoRA adapters and the prefix-cache reset are the manager's ``WeightUpdates``
(``weight_updates.py``). In-flight requests keep their KV by default (PipelineRL); ``recompute=True`` re-prefills them
(AReaL). Weights changed without ``update_weights`` are noticed by the model's ``WeightWatch``
(``rollout.weights.versions``): from their contents when a pause ends and at start, from a cheap fingerprint when
requests are added. The version is the model object's, shared with every manager and engine on it; a pause holds
every manager on the model. A manager kept for the next session is its model's persistent manager
(``persistence.py``).

Under tensor parallelism every rank runs a manager and calls it the same way; the loop is
``loop.TensorParallelLoop``, and only the driver's (TP rank 0) ``add_request`` queues and returns an id.

A thread inside its own ``pause()`` cannot wait for the loop: ``stop``, ``destroy`` and the calls that would wait for
ever (``get_result``, ``request_id_iter``, ``join`` without a timeout, ``add_request(block=True)`` on a full queue)
raise ``RuntimeError`` there instead of hanging, as transformers' ``stop`` does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from rollout.config import ContinuousBatchingConfig, resolve_continuous_batching_config, workload_tokens_hint
from rollout.engine import Engine, EngineStats
from rollout.lora import LoraAdapter
from rollout.manager.intake import Inbox, QueueFullError, derive_seeds
from rollout.manager.lifecycle import Lifecycle, State
from rollout.manager.loop import GenerationLoop, TensorParallelLoop
from rollout.manager.outputs import OutputRouter
from rollout.manager.pausing import PauseGate
from rollout.manager.persistence import persistent_manager_of, register_persistent, unregister_persistent
from rollout.manager.request_api import RequestAPI
from rollout.manager.weight_updates import WeightUpdates
from rollout.sampling_params import SamplingParams, build_sampling_params, resolve_generation_config
from rollout.stop_strings import check_tokenizer
from rollout.weights.model_info import vocab_size
from rollout.weights.versions import NamedTensors, watch_of

# derive_seeds (intake.py) and persistent_manager_of (persistence.py) stay importable from here.
__all__ = ["ContinuousBatchingManager", "QueueFullError", "derive_seeds", "persistent_manager_of"]

logger = logging.getLogger(__name__)


class ContinuousBatchingManager(RequestAPI):
    """Runs a continuous-batching engine in a background thread.

    The request methods (``add_request``, ``add_requests``, ``add_scoring_requests``, ``cancel_request``,
    ``get_result``, iteration, ``request_id_iter``, ``register_result_handler``, ``default_params``) are those of its
    base class, ``RequestAPI`` (``request_api.py``); the weight and adapter methods run on its ``WeightUpdates``
    (``weight_updates.py``). This class builds the parts and owns the engine, the lifecycle and the pause.

    Args:
        model: a ``transformers`` decoder-only causal LM, shared with the trainer (never copied). Its attention is
            switched to rollout's paged dispatcher while the manager lives; forwards without engine metadata are
            unchanged.
        generation_config: default sampling values of requests (max_new_tokens, do_sample, temperature, top_k, top_p,
            eos_token_id, the logits processors and stop strings of ``SamplingParams``); per-request arguments of
            ``add_request`` override them. A ``GenerationConfig`` is completed by the model's ``generation_config``
            (transformers' rule: a field left None takes the model's value, so a checkpoint's ``top_k 20`` applies). A
            ``SamplingParams`` is taken as it is, the model's config unread (what a trainer passes).
        continuous_batching_config: engine configuration: rollout's, or a ``transformers.ContinuousBatchingConfig``
            (converted, see ``ContinuousBatchingConfig.from_transformers``); None takes the one the generation config
            carries (deprecated, with a warning) or the defaults.
        workload_hints: transformers' ``WorkloadHints`` (max_prompt_length, max_generated_length, num_requests): when
            ``num_blocks`` is unset, the cache is no larger than what holds that workload at once, memory permitting.
        tokenizer: the model's tokenizer, needed by requests with stop strings (``stop_strings``, ``stop``) to read the
            text of their tokens.

    Raises:
        UnsupportedModelError: the model cannot be paged.
        ValueError: a sampling value of the generation config, or a workload hint, is out of range; the generation
            config has stop strings and there is no tokenizer, or asks for a logits processor rollout lacks with
            ``drop_unsupported_processors=False``.
        TypeError: ``continuous_batching_config`` is neither config class.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | SamplingParams | None = None,
        continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
        workload_hints: Any = None,
        tokenizer: object | None = None,
    ) -> None:
        self.model = model
        exact = generation_config if isinstance(generation_config, SamplingParams) else None
        # With exact parameters the model's generation config gives no sampling value (nor a nested
        # engine or compile config): the transformers defaults stand in for it.
        self.generation_config = (
            GenerationConfig() if exact is not None else resolve_generation_config(model, generation_config)
        )
        self.cb_config = resolve_continuous_batching_config(continuous_batching_config, self.generation_config)
        vocab = vocab_size(model)
        defaults = build_sampling_params(
            exact if exact is not None else self.generation_config,
            vocab_size=vocab,
            drop_unsupported_processors=self.cb_config.drop_unsupported_processors,
        )
        check_tokenizer(defaults.stop_strings, defaults.stop, tokenizer)
        self.tokenizer = tokenizer
        self._tokens_hint = workload_tokens_hint(workload_hints)
        self._fallback_compile_config = self.generation_config.compile_config
        engine = self._new_engine()
        self._warmup_wanted = False  # warmup() was called: an engine rebuilt by start() is warmed too
        cond = threading.Condition()
        life = Lifecycle(cond)  # state, stop flags, the loop's thread and error
        pausing = PauseGate(cond)  # pause holders, the in-step flag
        outputs = OutputRouter(cond, producing=life.producing)
        inbox = Inbox(cond, outputs, self.cb_config.max_queue_size, self._num_waiting_in_engine)
        # The model's weight version and record, shared with every engine and manager on the model; a pause of this
        # manager holds the pause gates of all of them (WeightWatch.hold_all).
        self._updates = WeightUpdates(
            watch_of(model), pausing, cond, inbox, lambda: self._engine, engine.tp, self.cb_config.check_weight_contents
        )
        super().__init__(
            defaults,
            self.cb_config.per_request_processors,
            vocab,
            engine=engine,
            cond=cond,
            inbox=inbox,
            outputs=outputs,
            life=life,
            pausing=pausing,
            tp=engine.tp,
            sync_weight_version=self._updates.sync,
        )
        # A tensor-parallel model: every rank's loop runs the driver's decisions in lockstep (loop.TensorParallelLoop).
        loop_class = GenerationLoop if self._tp is None else TensorParallelLoop
        self._loop = loop_class(
            cond, inbox, outputs, pausing, life, self._updates.watch, self.cb_config.check_weight_contents
        )
        self.final_stats: EngineStats | None = None  # the engine's statistics, set by destroy()

    def _new_engine(self) -> Engine:
        return Engine(
            self.model,
            self.cb_config,
            max_tokens_hint=self._tokens_hint,
            tokenizer=self.tokenizer,
            fallback_compile_config=self._fallback_compile_config,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the background loop (again, after ``stop()``); a no-op while it runs.

        Weights changed since the manager last looked (see ``update_weights``) bump the weight version first, so a kept
        prefix cache is not served under new weights.

        Raises:
            RuntimeError: the manager was destroyed or failed.
        """
        with self._cond:
            self._life.check_startable()
        if not self._life.wait_for_stopping_loop():  # a stop(block=False) still finishing ends first
            return
        with self._cond:
            if self._engine is None or self._engine.closed:
                version = self._engine.weight_version if self._engine is not None else 0
                self._engine = self._new_engine()
                self._updates.restore(self._engine, version)
                if self._warmup_wanted:
                    self._engine.warmup()
            self._updates.check(self._engine)
            self._loop.weights_checked()
            self._life.launch(functools.partial(self._loop.run, self._engine))

    def is_running(self) -> bool:
        """True while the background loop runs."""
        return self._life.is_running()

    @property
    def state(self) -> str:
        """The manager's state: ``created``, ``running``, ``stopped``, ``failed`` or ``destroyed``."""
        return self._life.state.value

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> bool:
        """Wait for the loop to end; True if it has.

        Args:
            stop_trigger_time: ``time.perf_counter()`` when the stop was asked (transformers' argument): the time the
                loop took to end is logged from it. Optional.
            timeout: most seconds to wait; None waits until the loop ends.

        Raises:
            RuntimeError: called without a timeout from inside this thread's ``pause()`` while the loop runs (it could
                never end).
        """
        if timeout is None and self._life.is_running():
            self._pausing.refuse_if_held("join()")
        return self._life.join(timeout, stop_trigger_time)

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop the loop.

        Args:
            block: wait for the loop to end (up to ``timeout`` seconds).
            timeout: seconds to wait when blocking; None waits for ever.
            keep_for_next_session: keep the engine and its KV cache (prefix cache included) for the next ``start()``,
                and leave the manager on the model: ``init_continuous_batching``,
                ``continuous_batching_context_manager`` and ``generate_batch`` on that model then reuse it, until
                ``destroy()``. Otherwise the engine is closed (the model's original attention restored when no other
                engine uses the model) once the loop has ended.
            hard_stop: end waiting and running requests at once, status FAILED with a RuntimeError in ``error`` and
                their partial tokens kept. Otherwise they are finished first.

        Raises:
            RuntimeError: called from inside this thread's ``pause()`` (the loop could never end; transformers raises
                the same).
        """
        if self._life.state == State.DESTROYED:
            return
        self._pausing.refuse_if_held("stop()")
        trigger = time.perf_counter()
        with self._cond:
            self._life.request_stop(hard_stop, keep_for_next_session)
        if keep_for_next_session:
            self.persist()
        if block:
            self.join(trigger, timeout)

    def destroy(self) -> None:
        """Stop the loop the default way, free the cache and release the model's attention. Idempotent.

        A running manager is first stopped as ``stop()`` does: its pending requests finish (call
        ``stop(hard_stop=True)`` first to fail them instead). Requests that can no longer run (queued on a manager never
        started) end FAILED. The manager cannot start again afterwards, and it is no longer its model's persistent
        manager.

        Raises:
            RuntimeError: called from inside this thread's ``pause()`` (see ``stop``).
        """
        if self._life.state == State.DESTROYED:
            return
        self._pausing.refuse_if_held("destroy()")
        if self.is_running():
            self.stop(block=True)
        with self._cond:
            self._life.destroy()
            engine, self._engine = self._engine, None
            message = "RuntimeError: the manager was destroyed before the request ran"
            self._inbox.fail_all(message)
            self._outputs.fail_pending(message)
        self._updates.release(engine)  # the engine's weight version stays the manager's
        if engine is not None:
            self.final_stats = engine.stats
            engine.close()
        unregister_persistent(self)

    def adopt_tokenizer(self, tokenizer: object) -> None:
        """Take ``tokenizer`` for stop strings if the manager was built without one; else keep its own."""
        with self._cond:
            if self.tokenizer is None:
                self.tokenizer = tokenizer
                if self._engine is not None:
                    self._engine.tokenizer = tokenizer

    def warmup(self, progress_bar: bool = True) -> None:
        """Compile (and on CUDA capture) the engine's step shapes before the first request.

        See ``Engine.warmup``: a no-op (logged at debug) when no path is compiled or CUDA-graphed, and when the engine
        is already warmed up; the requests, the KV cache, the prefix cache, the random generators and the request
        counters are left as they were. On a running manager the loop is paused around it (the warmup waits for the
        current step). An engine the manager builds again later (``start()`` after a ``stop()`` that closed it) is
        warmed up too.

        Args:
            progress_bar: show a tqdm bar over the shapes.

        Raises:
            RuntimeError: the manager was destroyed.
        """
        engine = self.engine
        self._warmup_wanted = True
        if engine.warmed_up or not engine.warmup_plan():
            engine.warmup(progress_bar)  # nothing to run: a no-op logged at debug, no pause needed
            return
        if self.is_running():
            with self.pause():
                engine.warmup(progress_bar)
        else:
            engine.warmup(progress_bar)

    def persist(self) -> None:
        """Register as the model's persistent manager until ``destroy()``.

        ``init_continuous_batching(model)``, ``continuous_batching_context_manager(model, ...)`` and
        ``generate_batch(model, ...)`` then run on this manager.
        """
        register_persistent(self)

    def holds_pause(self) -> bool:
        """True when the calling thread is inside this manager's ``pause()``."""
        return self._pausing.held_here()

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _num_waiting_in_engine(self) -> int:
        return len(self._engine.scheduler.waiting) if self._engine is not None else 0

    # ------------------------------------------------------------------ properties
    @property
    def weight_version(self) -> int:
        """The model's weight version: the number of weight changes recorded so far on the model, through this manager
        or any other manager or engine on the same model object (the engine's, kept after ``destroy()``; under tensor
        parallelism, the driver's as this rank's engine adopted it)."""
        return self._updates.version

    @property
    def error(self) -> BaseException | None:
        """What the loop raised once the manager is ``failed``; None otherwise."""
        return self._life.error

    @property
    def continuous_batching_config(self) -> ContinuousBatchingConfig:
        """The engine configuration (transformers' attribute name; the same object as ``cb_config``)."""
        return self.cb_config

    @property
    def engine(self) -> Engine:
        """The engine (for statistics; do not step it while the loop runs)."""
        if self._engine is None:
            raise RuntimeError("this manager was destroyed")
        return self._engine

    # ------------------------------------------------------------------ pause and weights
    def pause(self) -> contextlib.AbstractContextManager[None]:
        """Hold the model: the loop finishes its current step and waits until every holder leaves.

        The loop of every other manager on the same model object is held too (``WeightWatch.hold_all``): the caller
        has the model to itself. Re-entrant, and several threads may hold it at once. Returns within one engine step
        of each loop. The KV cache and in-flight requests are kept (see ``PauseGate.hold``). When the last holder
        leaves, each loop decides whether the weights changed (from their contents, unless ``check_weight_contents``
        is off: ``WeightWatch.record``), however they were written; a change is a new weight version of the
        model (as ``update_weights`` makes): packed copies of the old weights are dropped, tokens sampled from then on
        record it, and no request reuses prefix-cache blocks of older versions. Under tensor parallelism the pause is
        collective, as in transformers: every rank must enter it (the same number of times); no rank steps until every
        rank has entered and left its own.
        """
        return self._updates.pause()

    def update_weights(
        self, named_tensors: NamedTensors | None = None, *, recompute: bool = False, version: int | None = None
    ) -> int:
        """Copy new weights into the model in place and bump the model's weight version.

        Under ``pause()``: every manager on the model is held while the tensors are copied, and every engine on the
        model adopts the new version before its next step (one weight version per model object); with ``recompute``,
        each re-prefills its in-flight requests then.

        Args:
            named_tensors: a state dict or (name, tensor) pairs, names as in ``model.named_parameters()`` (buffers too).
                None only records that the caller changed the weights itself under ``pause()``.
            recompute: re-prefill in-flight requests (of every engine on the model) under the new weights instead of
                keeping their KV.
            version: the new weight version, above the current one (a server that rejoins a fleet takes the fleet's
                number, ``RolloutPool``); None: the current one + 1.

        Under tensor parallelism every rank calls it with the same full tensors (each rank keeps its
        own shard of each, see ``rollout.weights.versions.copy_weights``); the loops step again once every rank's update
        is done, and the driver's weight version and ``recompute`` are every rank's.

        Returns:
            The new weight version.

        Raises:
            KeyError: an unknown name; ValueError: a shape or dtype mismatch, or ``version`` not above the current
                version; TypeError: a value that is not a tensor. All are raised before anything is copied.
            RuntimeError: the manager was destroyed.
        """
        return self._updates.update_weights(named_tensors, recompute, version)

    def load_lora(self, adapter: LoraAdapter, replace: bool = False) -> int:
        """Load a LoRA adapter (``LoraAdapter.from_peft_dir`` / ``from_tensors``) under a pause; requests select it by
        name (``add_request(..., lora=name)``). Its tensors are copied: changing the adapter's tensors afterwards
        changes nothing served. The load is a new weight version (bumped as by ``update_weights``), which the adapter's
        tokens record until it is unloaded, whatever is loaded after it; in-flight requests keep their own adapter, KV
        and version. The base weights are not touched.

        Args:
            adapter: the adapter.
            replace: an adapter loaded under the same name is replaced (vLLM's ``load_inplace``); requests accepted
                under the old one finish under it. The load is checked first: a refused one leaves the old loaded.

        Returns:
            The new weight version.

        Raises:
            FieldError (a ValueError) naming the field: the adapter cannot be loaded (its name is loaded and
                ``replace`` is off, its rank above ``max_lora_rank``, a target module the engine cannot adapt, tensors
                of another base model, ``max_loras`` taken); nothing changes. ValueError: ``enable_lora`` is off.
            RuntimeError: the manager was destroyed; or under tensor parallelism (not served there).
        """
        return self._updates.load_lora(adapter, replace)

    def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``: later requests cannot select it; requests already accepted under it (running or
        still queued) finish under it.

        Raises:
            KeyError: no adapter of that name is loaded; ValueError: ``enable_lora`` is off.
            RuntimeError: the manager was destroyed.
        """
        self._updates.unload_lora(name)

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters, in load order."""
        return self._updates.lora_adapters

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Forget every prefix-cache block: later requests compute their prompts again.

        Runs under a pause (at most one step's wait), so no step reads the hashes meanwhile.

        Args:
            reset_running_requests: also drop the KV of every unfinished request (vLLM's flag, which preempts them):
                each is re-prefilled, prompt and generated tokens, when the loop steps again, under the weights of
                that moment. vLLM's update flow (pause keep, this, new weights, resume) thus has in-flight requests
                recompute under the new weights. False: blocks held by running requests stay theirs; only the hashes
                that let other requests reuse them go.

        Raises:
            RuntimeError: the manager was destroyed.
        """
        self._updates.reset_prefix_cache(reset_running_requests)
