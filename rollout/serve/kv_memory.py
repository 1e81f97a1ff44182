"""The KV cache ``rollout-serve`` is asked for, against the memory there is: one line naming the flags, no traceback.

A ``--num-blocks`` cache that cannot fit the device's usable memory (``rollout.usable_memory_bytes``: the available RAM
on CPU, free plus torch's cached bytes on CUDA) is refused before it is allocated: on Linux an allocation larger than
the RAM left may succeed on paper (overcommit) and the process be killed for memory part way, without a word. An
allocation that still fails (replicas started together size their caches from the same free memory; a
``--max-memory-percent`` near 1) is answered the same way. Each message names ``--num-blocks`` and
``--max-memory-percent``, what was asked for and what is usable.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout import ContinuousBatchingConfig, num_blocks_for_model, usable_memory_bytes
from rollout.engine.kv.cache import CacheShape
from rollout.weights.model_info import attention_dtype, input_device

GIB = 1024**3
# The message of torch's CPU allocator when malloc fails (``DefaultCPUAllocator: can't allocate memory``): a plain
# RuntimeError, with no type of its own (CUDA's is ``torch.OutOfMemoryError``).
CPU_ALLOCATOR_FAILURE = "can't allocate memory"


def _usable(device: Any) -> str:
    return f"{usable_memory_bytes(device) / GIB:.2f} GiB are usable on {device}"


def oversized_cache(model: Any, config: ContinuousBatchingConfig) -> str | None:
    """Why a ``--num-blocks`` cache cannot fit, or None when it can (or when ``num_blocks`` is unset: the cache is
    then sized from ``--max-memory-percent`` of the memory there is, so it fits when it is built).

    Args:
        model: the loaded model (its layers' KV shapes and device).
        config: the engine's configuration.
    """
    if config.num_blocks is None:
        return None
    most = num_blocks_for_model(model, config, memory_percent=1.0)  # every usable byte, less the step's workspace
    if config.num_blocks <= most:
        return None
    device = input_device(model)
    page = config.resolved_page_size(device.type)
    asked = CacheShape.from_model(model, attention_dtype(model)).bytes_per_token * page * config.num_blocks
    return (
        f"--num-blocks {config.num_blocks}: a KV cache of {config.num_blocks} blocks of {page} tokens "
        f"({asked / GIB:.2f} GiB) does not fit: {_usable(device)}, room for at most {most} blocks beside the step's "
        "workspace; lower --num-blocks, or leave it unset and size the cache with --max-memory-percent (now "
        f"{config.resolved_memory_percent(device.type):g} of the usable memory)"
    )


def is_allocation_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed allocation (``MemoryError``, ``torch.OutOfMemoryError``, or torch's CPU
    allocator's RuntimeError)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(error)


def allocation_failure(model: Any, config: ContinuousBatchingConfig, error: BaseException) -> str:
    """The one line that answers an engine whose KV cache could not be allocated: what was asked for (the blocks of
    ``--num-blocks`` or the share of ``--max-memory-percent``), what is usable now, and torch's own first line."""
    device = input_device(model)
    if config.num_blocks is not None:
        asked = f"--num-blocks {config.num_blocks}: the KV cache of {config.num_blocks} blocks"
    else:
        share = config.resolved_memory_percent(device.type)
        asked = f"--max-memory-percent {share:g}: the KV cache of {share:g} of the usable memory"
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"{asked} could not be allocated ({cause}); {_usable(device)} now (other processes, or replicas started "
        "together, may hold the rest); lower --num-blocks or --max-memory-percent"
    )
