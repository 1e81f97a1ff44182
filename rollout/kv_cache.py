"""The paged K/V tensors of every attention layer, and their sizing from free memory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch
from transformers import PreTrainedModel

from .models import layer_kv_shapes

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class CacheShape:
    """What one token of KV costs: layers, KV heads, head dim, dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_model(cls, model: PreTrainedModel, dtype: torch.dtype) -> CacheShape:
        """The KV shape of a decoder-only model whose layers all share one (``check_model_supported``)."""
        shapes = layer_kv_shapes(model)
        num_kv_heads, head_dim = shapes[0]
        return cls(len(shapes), num_kv_heads, head_dim, dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of a device in bytes: ``torch.cuda.mem_get_info`` on CUDA, psutil's available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def num_blocks_for_memory(shape: CacheShape, block_size: int, device: torch.device, memory_percent: float) -> int:
    """Blocks that fit in ``memory_percent`` of the device's free memory (at least 1)."""
    budget = free_memory_bytes(device) * memory_percent
    per_block = shape.bytes_per_token * block_size
    return max(1, int(budget // per_block))


class PagedKVCache:
    """Per-layer key and value tensors of the paged cache.

    Each layer holds ``key[layer]`` and ``value[layer]`` of shape
    ``[num_blocks * block_size, num_kv_heads, head_dim]``: one row per slot, where
    slot = block_id * block_size + offset in block. The tensors start zeroed: padded
    gathers read slots that hold no token, and masked garbage (NaN * 0) would still
    poison the attention output. On CPU zeroed pages are only touched when written.

    Args:
        shape: layers, KV heads, head dim and dtype.
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        device: where the tensors live.
    """

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        # Never inference tensors, whatever mode the caller builds the engine in: the steps write
        # them in place from the manager's thread, and a write to an inference tensor outside
        # inference mode is an error.
        with torch.inference_mode(False):
            self.key = [
                torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
                for _ in range(shape.num_layers)
            ]
            self.value = [
                torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
                for _ in range(shape.num_layers)
            ]
        logger.info(
            "paged KV cache: %d blocks x %d tokens, %.3f GiB on %s",
            num_blocks,
            block_size,
            self.size_bytes / GIB,
            device,
        )

    @property
    def size_bytes(self) -> int:
        """Bytes of all K and V tensors."""
        return self.shape.bytes_per_token * self.num_blocks * self.block_size

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new keys and values.

        Args:
            layer_idx: the layer.
            slot_mapping: int64 [T]; the slot of each query token.
            key, value: [T, num_kv_heads, head_dim] in the cache's dtype.
        """
        self.key[layer_idx].index_copy_(0, slot_mapping, key)
        self.value[layer_idx].index_copy_(0, slot_mapping, value)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks within the cache, every layer (copy-on-write of a shared block).

        Every source is read before any destination is written, so a block may be the source of
        one pair and the destination of a later one (freed and reused in the same step).

        Args:
            pairs: (source block id, destination block id); destinations are distinct.
        """
        if not pairs:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        ids = torch.tensor(pairs, dtype=torch.int64, device=self.device)  # [P, 2]
        src = (ids[:, 0:1] * bs + offsets).reshape(-1)
        dst = (ids[:, 1:2] * bs + offsets).reshape(-1)
        for tensors in (self.key, self.value):
            for layer in tensors:
                layer.index_copy_(0, dst, layer.index_select(0, src))


class CPUOffloadPool:
    """CPU memory that holds the KV blocks of requests preempted by offload.

    Per layer, ``key[layer]`` and ``value[layer]`` have the cache's slot layout
    ``[num_blocks * block_size, num_kv_heads, head_dim]``; pinned when the cache is on
    CUDA, so copies can overlap. Blocks are handed out from a free list: the KV cache manager
    allocates and frees them (bookkeeping), the model runner copies into and out of them.

    Args:
        shape: the cache's shape.
        space_gib: GiB of CPU memory to use (> 0).
        block_size: tokens per block (the cache's).
        pin: pin the memory (for a CUDA cache).
    """

    def __init__(self, shape: CacheShape, space_gib: float, block_size: int, pin: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = max(0, int(space_gib * GIB // (shape.bytes_per_token * block_size)))
        num_slots = self.num_blocks * block_size
        make = lambda: torch.zeros(  # noqa: E731
            num_slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, pin_memory=pin
        )
        with torch.inference_mode(False):  # as for the cache: written in place from any thread
            self.key = [make() for _ in range(shape.num_layers)]
            self.value = [make() for _ in range(shape.num_layers)]
        self.free_blocks = list(range(self.num_blocks))

    def _slots(self, block_ids: list[int], device: torch.device) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        offsets = torch.arange(self.block_size, device=device)
        return (ids[:, None] * self.block_size + offsets[None, :]).reshape(-1)

    def can_hold(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` pool blocks are free."""
        return num_blocks <= len(self.free_blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` pool blocks (bookkeeping only; ``store`` fills them).

        Raises:
            RuntimeError: fewer free blocks than asked (check ``can_hold`` first).
        """
        if not self.can_hold(num_blocks):
            raise RuntimeError(f"offload pool has {len(self.free_blocks)} free blocks, asked for {num_blocks}")
        return [self.free_blocks.pop() for _ in range(num_blocks)]

    def free(self, pool_ids: list[int]) -> None:
        """Return pool blocks to the free list."""
        self.free_blocks.extend(pool_ids)

    def store(self, cache: PagedKVCache, block_ids: list[int], pool_ids: list[int]) -> None:
        """Copy cache blocks ``block_ids`` into pool blocks ``pool_ids`` (same length), every layer."""
        src = self._slots(block_ids, cache.device)
        dst = self._slots(pool_ids, torch.device("cpu"))
        for layer in range(len(cache.key)):
            self.key[layer][dst] = cache.key[layer][src].to("cpu", non_blocking=True)
            self.value[layer][dst] = cache.value[layer][src].to("cpu", non_blocking=True)

    def load(self, cache: PagedKVCache, pool_ids: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks ``pool_ids`` back into cache blocks ``block_ids`` (the pool blocks stay taken)."""
        src = self._slots(pool_ids, torch.device("cpu"))
        dst = self._slots(block_ids, cache.device)
        for layer in range(len(cache.key)):
            cache.key[layer][dst] = self.key[layer][src].to(cache.device, non_blocking=True)
            cache.value[layer][dst] = self.value[layer][src].to(cache.device, non_blocking=True)
