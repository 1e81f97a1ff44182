"""``EngineStats``: an engine's counters, as ``Engine.stats`` reads them from their owners."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters of an engine since it was built: the one place to read them.

    Attributes:
        num_steps: forwards run.
        num_prompt_tokens_computed: prompt tokens whose KV was computed (prefix-cache
            hits are not computed; recompute after preemption is).
        num_tokens_computed: all scheduled tokens computed.
        num_generated_tokens: tokens sampled.
        num_preemptions: requests evicted for lack of blocks.
        num_offloads: preempted requests whose KV went to the CPU pool (not recomputed).
        num_prefix_cache_hit_blocks: blocks handed to requests from the prefix cache (a block
            shared by G requests counts G times when each found it in the cache).
        num_forks: requests forked from another's prefill of the same tokens, which they did not
            compute (of the G samples of a prompt submitted together, G - 1).
        num_block_copies: shared blocks copied before a request wrote into them (copy-on-write of
            the partial last block of a forked prompt).
        num_decode_fast_path_steps: steps that went through flash-attn's ``flash_attn_with_kvcache``
            (the CUDA decode fast path, see ``ContinuousBatchingConfig.max_blocks_per_request``).
        decode_step_seconds: wall time of steps that only decoded (one token per request). With async
            batching, the time from the later of the step's launch and the previous step's end to the
            step's end: the wall time the step adds.
        decode_step_batch: the batch size of each of those steps.
        kv_cache_bytes: bytes of the paged KV cache's tensors, every layer group together.
        kv_cache_capacity_tokens: per layer group (``KVCacheGroup.name``, e.g. ``"full:5"``,
            ``"sliding64:0"``), the tokens of KV its layers can hold: every block of the pool, which the
            groups share (a sliding group holds only a window of each request, so the pool serves more
            requests than a cache of full layers of the same bytes).
        num_padded_steps: steps run on the static-shape path (a compiled or CUDA-graphed path).
        num_compiles: dynamo compilations triggered by this engine's forwards, warmup included (0
            when the graphs were already compiled by an earlier engine with the same config).
        num_compiles_after_warmup: those triggered by steps after ``Engine.warmup()`` (0 when
            warmup never ran).
        num_cuda_graph_captures: CUDA graphs captured, warmup included.
        num_cuda_graph_captures_after_warmup: those captured by steps after ``warmup()``.
        warmup_seconds: wall time of ``warmup()`` (None when it never ran or had nothing to do).
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
