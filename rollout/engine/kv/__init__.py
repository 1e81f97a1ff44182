"""The KV memory room: the block pool and prefix hashing (``block_pool``), the layer groups' policies
(``group_policy``), the cache tensors and their layout (``cache``), the KV cache manager that gives requests their
blocks (``manager``), the cache's sizing (``sizing``) and the pinned CPU pool of offload preemption (``offload``).

May import the ground modules (``rollout.checks``, ``config``, ``sampling_params``, ``stop_strings``, ``requests``)
and ``rollout.weights`` (model introspection), nothing else of rollout. The scheduler reads the KV cache manager; the
attention backends and the worker read the cache tensors (``cache``) and the offload pool, never the manager.
"""

from rollout.engine.kv.block_pool import NULL_BLOCK, BlockManager
from rollout.engine.kv.cache import CacheLayout, CacheShape, PagedKVCache
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.engine.kv.sizing import num_blocks_for_model, offload_space_gib, usable_memory_bytes

__all__ = [
    "NULL_BLOCK",
    "BlockManager",
    "CPUOffloadPool",
    "CacheLayout",
    "CacheShape",
    "KVCacheManager",
    "PagedKVCache",
    "num_blocks_for_model",
    "offload_space_gib",
    "usable_memory_bytes",
]
