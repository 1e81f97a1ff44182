"""The paged K/V tensors of every attention layer, grouped by layer kind and shape (their sizing from
memory is ``sizing``'s, the CPU offload pool ``offload``'s).

Layer groups. Layers are grouped by what their cache must hold: (sliding window, KV heads, head dim). A sliding
group keeps, per request, only the blocks its next queries read (a Gemma-3 model holds a whole sequence in 1 layer
of 6). Each group has its own block table per request (``Request.block_tables``), as in vLLM v1's hybrid KV cache
manager (``vllm/v1/core/kv_cache_coordinator.py``): a sliding group gives back the blocks that left its window while
a full group keeps the same positions. transformers keeps a sliding group in a ring buffer per request instead
(``cache_allocators/sliding_attention.py``), which cannot share pages nor give the flash kernel a block table.

Memory. The groups draw on one pool of block ids, so one block id must mean the same bytes in every group: the
layers are split into groups of equal size k (the gcd of the layer counts of each kind: Gemma-3's 5:1 gives 6
groups of one layer), and tensor slot j holds the j-th layer of every group (vLLM's ``KVCacheTensor``). A block id
belongs to one group at a time, so the layers sharing a slot never write the same block. Layers whose token rows
differ share slots padded to the widest row (``CacheLayout.row_shape``). A model sharded over devices keeps each
slot on one device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rollout.engine.kv.group_policy import group_policies
from rollout.weights.model_info import layer_kv_shapes, layer_sliding_windows

logger = logging.getLogger(__name__)

GIB = 1024**3


@dataclass(frozen=True)
class LayerKV:
    """What one attention layer keeps per token: KV heads, head dim, and its sliding window (None: full)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    @property
    def row(self) -> int:
        """Elements of one token's keys (or values): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheShape:
    """What one token of KV costs: layers, KV heads, head dim, dtype; per layer when the layers differ.

    Attributes:
        num_layers: attention layers.
        num_kv_heads, head_dim: of every layer when ``layers`` is empty, else of layer 0.
        dtype: the cache's dtype.
        layers: each layer's ``LayerKV`` (shape and sliding window); empty means every layer is
            ``LayerKV(num_kv_heads, head_dim)`` with full attention.

    Raises:
        ValueError: ``layers`` is given with another length than ``num_layers``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layers: tuple[LayerKV, ...] = ()

    def __post_init__(self) -> None:
        if self.layers and len(self.layers) != self.num_layers:
            raise ValueError(f"layers must give one LayerKV per layer ({self.num_layers}), got {len(self.layers)}")

    @classmethod
    def from_model(cls, model: PreTrainedModel, dtype: torch.dtype, sliding_windows: bool = True) -> CacheShape:
        """The KV shape of each layer of a decoder-only model (``weights.model_info.layer_kv_shapes``) and its sliding
        window (``weights.model_info.layer_sliding_windows``; all None when ``sliding_windows`` is False)."""
        shapes = layer_kv_shapes(model)
        windows = layer_sliding_windows(model) if sliding_windows else [None] * len(shapes)
        layers = tuple(LayerKV(kv, dim, w) for (kv, dim), w in zip(shapes, windows, strict=True))
        num_kv_heads, head_dim = shapes[0]
        return cls(len(shapes), num_kv_heads, head_dim, dtype, layers)

    def layer(self, index: int) -> LayerKV:
        """Layer ``index``'s ``LayerKV``."""
        return self.layers[index] if self.layers else LayerKV(self.num_kv_heads, self.head_dim)

    def subset(self, indices: Sequence[int]) -> CacheShape:
        """The shape of some of the layers (those a device holds, for sizing)."""
        layers = tuple(self.layer(i) for i in indices)
        return CacheShape(len(layers), self.num_kv_heads, self.head_dim, self.dtype, layers)

    @property
    def element_size(self) -> int:
        """Bytes of one element of the dtype."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers (each at its own shape, no padding)."""
        return 2 * sum(self.layer(i).row for i in range(self.num_layers)) * self.element_size


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose cache is managed together: one block table per request, one kind of eviction.

    Attributes:
        name: ``"full:1,3"`` or ``"sliding64:0"`` (kind, then the layers; ``":HxD"``, KV heads x head dim,
            is added when the model's layers differ in shape); the key of ``EngineStats.kv_cache_capacity_tokens``.
        layers: the model's layer indices, ascending.
        sliding_window: the window of its layers, None for full attention.
    """

    name: str
    layers: tuple[int, ...]
    sliding_window: int | None


@dataclass(frozen=True)
class CacheLayout:
    """How the layers of a cache are grouped and where their tensors are (see the module docstring).

    Attributes:
        groups: the layer groups, ordered by their first layer.
        layer_group: the group of each layer.
        layer_slot: the tensor slot of each layer (layers of different groups share a slot).
        slot_devices: the device of each slot.
        row_shape: (heads, dim) of one token's keys in every slot: the layers' own when they all share
            one, else (1, the widest row) and narrower layers use the first elements of each row.
    """

    groups: tuple[KVCacheGroup, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    slot_devices: tuple[torch.device, ...]
    row_shape: tuple[int, int]

    @classmethod
    def build(cls, shape: CacheShape, layer_devices: Sequence[torch.device]) -> CacheLayout:
        """Group the layers of ``shape`` and give each a tensor slot.

        Layers are keyed by (sliding window, KV heads, head dim); each key's layers, in order, are cut
        into groups of k = gcd of the keys' layer counts (a model whose layers share one key is one
        group). On each device, the i-th layer of a group there takes that device's slot i.

        Raises:
            ValueError: ``layer_devices`` does not give one device per layer.
        """
        n = shape.num_layers
        if len(layer_devices) != n:
            raise ValueError(f"layer_devices must name one device per layer ({n}), got {len(layer_devices)}")
        layers = [shape.layer(i) for i in range(n)]
        by_key: dict[tuple[int | None, int, int], list[int]] = {}
        for i, layer in enumerate(layers):
            by_key.setdefault((layer.sliding_window, layer.num_kv_heads, layer.head_dim), []).append(i)
        k = math.gcd(*(len(v) for v in by_key.values()))
        mixed_shapes = len({(kv, dim) for _, kv, dim in by_key}) > 1
        chunks = sorted(
            (tuple(indices[j : j + k]), key) for key, indices in by_key.items() for j in range(0, len(indices), k)
        )
        groups = []
        layer_group = [0] * n
        for g, (members, (window, kv, dim)) in enumerate(chunks):
            kind = "full" if window is None else f"sliding{window}"
            name = f"{kind}:{','.join(map(str, members))}" + (f":{kv}x{dim}" if mixed_shapes else "")
            groups.append(KVCacheGroup(name, members, window))
            for layer in members:
                layer_group[layer] = g
        index_on_device = [0] * n  # each layer's index among its group's layers on its device
        for group in groups:
            used: dict[torch.device, int] = {}
            for layer in group.layers:
                index_on_device[layer] = used.get(layer_devices[layer], 0)
                used[layer_devices[layer]] = index_on_device[layer] + 1
        # Slots numbered in the order of their first layer, so that a single group's slot i is layer i.
        slot_of: dict[tuple[torch.device, int], int] = {}
        layer_slot = [slot_of.setdefault((layer_devices[i], index_on_device[i]), len(slot_of)) for i in range(n)]
        slot_devices = [device for device, _ in slot_of]
        rows = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
        row_shape = next(iter(rows)) if len(rows) == 1 else (1, max(layer.row for layer in layers))
        return cls(tuple(groups), tuple(layer_group), tuple(layer_slot), tuple(slot_devices), row_shape)

    @property
    def num_slots(self) -> int:
        """Tensor slots (K and V each) of the cache."""
        return len(self.slot_devices)

    @property
    def sliding_windows(self) -> list[int | None]:
        """The sliding window of each group, in group order (None: full attention)."""
        return [group.sliding_window for group in self.groups]

    def pool_block_bytes(self, shape: CacheShape, block_size: int, device: torch.device | None = None) -> int:
        """Bytes of one block id over every slot (on ``device`` only, when given): K and V, padded rows."""
        heads, dim = self.row_shape
        slots = sum(1 for d in self.slot_devices if device is None or d == device)
        return 2 * slots * block_size * heads * dim * shape.element_size

    def pool_blocks(self, shape: CacheShape, num_model_blocks: int, block_size: int) -> int:
        """The block ids that the memory of ``num_model_blocks`` whole-model blocks holds.

        A whole-model block is ``block_size`` tokens of KV in every layer (``shape.bytes_per_token`` each); its
        bytes, per device, buy that device's share of ``pool_block_bytes``. For a model whose layers form one
        group, the two are the same; Gemma-3's 6 groups of one layer get 6 block ids for each whole-model block.

        Returns:
            ``min`` over devices of ``floor(num_model_blocks * model bytes there / pool bytes there)``, >= 1.
        """
        layer_devs = [self.slot_devices[slot] for slot in self.layer_slot]
        counts = []
        for device in dict.fromkeys(self.slot_devices):
            layers = [i for i, d in enumerate(layer_devs) if d == device]
            model_bytes = shape.subset(layers).bytes_per_token * block_size
            counts.append(num_model_blocks * model_bytes // self.pool_block_bytes(shape, block_size, device))
        return max(1, min(counts))

    def max_blocks_needed(self, num_tokens: int, max_chunk: int, block_size: int) -> int:
        """The most block ids a request of ``num_tokens`` tokens holds at once, over all groups."""
        return sum(p.max_blocks_held(num_tokens, max_chunk) for p in group_policies(self.sliding_windows, block_size))

    def slots_by_device(self) -> list[tuple[torch.device, list[int]]]:
        """The tensor slots grouped by the device that holds them, in slot order."""
        found: dict[torch.device, list[int]] = {}
        for slot, device in enumerate(self.slot_devices):
            found.setdefault(device, []).append(slot)
        return list(found.items())


def block_slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """int64 [len(block_ids) * block_size]: the cache slots of whole blocks, block by block, on ``device``."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)


class PagedKVCache:
    """Per-layer key and value tensors of the paged cache, laid out by layer group (``CacheLayout``).

    Each layer reads and writes ``key[layer]`` and ``value[layer]``, ``[num_blocks * block_size, num_kv_heads,
    head_dim]`` (its own shape): one row per slot, slot = block_id * block_size + offset in block. They are
    views of the tensor slot the layer shares with one layer of each other group (``slot_key``/``slot_value``,
    ``[num_blocks * block_size, *row_shape]``); with one group, ``key[layer]`` is the layer's slot. The tensors
    start zeroed: padded gathers read slots that hold no token, and masked garbage (NaN * 0) would still poison
    the attention output; on CPU zeroed pages are only touched when written.

    Args:
        shape: layers, KV heads, head dim (per layer when they differ) and dtype (the dtype the
            attention computes in, ``weights.model_info.attention_dtype``; keys and values arriving in another are
            cast on write).
        num_blocks: block ids in the pool (every group's blocks together).
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
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.layer_devices = list(layer_devices) if layer_devices is not None else [device] * shape.num_layers
        self.layout = CacheLayout.build(shape, self.layer_devices)
        num_slots = num_blocks * block_size
        row_shape = self.layout.row_shape
        # Never inference tensors, whatever mode the caller builds the engine in: the steps write them in place
        # from the manager's thread, and a write to an inference tensor outside inference mode is an error.
        with torch.inference_mode(False):
            self.slot_key = [
                torch.zeros(num_slots, *row_shape, dtype=shape.dtype, device=d) for d in self.layout.slot_devices
            ]
            self.slot_value = [
                torch.zeros(num_slots, *row_shape, dtype=shape.dtype, device=d) for d in self.layout.slot_devices
            ]
        slots = self.layout.layer_slot
        self.key = [self._layer_view(self.slot_key[slots[i]], shape.layer(i)) for i in range(shape.num_layers)]
        self.value = [self._layer_view(self.slot_value[slots[i]], shape.layer(i)) for i in range(shape.num_layers)]
        groups = self.layout.groups
        width = row_shape[0] * row_shape[1]
        narrow = [i for i in range(shape.num_layers) if shape.layer(i).row < width]
        logger.info(
            "paged KV cache: %d blocks x %d tokens, %s, %.3f GiB on %s; %d layer group%s%s%s",
            num_blocks,
            block_size,
            shape.dtype,
            self.size_bytes / GIB,
            ", ".join(str(d) for d in dict.fromkeys(self.layer_devices)),
            len(groups),
            "" if len(groups) == 1 else "s",
            "" if len(groups) == 1 else " (" + ", ".join(g.name for g in groups) + ")",
            f"; layers {narrow} padded to the widest row, {width} elements" if narrow else "",
        )
        self._warned_cast = False

    @staticmethod
    def _layer_view(slot: torch.Tensor, layer: LayerKV) -> torch.Tensor:
        """A layer's ``[rows, num_kv_heads, head_dim]`` view of its slot ``[rows, *row_shape]``."""
        rows = slot.shape[0]
        if tuple(slot.shape[1:]) == (layer.num_kv_heads, layer.head_dim):
            return slot
        flat = slot.view(rows, -1)
        if flat.shape[1] != layer.row:
            flat = flat[:, : layer.row]  # a padded row: the layer uses its first elements
        return flat.view(rows, layer.num_kv_heads, layer.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every key and value tensor."""
        return self.shape.dtype

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """The layer groups (see ``CacheLayout``)."""
        return self.layout.groups

    @property
    def size_bytes(self) -> int:
        """Bytes of all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.slot_key + self.slot_value)

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new keys and values.

        Args:
            layer_idx: the layer.
            slot_mapping: int64 [T]; the slot of each query token in the layer's group, on the layer's device.
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

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks within the cache, every slot (copy-on-write of a shared block).

        A block id belongs to one group, whose layers are the only ones using its rows in every slot,
        so copying the rows of every slot copies exactly that group's layers. Every source is read
        before any destination is written, so a block may be the source of one pair and the destination
        of a later one (freed and reused in the same step).

        Args:
            pairs: (source block id, destination block id); destinations are distinct.
        """
        if not pairs:
            return
        for device, slots in self.layout.slots_by_device():  # a sharded cache: one device at a time
            src = block_slots([source for source, _ in pairs], self.block_size, device)
            dst = block_slots([destination for _, destination in pairs], self.block_size, device)
            for slot in slots:
                for tensors in (self.slot_key, self.slot_value):
                    tensors[slot].index_copy_(0, dst, tensors[slot].index_select(0, src))
