"""The paged K/V tensors of every attention layer, grouped by layer kind and shape; their sizing from usable
memory; and the CPU offload pool.

Layer groups. Layers are grouped by what their cache must hold: (attention kind with its sliding window,
KV heads, head dim). A sliding-window group keeps, for each request, only the blocks its next queries
read, so a Gemma-3 model (5 sliding layers to 1 global) holds a whole sequence in 1 layer of 6 and a
window of it in the other 5. Each group has its own block table per request (``Request.block_tables``):
the design of vLLM v1's hybrid KV cache manager (``vllm/v1/core/kv_cache_coordinator.py``,
``single_type_kv_cache_manager.py``: one ``SingleTypeKVCacheManager`` per group, one block table per
request per group, over one shared block pool). A single table shared by all groups cannot work: a
sliding group gives back the blocks that left its window while the full group keeps the same
positions. transformers' continuous batching (``cache_allocators/sliding_attention.py``) keeps a
sliding group in a ring buffer of ``ceil(window / page)`` pages per request instead, which needs no
table entries for evicted blocks but cannot share them (prefix caching is off for the whole cache, and
a fork copies them) nor give the flash kernel a block table; rollout keeps block tables, so prefix
caching, forks, copy-on-write and the flash path work on sliding groups unchanged.

Memory. The groups draw on one pool of block ids, so memory moves to whichever group needs it (how
many requests a budget admits does not depend on guessing their lengths). For that, one block id must
mean the same bytes in every group: the layers are split into groups of equal size k (the gcd of the
layer counts of each kind: Gemma-3's 5:1 gives 6 groups of one layer, 5 sliding and 1 full), and
tensor slot j holds the j-th layer of every group (vLLM's ``KVCacheTensor`` shared by one layer of
each group). A block id belongs to one group at a time, so the layers sharing a slot never write the
same block. Layers whose token rows differ (other head dims or KV-head counts) share slots padded to
the widest row (``CacheLayout.row_shape``); vLLM instead gives narrower groups more tokens per block.
A model sharded over devices keeps each slot on one device: the layers of a group on another device
get slots there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch
from transformers import PreTrainedModel

from .config import ContinuousBatchingConfig
from .models import (
    attention_dtype,
    input_device,
    layer_devices,
    layer_kv_shapes,
    layer_sliding_windows,
    vocab_size,
)

logger = logging.getLogger(__name__)

GIB = 1024**3

# Float32 temporaries of one step's logits and sampling, per logits entry (row x vocabulary), on top of
# the model's own logits. The plain temperature-sampling path with logprobs peaks at 7 live at once
# (the float32 copy, the scaled logits, the softmax, the float64 CDF counted as two, and the scaled copy
# and log-softmax of the logprobs); one more covers the top-k/top-p masks, which run on sampled rows only.
LOGITS_FLOAT32_TEMPORARIES = 8


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
        """The KV shape of each layer of a decoder-only model (``models.layer_kv_shapes``) and its sliding
        window (``models.layer_sliding_windows``; all None when ``sliding_windows`` is False)."""
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
        if not self.layers:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size
        return 2 * sum(layer.row for layer in self.layers) * self.element_size


def window_start_block(sliding_window: int | None, num_computed_tokens: int, block_size: int) -> int:
    """The first block that queries from position ``num_computed_tokens`` on read, in a layer with that window.

    A query at position p reads keys p - window + 1 .. p, so every block before block
    ``max(0, num_computed_tokens - window + 1) // block_size`` is read by no later query (vLLM v1's
    ``SlidingWindowManager.get_num_skipped_tokens``). 0 for full attention (``sliding_window`` None).
    """
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def max_blocks_held(sliding_window: int | None, num_tokens: int, max_chunk: int, block_size: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once in a group with this window.

    Full attention: ``ceil(num_tokens / block_size)``. A sliding window W, with chunks of at most
    ``max_chunk`` tokens: the blocks of positions [c - W + 1, c + n) for a chunk of n tokens from
    position c, at most ``1 + ceil((W + max_chunk - 2) / block_size)``, and never more than full attention.
    """
    full = -(-num_tokens // block_size)
    if sliding_window is None:
        return full
    return min(full, 1 + -(-(sliding_window + max_chunk - 2) // block_size))


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose cache is managed together: one block table per request, one kind of eviction.

    Attributes:
        name: ``"full:1,3"`` or ``"sliding64:0"`` (kind, then the layers; ``":HxD"`` is added when the
            model's layers differ in shape); the key of ``EngineStats.kv_cache_capacity_tokens``.
        layers: the model's layer indices, ascending.
        num_kv_heads, head_dim: the shape of each of its layers.
        sliding_window: the window of its layers, None for full attention.
    """

    name: str
    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None

    def max_blocks(self, num_tokens: int, max_chunk: int, block_size: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds in this group at once (``max_blocks_held``)."""
        return max_blocks_held(self.sliding_window, num_tokens, max_chunk, block_size)


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
            groups.append(KVCacheGroup(name, members, kv, dim, window))
            for layer in members:
                layer_group[layer] = g
        slot_of: dict[tuple[torch.device, int], int] = {}
        layer_slot = [0] * n
        for group in groups:
            used: dict[torch.device, int] = {}
            for layer in group.layers:
                device = layer_devices[layer]
                key = (device, used.get(device, 0))
                used[device] = key[1] + 1
                layer_slot[layer] = slot_of.setdefault(key, len(slot_of))
        # Slots in the order of their first layer, so that a single group's slot i is layer i.
        order = sorted(slot_of.values(), key=lambda s: layer_slot.index(s))
        renumber = {old: new for new, old in enumerate(order)}
        layer_slot = [renumber[s] for s in layer_slot]
        slot_devices = [torch.device("cpu")] * len(order)
        for layer, slot in enumerate(layer_slot):
            slot_devices[slot] = layer_devices[layer]
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

        A whole-model block is ``block_size`` tokens of KV in every layer (``shape.bytes_per_token``
        each); its bytes, per device, buy that device's share of ``pool_block_bytes``. For a model whose
        layers form one group, the two are the same; Gemma-3's 6 groups of one layer get 6 block ids
        for each whole-model block.

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
        return sum(group.max_blocks(num_tokens, max_chunk, block_size) for group in self.groups)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of a device in bytes: ``torch.cuda.mem_get_info`` on CUDA, psutil's available RAM on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


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

    The engine takes ``memory_percent`` of the usable memory (free plus torch's cached-but-unused
    bytes, see ``MemoryReport``): its step workspace first (``logits_workspace_bytes``), the KV cache
    from the rest.

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

    A block here is what ``ContinuousBatchingConfig.num_blocks`` counts: ``page_size`` tokens of KV in
    every layer, each layer at its own shape (a whole-model block). The engine lays that memory out per
    layer group (``CacheLayout.pool_blocks``): with sliding-window groups it holds more block ids than
    whole-model blocks (Gemma-3's 6 groups: 6 per whole-model block), and a sliding group holds only
    its window's, so the same memory serves more requests.

    The cache holds the dtype attention computes in (``models.attention_dtype``); its block size,
    token budget and share come from ``config`` (``max_memory_percent``, or its device default) unless
    ``memory_percent`` is given. The step's logits and sampling temporaries
    (``logits_workspace_bytes``) come out of the same share, on the device of the last layer (where
    the head computes them). Each device of a ``device_map``-sharded model holds its own layers'
    share of every block, so the tightest device decides.

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
    gib = config.resolved_cpu_offload_gib(free_memory_bytes(torch.device("cpu")))
    if gib <= 0:
        logger.warning(
            "preemption_mode='offload' with cpu_offload_space=%s (safety threshold %s): no CPU pool, preempted "
            "requests are recomputed",
            config.cpu_offload_space,
            config.cpu_offload_space_safety_threshold,
        )
    return gib


class PagedKVCache:
    """Per-layer key and value tensors of the paged cache, laid out by layer group (``CacheLayout``).

    Each layer reads and writes ``key[layer]`` and ``value[layer]`` of shape
    ``[num_blocks * block_size, num_kv_heads, head_dim]`` (its own shape): one row per slot, where
    slot = block_id * block_size + offset in block. They are views of the tensor slot the layer shares
    with one layer of each other group (``slot_key``/``slot_value``, ``[num_blocks * block_size, *row_shape]``);
    a model whose layers form one group has one slot per layer, and ``key[layer]`` is that slot. Block
    ids come from one pool and belong to one group at a time, so the layers sharing a slot never
    write the same rows. The tensors start zeroed: padded gathers read slots that hold no token, and
    masked garbage (NaN * 0) would still poison the attention output. On CPU zeroed pages are only
    touched when written.

    Args:
        shape: layers, KV heads, head dim (per layer when they differ) and dtype (the dtype the
            attention computes in, ``models.attention_dtype``; keys and values arriving in another are
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
        if layer_devices is not None and len(layer_devices) != shape.num_layers:
            raise ValueError(
                f"layer_devices must name one device per layer ({shape.num_layers}), got {len(layer_devices)}"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.layer_devices = list(layer_devices) if layer_devices is not None else [device] * shape.num_layers
        self.layout = CacheLayout.build(shape, self.layer_devices)
        num_slots = num_blocks * block_size
        row_shape = self.layout.row_shape
        # Never inference tensors, whatever mode the caller builds the engine in: the steps write
        # them in place from the manager's thread, and a write to an inference tensor outside
        # inference mode is an error.
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
        logger.info(
            "paged KV cache: %d blocks x %d tokens, %s, %.3f GiB on %s; %d layer group%s%s",
            num_blocks,
            block_size,
            shape.dtype,
            self.size_bytes / GIB,
            ", ".join(str(d) for d in dict.fromkeys(self.layer_devices)),
            len(groups),
            "" if len(groups) == 1 else "s",
            "" if len(groups) == 1 else " (" + ", ".join(g.name for g in groups) + ")",
        )
        narrow = [i for i in range(shape.num_layers) if shape.layer(i).row < row_shape[0] * row_shape[1]]
        if narrow:
            logger.info(
                "KV cache: layers %s have narrower rows than the widest layer's %d elements and are padded to it",
                narrow,
                row_shape[0] * row_shape[1],
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
        bs = self.block_size
        slots: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # a sharded cache: per device
        for slot, device in enumerate(self.layout.slot_devices):
            if device not in slots:
                offsets = torch.arange(bs, device=device)
                ids = torch.tensor(pairs, dtype=torch.int64, device=device)  # [P, 2]
                slots[device] = ((ids[:, 0:1] * bs + offsets).reshape(-1), (ids[:, 1:2] * bs + offsets).reshape(-1))
            src, dst = slots[device]
            for tensors in (self.slot_key, self.slot_value):
                tensors[slot].index_copy_(0, dst, tensors[slot].index_select(0, src))


def _page_lock(buffer: torch.Tensor) -> None:
    """Page-lock (pin) a CPU tensor's whole storage in place, exactly its bytes (``cudaHostRegister``).

    Raises:
        RuntimeError: CUDA refused (the error code is in the message).
    """
    nbytes = buffer.untyped_storage().nbytes()
    # Flag 1 is cudaHostRegisterPortable: pinned for every CUDA context of the process.
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes}-byte CPU offload pool failed with CUDA error {err}")


def _page_unlock(buffer: torch.Tensor) -> None:
    """Undo ``_page_lock`` (``cudaHostUnregister``); errors are ignored (the memory is freed next anyway)."""
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _slots_by_device(cache: PagedKVCache) -> list[tuple[torch.device, list[int]]]:
    """The cache's tensor slots grouped by the device that holds them, in slot order."""
    groups: dict[torch.device, list[int]] = {}
    for slot, device in enumerate(cache.layout.slot_devices):
        groups.setdefault(device, []).append(slot)
    return list(groups.items())


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ids: (index in ``ids``, first id, length) each."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


class CPUOffloadPool:
    """CPU memory that holds the KV blocks of requests preempted by offload.

    One buffer of exactly ``num_blocks`` pool blocks, viewed as ``blocks`` of shape
    ``[num_blocks, num_slots, 2, block_size, *row_shape]`` (2: key then value; the slots and row shape
    of the cache's ``CacheLayout``: for a model whose layers form one group, one slot per layer and
    ``row_shape`` = (num_kv_heads, head_dim)): a pool block holds one cache block of every slot,
    contiguous, so a request's blocks move in one copy per run of consecutive pool ids (the free list
    hands ids out in ascending order). A cache block belongs to one layer group, whose layers are the
    ones holding its rows in every slot. ``key[slot]`` and ``value[slot]`` are views
    ``[num_blocks, block_size, *row_shape]`` of it. Blocks are
    handed out from a free list: the KV cache manager allocates and frees them (bookkeeping), the model
    runner copies into and out of them.

    Pinned (for a CUDA cache), the buffer is allocated pageable and then page-locked in place with
    ``cudaHostRegister``, so exactly ``size_bytes`` are pinned: torch's pinned allocator
    (``pin_memory=True``) rounds each allocation up to a power of two, up to twice what was asked.

    Copies and their order (CUDA cache): ``store`` enqueues the device-to-host copies straight into
    the pool blocks on the current stream, without waiting, and records an event after them (one per device);
    nothing reads the pool on the host before they land (``read_blocks`` waits for the event first).
    ``load`` makes the current stream wait for those events, enqueues host-to-device copies from the
    pinned blocks and records its own event (``close`` waits for all before unpinning). A pool block
    freed and handed out again is only written by a later ``store``, whose copy the stream orders
    after the ``load`` that read it, so one stream (the engine's thread) needs no other
    synchronisation.

    Args:
        shape: the cache's shape.
        space_gib: GiB of CPU memory to use (> 0); the pool holds ``floor(space / bytes per block)`` blocks.
        block_size: tokens per block (the cache's).
        pin: page-lock the buffer (for a CUDA cache).
        layout: the cache's layout (``PagedKVCache.layout``); None: the one of ``shape`` on one device.

    Raises:
        RuntimeError: pinning failed.
    """

    def __init__(
        self,
        shape: CacheShape,
        space_gib: float,
        block_size: int,
        pin: bool = False,
        layout: CacheLayout | None = None,
    ) -> None:
        self.shape = shape
        self.block_size = block_size
        self.layout = layout or CacheLayout.build(shape, [torch.device("cpu")] * shape.num_layers)
        bytes_per_block = self.layout.pool_block_bytes(shape, block_size)
        self.num_blocks = max(0, int(space_gib * GIB // bytes_per_block))
        num_slots = self.layout.num_slots
        self.row_shape = self.layout.row_shape
        block_shape = (num_slots, 2, block_size, *self.row_shape)
        numel = self.num_blocks * bytes_per_block // shape.element_size
        with torch.inference_mode(False):  # as for the cache: written in place from any thread
            # Uninitialised: a pool block is only read back after a store filled it; untouched pages
            # of an unpinned pool cost no RAM.
            self.buffer = torch.empty(numel, dtype=shape.dtype)
            self.blocks = self.buffer.view(self.num_blocks, *block_shape)
            self.key = [self.blocks[:, slot, 0] for slot in range(num_slots)]
            self.value = [self.blocks[:, slot, 1] for slot in range(num_slots)]
        self.pinned = False
        if pin and numel > 0:
            _page_lock(self.buffer)
            self.pinned = True
        # Descending, so that ``pop`` hands out ascending ids: a fresh request's blocks are one run.
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.copy_events: dict[torch.device, torch.cuda.Event] = {}  # the last copies' end, per CUDA device

    @property
    def size_bytes(self) -> int:
        """Bytes of the pool's buffer (all pinned when ``pinned``): ``num_blocks`` x bytes per block."""
        return self.buffer.untyped_storage().nbytes()

    def close(self) -> None:
        """Wait for pending copies and unpin the buffer. Idempotent; the pool is unusable for CUDA copies after."""
        if self.pinned:
            self.synchronize()
            self.pinned = False
            _page_unlock(self.buffer)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
            pass

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
        """Copy cache blocks ``block_ids`` into pool blocks ``pool_ids`` (same length), every slot.

        On CUDA the copies are only enqueued (see the class docstring); an event per device marks their
        end. A cache sharded over devices (``CacheLayout.slot_devices``) is copied one device's slots
        at a time.
        """
        n = len(block_ids)
        if n == 0:
            return
        bs = self.block_size
        runs = _runs(pool_ids)
        for device, slots in _slots_by_device(cache):
            src = self._slots(block_ids, device)

            def blocks_of(t: torch.Tensor, src: torch.Tensor = src) -> torch.Tensor:
                return t[src].view(n, bs, *self.row_shape)

            # [n, len(slots), 2, bs, *row_shape] on the device: the pool blocks' layout for these slots.
            staged = torch.stack(
                [torch.stack((blocks_of(cache.slot_key[i]), blocks_of(cache.slot_value[i])), dim=1) for i in slots],
                dim=1,
            )
            whole = len(slots) == self.layout.num_slots
            for index, first, length in runs:
                if whole:  # one contiguous copy per run
                    self.blocks[first : first + length].copy_(staged[index : index + length], non_blocking=True)
                else:
                    for j, slot in enumerate(slots):
                        self.blocks[first : first + length, slot].copy_(
                            staged[index : index + length, j], non_blocking=True
                        )
            self._record(device)

    def _record(self, device: torch.device) -> None:
        """Mark the end of the copies just enqueued on ``device``'s current stream (CUDA only)."""
        if device.type == "cuda":
            event = self.copy_events.get(device)
            if event is None:
                event = self.copy_events[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))

    def load(self, cache: PagedKVCache, pool_ids: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks ``pool_ids`` back into cache blocks ``block_ids`` (the pool blocks stay taken)."""
        n = len(pool_ids)
        if n == 0:
            return
        runs = _runs(pool_ids)
        rows = n * self.block_size
        for device, slots in _slots_by_device(cache):
            if device.type == "cuda":
                stream = torch.cuda.current_stream(device)
                for event in self.copy_events.values():
                    stream.wait_event(event)
            whole = len(slots) == self.layout.num_slots
            parts = [
                (self.blocks[first : first + length] if whole else self.blocks[first : first + length, slots]).to(
                    device, non_blocking=True
                )
                for _, first, length in runs
            ]
            moved = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n, len(slots), 2, bs, *row_shape]
            dst = self._slots(block_ids, device)
            for j, slot in enumerate(slots):
                cache.slot_key[slot][dst] = moved[:, j, 0].reshape(rows, *self.row_shape)
                cache.slot_value[slot][dst] = moved[:, j, 1].reshape(rows, *self.row_shape)
            self._record(device)

    def synchronize(self) -> None:
        """Block the host until every copy into or out of the pool enqueued so far is done."""
        for event in self.copy_events.values():
            event.synchronize()

    def read_blocks(self, pool_ids: list[int]) -> torch.Tensor:
        """A host copy of pool blocks, after the pending stores have landed.

        Returns:
            [len(pool_ids), num_slots, 2, block_size, *row_shape] in the cache's dtype (one slot per layer
            and (num_kv_heads, head_dim) for a model whose layers form one group).
        """
        self.synchronize()
        return self.blocks[torch.tensor(pool_ids, dtype=torch.int64)].clone()
