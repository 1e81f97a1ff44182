"""The attention room: rollout's paged attention (``paged``: one function over the flattened step, through the paged
cache), its backends (``flash``: flash-attn's paged kernels on CUDA; ``cpu``: the C++ CPU kernel, built from ``csrc/``
on first use; SDPA otherwise) and its registration with ``transformers.AttentionInterface`` (``registry``: the
dispatcher that runs the model's own attention for any forward without a step's metadata).

May import the ground modules and ``engine.kv.cache`` (the cache tensors it reads and writes), nothing else of rollout:
not the scheduler, not the KV cache manager.
"""

from rollout.engine.attention.cpu import choose_cpu_attention
from rollout.engine.attention.flash import choose_flash, flash_support
from rollout.engine.attention.paged import METADATA_KWARG, PagedAttentionMetadata, paged_attention
from rollout.engine.attention.registry import enable_paged_attention, restore_attention

__all__ = [
    "METADATA_KWARG",
    "PagedAttentionMetadata",
    "choose_cpu_attention",
    "choose_flash",
    "enable_paged_attention",
    "flash_support",
    "paged_attention",
    "restore_attention",
]
