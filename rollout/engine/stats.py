"""``EngineStats``: an engine's counters, as ``Engine.stats`` reads them from their owners (``read_stats``); the step
loop's own (``StepMeter``) and its ``ProgressLog``."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.engine.sched.output import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from rollout.engine.batch_queue import BatchQueue
    from rollout.engine.kv.cache import PagedKVCache
    from rollout.engine.kv.manager import KVCacheManager
    from rollout.engine.sched.scheduler import Scheduler
    from rollout.engine.warmup import Warmup
    from rollout.engine.worker.runner import ModelRunner

logger = logging.getLogger("rollout.engine.engine.progress")  # under the engine's logger, which users configure

__all__ = ["EngineStats", "ProgressLog", "StepMeter", "read_stats"]


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


def read_stats(
    counts: EngineStats,
    scheduler: Scheduler,
    kv_cache_manager: KVCacheManager,
    runner: ModelRunner,
    cache: PagedKVCache,
    warmup: Warmup,
    queue: BatchQueue | None,
) -> EngineStats:
    """An engine's counters, read now from their owners (vLLM's ``make_stats``): the step loop's own (``counts``), then
    the scheduler's, the KV cache manager's and block pool's, the runner's, the cache's, the warmup's and the batch
    queue's. A snapshot: it does not change as the engine steps on (its lists do: they are the loop's own)."""
    compiles, captures = warmup.compile_counts()
    pool = kv_cache_manager.block_manager
    return dataclasses.replace(
        counts,
        num_preemptions=scheduler.num_preemptions,
        num_offloads=kv_cache_manager.num_offloads,
        num_prefix_cache_hit_blocks=pool.num_prefix_cache_hit_blocks,
        num_block_copies=kv_cache_manager.num_block_copies,
        num_decode_fast_path_steps=runner.num_decode_fast_path_steps,
        kv_cache_bytes=cache.size_bytes,
        kv_cache_capacity_tokens={g.name: pool.num_blocks * pool.block_size for g in cache.groups},
        num_compiles=compiles,
        num_compiles_after_warmup=compiles - warmup.counts[0] if warmup.done else 0,
        num_cuda_graph_captures=captures,
        num_cuda_graph_captures_after_warmup=captures - warmup.counts[1] if warmup.done else 0,
        warmup_seconds=warmup.seconds,
        num_async_steps=queue.num_async_steps if queue is not None else 0,
    )


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


class StepMeter:
    """The step loop's own counters (``counts``: steps, tokens computed and sampled, decode step times) and its progress
    log; the engine's other counters are read from their owners (``read_stats``).

    Args:
        scheduler: the engine's scheduler (its queues and free blocks, for the progress log).
        runner: the engine's model runner (which paths run padded).
        interval: most seconds between progress logs (``ContinuousBatchingConfig.progress_log_interval``).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, interval: float) -> None:
        self.counts = EngineStats()
        self.scheduler = scheduler
        self.runner = runner
        self._progress = ProgressLog(interval)

    def record(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput, seconds: float) -> None:
        """Count a step that computed something (an empty one counts nothing) and log progress now and then; ``seconds``
        is the wall time the step adds (see ``EngineStats.decode_step_seconds``)."""
        if scheduler_output.is_empty:
            return
        padded = self.runner.path_of(scheduler_output.scheduled) in self.runner.static_paths
        self.counts.count_step(scheduler_output, runner_output, seconds, padded)
        scheduler = self.scheduler
        free = scheduler.kv_cache_manager.num_free_blocks
        self._progress.tick(self.counts.num_generated_tokens, len(scheduler.running), len(scheduler.waiting), free)
