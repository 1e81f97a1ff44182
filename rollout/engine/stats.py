"""``EngineStats``: an engine's counters, as ``Engine.stats`` reads them from their owners; ``ProgressLog``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rollout.engine.sched.output import RunnerOutput, SchedulerOutput

logger = logging.getLogger("rollout.engine.engine.progress")  # under the engine's logger, which users configure

__all__ = ["EngineStats", "ProgressLog"]


@dataclass
class EngineStats:
    """Counters of an engine since it was built: the one place to read them.

    Attributes:
        num_steps: forwards run.
        num_prompt_tokens_computed: prompt tokens whose KV was computed (prefix-cache hits are not computed; recompute
            after preemption is).
        num_tokens_computed: all scheduled tokens computed.
        num_generated_tokens: tokens sampled.
        num_preemptions: requests evicted for lack of blocks.
        num_offloads: preempted requests whose KV went to the CPU pool (not recomputed).
        num_prefix_cache_hit_blocks: blocks handed to requests from the prefix cache (a block shared by G requests
            counts G times when each found it in the cache).
        num_forks: requests forked from another's prefill of the same tokens, which they did not compute (of the G
            samples of a prompt submitted together, G - 1).
        num_block_copies: shared blocks copied before a request wrote into them (copy-on-write of the partial last block
            of a forked prompt).
        num_decode_fast_path_steps: steps that went through flash-attn's ``flash_attn_with_kvcache`` (the CUDA decode
            fast path, see ``ContinuousBatchingConfig.max_blocks_per_request``).
        decode_step_seconds: wall time of steps that only decoded (one token per request). With async batching, the time
            from the later of the step's launch and the previous step's end to the step's end: the wall time the step
            adds.
        decode_step_batch: the batch size of each of those steps.
        kv_cache_bytes: bytes of the paged KV cache's tensors, every layer group together.
        kv_cache_capacity_tokens: per layer group (``KVCacheGroup.name``, e.g. ``"full:5"``, ``"sliding64:0"``), the
            tokens of KV its layers can hold: every block of the pool, which the groups share (a sliding group holds
            only a window of each request, so the pool serves more requests than a cache of full layers of the same
            bytes).
        num_padded_steps: steps run on the static-shape path (a compiled or CUDA-graphed path).
        num_compiles: dynamo compilations triggered by this engine's forwards, warmup included (0 when the graphs were
            already compiled by an earlier engine with the same config).
        num_compiles_after_warmup: those triggered by steps after ``Engine.warmup()`` (0 when warmup never ran).
        num_cuda_graph_captures: CUDA graphs captured, warmup included.
        num_cuda_graph_captures_after_warmup: those captured by steps after ``warmup()``.
        warmup_seconds: wall time of ``warmup()`` (0.0 when an earlier engine on the model had compiled its
            shapes; None when it never ran or had nothing to do).
        num_async_steps: async batching: steps scheduled and launched while the step before them ran.
    """

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_tokens_computed: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_offloads: int = 0
    num_prefix_cache_hit_blocks: int = 0
    num_forks: int = 0
    num_block_copies: int = 0
    num_decode_fast_path_steps: int = 0
    decode_step_seconds: list[float] = field(default_factory=list)
    decode_step_batch: list[int] = field(default_factory=list)
    kv_cache_bytes: int = 0
    kv_cache_capacity_tokens: dict[str, int] = field(default_factory=dict)
    num_padded_steps: int = 0
    num_compiles: int = 0
    num_compiles_after_warmup: int = 0
    num_cuda_graph_captures: int = 0
    num_cuda_graph_captures_after_warmup: int = 0
    warmup_seconds: float | None = None
    num_async_steps: int = 0

    def count_step(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float, padded: bool
    ) -> None:
        """Count a step that computed something in the step loop's own counters.

        Args:
            scheduler_output, runner_output: the step.
            seconds: its wall time (see ``decode_step_seconds``).
            padded: it ran on the static-shape path.
        """
        self.num_steps += 1
        self.num_padded_steps += int(padded)
        self.num_tokens_computed += scheduler_output.total_num_scheduled_tokens
        self.num_prompt_tokens_computed += scheduler_output.num_scheduled_prompt_tokens
        self.num_generated_tokens += len(runner_output.sampled_token_ids)
        self.num_forks += len(scheduler_output.forks)
        if scheduler_output.is_decode_only:
            self.decode_step_seconds.append(seconds)
            self.decode_step_batch.append(len(scheduler_output.scheduled))


class ProgressLog:
    """A debug log of throughput at most every ``interval`` seconds (``config.progress_log_interval``)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = (time.perf_counter(), 0)  # (time, generated tokens) of the last log

    def tick(self, generated: int, running: int, waiting: int, free_blocks: int) -> None:
        """Log if ``interval`` seconds passed since the last log; ``generated`` counts every token sampled."""
        now = time.perf_counter()
        if now - self._last[0] < self.interval:
            return
        rate = (generated - self._last[1]) / (now - self._last[0])
        logger.debug(
            "%.1f generated tokens/s; %d running, %d waiting, %d free blocks", rate, running, waiting, free_blocks
        )
        self._last = (now, generated)
