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

- ``prepare_step``: the host work (inputs, attention metadata, sampling rows and random numbers) and the
  staged upload of the inputs;
- ``launch``: the KV copies, the forward and the sampling. A step scheduled ahead holds placeholders for
  the tokens that the step before it samples (``ScheduledRequest.placeholder_row``); ``launch`` copies
  those tokens into its input ids on the device first (vLLM v1's async scheduling and transformers'
  "carry over" of tokens between batches do the same). On CPU a worker thread runs it (torch releases
  the GIL inside its kernels, so the host's Python overlaps them); on CUDA it is enqueued on the current
  stream from the calling thread (kernels run asynchronously anyway), with the inputs copied on a side
  stream into two staging buffer sets used in turn and the results copied back into pinned memory;
- ``collect``: waits for the launched step and reads its results back in one copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .attention import METADATA_KWARG, PagedAttentionMetadata, PrefillSegment
from .kv_cache import CPUOffloadPool, PagedKVCache
from .requests import Request
from .sampling import HostStaging, sample_tokens, step_uniforms
from .scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput


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
        kwargs: the forward's keyword arguments: ``input_ids`` int64 [1, T], ``position_ids`` int64 [1, T],
            the paged-attention metadata, ``logits_to_keep``.
        rows: int64 [R], the rows whose logits are kept.
        plan: which kept row is for what.
        sampled: the request of each sampled row: ``plan.sampled``, then each fork's child.
        uniform: float64 [len(sampled)], the number each sampled row draws its token with (see
            ``sampling.step_uniforms``); None when nothing is sampled.
        placeholders: int64 [2, P] on the device: row 0 the positions of ``input_ids`` that hold a
            placeholder, row 1 the index of the token that replaces each among the previous step's
            sampled tokens; None when every input token is known.
        generator_state: the engine generator's state before this step drew from it, put back by
            ``ModelRunner.discard``; None when the step did not draw, or cannot be discarded.
        staging_slot: the input staging buffer set holding the inputs.
    """

    scheduler_output: SchedulerOutput
    kwargs: dict
    rows: torch.Tensor
    plan: LogitsPlan
    sampled: list[Request]
    uniform: np.ndarray | None
    placeholders: torch.Tensor | None
    generator_state: torch.Tensor | None
    staging_slot: int


@dataclass
class StepResult:
    """What a launched step leaves on the device (and, for async CUDA steps, on its way to the host).

    Attributes:
        packed: float64 [N]: the scores, then the sampled tokens, then their logprobs (see ``collect``);
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


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """int64 [len(rows), longest]: the rows right-padded with 0."""
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def slots_of(block_tables: torch.Tensor, lengths_max: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..lengths_max-1 of each sequence.

    Args:
        block_tables: int64 [B, max_blocks]; row b lists the physical blocks of sequence b.
        lengths_max: positions to map per row.
        block_size: tokens per block.

    Returns:
        int64 [B, lengths_max]: block_tables[b, pos // block_size] * block_size + pos % block_size.
        Positions past a row's blocks map to slots of block 0: callers mask them.
    """
    pos = torch.arange(lengths_max, device=block_tables.device)
    blocks = block_tables[:, pos // block_size]
    return blocks * block_size + (pos % block_size)[None, :]


class ModelRunner:
    """Runs the model on a flattened variable-length batch through the paged cache, then samples.

    The batch of a step is one sequence of T scheduled tokens, ``input_ids`` [1, T] and
    ``position_ids`` [1, T] (each token's position in its own request). Only the rows
    whose logits are sampled or scored go through the LM head (``logits_to_keep``).

    Args:
        model: a ``transformers`` causal LM whose attention is the paged dispatcher.
        cache: the paged KV cache.
        use_flash: build flash-attn varlen metadata (CUDA) instead of the SDPA path.
        offload_pool: the CPU pool of offload preemption, or None.
        seed: seed of the generator of sampled requests that have no seed of their own;
            None seeds it from the OS.
        logprobs_mode: "temperature", "raw" or "sampled" (see ``sample_tokens``).
        return_logprobs: return one logprob per sampled token.
        async_batching: ``launch`` starts a step and returns (see the module docstring): on CPU a worker
            thread computes it, on CUDA the inputs are staged on a side stream into two buffer sets.
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
        async_batching: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.use_flash = use_flash
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
        # A prepared 4D mask makes transformers skip building its own masks: the
        # paged attention masks each request itself.
        self._skip_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # One staging buffer for the step's inputs and one for the sampler's per-row values: each
        # waits only for its own previous copy before it is refilled.
        self.async_batching = async_batching
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

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> tuple[dict, torch.Tensor, LogitsPlan]:
        """Build the model inputs and the attention metadata of a step.

        Every index tensor is built on the host with numpy and reaches the device in one copy
        (``HostStaging``); the block-table gathers are then computed on the device.

        Returns:
            The forward kwargs; int64 [R]: the rows whose logits are kept (sampled
            requests' last query tokens, then scored positions); and the plan of those rows.
        """
        kwargs, rows, plan, _ = self._prepare_inputs(scheduled)
        return kwargs, rows, plan

    def _prepare_inputs(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> tuple[dict, torch.Tensor, LogitsPlan, torch.Tensor | None]:
        """``prepare``, and the placeholders of a step scheduled ahead (see ``PreparedStep.placeholders``).

        A placeholder's input id is staged as 0 (a valid id) and replaced on the device by ``launch``.
        """
        bs = self.block_size
        placeholder_rows: list[int] = []
        placeholder_sources: list[int] = []
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        score_rows: list[int] = []
        score_temps: list[float] = []
        plan = LogitsPlan()
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int]]] = []
        for entry in scheduled:
            req, n = entry.request, entry.num_scheduled_tokens
            c = req.num_computed_tokens
            start = len(input_ids)
            input_ids.extend(req.token_ids[c : c + n])
            if entry.placeholder_row is not None:
                # The request's one input token is sampled by the step in flight.
                input_ids[-1] = 0
                placeholder_rows.append(start + n - 1)
                placeholder_sources.append(entry.placeholder_row)
            table = req.block_table
            positions.extend(range(c, c + n))
            if n == 1:
                slots.append(table[c // bs] * bs + c % bs)
            else:
                pos = np.arange(c, c + n, dtype=np.int64)
                slots.extend((np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
            if entry.sample:
                logits_rows.append(start + n - 1)
                plan.sampled.append(req)
            if req.score_from is not None:
                # Position p's logits predict token p + 1.
                # Positions already scored (before a preemption) are not recorded twice.
                lo = max(c, req.score_from - 1 + len(req.prompt_logprobs))
                hi = min(c + n, req.num_tokens - 1)
                if hi > lo:
                    score_rows.extend(range(start + lo - c, start + hi - c))
                    plan.score_targets.extend(req.token_ids[lo + 1 : hi + 1])
                    plan.score_segments.append((req, hi - lo))
                    score_temps.extend([req.score_temperature] * (hi - lo))
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lengths.append(c + 1)
            else:
                prefill_specs.append((start, start + n, c, table))
        use_flash = self.use_flash
        gathered = [spec for spec in prefill_specs if spec[2] > 0] if not use_flash else []
        arrays: list[np.ndarray] = [
            np.asarray(input_ids, dtype=np.int64),
            np.asarray(positions, dtype=np.int64),
            np.asarray(slots, dtype=np.int64),
            np.asarray(logits_rows + score_rows, dtype=np.int64),
            np.asarray(plan.score_targets, dtype=np.int64),
            np.asarray(score_temps, dtype=np.float64),
        ]
        if use_flash:
            arrays += self._flash_arrays(scheduled)
        elif decode_rows:
            arrays += [
                np.asarray(decode_rows, dtype=np.int64),
                np.asarray(decode_lengths, dtype=np.int64),
                _padded(decode_tables),
            ]
        arrays += [np.asarray(table, dtype=np.int64) for _, _, _, table in gathered]
        if placeholder_rows:
            arrays.append(np.asarray([placeholder_rows, placeholder_sources], dtype=np.int64))
        staged_list = self._input_staging.upload(*arrays)
        placeholders = staged_list.pop() if placeholder_rows else None
        staged = iter(staged_list)
        ids_t, pos_t, slot_mapping, rows, targets, temps = (next(staged) for _ in range(6))
        if plan.score_segments:
            plan.score_target_ids, plan.score_temperatures = targets, temps.float()
        flash = None
        d_rows = d_gather = d_lengths = None
        prefills: list[PrefillSegment] = []
        if use_flash:
            cu_q, cu_k, table_t = next(staged), next(staged), next(staged)
            q_lens = [e.num_scheduled_tokens for e in scheduled]
            k_lens = [e.request.num_computed_tokens + e.num_scheduled_tokens for e in scheduled]
            flash = {
                "cu_seqlens_q": cu_q.to(torch.int32),
                "cu_seqlens_k": cu_k.to(torch.int32),
                "max_seqlen_q": max(q_lens),
                "max_seqlen_k": max(k_lens),
                "block_table": table_t.to(torch.int32),
            }
        else:
            if decode_rows:
                d_rows, d_lengths, d_tables = next(staged), next(staged), next(staged)
                d_gather = slots_of(d_tables, max(decode_lengths), bs)
            tables = {id(spec): next(staged) for spec in gathered}
            for spec in prefill_specs:
                start, end, c, _table = spec
                gather = None
                if c > 0:
                    gather = slots_of(tables[id(spec)][None, :], c + end - start, bs)[0]
                prefills.append(PrefillSegment(start, end, c, gather))
        meta = PagedAttentionMetadata(self.cache, slot_mapping, d_rows, d_gather, d_lengths, prefills, flash)
        kwargs = {
            "input_ids": ids_t[None, :],
            "position_ids": pos_t[None, :],
            "attention_mask": self._skip_mask,
            "use_cache": False,
            METADATA_KWARG: meta,
        }
        plan.num_sample_rows = len(logits_rows)
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        return kwargs, rows, plan, placeholders

    @staticmethod
    def _flash_arrays(scheduled: Sequence[ScheduledRequest]) -> list[np.ndarray]:
        """int64 host arrays of flash-attn's varlen inputs.

        Returns:
            cu_seqlens_q [B+1], cu_seqlens_k [B+1] and the block table [B, W] (rows padded with 0).
        """
        q_lens = np.asarray([e.num_scheduled_tokens for e in scheduled], dtype=np.int64)
        k_lens = np.asarray([e.request.num_computed_tokens for e in scheduled], dtype=np.int64) + q_lens
        zero = np.zeros(1, dtype=np.int64)
        return [
            np.concatenate([zero, np.cumsum(q_lens)]),
            np.concatenate([zero, np.cumsum(k_lens)]),
            _padded([e.request.block_table for e in scheduled]),
        ]

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
        """The host work of a step that is not empty: its inputs staged on the device, its sampling rows and
        random numbers drawn (``step_uniforms``: a sampled request's counter counts a pending placeholder,
        as the synchronous loop counts the token it stands for).

        A step scheduled ahead (``scheduler_output.ahead``) keeps the generator's state from before its
        draw, so that ``discard`` can put it back: a discarded step then draws nothing.
        """
        kwargs, rows, plan, placeholders = self._prepare_inputs(scheduler_output.scheduled)
        sampled = plan.sampled + [child for _, child in scheduler_output.forks]
        uniform = None
        state = None
        if sampled:
            params = [r.params for r in sampled]
            if scheduler_output.ahead and any(not p.greedy and p.seed is None for p in params):
                state = self.generator.get_state()
            uniform = step_uniforms(params, [r.num_generated_tokens for r in sampled], self.generator)
        return PreparedStep(
            scheduler_output, kwargs, rows, plan, sampled, uniform, placeholders, state, self._input_staging.last_slot
        )

    def discard(self, prepared: PreparedStep) -> None:
        """Drop a prepared step that will not run: the generator's draw is taken back and its staging released."""
        if prepared.generator_state is not None:
            self.generator.set_state(prepared.generator_state)
        self._input_staging.release(prepared.staging_slot)

    def launch(self, prepared: PreparedStep, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Start a step's KV copies, forward and sampling; ``collect`` waits for them.

        Without ``async_batching`` the step is computed before this returns. With it, on CPU the worker
        thread computes it (one step at a time, in launch order, so a step's KV writes land before the
        next step's forward reads or overwrites any block); on CUDA it is enqueued on the current stream.

        Args:
            prepared: the step.
            previous: the step launched before it, whose sampled tokens fill its placeholders (needed when
                ``prepared.placeholders`` is set; collected already, or at least launched earlier).

        Raises:
            ValueError: the step has placeholders and ``previous`` sampled nothing.
            Whatever the forward raises when it runs in the calling thread.
        """
        tokens = None
        if prepared.placeholders is not None:
            tokens = previous.wait().tokens if previous is not None else None
            if tokens is None:
                raise ValueError("a step with placeholder tokens needs the previous step's sampled tokens")
        if self._worker is not None:
            return LaunchedStep(prepared, future=self._worker.submit(self._compute, prepared, tokens))
        try:
            return LaunchedStep(prepared, result=self._compute(prepared, tokens, readback=self.async_batching))
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
    def _compute(
        self, prepared: PreparedStep, previous_tokens: torch.Tensor | None, readback: bool = False
    ) -> StepResult:
        """The device work of a step: KV copies, placeholders, forward, sampling, scores, packed results.

        Args:
            prepared: the step.
            previous_tokens: int64 [B'] the previous step's sampled tokens, for the placeholders.
            readback: start the copy of the results into pinned host memory (CUDA; ``collect`` waits for it).
        """
        scheduler_output = prepared.scheduler_output
        self._move_kv(scheduler_output)
        kwargs, plan = prepared.kwargs, prepared.plan
        if prepared.placeholders is not None:
            assert previous_tokens is not None
            positions, sources = prepared.placeholders[0], prepared.placeholders[1]
            kwargs["input_ids"][0, positions] = previous_tokens.index_select(0, sources)
        out = self.model(**kwargs)
        logits = out.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, prepared.rows)
        logits = logits.float()
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
            tokens, logprobs = sample_tokens(
                sample_logits,
                [r.params for r in sampled],
                None,
                None,
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
            result.logprobs = host[i + b : i + 2 * b] if self.return_logprobs else None
        return result

    @torch.inference_mode()
    def run(self, scheduled: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, LogitsPlan]:
        """One forward of the step (no KV copies, no sampling).

        Returns:
            float32 [R, V]: the kept logits (see ``LogitsPlan``), and their plan.
        """
        kwargs, rows, plan = self.prepare(scheduled)
        out = self.model(**kwargs)
        logits = out.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, rows)
        return logits.float(), plan

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
