"""The model runner: a scheduled step in, sampled tokens, logprobs and scores out.

``ModelRunner.execute`` does the device work of one step, as nano-vllm's and vLLM's runners
do: the KV copies of offload preemption and of copy-on-write, one flattened forward of the model
through the paged cache, then sampling (a forked request samples from its parent's logits row) and
the logprobs of scoring requests. It reads requests but changes none: ``Scheduler.update_from_output``
applies what it returns.

Host work per step is batched so that the device runs without waiting on Python: the step's
index tensors (token ids, positions, slots, block tables, kept rows, score targets) are built
with numpy and reach the device in one copy through a pinned staging buffer, the sampler's
per-row values in a second one, the random numbers of all sampled requests come from one
vectorised draw (``sampling.step_uniforms``), and the results (tokens, logprobs, scores) come
back in one device-to-host copy, the step's only host sync outside the model's forward.

``execute`` is three phases, which async batching (``async_batching=True``) runs apart so that the host
prepares step k + 1 while step k's forward and sampling run:

- ``prepare_step``: the host work (the step's batch, exact or padded for a compiled or CUDA-graphed path,
  sampling rows and random numbers) and the staged upload of the inputs;
- ``launch``: the KV copies, the forward and the sampling. A step scheduled while the one before it runs
  holds placeholders for the tokens that step samples (``Request.num_output_placeholders``); ``launch`` copies
  those tokens into its input ids on the device first (vLLM v1's async scheduling and transformers'
  "carry over" of tokens between batches do the same), before a CUDA graph copies them into its static
  inputs. On CPU a worker thread runs it (torch
  releases the GIL inside its kernels, so the host's Python overlaps them); on CUDA it is enqueued on the
  current stream from the calling thread (kernels run asynchronously anyway), with the inputs copied on a
  side stream into two staging buffer sets used in turn and the results copied back into pinned memory;
- ``collect``: waits for the launched step and reads its results back in one copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function
from transformers.generation import CompileConfig

from .cpu_offload import CPUOffloadPool
from .kv_cache import PagedKVCache
from .onednn import AUTO, MKL, is_dtensor, linear_kernel_policy
from .requests import Request
from .sampling import HostStaging, sample_tokens, step_uniforms
from .scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from .static_step import (
    FORWARDS,
    PATHS,
    CompileCounter,
    CUDAGraphs,
    PaddedBatch,
    PaddingRule,
    build_padded_batch,
    compiled_forward,
    synthetic_batch,
)

# ``torch.profiler.record_function`` ranges the runner opens on the thread that runs them, so that a profile
# (``rollout.benchmarks.profile_step``) can tell the host work of a step from its model forward.
PREPARE_SCOPE = "rollout.prepare_step"  # the host work of ``prepare_step``: inputs, metadata, staged upload
FORWARD_SCOPE = "rollout.forward"  # the model's forward (eager, compiled or graph replay), logits rows kept


@dataclass
class LogitsPlan:
    """Which rows of a step's logits are for what.

    The first ``num_sample_rows`` rows are the last query token of each sampled
    request, in batch order. The rest are scored positions of scoring requests:
    row ``num_sample_rows + j`` predicts ``score_targets[j]``; ``score_segments``
    says, in order, how many of those rows belong to which request.
    """

    num_sample_rows: int = 0
    score_targets: list[int] = field(default_factory=list)
    score_segments: list[tuple[Request, int]] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)  # the request of each sample row, in order
    # On the device (staged with the step's inputs): int64 [S] score_targets, float32 [S] the
    # temperature of each scored row; None when nothing is scored.
    score_target_ids: torch.Tensor | None = None
    score_temperatures: torch.Tensor | None = None


@dataclass
class PreparedStep:
    """A step's inputs, built on the host and staged on the device (``ModelRunner.prepare_step``).

    Attributes:
        scheduler_output: the step (not empty).
        batch: the step's inputs (``static_step.PaddedBatch``), exact or padded as its path runs.
        rows: the rows whose logits are kept, in order (the forward keeps ``batch.logits_rows``, these first).
        plan: which kept row is for what.
        sampled: the request of each sampled row: ``plan.sampled``, then each fork's child.
        uniform: float64 [len(sampled)], the number each sampled row draws its token with (see
            ``sampling.step_uniforms``); None when nothing is sampled.
        placeholders: int64 [2, P] on the device: row 0 the rows of ``batch.input_ids`` (a padded batch
            keeps the real rows first, at the same indices) that hold a placeholder, row 1 the index of
            the token that replaces each among the previous step's sampled tokens; None when every input
            token is known.
        staging_slot: the input staging buffer set holding the inputs.
    """

    scheduler_output: SchedulerOutput
    batch: PaddedBatch
    rows: list[int]
    plan: LogitsPlan
    sampled: list[Request]
    uniform: np.ndarray | None
    placeholders: torch.Tensor | None
    staging_slot: int


@dataclass
class StepResult:
    """What a launched step leaves on the device (and, for async CUDA steps, on its way to the host).

    Attributes:
        packed: float64 [N]: the scores, then the sampled tokens, then their logprobs, then the top
            logprobs' ids and values (R x K each, row-major: ``sampling.TopLogprobs``; see ``collect``);
            None when the step neither samples nor scores (a prefill chunk).
        tokens: int64 [B] the sampled tokens on the device (the next step's placeholders read them);
            None when nothing is sampled.
        host: a pinned float64 [N] copy of ``packed`` being made, or None (``packed`` is read directly).
        copied: the CUDA event of that copy.
    """

    packed: torch.Tensor | None
    tokens: torch.Tensor | None
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were started (``ModelRunner.launch``); ``collect`` waits for it.

    Attributes:
        prepared: the step's inputs.
        future: the worker thread's computation (CPU), or None.
        result: the result when computed in the calling thread (the forward enqueued on CUDA), or None.
    """

    prepared: PreparedStep
    future: Future[StepResult] | None = None
    result: StepResult | None = None

    def wait(self) -> StepResult:
        """The step's result, once computed (blocks on the worker thread); re-raises its error."""
        if self.future is not None:
            return self.future.result()
        assert self.result is not None
        return self.result


def unpack_top_logprobs(counts: Sequence[int], host: Sequence[float]) -> list[tuple[list[int], list[float]]] | None:
    """Each sampled row's top logprobs from the tail of a step's packed results.

    Args:
        counts: each sampled row's ``num_top_logprobs`` (0: none), in row order.
        host: the ids then the logprobs of ``sampling.TopLogprobs``, R x K each, row-major, for the R rows
            whose count is > 0 (K, the widest count capped at the vocabulary, follows from the length).

    Returns:
        Per sampled row: (ids, logprobs) of its first ``counts[row]`` alternatives, most likely first, or
        ``([], [])`` for a row that asked for none; None when no row asked.
    """
    asked = sum(1 for c in counts if c > 0)
    if not asked:
        return None
    k = len(host) // (2 * asked)
    ids, values = host[: asked * k], host[asked * k : 2 * asked * k]
    out: list[tuple[list[int], list[float]]] = []
    j = 0
    for c in counts:
        if c > 0:
            n = min(c, k)
            out.append(([int(t) for t in ids[j * k : j * k + n]], list(values[j * k : j * k + n])))
            j += 1
        else:
            out.append(([], []))
    return out


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """int64 [len(rows), longest]: the rows right-padded with 0."""
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _scored_span(req: Request, computed: int, num_tokens: int) -> tuple[int, int]:
    """The positions [lo, hi) of a scoring request whose logits this step records (empty when hi <= lo).

    Position p's logits predict token p + 1; positions already scored (before a preemption) are not
    recorded twice.
    """
    lo = max(computed, req.score_from - 1 + len(req.prompt_logprobs))
    hi = min(computed + num_tokens, req.num_tokens - 1)
    return lo, hi


def _keep_rows(
    entry: ScheduledRequest,
    start: int,
    plan: LogitsPlan,
    logits_rows: list[int],
    score_rows: list[int],
    score_temps: list[float],
) -> None:
    """Record which of a request's query rows (from row ``start`` of the step) keep their logits.

    A sampled request keeps its last row (appended to ``logits_rows`` and ``plan.sampled``); a scoring
    request its rows that predict a prompt token not yet scored (``score_rows``, with their targets and
    segment in ``plan`` and their temperature in ``score_temps``).
    """
    req, n = entry.request, entry.num_scheduled_tokens
    c = entry.num_computed_tokens
    if entry.sample:
        logits_rows.append(start + n - 1)
        plan.sampled.append(req)
    if req.score_from is not None:
        lo, hi = _scored_span(req, c, n)
        if hi > lo:
            score_rows.extend(range(start + lo - c, start + hi - c))
            plan.score_targets.extend(req.token_ids[lo + 1 : hi + 1])
            plan.score_segments.append((req, hi - lo))
            score_temps.extend([req.score_temperature] * (hi - lo))


def _placeholders(scheduled: Sequence[ScheduledRequest], sample_rows: dict[str, int]) -> tuple[list[int], list[int]]:
    """Where a step's inputs hold placeholders: tokens that the step before it samples (async batching).

    A request's query tokens past its known ``token_ids`` are such tokens; the scheduling rule lets a
    request have one (its last query token), sampled by the step launched just before.

    Args:
        scheduled: the step's requests, in batch order.
        sample_rows: the row of each request (by id) among the sampled tokens of the step before.

    Returns:
        The flattened input rows that hold one, and for each the index of the token that replaces it
        among the previous step's sampled tokens; both empty when none.
    """
    rows: list[int] = []
    sources: list[int] = []
    end = 0
    for entry in scheduled:
        end += entry.num_scheduled_tokens
        if entry.num_computed_tokens + entry.num_scheduled_tokens > entry.request.num_tokens:
            rows.append(end - 1)
            sources.append(sample_rows[entry.request.request_id])
    return rows, sources


class ModelRunner:
    """Runs the model on a flattened variable-length batch through the paged cache, then samples.

    The batch of a step is one sequence of T scheduled tokens, ``input_ids`` [1, T] and
    ``position_ids`` [1, T] (each token's position in its own request). Only the rows
    whose logits are sampled or scored go through the LM head (``logits_to_keep``).

    Two paths: a decode-only step (one token per request, each sampled) is the "decode" path, every
    other step (prefill chunks, mixed, scoring) the "varlen" path. Every step has one input builder
    (``static_step.build_padded_batch``) and one forward over the same paged attention; padding is a
    choice of sizes: a path that is neither compiled nor CUDA-graphed keeps the exact sizes (and, with
    ``use_flash``, adds flash-attn's inputs), one that is runs padded (``padding``), through its compiled
    forward and, on CUDA, a captured graph per padded shape. Sampling stays eager.

    Args:
        model: a ``transformers`` causal LM whose attention is the paged dispatcher.
        cache: the paged KV cache.
        use_flash: eager steps add flash-attn's inputs (CUDA): attention runs its kernels, not SDPA.
        max_blocks_per_request: with ``use_flash``, the width of the decode fast path's block table
            (``ContinuousBatchingConfig.resolved_max_blocks_per_request``); 0 sends every step
            through the varlen kernel.
        offload_pool: the CPU pool of offload preemption, or None.
        seed: seed of the generator of sampled requests that have no seed of their own;
            None seeds it from the OS.
        logprobs_mode: "temperature", "raw" or "sampled" (see ``sample_tokens``).
        return_logprobs: return one logprob per sampled token.
        compile_configs: the (varlen, decode) compile configs; None runs that path uncompiled.
        cuda_graphs: (varlen, decode): replay that path's padded forward as CUDA graphs (CUDA only).
        padding: how static-shape steps are padded; needed when a path is compiled or graphed.
        async_batching: ``launch`` starts a step and returns (see the module docstring): on CPU a worker
            thread computes it, on CUDA the inputs are staged on a side stream into two buffer sets.

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
    ) -> None:
        self.model = model
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
        # On CPU the step's float32 linear layers (eager and padded) run MKL or oneDNN, whichever is faster
        # per shape on this CPU (rollout/onednn.py: the gain depends on the CPU; issue 22).
        self._linear_policy = linear_kernel_policy() if self.device.type == "cpu" else MKL
        if self._linear_policy == AUTO and any(is_dtensor(p) for p in model.parameters()):
            # Tensor parallelism: sharded layers keep their own linear, and each rank would measure the
            # replicated ones apart (a choice per rank, so logits rounded differently per rank).
            self._linear_policy = MKL
        # A prepared 4D mask makes transformers skip building its own masks: the
        # paged attention masks each request itself.
        self._skip_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # One staging buffer for the step's inputs and one for the sampler's per-row values: each
        # waits only for its own previous copy before it is refilled.
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
        # Per-row sampling values are staged by ``launch``, after the forward, on the current stream.
        self._sampling_staging = HostStaging(self.device)
        # The static-shape paths: for each path, its forward (compiled or plain) when it runs padded.
        self.padding = padding
        self._exact = PaddingRule.exact_rule(self.block_size)
        self.compile_configs = dict(zip(PATHS, compile_configs, strict=True))
        self.cuda_graph_paths = dict(zip(PATHS, cuda_graphs, strict=True))
        # Each path's forward (compiled or plain); the paths that run padded (compiled or graphed).
        self._forwards: dict[str, Callable[..., torch.Tensor]] = {}
        self._static: set[str] = set()
        for path in PATHS:
            config, graphed = self.compile_configs[path], self.cuda_graph_paths[path]
            self._forwards[path] = FORWARDS[path] if config is None else compiled_forward(path, config)
            if config is None and not graphed:
                continue
            if padding is None:
                raise ValueError(f"the {path} path is compiled or CUDA-graphed: it needs a padding rule")
            self._static.add(path)
        if any(cuda_graphs) and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph needs a CUDA device, the cache is on {self.device.type!r}")
        self.graphs = CUDAGraphs(self.device) if any(cuda_graphs) else None
        self.compile_counter = CompileCounter()

    def _fits_decode_fast_path(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """Whether a step goes through ``flash_attn_with_kvcache``: every request computes one token and
        its keys (this one included) fit in ``max_blocks_per_request`` blocks. One wider request sends the
        whole step through the varlen kernel (transformers' scheduler applies the same rule)."""
        width = self.max_blocks_per_request
        if width <= 0 or not scheduled:
            return False
        limit = width * self.block_size  # keys a table row can address
        return all(e.num_scheduled_tokens == 1 and e.num_computed_tokens < limit for e in scheduled)

    @staticmethod
    def _flash_decode_arrays(
        scheduled: Sequence[ScheduledRequest], width: int, num_groups: int = 1
    ) -> list[np.ndarray]:
        """int64 host arrays of the decode fast path's inputs (each request computes one token).

        Returns:
            cache_seqlens [B] (the request's keys after this step's write: computed tokens + 1), then the
            block table [B, width] of each layer group: each request's first ``width`` blocks, padded with
            block 0 (the kernel reads only the blocks its cache_seqlens covers; a sliding group's
            ``NULL_BLOCK`` entries before its window read as block 0, which the window mask never lets a
            query attend to, as in ``_flash_arrays``).
        """
        seqlens = np.asarray([e.num_computed_tokens + 1 for e in scheduled], dtype=np.int64)
        tables = []
        for g in range(num_groups):
            table = np.zeros((len(scheduled), width), dtype=np.int64)
            for i, e in enumerate(scheduled):
                row = e.request.block_tables[g][:width]
                table[i, : len(row)] = row
            tables.append(np.maximum(table, 0))
        return [seqlens, *tables]

    @staticmethod
    def _flash_arrays(scheduled: Sequence[ScheduledRequest], num_groups: int = 1) -> list[np.ndarray]:
        """int64 host arrays of flash-attn's varlen inputs.

        Returns:
            cu_seqlens_q [B+1], cu_seqlens_k [B+1], then the block table [B, W] of each layer group (rows
            padded with 0; a sliding group's ``NULL_BLOCK`` entries, before its window, read as block 0,
            which the kernel's window mask never lets a query attend to).
        """
        q_lens = np.asarray([e.num_scheduled_tokens for e in scheduled], dtype=np.int64)
        k_lens = np.asarray([e.num_computed_tokens for e in scheduled], dtype=np.int64) + q_lens
        zero = np.zeros(1, dtype=np.int64)
        tables = [np.maximum(_padded([e.request.block_tables[g] for e in scheduled]), 0) for g in range(num_groups)]
        return [np.concatenate([zero, np.cumsum(q_lens)]), np.concatenate([zero, np.cumsum(k_lens)]), *tables]

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
        result = self._compute(prepared, None)
        return self._unpack(prepared, result.packed.tolist() if result.packed is not None else [])

    @torch.inference_mode()
    def prepare_step(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host work of a step that is not empty: its inputs staged on the device (the padded batch on
        a compiled or CUDA-graphed path), its sampling rows and random numbers drawn (``step_uniforms``:
        a sampled token's counter is its index among the request's generated tokens, placeholders of the
        step in flight counted, so that a seeded request draws the same numbers whatever the batching).

        Steps must be prepared in the order they are launched: a step's placeholders are filled from the
        sampled tokens of the step prepared before it.
        """
        scheduled = scheduler_output.scheduled
        with record_function(PREPARE_SCOPE):
            batch, rows, plan, placeholders = self._prepare_batch(scheduled, self.path_of(scheduled))
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

        Without ``async_batching`` the step is computed before this returns. With it, on CPU the worker
        thread computes it (one step at a time, in launch order, so a step's KV writes land before the
        next step's forward reads or overwrites any block); on CUDA it is enqueued on the current stream.

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
            return LaunchedStep(prepared, future=self._worker.submit(self._compute, prepared, previous))
        try:
            return LaunchedStep(prepared, result=self._compute(prepared, previous, readback=self.async_batching))
        finally:
            self._input_staging.release(prepared.staging_slot)

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and read its results back (one copy): see ``execute``'s return value.

        Raises:
            Whatever the step's forward or sampling raised.
        """
        result = launched.wait()
        if result.host is not None:
            assert result.copied is not None
            result.copied.synchronize()
            return self._unpack(launched.prepared, result.host.tolist())
        return self._unpack(launched.prepared, result.packed.tolist() if result.packed is not None else [])

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
        plan = prepared.plan
        if prepared.placeholders is not None:
            assert previous is not None
            previous_tokens = previous.wait().tokens
            assert previous_tokens is not None
            rows, sources = prepared.placeholders[0], prepared.placeholders[1]
            prepared.batch.input_ids[rows] = previous_tokens.index_select(0, sources)
        with record_function(FORWARD_SCOPE):
            logits = self.forward(prepared.batch)[: len(prepared.rows)]
        # Everything the host needs back, in one float64 vector and one device-to-host copy: the
        # step's single sync. Token ids (< 2**53) and float32 logprobs are exact in float64.
        parts: list[torch.Tensor] = []
        if plan.score_segments:
            parts.append(self._score_logprobs(logits[plan.num_sample_rows :], plan).double())
        tokens = None
        if plan.sampled:
            sampled = prepared.sampled
            sample_logits = logits[: plan.num_sample_rows]
            if scheduler_output.forks:
                # Each fork samples from its parent's row (the last prompt token, computed once),
                # with its own parameters and random stream.
                row_of = {id(req): i for i, req in enumerate(plan.sampled)}
                parent_rows = [row_of[id(parent)] for parent, _ in scheduler_output.forks]
                index = torch.tensor(parent_rows, dtype=torch.int64, device=sample_logits.device)
                sample_logits = torch.cat([sample_logits, sample_logits.index_select(0, index)])
            tokens, logprobs, top = sample_tokens(
                sample_logits,
                [r.params for r in sampled],
                self.logprobs_mode,
                self.return_logprobs,
                token_ids=[r.token_ids for r in sampled],
                num_prompt_tokens=[r.num_prompt_tokens for r in sampled],
                uniform=prepared.uniform,
                staging=self._sampling_staging,
            )
            parts.append(tokens.double())
            if logprobs is not None:
                parts.append(logprobs.double())
            if top is not None:
                parts += [top.token_ids.flatten().double(), top.logprobs.flatten().double()]
        packed = torch.cat(parts) if parts else None
        result = StepResult(packed, tokens)
        if readback and packed is not None and packed.is_cuda:
            result.host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            result.host.copy_(packed, non_blocking=True)
            result.copied = torch.cuda.Event()
            result.copied.record(torch.cuda.current_stream(packed.device))
        return result

    def _unpack(self, prepared: PreparedStep, host: list[float]) -> RunnerOutput:
        """The ``RunnerOutput`` of a step from its packed results read back to the host."""
        plan = prepared.plan
        result = RunnerOutput()
        i = 0
        if plan.score_segments:
            result.prompt_logprobs = []
            for req, count in plan.score_segments:
                result.prompt_logprobs.append((req, host[i : i + count]))
                i += count
        if plan.sampled:
            b = len(prepared.sampled)
            result.sampled_token_ids = [int(t) for t in host[i : i + b]]
            i += b
            if self.return_logprobs:
                result.logprobs = host[i : i + b]
                i += b
            result.top_logprobs = unpack_top_logprobs([r.params.num_top_logprobs for r in prepared.sampled], host[i:])
        return result

    @property
    def static_paths(self) -> list[str]:
        """The paths that run padded (compiled or CUDA-graphed), in ``PATHS`` order."""
        return [path for path in PATHS if path in self._static]

    @staticmethod
    def path_of(scheduled: Sequence[ScheduledRequest]) -> str:
        """``"decode"`` when every request computes one token and samples it, else ``"varlen"``."""
        return "decode" if all(e.num_scheduled_tokens == 1 and e.sample for e in scheduled) else "varlen"

    def _prepare_batch(
        self, scheduled: Sequence[ScheduledRequest], path: str
    ) -> tuple[PaddedBatch, list[int], LogitsPlan, torch.Tensor | None]:
        """The inputs of a step (one staged upload): its batch, sized exact or padded as its path runs
        (``static_paths``), with flash-attn's inputs on an eager CUDA step (``use_flash``); the real logits
        rows, their plan, and the placeholders of a step scheduled behind another (see
        ``PreparedStep.placeholders``: a padded batch keeps the real rows first, at the same indices)."""
        static = path in self._static
        rule = self.padding if static else self._exact
        assert rule is not None
        plan = LogitsPlan()
        logits_rows: list[int] = []
        score_rows: list[int] = []
        score_temps: list[float] = []
        start = 0
        for entry in scheduled:
            _keep_rows(entry, start, plan, logits_rows, score_rows, score_temps)
            start += entry.num_scheduled_tokens
        rows = logits_rows + score_rows
        extra = [np.asarray(plan.score_targets, dtype=np.int64), np.asarray(score_temps, dtype=np.float64)]
        placeholder_rows, placeholder_sources = (
            _placeholders(scheduled, self._sample_rows) if self.async_batching else ([], [])
        )
        if placeholder_rows:
            extra.append(np.asarray([placeholder_rows, placeholder_sources], dtype=np.int64))
        num_groups = len(self.sliding_windows)
        fast_decode = flash = False
        if self.use_flash and not static:
            flash = True
            fast_decode = self._fits_decode_fast_path(scheduled)
            if fast_decode:
                extra += self._flash_decode_arrays(scheduled, self.max_blocks_per_request, num_groups)
            else:
                extra += self._flash_arrays(scheduled, num_groups)
        batch, staged = build_padded_batch(
            scheduled, rows, path == "decode", rule, self._input_staging, extra, num_groups
        )
        targets, temps = staged[0], staged[1]
        placeholders = staged[2] if placeholder_rows else None
        if flash:
            flash_in = staged[3 if placeholder_rows else 2 :]
            tables = torch.stack(flash_in[-num_groups:]).to(torch.int32)  # [N, B, W]
            if fast_decode:
                batch.flash = {"cache_seqlens": flash_in[0].to(torch.int32), "block_tables": tables}
                self.num_decode_fast_path_steps += 1
            else:
                k_lens = [e.num_computed_tokens + e.num_scheduled_tokens for e in scheduled]
                batch.flash = {
                    "cu_seqlens_q": flash_in[0].to(torch.int32),
                    "cu_seqlens_k": flash_in[1].to(torch.int32),
                    "max_seqlen_q": max(e.num_scheduled_tokens for e in scheduled),
                    "max_seqlen_k": max(k_lens),
                    "block_tables": tables,
                }
        if plan.score_segments:
            plan.score_target_ids, plan.score_temperatures = targets, temps.float()
        plan.num_sample_rows = len(logits_rows)
        return batch, rows, plan, placeholders

    def forward(self, batch: PaddedBatch) -> torch.Tensor:
        """The one forward of a step, on ``batch``'s path: compiled or not, replayed as a CUDA graph or not.

        Compilations it triggers are counted in ``compile_counter``.

        Returns:
            float32 [R, V]: the logits of ``batch.logits_rows`` (padding rows included).
        """
        path = batch.path
        fn = self._forwards[path]  # the plain forward on an eager path
        args = (self.block_size, self._skip_mask, self.supports_logits_to_keep, self._linear_policy)

        def run(b: PaddedBatch) -> torch.Tensor:
            return self.compile_counter.run(fn, self.model, self.cache, b, *args)

        if self.graphs is not None and self.cuda_graph_paths[path]:
            return self.graphs.run((path, batch.shape), run, batch)
        return run(batch)

    @torch.inference_mode()
    def warmup(
        self, shapes: Sequence[tuple[str, tuple[int, ...]]], on_shape: Callable[[], object] | None = None
    ) -> None:
        """Run the padded forward of each (path, shape) on a synthetic batch, compiling or capturing it.

        The synthetic batches read and write the padding block only (``static_step.synthetic_batch``):
        no request's keys, no prefix-cache block, no random generator and no counter of requests change.

        Args:
            shapes: (path, padded shape) pairs, for paths in ``static_paths``.
            on_shape: called after each shape (a progress bar's update), or None.
        """
        assert self.padding is not None
        for path, shape in shapes:
            self.forward(synthetic_batch(path, shape, self.padding, self.device, len(self.sliding_windows)))
            if on_shape is not None:
                on_shape()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _move_kv(self, scheduler_output: SchedulerOutput) -> None:
        """The step's KV copies before its forward: offloads, copy-on-write copies, restores.

        Offloads first: a victim's freed blocks may already be handed to a restored request, or be
        the destination of a copy-on-write, in the same step (and are written by this step's
        forward, after the copies). Copies before restores: a copy's source block, freed in the
        same pass, may be a restored request's block.
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

    @staticmethod
    def _score_logprobs(logits: torch.Tensor, plan: LogitsPlan) -> torch.Tensor:
        """Logprobs of the scored positions: ``log_softmax(logits / T)`` at each target token.

        Args:
            logits: float32 [S, V]; row j predicts ``plan.score_targets[j]``.
            plan: the step's rows, with ``score_target_ids`` and ``score_temperatures`` on the device.

        Returns:
            float32 [S] on the device, in row order; ``plan.score_segments`` splits it by request.
        """
        targets, temps = plan.score_target_ids, plan.score_temperatures
        assert targets is not None and temps is not None
        return torch.log_softmax(logits / temps[:, None], dim=-1).gather(1, targets[:, None])[:, 0]
