"""Public entry points: ``generate_batch``, ``init_continuous_batching``, ``continuous_batching_context_manager``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from .checks import check_int, token_ids
from .config import ContinuousBatchingConfig
from .engine import Engine
from .manager import ContinuousBatchingManager, persistent_manager_of
from .models import vocab_size
from .requests import GenerationOutput, Request, RequestStatus
from .sampling_params import SamplingParams, build_sampling_params, resolve_generation_config

# Arguments of transformers' generate_batch that have no meaning here and are accepted silently.
IGNORED_TRANSFORMERS_KWARGS = frozenset({"warmup", "persistent_manager"})


def generate_batch(
    model: PreTrainedModel,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = False,
    record_timestamps: bool = False,
    tokenizer: Any | None = None,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate completions for a batch of prompts with continuous batching.

    Every prompt is checked before any generation starts. The batch runs on a fresh
    engine; the model's attention implementation is restored when this returns or
    raises.

    Args:
        model: a ``transformers`` decoder-only causal LM (fp32, fp16 or bf16; CPU or CUDA).
        inputs: prompts, each a non-empty list of token ids.
        generation_config: max_new_tokens (default 20), do_sample, temperature, top_k,
            top_p, eos_token_id (int or list; default the model's), num_return_sequences
            (G samples per prompt, which share the prompt's KV blocks), and the logits
            processors and stop strings of ``SamplingParams``. Values the caller does not set
            come from ``model.generation_config``.
        continuous_batching_config: engine configuration. With ``seed`` set, sample k
            (in output order) uses its own generator seeded ``seed + k``, so the batch is
            reproducible.
        progress_bar: show a tqdm bar of finished requests and tokens/s.
        record_timestamps: record a ``time.perf_counter()`` timestamp per generated token.
        tokenizer: the model's tokenizer, needed for ``stop_strings`` (as ``model.generate``'s
            ``tokenizer=``). A persistent manager keeps the tokenizer it was built with, or takes
            this one if it has none.
        **kwargs: only transformers' ``warmup`` and ``persistent_manager`` (ignored), so
            that calls written for ``model.generate_batch`` run; anything else is a TypeError.

    Returns:
        request id -> GenerationOutput, in input order; with G > 1 the ids are
        ``req_{i}_{g}`` and the G samples of prompt i follow each other, else ``req_{i}``.

    Raises:
        ValueError: inputs that are not a list of token-id lists, an empty prompt, a token id
            outside the vocabulary, max_new_tokens < 1, num_return_sequences < 1, a non-finite
            temperature, a request that can never fit the cache, stop strings without a tokenizer,
            or a logits processor rollout lacks with ``drop_unsupported_processors=False``.
        TypeError: an unexpected keyword argument.
        UnsupportedModelError: the model is not a decoder-only LM with pageable attention.
    """
    unknown = set(kwargs) - IGNORED_TRANSFORMERS_KWARGS
    if unknown:
        raise TypeError(
            f"generate_batch got unexpected keyword arguments {sorted(unknown)}; sampling values go in "
            "generation_config=GenerationConfig(...), engine values in continuous_batching_config"
        )
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence) and not hasattr(inputs, "tolist"):
        raise ValueError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    if hasattr(inputs, "tolist") and not isinstance(inputs, (list, tuple)):
        inputs = inputs.tolist()
    if len(inputs) and all(isinstance(t, int) for t in inputs):
        raise ValueError("inputs must be a list of prompts, each a list of token ids; got one flat list of ints")
    if not inputs:
        return {}
    gc = resolve_generation_config(model, generation_config)
    num_samples = gc.num_return_sequences if gc.num_return_sequences is not None else 1
    check_int("num_return_sequences", num_samples, minimum=1)
    manager = persistent_manager_of(model)
    if manager is not None:  # the manager checks the prompts, at its own boundary
        if tokenizer is not None:
            manager.adopt_tokenizer(tokenizer)
        return _generate_on_manager(manager, inputs, gc, num_samples, progress_bar, record_timestamps)
    vocab = vocab_size(model)
    prompts = [token_ids(p, f"inputs[{i}]", vocab) for i, p in enumerate(inputs)]
    cb_config = continuous_batching_config or ContinuousBatchingConfig()
    base_params = build_sampling_params(
        gc, vocab_size=vocab, drop_unsupported_processors=cb_config.drop_unsupported_processors
    )
    jobs: list[tuple[str, list[int], SamplingParams]] = []
    ids = iter(_output_ids(len(prompts), num_samples))
    for prompt in prompts:
        for _ in range(num_samples):
            params = base_params
            if cb_config.seed is not None and base_params.do_sample:
                params = build_sampling_params(base_params, seed=cb_config.seed + len(jobs))
            jobs.append((next(ids), prompt, params))
    hint = [len(prompt) + p.max_new_tokens for _, prompt, p in jobs]
    engine = Engine(model, cb_config, max_tokens_hint=hint, tokenizer=tokenizer)
    try:
        # A request that can never fit raises here, before any step; the engine is closed and nothing is returned.
        for rid, prompt, params in jobs:
            engine.check_request(rid, len(prompt), params)
        requests = [Request(rid, prompt, params, record_timestamps) for rid, prompt, params in jobs]
        for req in requests:
            engine.enqueue(req)
        bar = tqdm(total=len(requests), desc="generate_batch", unit="req", disable=not progress_bar)
        t0 = time.perf_counter()
        try:
            while engine.has_unfinished():
                updated = engine.step()
                done_now = sum(1 for r in updated if r.status == RequestStatus.FINISHED)
                if done_now:
                    bar.update(done_now)
                if progress_bar:
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(tok_s=f"{engine.stats.num_generated_tokens / elapsed:.1f}", refresh=False)
        finally:
            bar.close()
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
    inputs: list[list[int]],
    gc: GenerationConfig,
    num_samples: int,
    progress_bar: bool,
    record_timestamps: bool,
) -> dict[str, GenerationOutput]:
    """Run a batch on a persistent manager; keys and order as on a fresh engine (``req_{i}``, ``req_{i}_{g}``).

    The sampling parameters go to the manager whole; it checks the prompts and the parameters.
    """
    params = build_sampling_params(gc, drop_unsupported_processors=manager.cb_config.drop_unsupported_processors)
    keys = _output_ids(len(inputs), num_samples)
    expanded = [p for p in inputs for _ in range(num_samples)]
    was_running = manager.is_running()
    if not was_running:
        manager.start()
    try:
        ids = manager.add_requests(expanded, sampling_params=params, record_timestamps=record_timestamps)
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
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    tokenizer: Any | None = None,
) -> ContinuousBatchingManager:
    """Build a manager for the model (not started: call ``start()``).

    ``tokenizer`` is needed by requests with stop strings (see ``ContinuousBatchingManager``).

    Raises:
        UnsupportedModelError: the model cannot be paged.
    """
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, tokenizer=tokenizer)


@contextlib.contextmanager
def continuous_batching_context_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
    block: bool = True,
    timeout: float | None = None,
    tokenizer: Any | None = None,
) -> Iterator[ContinuousBatchingManager]:
    """Run a started manager for the duration of a ``with`` block.

    On exit the manager is stopped (finishing its requests) and destroyed, unless
    ``persistent_manager`` is True: then it is stopped with its cache kept, stays
    attached to the model, and the next call with the same model (and
    ``generate_batch``) reuses it; the configs of that next call are then ignored.

    Args:
        model: the model.
        generation_config, continuous_batching_config: as for the manager.
        persistent_manager: keep the manager for the next call.
        block, timeout: how ``stop`` waits on exit.
        tokenizer: for requests with stop strings, as for the manager.
    """
    manager = persistent_manager_of(model)
    if manager is None:
        manager = init_continuous_batching(model, generation_config, continuous_batching_config, tokenizer)
    if persistent_manager:
        manager.persist()
    manager.start()
    try:
        yield manager
    finally:
        if persistent_manager:
            manager.stop(block=block, timeout=timeout, keep_for_next_session=True)
        else:
            manager.stop(block=block, timeout=timeout)
            manager.destroy()
