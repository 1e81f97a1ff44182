"""Entry points: ``generate_batch``, ``init_continuous_batching``, ``continuous_batching_context_manager``, ``attach``.

They follow transformers' ``ContinuousMixin`` methods of the same names, as functions that take the
model first; ``attach(model)`` binds them on a model so that code written for
``model.generate_batch(...)`` (TRL's ``use_transformers_continuous_batching`` among it) runs on rollout.
Where the behaviour differs on purpose, docs/api.md ("API compatibility") says how.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from rollout.checks import check_bool, check_int, token_ids
from rollout.config import ContinuousBatchingConfig, resolve_continuous_batching_config, workload_tokens_hint
from rollout.engine import Engine
from rollout.lora import LoraAdapter
from rollout.manager.intake import derive_seeds
from rollout.manager.manager import ContinuousBatchingManager
from rollout.manager.persistence import persistent_manager_of
from rollout.requests import GenerationOutput, Request, RequestStatus
from rollout.sampling_params import SamplingParams, build_sampling_params, resolve_generation_config
from rollout.structured_outputs import StructuredOutputs
from rollout.weights.model_info import check_model_supported, vocab_size

logger = logging.getLogger(__name__)


def generate_batch(
    model: PreTrainedModel,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: Any = None,
    tokenizer: Any | None = None,
    lora: LoraAdapter | str | None = None,
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate completions for a batch of prompts with continuous batching.

    Every prompt is checked before any generation starts. Without a persistent manager the batch
    runs on a fresh engine sized for it, and the model's attention implementation is restored when
    this returns or raises (unless another engine or manager still uses the model). When the model
    has a persistent manager (``persistent_manager=True`` here or in
    ``continuous_batching_context_manager``, or ``stop(keep_for_next_session=True)``), the batch
    runs on it instead, and it is left as it was found (stopped or running).

    Args:
        model: a ``transformers`` decoder-only causal LM (fp32, fp16 or bf16; CPU or CUDA).
        inputs: prompts, each a non-empty list of token ids.
        generation_config: max_new_tokens (default 20), do_sample, temperature, top_k,
            top_p, eos_token_id (int or list; default the model's), num_return_sequences
            (G samples per prompt, which share the prompt's KV blocks), and the logits
            processors and stop strings of ``SamplingParams``. Values the caller does not set
            come from ``model.generation_config``.
        continuous_batching_config: engine configuration, rollout's or transformers' (converted);
            None takes the one the generation config carries (deprecated) or the defaults.
            With ``seed`` set, sample k (in output order) uses its own random stream seeded
            ``seed + k``, so the batch is reproducible, on a fresh engine or a persistent manager.
            Ignored, but for ``seed``, when a persistent manager already exists.
        record_timestamps: record a ``time.perf_counter()`` timestamp per generated token.
        progress_bar: show a tqdm bar of finished requests and tokens/s.
        persistent_manager: keep a manager on the model for the next calls: when the model has
            none, one is built with these configs (its cache sized from free memory, not for this
            batch alone), used, stopped with its cache kept and registered on the model.
        warmup: compile (and on CUDA capture) the step shapes before the first request when a path
            is compiled or CUDA-graphed (``default_compile_level``, ``varlen_compile_config``,
            ``decode_compile_config``, the generation config's ``compile_config``,
            ``use_cuda_graph``; see ``Engine.warmup``), with a progress bar when ``progress_bar``;
            nothing to do otherwise. Outputs are the same with or without it.
        workload_hints: transformers' ``WorkloadHints``; checked, otherwise unused here: a fresh
            engine is sized from the batch itself, and a persistent manager built here from free
            memory, since it serves later batches too.
        tokenizer: the model's tokenizer, needed for ``stop_strings`` (as ``model.generate``'s
            ``tokenizer=``). A persistent manager keeps the tokenizer it was built with, or takes
            this one if it has none.
        lora: run every prompt under this LoRA adapter, served unmerged (``rollout.lora``): a ``LoraAdapter`` is
            loaded first (a fresh engine turns ``enable_lora`` on, its ``max_lora_rank`` at least the adapter's; a
            persistent manager loads it unless an adapter of that name is loaded); a name selects an adapter the
            persistent manager has loaded. None: the base model.
        structured_outputs: what every output must match (``StructuredOutputs``, or a dict of its fields such as
            ``{"json": schema}``; each sample gets its own matcher); needs ``tokenizer`` (or a persistent manager's).
            Checked and compiled before any generation starts.
        **kwargs: none is accepted: a TypeError names them. (transformers quietly reads
            ``max_new_tokens`` from here and drops anything else; set it in the generation config.)

    Tensor parallelism: on a model loaded with a ``tp_plan`` under ``torchrun``, every rank calls this
    with the same arguments; the driver's (TP rank 0) requests run on every rank, and only the driver
    returns them: every other rank returns an empty dict, as in transformers.

    Returns:
        request id -> GenerationOutput, in input order; with G > 1 the ids are
        ``req_{i}_{g}`` and the G samples of prompt i follow each other, else ``req_{i}``. An empty
        dict on a tensor-parallel rank other than the driver.

    Raises:
        ValueError: inputs that are not a list of token-id lists, an empty prompt, a token id
            outside the vocabulary, max_new_tokens < 1, num_return_sequences < 1, a non-finite
            temperature, a bad workload hint, a request that can never fit the cache, stop strings
            without a tokenizer, or a logits processor rollout lacks with
            ``drop_unsupported_processors=False``.
        TypeError: an unexpected keyword argument, or a continuous_batching_config of another type.
        UnsupportedModelError: the model is not a decoder-only LM with pageable attention.
        RuntimeError: called on a persistent manager from inside this thread's ``manager.pause()``.
    """
    if kwargs:
        raise TypeError(
            f"generate_batch got unexpected keyword arguments {sorted(kwargs)}; sampling values (max_new_tokens "
            "included) go in generation_config=GenerationConfig(...), engine values in continuous_batching_config"
        )
    check_bool("persistent_manager", persistent_manager)
    check_bool("record_timestamps", record_timestamps)
    check_bool("warmup", warmup)
    workload_tokens_hint(workload_hints)  # checked only: see the docstring
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence) and not hasattr(inputs, "tolist"):
        raise ValueError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    if hasattr(inputs, "tolist") and not isinstance(inputs, (list, tuple)):
        inputs = inputs.tolist()
    if len(inputs) and all(isinstance(t, int) for t in inputs):
        raise ValueError("inputs must be a list of prompts, each a list of token ids; got one flat list of ints")
    if not inputs:
        return {}
    if lora is not None and not isinstance(lora, (str, LoraAdapter)):
        raise TypeError(f"lora must be a LoraAdapter, an adapter's name or None, got {type(lora).__name__}")
    lora_name = lora.name if isinstance(lora, LoraAdapter) else lora
    gc = resolve_generation_config(model, generation_config)
    num_samples = gc.num_return_sequences if gc.num_return_sequences is not None else 1
    check_int("num_return_sequences", num_samples, minimum=1)
    vocab = vocab_size(model)
    prompts = [token_ids(p, f"inputs[{i}]", vocab) for i, p in enumerate(inputs)]
    manager = persistent_manager_of(model)
    if manager is None and persistent_manager:
        cb_config = resolve_continuous_batching_config(continuous_batching_config, gc)
        manager = ContinuousBatchingManager(model, generation_config, cb_config, tokenizer=tokenizer)
        manager.persist()
    if manager is not None:
        if tokenizer is not None:
            manager.adopt_tokenizer(tokenizer)
        if warmup:
            manager.warmup(progress_bar)
        drop = manager.cb_config.drop_unsupported_processors
        base_params = build_sampling_params(
            gc,
            vocab_size=vocab,
            drop_unsupported_processors=drop,
            lora=lora_name,
            structured_outputs=structured_outputs,
        )
        if isinstance(lora, LoraAdapter) and lora.name not in manager.lora_adapters:
            manager.load_lora(lora)
        seed = manager.cb_config.seed
        if continuous_batching_config is not None:
            call_seed = resolve_continuous_batching_config(continuous_batching_config, gc).seed
            seed = call_seed if call_seed is not None else seed
        return _generate_on_manager(manager, prompts, base_params, num_samples, seed, progress_bar, record_timestamps)
    cb_config = resolve_continuous_batching_config(continuous_batching_config, gc)
    if isinstance(lora, str):
        raise ValueError(f"lora={lora!r}: a fresh engine has no adapter loaded; pass the LoraAdapter itself")
    if lora is not None:
        rank = max(cb_config.max_lora_rank, lora.rank)
        cb_config = dataclasses.replace(cb_config, enable_lora=True, max_lora_rank=rank)
    drop = cb_config.drop_unsupported_processors
    base_params = build_sampling_params(
        gc, vocab_size=vocab, drop_unsupported_processors=drop, lora=lora_name, structured_outputs=structured_outputs
    )
    expanded = [p for p in prompts for _ in range(num_samples)]  # the G samples of a prompt next to each other
    seeds = derive_seeds(cb_config.seed if base_params.do_sample else None, len(expanded))
    jobs: list[tuple[str, list[int], SamplingParams]] = [
        (rid, prompt, base_params if seed is None else build_sampling_params(base_params, seed=seed))
        for rid, prompt, seed in zip(_output_ids(len(prompts), num_samples), expanded, seeds)
    ]
    hint = [len(prompt) + p.max_new_tokens for _, prompt, p in jobs]
    engine = Engine(
        model, cb_config, max_tokens_hint=hint, tokenizer=tokenizer, fallback_compile_config=gc.compile_config
    )
    try:
        if isinstance(lora, LoraAdapter):
            engine.load_lora(lora)
        # A request that can never fit raises here, before any step; the engine is closed and nothing is returned.
        for rid, prompt, params in jobs:
            engine.gate.check(rid, len(prompt), params)
        if warmup:
            engine.warmup(progress_bar)
        jobs = engine.from_driver(jobs)  # tensor parallelism: every rank runs the driver's requests
        requests = [Request(rid, prompt, params, record_timestamps) for rid, prompt, params in jobs]
        for req in requests:
            engine.enqueue(req)
        show = progress_bar and engine.is_driver
        bar = tqdm(total=len(requests), desc="generate_batch", unit="req", disable=not show)
        t0 = time.perf_counter()
        try:
            while engine.has_unfinished():
                updated = engine.step()
                done_now = sum(1 for r in updated if r.status == RequestStatus.FINISHED)
                if done_now:
                    bar.update(done_now)
                if show:
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(tok_s=f"{engine.stats.num_generated_tokens / elapsed:.1f}", refresh=False)
        finally:
            bar.close()
        if not engine.is_driver:
            return {}
        return {req.request_id: req.to_output() for req in requests}
    finally:
        engine.close()


def _output_ids(num_prompts: int, num_samples: int) -> list[str]:
    """Output keys in input order: ``req_{i}``, or ``req_{i}_{g}`` with several samples per prompt."""
    if num_samples == 1:
        return [f"req_{i}" for i in range(num_prompts)]
    return [f"req_{i}_{g}" for i in range(num_prompts) for g in range(num_samples)]


def _generate_on_manager(
    manager: ContinuousBatchingManager,
    prompts: list[list[int]],
    params: SamplingParams,
    num_samples: int,
    seed: int | None,
    progress_bar: bool,
    record_timestamps: bool,
) -> dict[str, GenerationOutput]:
    """Run a batch on a persistent manager; keys, order and seeds as on a fresh engine.

    The sampling parameters go to the manager whole; with a seed, sample k (output order) gets
    ``seed + k``, as ``generate_batch`` on a fresh engine does. On a tensor-parallel rank other than the
    driver nothing is queued or read: its loop runs the driver's requests, and its ``stop`` (when this
    call started the manager) returns once the driver's has, after the batch.
    """
    if manager.holds_pause():
        raise RuntimeError(
            "generate_batch on the model's persistent manager from inside this thread's manager.pause() would wait "
            "for the generation loop, which waits for the pause to end; leave the pause first"
        )
    keys = _output_ids(len(prompts), num_samples)
    expanded = [p for p in prompts for _ in range(num_samples)]
    seeds = seed if seed is not None and params.do_sample else None
    was_running = manager.is_running()
    if not was_running:
        manager.start()
    try:
        ids = manager.add_requests(expanded, sampling_params=params, seed=seeds, record_timestamps=record_timestamps)
        if not manager.engine.is_driver:
            return {}
        results: dict[str, GenerationOutput] = {}
        for key, rid in tqdm(list(zip(keys, ids)), desc="generate_batch", unit="req", disable=not progress_bar):
            out = manager.get_result(rid)
            if out is None:
                raise RuntimeError(f"the persistent manager ended before request {key} finished")
            out.request_id = key  # the manager's own ids are unique across calls; the caller gets req_{i}
            results[key] = out
        return results
    finally:
        if not was_running:
            manager.stop(keep_for_next_session=True)


def init_continuous_batching(
    model: PreTrainedModel,
    generation_config: GenerationConfig | SamplingParams | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    workload_hints: Any = None,
    tokenizer: Any | None = None,
) -> ContinuousBatchingManager:
    """The model's persistent manager if it has one, else a new manager (not started: call ``start()``).

    As in transformers, a persistent manager (kept by ``stop(keep_for_next_session=True)`` or a
    ``persistent_manager=True`` call) is returned as it is, and the configs given here are ignored;
    ``destroy()`` it to build a new one.

    Args:
        model: the model.
        generation_config, continuous_batching_config, workload_hints: as for
            ``ContinuousBatchingManager``.
        tokenizer: for requests with stop strings (see ``ContinuousBatchingManager``); a
            persistent manager without one takes it.

    Raises:
        UnsupportedModelError: the model cannot be paged.
        ValueError, TypeError: a bad config value or type (see ``ContinuousBatchingManager``).
    """
    manager = persistent_manager_of(model)
    if manager is not None:
        logger.info("init_continuous_batching: reusing the model's persistent manager (its configs are kept)")
        if tokenizer is not None:
            manager.adopt_tokenizer(tokenizer)
        return manager
    return ContinuousBatchingManager(
        model, generation_config, continuous_batching_config, workload_hints, tokenizer=tokenizer
    )


@contextlib.contextmanager
def continuous_batching_context_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig | SamplingParams | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    persistent_manager: bool = False,
    block: bool = True,
    timeout: float | None = None,
    warmup: bool = True,
    workload_hints: Any = None,
    tokenizer: Any | None = None,
) -> Iterator[ContinuousBatchingManager]:
    """Run a started manager for the duration of a ``with`` block.

    The manager comes from ``init_continuous_batching`` (the model's persistent manager when it
    has one). On exit it is stopped (finishing its requests) and destroyed, unless
    ``persistent_manager`` is True: then it is registered on the model from the start, stopped
    with its cache kept on exit, and the next call with the same model (and ``generate_batch``)
    reuses it; the configs of that next call are then ignored.

    Args:
        model: the model.
        generation_config, continuous_batching_config, workload_hints: as for the manager.
        persistent_manager: keep the manager for the next call.
        block, timeout: how ``stop`` waits on exit.
        warmup: call ``manager.warmup()`` before starting it (compiles and captures the step shapes
            when a path is compiled or CUDA-graphed; nothing to do otherwise).
        tokenizer: for requests with stop strings, as for the manager.
    """
    manager = init_continuous_batching(
        model, generation_config, continuous_batching_config, workload_hints, tokenizer=tokenizer
    )
    if persistent_manager:  # generate_batch inside the block already runs on it
        manager.persist()
    if warmup:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        if persistent_manager:
            manager.stop(block=block, timeout=timeout, keep_for_next_session=True)
        else:
            manager.stop(block=block, timeout=timeout)
            manager.destroy()


# ------------------------------------------------------------------ drop-in for transformers code
def attach(model: PreTrainedModel) -> PreTrainedModel:
    """Make ``model.generate_batch`` and its siblings run on rollout, with transformers' signatures.

    Binds, on this model object only (other instances of its class are untouched):
    ``generate_batch``, ``init_continuous_batching``, ``continuous_batching_context_manager`` and
    ``destroy_cached_continuous_batching_manager``. Code written for transformers' continuous
    batching, TRL's ``GRPOTrainer(..., args=GRPOConfig(use_transformers_continuous_batching=True))``
    among it, then runs on rollout's engine unchanged. Idempotent; a deep copy of the model is
    attached too (its methods are bound to the copy).

    Args:
        model: a ``transformers`` decoder-only causal LM.

    Returns:
        The same model object.

    Raises:
        UnsupportedModelError: the model cannot run on the paged engine (checked now, not at the
            first call).
    """
    check_model_supported(model)
    model.generate_batch = types.MethodType(generate_batch, model)
    model.init_continuous_batching = types.MethodType(init_continuous_batching, model)
    model.continuous_batching_context_manager = types.MethodType(_attached_context_manager, model)
    model.destroy_cached_continuous_batching_manager = types.MethodType(_destroy_persistent_manager, model)
    return model


def is_attached(model: PreTrainedModel) -> bool:
    """True when ``attach`` bound rollout's entry points on this model object."""
    bound = model.__dict__.get("generate_batch")
    return isinstance(bound, types.MethodType) and bound.__func__ is generate_batch


@contextlib.contextmanager
def _attached_context_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: Any = None,
    tokenizer: Any | None = None,
) -> Iterator[ContinuousBatchingManager]:
    # transformers' positional order (block and timeout before continuous_batching_config).
    with continuous_batching_context_manager(
        model,
        generation_config,
        continuous_batching_config,
        persistent_manager=persistent_manager,
        block=block,
        timeout=timeout,
        warmup=warmup,
        workload_hints=workload_hints,
        tokenizer=tokenizer,
    ) as manager:
        yield manager


def _destroy_persistent_manager(model: PreTrainedModel) -> None:
    """transformers' ``destroy_cached_continuous_batching_manager``: destroy the model's persistent manager, if any."""
    manager = persistent_manager_of(model)
    if manager is not None:
        manager.destroy()
