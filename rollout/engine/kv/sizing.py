"""How many KV blocks an engine gets: the device's usable memory, the step's logits workspace, the
engine's share of what is left; and the CPU offload pool's size.

A ``num_blocks`` that cannot fit the device's usable memory is refused before the cache is allocated
(``check_cache_fits``): on Linux an allocation larger than the RAM left may succeed on paper (overcommit) and the
process be killed for memory part way, without a word. An allocation that fails anyway (engines built together size
their caches from the same free memory; a ``max_memory_percent`` near 1) is answered as ``CacheAllocationError``
(``allocation_error``). Both messages name ``num_blocks`` and ``max_memory_percent``, what was asked for and what is
usable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch
from transformers import PreTrainedModel

from rollout.checks import FieldError
from rollout.config import ContinuousBatchingConfig
from rollout.engine.kv.cache import GIB, CacheShape
from rollout.weights.model_info import attention_dtype, input_device, layer_devices, vocab_size

logger = logging.getLogger(__name__)

# Float32 temporaries of one step's logits and sampling, per logits entry (row x vocabulary), on top of
# the model's own logits. The plain temperature-sampling path with logprobs peaks at 7 live at once
# (the float32 copy, the scaled logits, the softmax, the float64 CDF counted as two, and the scaled copy
# and log-softmax of the logprobs); one more covers the top-k/top-p masks, which run on sampled rows only.
LOGITS_FLOAT32_TEMPORARIES = 8
# The message of torch's CPU allocator when malloc fails (``DefaultCPUAllocator: can't allocate memory``): a plain
# RuntimeError, with no type of its own (CUDA's is ``torch.OutOfMemoryError``).
CPU_ALLOCATOR_FAILURE = "can't allocate memory"


@dataclass(frozen=True)
class MemoryReport:
    """What a new allocation on a device can use, in bytes.

    Attributes:
        free: bytes the driver reports free (``torch.cuda.mem_get_info``), or psutil's available RAM on CPU.
        cached: bytes torch's CUDA caching allocator holds but no tensor uses
            (``memory_reserved - memory_allocated``; 0 on CPU). The driver counts them as used, yet
            torch hands them out first, so an engine built after another one was destroyed, or after a
            training step freed its temporaries, can use them.
    """

    free: int
    cached: int

    @property
    def usable(self) -> int:
        """Bytes this process can allocate: ``free + cached``."""
        return self.free + self.cached


def memory_report(device: torch.device) -> MemoryReport:
    """The device's free and cached-but-unused bytes (see ``MemoryReport``)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return MemoryReport(int(free), max(0, int(cached)))
    return MemoryReport(int(psutil.virtual_memory().available), 0)


def usable_memory_bytes(device: torch.device) -> int:
    """Bytes this process can allocate on a device: ``memory_report(device).usable``."""
    return memory_report(device).usable


def logits_workspace_bytes(max_batch_tokens: int, vocab: int, logits_dtype: torch.dtype) -> int:
    """Bytes of one step's logits and sampling temporaries, at most.

    A step keeps the logits of at most ``max_batch_tokens`` rows (sampled requests' last tokens plus
    scored positions); each row holds ``vocab`` entries in the model's dtype, plus
    ``LOGITS_FLOAT32_TEMPORARIES`` float32 temporaries of the sampler and the logprobs.

    Args:
        max_batch_tokens: the step's token budget (rows of logits at most).
        vocab: entries per row (the LM head's width).
        logits_dtype: the dtype the model returns its logits in.

    Returns:
        ``max_batch_tokens * vocab * (itemsize(logits_dtype) + 4 * LOGITS_FLOAT32_TEMPORARIES)``.
    """
    elem = torch.empty((), dtype=logits_dtype).element_size()
    return max_batch_tokens * vocab * (elem + 4 * LOGITS_FLOAT32_TEMPORARIES)


def num_blocks_for_memory(
    shape: CacheShape,
    block_size: int,
    device: torch.device,
    memory_percent: float,
    workspace_bytes: int = 0,
    usable_bytes: int | None = None,
) -> int:
    """Blocks that fit in the engine's share of the device's usable memory (at least 1).

    The engine takes ``memory_percent`` of the usable memory (free plus torch's cached-but-unused bytes, see
    ``MemoryReport``): its step workspace first (``logits_workspace_bytes``), the KV cache from the rest.

    Args:
        shape: the cache's per-token shape.
        block_size: tokens per block.
        device: where the cache goes.
        memory_percent: the engine's share, in (0, 1].
        workspace_bytes: bytes of the step's temporaries, taken from the share before the cache.
        usable_bytes: the usable memory in bytes; None measures it (``usable_memory_bytes``).

    Returns:
        ``max(1, floor((usable * memory_percent - workspace_bytes) / (bytes_per_token * block_size)))``.
    """
    usable = usable_memory_bytes(device) if usable_bytes is None else usable_bytes
    share = usable * memory_percent
    per_block = shape.bytes_per_token * block_size
    if share - workspace_bytes < per_block:
        logger.warning(
            "KV cache sizing: %.0f%% of %.3f GiB usable on %s leaves no room for one %d-token block after the "
            "%.3f GiB logits workspace; the cache gets 1 block (set num_blocks, or lower max_batch_tokens)",
            100 * memory_percent,
            usable / GIB,
            device,
            block_size,
            workspace_bytes / GIB,
        )
    return max(1, int((share - workspace_bytes) // per_block))


def num_blocks_for_model(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig | None = None,
    memory_percent: float | None = None,
    usable_bytes: int | None = None,
) -> int:
    """The blocks an engine built now on ``model`` sizes from memory (``num_blocks`` unset).

    A block here is what ``ContinuousBatchingConfig.num_blocks`` counts: ``page_size`` tokens of KV in every layer
    (a whole-model block), which the engine lays out per layer group (``CacheLayout.pool_blocks``). The cache holds
    the dtype attention computes in; block size, token budget and share come from ``config`` unless
    ``memory_percent`` is given. The step's logits workspace (``logits_workspace_bytes``) comes out of the share on
    the last layer's device. Each device of a ``device_map``-sharded model holds its own layers' share of every
    block, so the tightest device decides.

    Args:
        model: a supported decoder-only model (``check_model_supported``).
        config: the engine's settings; None: the defaults.
        memory_percent: the share to use instead of the config's, in (0, 1].
        usable_bytes: the usable memory of each device in bytes; None measures it.

    Returns:
        The number of blocks (>= 1), as ``num_blocks_for_memory`` computes it.
    """
    config = config or ContinuousBatchingConfig()
    devices = layer_devices(model)
    dtype = attention_dtype(model)
    dev_type = input_device(model).type
    shape = CacheShape.from_model(model, dtype)
    workspace = logits_workspace_bytes(config.resolved_max_batch_tokens(dev_type), vocab_size(model), dtype)
    return min(
        num_blocks_for_memory(
            shape.subset([i for i, d in enumerate(devices) if d == device]),
            config.resolved_page_size(dev_type),
            device,
            config.resolved_memory_percent(device.type) if memory_percent is None else memory_percent,
            workspace if device == devices[-1] else 0,
            usable_bytes,
        )
        for device in dict.fromkeys(devices)
    )


def offload_space_gib(config: ContinuousBatchingConfig) -> float:
    """GiB of the CPU offload pool of an engine with ``config``; 0 when preempted requests are recomputed.

    Offload is on when ``preemption_mode="offload"`` or ``cpu_offload_space`` is above 0 or None
    (transformers turns it on by the space alone); the space is capped at
    ``cpu_offload_space_safety_threshold`` of the available RAM (a warning when nothing is left).
    """
    wanted = config.preemption_mode == "offload" or config.cpu_offload_space is None or config.cpu_offload_space > 0
    if not wanted:
        return 0.0
    gib = config.resolved_cpu_offload_gib(memory_report(torch.device("cpu")).free)
    if gib <= 0:
        logger.warning(
            "preemption_mode='offload' with cpu_offload_space=%s (safety threshold %s): no CPU pool, preempted "
            "requests are recomputed",
            config.cpu_offload_space,
            config.cpu_offload_space_safety_threshold,
        )
    return gib


class CacheAllocationError(MemoryError):
    """The KV cache could not be allocated; the message names ``num_blocks`` and ``max_memory_percent``, what was
    asked for and what is usable now (``allocation_error``)."""


def _usable(device: torch.device) -> str:
    return f"{usable_memory_bytes(device) / GIB:.2f} GiB are usable on {device}"


def check_cache_fits(model: PreTrainedModel, config: ContinuousBatchingConfig) -> None:
    """Refuse a ``num_blocks`` cache that cannot fit the device's usable memory beside the step's workspace (nothing
    to check when ``num_blocks`` is unset: the cache is then sized from ``max_memory_percent``, so it fits).

    Raises:
        FieldError: ``num_blocks``; the message gives the cache's GiB, the GiB usable and the most blocks that fit.
    """
    if config.num_blocks is None:
        return
    most = num_blocks_for_model(model, config, memory_percent=1.0)  # every usable byte, less the step's workspace
    if config.num_blocks <= most:
        return
    device = input_device(model)
    page = config.resolved_page_size(device.type)
    asked = CacheShape.from_model(model, attention_dtype(model)).bytes_per_token * page * config.num_blocks
    raise FieldError(
        "num_blocks",
        f"num_blocks={config.num_blocks}: a KV cache of {config.num_blocks} blocks of {page} tokens "
        f"({asked / GIB:.2f} GiB) does not fit: {_usable(device)}, room for at most {most} blocks beside the step's "
        "workspace; lower num_blocks, or leave it unset and size the cache with max_memory_percent (now "
        f"{config.resolved_memory_percent(device.type):g} of the usable memory)",
    )


def allocation_error(
    model: PreTrainedModel, config: ContinuousBatchingConfig, error: BaseException
) -> CacheAllocationError | None:
    """What to raise for ``error``, raised while the KV cache was allocated: a ``CacheAllocationError`` with what was
    asked for (the blocks of ``num_blocks`` or the share of ``max_memory_percent``), what is usable now and the
    allocator's own first line; None when ``error`` is no failed allocation (``MemoryError``,
    ``torch.OutOfMemoryError``, or torch's CPU allocator's RuntimeError)."""
    failed = isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(error)
    )
    if not failed:
        return None
    device = input_device(model)
    if config.num_blocks is not None:
        asked = f"num_blocks={config.num_blocks}: the KV cache of {config.num_blocks} blocks"
    else:
        share = config.resolved_memory_percent(device.type)
        asked = f"max_memory_percent={share:g}: the KV cache of {share:g} of the usable memory"
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CacheAllocationError(
        f"{asked} could not be allocated ({cause}); {_usable(device)} now (other processes, or engines built "
        "together, may hold the rest); lower num_blocks or max_memory_percent"
    )
