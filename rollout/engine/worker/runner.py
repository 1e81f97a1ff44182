"""The model runner: a scheduled step in, sampled tokens, logprobs and scores out.

``ModelRunner.execute`` does the device work of one step, as nano-vllm's and vLLM's runners do: the KV copies
of offload preemption and of copy-on-write, one flattened forward of the model through the paged cache, then
sampling (a forked request samples from its parent's logits row) and the logprobs of scoring requests. It reads
requests but changes none: ``Scheduler.update_from_output`` applies what it returns.

Host work is batched so that the device does not wait on Python: the step's inputs (``inputs``) are built
with numpy and reach the device in one copy through a pinned staging buffer, the sampler's per-row values in a
second, the random numbers of all sampled requests come from one vectorised draw (``sampler.step_uniforms``),
and the results come back in one device-to-host copy, the step's only host sync outside the forward (``readback``).

``execute`` is three phases, which async batching (``async_batching=True``) runs apart so that the host
prepares step k + 1 while step k's forward and sampling run:

- ``prepare_step``: the host work (inputs, exact or padded; sampling rows and random numbers) and the upload;
- ``launch``: the KV copies, the forward and the sampling. A step scheduled while the one before it runs
  holds placeholders for the tokens that step samples (``Request.num_output_placeholders``); ``launch``
  writes those tokens into its input ids on the device first (as vLLM v1's async scheduling does). On CPU a
  worker thread runs it (torch releases the GIL inside its kernels); on CUDA it is enqueued on the current
  stream, the inputs copied on a side stream into two staging buffer sets used in turn;
- ``collect``: waits for the launched step and reads its results back in one copy.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function
from transformers.generation import CompileConfig

from rollout.engine.kv.cache import PagedKVCache
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.engine.sample.sampler import TopLogprobs, sample_tokens, score_logprobs, step_uniforms
from rollout.engine.sched.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from rollout.engine.staging import HostStaging
from rollout.engine.worker.compile_cache import CompileCache
from rollout.engine.worker.forward import FORWARDS, PATHS, CompileCounter, CUDAGraphs, compiled_forward
from rollout.engine.worker.inputs import (
    LogitsPlan,
    PaddingRule,
    StepBatch,
    fits_decode_kernel,
    prepare_inputs,
    synthetic_batch,
)
from rollout.engine.worker.invariant import InvariantPacks, batch_invariant
from rollout.engine.worker.onednn import PackedWeights, linear_plan, packed_kernel, sibling_groups
from rollout.engine.worker.readback import StepResult, pack_results, read_back
from rollout.lora import LoraSlots
from rollout.requests import Request

# ``torch.profiler.record_function`` ranges the runner opens on the thread that runs them, so that a profile
# (``benchmarks.profile_step``) can tell the host work of a step from its model forward.
PREPARE_SCOPE = "rollout.prepare_step"  # the host work of ``prepare_step``: inputs, metadata, staged upload
FORWARD_SCOPE = "rollout.forward"  # the model's forward (eager, compiled or graph replay), logits rows kept


@dataclass
class PreparedStep:
    """A step's inputs, built on the host and staged on the device (``ModelRunner.prepare_step``).

    Attributes:
        scheduler_output: the step (not empty).
        batch: the step's inputs (``inputs.StepBatch``), exact or padded as its path runs.
        rows: the rows whose logits are kept, in order (the forward keeps ``batch.logits_rows``, these first).
        plan: which kept row is for what.
        sampled: the request of each sampled row: ``plan.sampled``, then each fork's child.
        uniform: float64 [len(sampled)], the number each sampled row draws its token with (see
            ``sampler.step_uniforms``); None when nothing is sampled.
        placeholders: int64 [2, P] on the device: row 0 the rows of ``batch.input_ids`` that hold a
            placeholder, row 1 the index of the token replacing each among the previous step's sampled
            tokens; None when every input token is known.
        staging_slot: the input staging buffer set holding the inputs.
    """

    scheduler_output: SchedulerOutput
    batch: StepBatch
    rows: list[int]
    plan: LogitsPlan
    sampled: list[Request]
    uniform: np.ndarray | None
    placeholders: torch.Tensor | None
    staging_slot: int


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were started (``ModelRunner.launch``); ``collect`` waits for it.

    Attributes:
        prepared: the step's inputs.
        future: the worker thread's computation (CPU), or the result computed in the calling thread already
            (the forward enqueued on CUDA).
    """

    prepared: PreparedStep
    future: Future[StepResult]

    def wait(self) -> StepResult:
        """The step's result, once computed (blocks on the worker thread); re-raises its error."""
        return self.future.result()


class ModelRunner:
    """Runs the model on a flattened variable-length batch through the paged cache, then samples.

    A step is one sequence of T scheduled tokens, ``input_ids`` [1, T] and ``position_ids`` [1, T] (each
    token's position in its own request); only the rows sampled or scored go through the LM head.

    A decode-only step (one token per request, each sampled) takes the "decode" path, every other step the
    "varlen" path. A path that is compiled or CUDA-graphed runs padded (``padding``), through its compiled
    forward and, on CUDA, a captured graph per padded shape; others keep the exact sizes. Sampling stays eager.

    Args:
        model: a ``transformers`` causal LM whose attention is the paged dispatcher.
        cache: the paged KV cache.
        use_flash: attention runs paged kernels with flash-attn's inputs (flash-attn's on CUDA, rollout's on CPU),
            not SDPA: the decode kernel for the steps that fit it (``prepare_step``), the varlen kernel otherwise.
        max_blocks_per_request: with ``use_flash``, the most blocks a request of a ``flash_attn_with_kvcache``
            step reads (``engine.spec.resolve_max_blocks_per_request``; 0: no step goes there).
        offload_pool: the CPU pool of offload preemption, or None.
        seed: seed of the generator of sampled requests that have no seed of their own; None: from the OS.
        logprobs_mode: "temperature", "raw" or "sampled" (see ``sample_tokens``).
        return_logprobs: return one logprob per sampled token.
        compile_configs: the (varlen, decode) compile configs; None runs that path uncompiled.
        cuda_graphs: (varlen, decode): replay that path's padded forward as CUDA graphs (CUDA only).
        padding: how static-shape steps are padded; needed when a path is compiled or graphed.
        async_batching: ``launch`` starts a step and returns: see the module docstring.
        lora: the engine's LoRA adapters (each query token runs under its request's: ``rollout.lora.LoraSlots``), or
            None.
        fused_layers: eager steps run ``fused_layer.fused_forward`` (the Llama family's fused CPU kernels).
        batch_invariant: every step's forward and sampling run inside ``invariant.batch_invariant`` with the
            runner's ``invariant_packs``, and the paged attention takes its batch-invariant kernel
            (``ContinuousBatchingConfig.batch_invariant``; the build refuses what this mode cannot run).
        regional: eager steps run the decoder layers' regions compiled (``regions``; the build installed them).
        compile_cache: where the forwards' new compilations are saved (``CompileCounter.cache``), or None.

    Raises:
        ValueError: a path is compiled or graphed without a padding rule, or graphed off CUDA.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedKVCache,
        use_flash: bool = False,
        offload_pool: CPUOffloadPool | None = None,
        seed: int | None = None,
        logprobs_mode: str = "temperature",
        return_logprobs: bool = False,
        max_blocks_per_request: int = 0,
        compile_configs: tuple[CompileConfig | None, CompileConfig | None] = (None, None),
        cuda_graphs: tuple[bool, bool] = (False, False),
        padding: PaddingRule | None = None,
        async_batching: bool = False,
        lora: LoraSlots | None = None,
        fused_layers: bool = False,
        batch_invariant: bool = False,
        regional: bool = False,
        compile_cache: CompileCache | None = None,
    ) -> None:
        self.model, self.regional = model, regional
        # ContinuousBatchingConfig.batch_invariant: every step's forward and sampling inside batch_invariant() (the
        # build refused what it cannot run: compiled or graphed paths, fused layers, LoRA, non-float32, off the CPU).
        self.batch_invariant = batch_invariant
        # Its packed copies of the linear weights, kept across steps (cleared by the engine at a new weight version).
        self.invariant_packs: InvariantPacks | None = InvariantPacks() if batch_invariant else None
        self.lora = lora
        self.fused_layers = fused_layers
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.sliding_windows = cache.layout.sliding_windows  # of each layer group, in group order
        self.use_flash = use_flash
        self.max_blocks_per_request = max_blocks_per_request
        self.num_decode_fast_path_steps = 0  # steps prepared for flash_attn_with_kvcache
        self.offload_pool = offload_pool
        self.logprobs_mode = logprobs_mode
        self.return_logprobs = return_logprobs
        self.generator = torch.Generator(device="cpu")
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        params = inspect.signature(model.forward).parameters
        self.supports_logits_to_keep = "logits_to_keep" in params
        # On CPU the step's float32 linear layers (eager and padded) run on their weights packed once (rollout's GEMM
        # on AVX-512, else oneDNN's blocked layout) where the copies fit in memory, else MKL (``onednn``: MKL and
        # oneDNN reorder a plain weight at every call).
        self.onednn, pack = (False, False) if batch_invariant else linear_plan(model, self.device)
        self.packs: PackedWeights | None = (
            PackedWeights(sibling_groups(model), kernel=packed_kernel(use_flash and self.device.type == "cpu"))
            if pack
            else None
        )
        # A prepared 4D mask: transformers builds no mask of its own (the paged attention masks each request).
        self._skip_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.async_batching = async_batching
        # Async batching: the row of each request (by id) among the sampled tokens of the step prepared last.
        self._sample_rows: dict[str, int] = {}
        self._worker: ThreadPoolExecutor | None = None
        if async_batching and self.device.type == "cuda":
            # Step k + 1's inputs are copied on a side stream while step k's forward reads its own set.
            copy_stream = torch.cuda.Stream(self.device)
            self._input_staging = HostStaging(self.device, num_buffers=2, copy_stream=copy_stream)
        else:
            self._input_staging = HostStaging(self.device)
            if async_batching:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-step")
        # The sampler's per-row values have a buffer of their own (each waits only for its own previous copy),
        # staged by ``launch`` after the forward, on the current stream.
        self._sampling_staging = HostStaging(self.device)
        self.padding = padding
        self._exact = PaddingRule.exact_rule(self.block_size)
        self.compile_configs = dict(zip(PATHS, compile_configs, strict=True))
        self.cuda_graph_paths = dict(zip(PATHS, cuda_graphs, strict=True))
        # Each path's forward (compiled or plain); the paths that run padded (compiled or graphed).
        configs = self.compile_configs.items()
        self._forwards = {p: FORWARDS[p] if c is None else compiled_forward(p, c) for p, c in configs}
        self._static = {p for p, c in configs if c is not None or self.cuda_graph_paths[p]}
        if self._static and padding is None:
            raise ValueError(f"the {' and '.join(sorted(self._static))} path is compiled or graphed: it needs padding")
        if any(cuda_graphs) and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph needs a CUDA device, the cache is on {self.device.type!r}")
        share = self._input_staging.copy_stream is None  # graphs replay on the staged inputs (``CUDAGraphs``)
        self.graphs = CUDAGraphs(self.device, share_inputs=share) if any(cuda_graphs) else None
        self.compile_counter = CompileCounter(compile_cache)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step: the KV copies, the forward, the sampling and the scores.

        Args:
            scheduler_output: the step; its requests' blocks are allocated.

        Returns:
            The sampled token ids and logprobs (one per sampling request, batch order, then one per
            fork of ``scheduler_output.forks``) and the prompt logprobs of scoring requests. Empty
            when nothing is scheduled.

        Raises:
            Whatever the forward raises; nothing of the requests has changed then.
        """
        if scheduler_output.is_empty:
            self._move_kv(scheduler_output)
            return RunnerOutput()
        prepared = self.prepare_step(scheduler_output)
        return read_back(self._compute(prepared, None), prepared.plan, prepared.sampled, self.return_logprobs)

    @torch.inference_mode()
    def prepare_step(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host work of a step that is not empty: its inputs staged on the device (padded on a compiled or
        graphed path), its random numbers drawn (``step_uniforms``: a sampled token's counter is its index among
        the request's generated tokens, placeholders counted, so a seeded request draws the same whatever the
        batching). Steps are prepared in launch order: placeholders come from the step prepared before.
        """
        scheduled = scheduler_output.scheduled
        path = self.path_of(scheduled)
        static = path in self._static
        kernel = "sdpa"
        if self.use_flash:
            # A padded varlen step of one-token chunks keeps the varlen kernel, the one its shapes were warmed
            # with; a padded decode step too wide for the decode kernel's table takes it as an eager one does.
            fits = (path == "decode" or not static) and fits_decode_kernel(
                scheduled, self.max_blocks_per_request, self.block_size
            )
            kernel = "flash_decode" if fits else "flash_varlen"
        self.num_decode_fast_path_steps += kernel == "flash_decode"
        rule = self.padding if static else self._exact
        assert rule is not None
        sample_rows = self._sample_rows if self.async_batching else None
        with record_function(PREPARE_SCOPE):
            batch, rows, plan, placeholders = prepare_inputs(
                scheduled,
                path == "decode",
                rule,
                self._input_staging,
                len(self.sliding_windows),
                kernel,
                sample_rows,
                lora=self.lora is not None,
            )
        forks = [child for _, child in scheduler_output.forks]
        sampled = plan.sampled + forks
        uniform = None
        if sampled:
            counters = [
                e.num_computed_tokens + e.num_scheduled_tokens - e.request.num_prompt_tokens
                for e in scheduled
                if e.sample
            ]
            counters += [child.num_generated_tokens for child in forks]
            uniform = step_uniforms([r.params for r in sampled], counters, self.generator)
        if self.async_batching:
            self._sample_rows = {r.request_id: i for i, r in enumerate(sampled)}
        return PreparedStep(
            scheduler_output, batch, rows, plan, sampled, uniform, placeholders, self._input_staging.last_slot
        )

    def launch(self, prepared: PreparedStep, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Start a step's KV copies, forward and sampling; ``collect`` waits for them.

        Without ``async_batching`` the step is computed before this returns. With it, on CPU the worker thread
        computes it (one step at a time, in launch order); on CUDA it is enqueued on the current stream.

        Args:
            prepared: the step.
            previous: the step launched before it, whose sampled tokens fill its placeholders (needed when
                ``prepared.placeholders`` is set).

        Raises:
            ValueError: the step has placeholders and no ``previous`` step.
            Whatever the forward raises when it runs in the calling thread (in the worker thread: ``collect``).
        """
        if prepared.placeholders is not None and previous is None:
            raise ValueError("a step with placeholder tokens needs the step launched before it")
        if self._worker is not None:
            return LaunchedStep(prepared, self._worker.submit(self._compute, prepared, previous))
        future: Future[StepResult] = Future()
        try:
            future.set_result(self._compute(prepared, previous, readback=self.async_batching))
        finally:
            self._input_staging.release(prepared.staging_slot)
        return LaunchedStep(prepared, future)

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and read its results back (one copy): see ``execute``'s return value.

        Raises:
            Whatever the step's forward or sampling raised.
        """
        prepared = launched.prepared
        return read_back(launched.wait(), prepared.plan, prepared.sampled, self.return_logprobs)

    def close(self) -> None:
        """Stop the worker thread (after the step it runs, if any). Idempotent."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    @torch.inference_mode()
    def _compute(self, prepared: PreparedStep, previous: LaunchedStep | None, readback: bool = False) -> StepResult:
        """The device work of a step: KV copies, placeholders, forward, sampling, scores, packed results.

        Args:
            prepared: the step.
            previous: the step launched before it, whose sampled tokens (int64 [B'] on the device) replace
                the placeholders; computed already when this runs (the worker runs steps in launch order).
            readback: start the copy of the results into pinned host memory (CUDA; ``collect`` waits for it).
        """
        scheduler_output = prepared.scheduler_output
        self._move_kv(scheduler_output)
        if prepared.placeholders is not None:
            assert previous is not None
            previous_tokens = previous.wait().tokens
            assert previous_tokens is not None
            rows, sources = prepared.placeholders[0], prepared.placeholders[1]
            prepared.batch.input_ids[rows] = previous_tokens.index_select(0, sources)
        with batch_invariant(self.invariant_packs) if self.batch_invariant else contextlib.nullcontext():
            return self._forward_and_sample(prepared, readback)

    def _forward_and_sample(self, prepared: PreparedStep, readback: bool) -> StepResult:
        scheduler_output, plan = prepared.scheduler_output, prepared.plan
        with record_function(FORWARD_SCOPE):
            logits = self.forward(prepared.batch)[: len(prepared.rows)]
        scores: torch.Tensor | None = None
        tokens: torch.Tensor | None = None
        logprobs: torch.Tensor | None = None
        top: TopLogprobs | None = None
        if plan.score_segments:
            targets, temps = plan.score_target_ids, plan.score_temperatures
            assert targets is not None and temps is not None
            scores = score_logprobs(logits[plan.num_sample_rows :], targets, temps)
        if plan.sampled:
            sampled = prepared.sampled
            sample_logits = logits[: plan.num_sample_rows]
            if scheduler_output.forks:
                # Each fork samples from its parent's row (the last prompt token, computed once),
                # with its own parameters and random stream.
                parents = [plan.sampled.index(parent) for parent, _ in scheduler_output.forks]  # by identity
                sample_logits = torch.cat([sample_logits, sample_logits[parents]])
            tokens, logprobs, top = sample_tokens(
                sample_logits,
                [r.params for r in sampled],
                self.logprobs_mode,
                self.return_logprobs,
                token_ids=[r.token_ids for r in sampled],
                num_prompt_tokens=[r.num_prompt_tokens for r in sampled],
                uniform=prepared.uniform,
                staging=self._sampling_staging,
                grammars=[r.grammar for r in sampled] if any(r.grammar is not None for r in sampled) else None,
                cpu_kernel=self.use_flash and self.device.type == "cpu",  # rollout's C++ extension is loaded
            )
        return pack_results(scores, tokens, logprobs, top, readback)

    @property
    def static_paths(self) -> list[str]:
        """The paths that run padded (compiled or CUDA-graphed), in ``PATHS`` order."""
        return [path for path in PATHS if path in self._static]

    @staticmethod
    def path_of(scheduled: Sequence[ScheduledRequest]) -> str:
        """``"decode"`` when every request computes one token and samples it, else ``"varlen"``."""
        return "decode" if all(e.num_scheduled_tokens == 1 and e.sample for e in scheduled) else "varlen"

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The one forward of a step, on ``batch``'s path: compiled or not, replayed as a CUDA graph or not.

        Compilations it triggers are counted in ``compile_counter``.

        Returns:
            float32 [R, V]: the logits of ``batch.logits_rows`` (padding rows included).
        """
        path = batch.path
        fn = self._forwards[path]  # the plain forward on an eager path
        static = path in self._static  # compiled or CUDA-graphed: transformers' forward, LoRA over every slot
        fused = self.fused_layers and not static
        args = (
            self.block_size,
            self._skip_mask,
            self.supports_logits_to_keep,
            self.onednn,
            fused,
            self.batch_invariant,
            self.regional and not static,
        )

        def run(b: StepBatch) -> torch.Tensor:
            with contextlib.ExitStack() as stack:
                if self.packs is not None:
                    stack.enter_context(self.packs.active())
                if self.lora is not None:  # each token's adapter, added by the targeted layers' hooks
                    stack.enter_context(self.lora.step(b.lora_slots, b.lora_used, b.lora_uniform, static))
                return self.compile_counter.run(fn, self.model, self.cache, b, *args)

        if self.graphs is not None and self.cuda_graph_paths[path]:
            return self.graphs.run((path, batch.shape, batch.kernel, bool(batch.lora_used)), run, batch)
        return run(batch)

    @torch.inference_mode()
    def warmup(
        self, shapes: Sequence[tuple[str, tuple[int, ...]]], on_shape: Callable[[], object] | None = None
    ) -> None:
        """Run the padded forward of each (path, shape) on a synthetic batch, compiling or capturing it.

        The synthetic batches read and write the padding block only (``inputs.synthetic_batch``):
        no request's keys, no prefix-cache block, no random generator and no counter of requests change.
        Each shape warms the kernel its steps take (``warmup_kernel``).

        Args:
            shapes: (path, padded shape) pairs, for paths in ``static_paths``.
            on_shape: called after each shape (a progress bar's update), or None.
        """
        assert self.padding is not None
        for path, shape in shapes:
            kernel = self.warmup_kernel(path)
            groups = len(self.sliding_windows)
            batch = synthetic_batch(
                path, shape, self.padding, self._input_staging, groups, kernel, lora=self.lora is not None
            )
            self.forward(batch)
            self._input_staging.release(self._input_staging.last_slot)
            if on_shape is not None:
                on_shape()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warmup_kernel(self, path: str) -> str:
        """The kernel a padded path's steps take (``prepare_step``), which its warmup compiles or captures: SDPA
        without flash-attn, else the decode kernel on the decode path (unless ``max_blocks_per_request`` is 0; a
        step too wide for it takes the varlen kernel, not warmed) and the varlen kernel on the varlen path."""
        if not self.use_flash:
            return "sdpa"
        return "flash_decode" if path == "decode" and self.max_blocks_per_request > 0 else "flash_varlen"

    def _move_kv(self, scheduler_output: SchedulerOutput) -> None:
        """The step's KV copies before its forward: offloads, copy-on-write copies, restores, in that order.

        A victim's freed blocks may be handed, in the same step, to a restored request or a copy-on-write; a copy's
        source block, freed in the same pass, may be a restored request's block.
        """
        pool = self.offload_pool
        if pool is not None:
            for blocks, pool_ids in scheduler_output.offloads:
                pool.store(self.cache, blocks, pool_ids)
        if scheduler_output.block_copies:
            self.cache.copy_blocks(scheduler_output.block_copies)
        if pool is None:
            return
        for req, blocks in scheduler_output.restores:
            assert req.offloaded is not None
            pool.load(self.cache, req.offloaded[0], blocks)
