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
        shape: layers, KV heads, head dim and dtype (the dtype the attention computes in,
            ``models.attention_dtype``; keys and values arriving in another are cast on write).
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        device: where the step's inputs live (the runner builds its metadata there).
        layer_devices: the device of each layer's tensors (a model sharded with ``device_map`` keeps
            each layer's cache beside the layer); None puts every layer on ``device``.

    Raises:
        ValueError: ``layer_devices`` does not have one device per layer.
    """

    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        layer_devices: Sequence[torch.device] | None = None,
    ) -> None:
        if layer_devices is not None and len(layer_devices) != shape.num_layers:
            raise ValueError(
                f"layer_devices must name one device per layer ({shape.num_layers}), got {len(layer_devices)}"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.layer_devices = list(layer_devices) if layer_devices is not None else [device] * shape.num_layers
        num_slots = num_blocks * block_size
        # Never inference tensors, whatever mode the caller builds the engine in: the steps write
        # them in place from the manager's thread, and a write to an inference tensor outside
        # inference mode is an error.
        with torch.inference_mode(False):
            self.key = [
                torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=d)
                for d in self.layer_devices
            ]
            self.value = [
                torch.zeros(num_slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=d)
                for d in self.layer_devices
            ]
        logger.info(
            "paged KV cache: %d blocks x %d tokens, %s, %.3f GiB on %s",
            num_blocks,
            block_size,
            shape.dtype,
            self.size_bytes / GIB,
            ", ".join(str(d) for d in dict.fromkeys(self.layer_devices)),
        )
        self._warned_cast = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every key and value tensor."""
        return self.shape.dtype

    @property
    def size_bytes(self) -> int:
        """Bytes of all K and V tensors."""
        return self.shape.bytes_per_token * self.num_blocks * self.block_size

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new keys and values.

        Args:
            layer_idx: the layer.
            slot_mapping: int64 [T]; the slot of each query token, on the layer's device.
            key, value: [T, num_kv_heads, head_dim], on the layer's device; cast to the cache's dtype
                when they arrive in another (autocast computes projections and rotary embeddings in
                different dtypes; the first such write logs it once).
        """
        if key.dtype != self.dtype or value.dtype != self.dtype:
            if not self._warned_cast:
                self._warned_cast = True
                logger.info(
                    "keys (%s) and values (%s) are cast to the KV cache's %s on write",
                    key.dtype,
                    value.dtype,
                    self.dtype,
                )
            key, value = key.to(self.dtype), value.to(self.dtype)
        self.key[layer_idx].index_copy_(0, slot_mapping, key)
        self.value[layer_idx].index_copy_(0, slot_mapping, value)


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
        dst = self._slots(pool_ids, torch.device("cpu"))
        src_on: dict[torch.device, torch.Tensor] = {}  # a sharded cache has layers on several devices
        for layer, device in enumerate(cache.layer_devices):
            src = src_on.get(device)
            if src is None:
                src = src_on[device] = self._slots(block_ids, device)
            self.key[layer][dst] = cache.key[layer][src].to("cpu", non_blocking=True)
            self.value[layer][dst] = cache.value[layer][src].to("cpu", non_blocking=True)

    def load(self, cache: PagedKVCache, pool_ids: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks ``pool_ids`` back into cache blocks ``block_ids`` (the pool blocks stay taken)."""
        src = self._slots(pool_ids, torch.device("cpu"))
        dst_on: dict[torch.device, torch.Tensor] = {}
        for layer, device in enumerate(cache.layer_devices):
            dst = dst_on.get(device)
            if dst is None:
                dst = dst_on[device] = self._slots(block_ids, device)
            cache.key[layer][dst] = self.key[layer][src].to(device, non_blocking=True)
            cache.value[layer][dst] = self.value[layer][src].to(device, non_blocking=True)
