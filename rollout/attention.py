"""Paged attention, registered with ``transformers.AttentionInterface``.

The engine runs the user's own model object. It switches the model's attention
implementation to ``"rollout_paged|<original>"``, a function that:

- when the forward carries engine metadata (the ``rollout_batch`` kwarg), writes the
  step's keys and values into the paged cache and attends over each request's
  blocks;
- otherwise calls the model's original implementation (``sdpa``, ``eager``, ...)
  with the mask that implementation's own mask function builds, so a training
  forward of the same model is exactly what it was before the engine touched it.

One metadata class (``PagedAttentionMetadata``) and one attention function (``paged_attention``) serve
eager, compiled and CUDA-graphed steps alike; only the sizes of the step's tensors differ (exact or
padded, chosen by the input builder, ``static_step.PaddingRule``). The keys and values go into the cache
through ``PagedKVCache.write``; every read then comes from the cache. SDPA path (CPU, and CUDA without
flash-attn): the query rows attend in groups over their request's keys, gathered through every KV layer
group's block tables: decode rows one per group (the query heads that share a KV head folded into the
query axis, so grouped-query attention needs no copy of the keys), prefill chunks in sub-chunks. CUDA
path of an eager step, used when ``flash_unsupported_reason`` finds nothing against it (flash-attn's
version, the GPU's compute capability, dtype, head dim, page size): a step that only decodes (one query
token per request) goes through flash-attn's ``flash_attn_with_kvcache`` with a fixed-width block table
(the decode fast path, ``max_blocks_per_request`` columns; transformers' continuous batching has the same
path); any other step through ``flash_attn_varlen_func`` over the whole flattened batch with a block
table (vLLM's and nano-vllm's approach).

The dispatcher's registered name never contains "flash" nor "/": transformers 5 treats any
implementation name containing "flash" as a request for a flash kernel (and tries to import one
under that name), and a name of the form ``org/repo`` as a Hub kernel to download and register
under that very name. A model loaded with ``attn_implementation="flash_attention_2"`` (or a Hub
kernel) gets the dispatcher ``rollout_paged|fa_attention_2`` (``dispatcher_name``), and its training
forwards still reach the original kernel, which sees the original name in ``module.config``.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kv_cache import PagedKVCache

logger = logging.getLogger(__name__)
# Reasons already logged by ``choose_flash``: one line per reason per process, not per engine.
_LOGGED_FLASH_REASONS: set[str] = set()

PAGED_PREFIX = "rollout_paged|"
METADATA_KWARG = "rollout_batch"

try:  # pragma: no cover - exercised on CUDA machines only
    from flash_attn import __version__ as _flash_attn_version
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
    from flash_attn import flash_attn_with_kvcache as _flash_attn_with_kvcache
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_varlen_func = None
    _flash_attn_with_kvcache = None
    _flash_attn_version = None

# What flash-attn's paged varlen kernel needs, read from flash-attn 2.8.3 (csrc/flash_attn/flash_api.cpp,
# mha_varlen_fwd, and flash_attn/flash_attn_interface.py):
# - flash_attn_varlen_func takes block_table since 2.5.7 and softcap since 2.6.0 (flash_attn_with_kvcache,
#   the decode fast path's kernel, has both by then too);
FLASH_ATTN_MIN_VERSION = (2, 6, 0)
# - "FlashAttention only supports Ampere GPUs or newer": compute capability major >= 8;
FLASH_MIN_COMPUTE_CAPABILITY = 8
# - q, k and v in fp16 or bf16, all of one dtype;
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# - a head dim of at most 256 and a multiple of 8 (the Python wrapper pads other head dims, which for a
#   paged cache would copy the whole cache at every call, so rollout treats them as unsupported);
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
# - "Paged KV cache block size must be divisible by 256";
FLASH_PAGE_MULTIPLE = 256
# - cu_seqlens, cache_seqlens and block_table in int32, every tensor on the device of q (model_runner
#   builds them so).


def flash_attn_available() -> bool:
    """True when flash-attn's kernels can be imported (its varlen and with_kvcache kernels import together)."""
    return _flash_attn_varlen_func is not None


def _version_tuple(version: str) -> tuple[int, ...]:
    """(2, 8, 3) for "2.8.3", "2.8.3.post1" or "2.8.3+cu12torch2.6"."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def flash_unsupported_reason(
    version: str | None,
    capabilities: Sequence[tuple[int, int] | None],
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
) -> str | None:
    """Why flash-attn's paged varlen kernel cannot serve a cache, or None when it can.

    A pure function of its arguments (no device is queried), so the rules can be tested with made-up
    GPUs. The rules are flash-attn 2.8's own (see the constants above; source: Dao-AILab/flash-attention,
    csrc/flash_attn/flash_api.cpp ``mha_varlen_fwd``).

    Args:
        version: flash-attn's ``__version__``, or None when it cannot be imported.
        capabilities: the CUDA compute capability (major, minor) of each device holding cache layers;
            None for a device that is not a CUDA GPU.
        dtype: the cache's dtype (the kernel reads q, k and v in it).
        head_dim: the attention head dim.
        page_size: tokens per cache block.

    Returns:
        A sentence naming the first unmet requirement, or None.
    """
    if version is None:
        return "flash-attn is not installed"
    if _version_tuple(version) < FLASH_ATTN_MIN_VERSION:
        need = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
        return f"flash-attn {version} is older than {need} (paged varlen attention with softcap)"
    for capability in capabilities:
        if capability is None:
            return "part of the cache is not on a CUDA GPU (the flash path is checked for NVIDIA GPUs only)"
        if capability[0] < FLASH_MIN_COMPUTE_CAPABILITY:
            return (
                f"a GPU has compute capability {capability[0]}.{capability[1]}; flash-attn 2 needs "
                f"{FLASH_MIN_COMPUTE_CAPABILITY}.0 (Ampere) or newer"
            )
    if dtype not in FLASH_DTYPES:
        return f"the KV cache is {dtype}; flash-attn reads only float16 and bfloat16"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % FLASH_HEAD_DIM_MULTIPLE:
        return (
            f"head_dim is {head_dim}; flash-attn needs a multiple of {FLASH_HEAD_DIM_MULTIPLE} "
            f"of at most {FLASH_MAX_HEAD_DIM}"
        )
    if page_size % FLASH_PAGE_MULTIPLE:
        return f"page_size is {page_size}; flash-attn's paged kernel needs a multiple of {FLASH_PAGE_MULTIPLE}"
    return None


def flash_support(devices: Sequence[torch.device], dtype: torch.dtype, head_dim: int, page_size: int) -> str | None:
    """``flash_unsupported_reason`` for a cache on these devices, with this machine's flash-attn and GPUs.

    Args:
        devices: the devices holding cache layers (one per layer, repeats allowed).
        dtype, head_dim, page_size: as in ``flash_unsupported_reason``.

    Returns:
        Why the flash path cannot be used, or None when it can.
    """
    capabilities: list[tuple[int, int] | None] = []
    for device in dict.fromkeys(devices):
        if device.type != "cuda" or torch.version.hip is not None:
            # ROCm reports its own architecture numbers here, and its flash-attn backend has other rules.
            capabilities.append(None)
        else:
            capabilities.append(torch.cuda.get_device_capability(device))
    version = _flash_attn_version if _flash_attn_varlen_func is not None else None
    return flash_unsupported_reason(version, capabilities, dtype, head_dim, page_size)


def choose_flash(devices: Sequence[torch.device], dtype: torch.dtype, head_dim: int, page_size: int) -> bool:
    """Whether an engine's steps run flash-attn's paged kernel (``flash_support``), else SDPA.

    Only a cache entirely on CUDA GPUs is considered; when flash-attn is installed but cannot serve
    this cache (GPU too old, fp32 cache, head dim, page size) the reason is logged as a warning, and
    a CUDA machine without flash-attn gets an info line (each reason once per process).
    """
    if any(d.type != "cuda" for d in devices):
        return False
    reason = flash_support(devices, dtype, head_dim, page_size)
    if reason is None:
        return True
    if reason not in _LOGGED_FLASH_REASONS:  # once per process: generate_batch builds an engine per call
        _LOGGED_FLASH_REASONS.add(reason)
        log = logger.info if not flash_attn_available() else logger.warning
        log("paged attention uses SDPA, not flash-attn: %s", reason)
    return False


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata of paged attention, shared by every layer: tensors only, no host read.

    Built by ``from_batch`` inside the step's forward (eager, compiled or CUDA-graphed: the same
    function), so it traces into one graph per layer. The query rows attend in groups, each group over
    the keys of one request, read from the cache through that request's block table:

    - the decode group: one query row per group (a request computing one token);
    - the prefill group (varlen path only): the chunks of the other requests, cut into sub-chunks of
      Qs consecutive rows; a sub-chunk reads its request's keys from position 0.

    Shapes are the sizes the input builder chose (``step_inputs.PaddingRule``): exact on an eager path,
    padded on a compiled or graphed one. T query rows; Bd decode groups reading Ld keys; G prefill groups
    of Qs rows reading Lp keys; N KV layer groups of the cache (``kv_cache.CacheLayout``), each with its
    own slots, a layer reading its group's (``group_of``). Filler groups and filler rows (there to fill a
    size) point at row T, read the padding block and are dropped. Padded query rows (on a padded path)
    write the padding slot and belong to no group: their attention output is 0.

    Attributes:
        cache: the paged KV cache.
        slot_mapping: int64 [N, T]; per layer group, the cache slot each query row writes.
        decode_rows: int64 [Bd], the query row of each decode group (fillers: T), or None on the
            decode path, where row i is decode group i (Bd = T).
        decode_gather: int64 [N, Bd, Ld]; per layer group, the slots of positions 0..Ld-1 of each decode
            group's request (None with ``flash``).
        decode_pos: int64 [Bd]; the position of each decode row (it sees keys 0..pos).
        prefill_rows: int64 [G, Qs]; the query rows of each prefill group (fillers: T), or None.
        prefill_gather: int64 [N, G, Lp]; per layer group, the slots of positions 0..Lp-1 of each
            prefill group's request (None with ``flash``).
        prefill_pos: int64 [G, Qs]; the position of each row in its request (0 for fillers).
        decode_read, prefill_read: ``decode_rows`` and ``prefill_rows`` with the fillers' T read as
            T - 1 (the rows whose queries they take), computed once per step rather than per layer.
        flash: the flash-attn inputs of a CUDA step (``step_inputs.StepBatch.flash``), else None. A step of
            ``flash_attn_with_kvcache`` (eager, compiled or graphed) has ``cache_seqlens`` (int32 [B]: keys of
            each request, this step's included), an eager varlen step ``cu_seqlens_q``, ``cu_seqlens_k``
            (int32 [B + 1]), ``max_seqlen_q`` and ``max_seqlen_k``; both have ``block_tables``, int32
            [N, B, W] (rows padded with the padding block, or block 0 on an eager step).
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    decode_gather: torch.Tensor | None
    decode_pos: torch.Tensor
    prefill_rows: torch.Tensor | None = None
    prefill_gather: torch.Tensor | None = None
    prefill_pos: torch.Tensor | None = None
    decode_read: torch.Tensor | None = None
    prefill_read: torch.Tensor | None = None
    flash: dict[str, Any] | None = None
    _on_device: dict[torch.device, PagedAttentionMetadata] = field(default_factory=dict, repr=False)

    @classmethod
    def from_batch(cls, cache: PagedKVCache, block_size: int, batch: Any) -> PagedAttentionMetadata:
        """The metadata of a step from its inputs (traceable: no host read).

        Args:
            cache: the paged KV cache.
            block_size: tokens per block.
            batch: the step's ``step_inputs.StepBatch`` (the builder sits above this module): its slots, rows,
                positions and ``flash`` inputs as the attributes here; its ``decode_tables`` int64 [N, Bd, Wd]
                and ``prefill_tables`` int64 [N, G, Wp] (None on the decode path), each group's block table,
                gathered into [N, Bd, Ld = Wd * block_size] and [N, G, Lp = Wp * block_size].
        """
        slot_mapping, decode_rows, prefill_rows = batch.slot_mapping, batch.decode_rows, batch.prefill_rows
        flash = batch.flash
        decode_gather = prefill_gather = decode_read = prefill_read = None
        if flash is None:  # flash-attn reads the keys through its block tables: no gather
            decode_gather = _gather(batch.decode_tables, block_size)
        if decode_rows is not None:
            assert batch.prefill_tables is not None and prefill_rows is not None
            if flash is None:
                prefill_gather = _gather(batch.prefill_tables, block_size)
            last = slot_mapping.shape[-1] - 1  # T - 1: slot_mapping has one entry per query row
            decode_read, prefill_read = decode_rows.clamp(max=last), prefill_rows.clamp(max=last)
        return cls(
            cache,
            slot_mapping,
            decode_rows,
            decode_gather,
            batch.decode_pos,
            prefill_rows,
            prefill_gather,
            batch.prefill_pos,
            decode_read,
            prefill_read,
            flash,
        )

    def group_of(self, layer: int, sliding_window: int | None) -> int:
        """The KV layer group of ``layer``, checked against the window the layer attends with.

        Raises:
            RuntimeError: the group keeps only a window of keys, but the layer attends further back (the
                keys it would read were given back).
        """
        group = self.cache.layout.layer_group[layer]
        kept = self.cache.layout.sliding_windows[group]
        if kept is not None and (sliding_window is None or sliding_window > kept):
            raise RuntimeError(
                f"layer {layer} attends with sliding_window={sliding_window}, but the KV cache keeps only the last "
                f"{kept} positions of that layer (read from the model's config and modules); build the engine with "
                "ContinuousBatchingConfig(sliding_window_cache=False) to keep every position"
            )
        return group

    def on(self, device: torch.device) -> PagedAttentionMetadata:
        """This step's metadata with every tensor on ``device``; ``self`` when they are there already.

        A model sharded over devices (``device_map``, eager steps only) runs each layer on its own device
        and keeps that layer's cache there, while the runner builds the metadata on the input's device.
        The copy for a device is made by the first layer there and reused by the others of the step.
        """
        if device == self.slot_mapping.device:
            return self
        moved = self._on_device.get(device)
        if moved is None:

            def to(value: Any) -> Any:
                return value.to(device) if isinstance(value, torch.Tensor) else value

            values = {f.name: to(getattr(self, f.name)) for f in fields(self) if f.name != "_on_device"}
            if self.flash is not None:
                values["flash"] = {k: to(v) for k, v in self.flash.items()}
            moved = self._on_device[device] = PagedAttentionMetadata(**values)
        return moved


def _gather(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [..., W * block_size]: the slots of positions 0.. of each row's block table [..., W]."""
    pos = torch.arange(tables.shape[-1] * block_size, device=tables.device)
    return tables[..., pos // block_size] * block_size + pos % block_size


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of q [B, H, n, D] over k, v [B, Hkv, L, D] (H a multiple of Hkv); returns [B, H, n, D]."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: autocast's when it is on for the query's device, else the query's.

    Under autocast (accelerate's ``mixed_precision``) the keys, values and queries of one layer may
    arrive in different dtypes (a bf16 projection, an fp32 rotary embedding), and SDPA would cast them
    all to autocast's dtype; casting them here first keeps the gathers from being cast twice.
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def _group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: torch.Tensor,
    q_pos: torch.Tensor,
    dtype: torch.dtype,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Groups of query rows, each over its own gathered keys: row i sees key j when j <= pos_i.

    Args:
        q: [G, Qs, H, D] the groups' queries.
        k_cache, v_cache: [slots, Hkv, D] one layer of the cache.
        gather: int64 [G, L]; the slot of each group's key positions 0..L-1.
        q_pos: int64 [G, Qs]; the position of each query row (its key positions 0..pos are visible,
            those further back than ``sliding_window`` are not).
        dtype: the compute dtype.
        scale, sliding_window, softcap: as in ``paged_attention``.

    Returns:
        [G, Qs, H, D]. With one row per group and no softcap, the query heads of each KV head are
        folded into the query axis (grouped-query attention reads every key once).
    """
    G, Qs, H, D = q.shape
    Hkv = k_cache.shape[1]
    L = gather.shape[1]
    flat = gather.reshape(-1)
    # index_select on the flat slot list is several times faster than advanced indexing on CPU.
    kg = k_cache.index_select(0, flat).view(G, L, Hkv, D).transpose(1, 2).to(dtype)  # [G, Hkv, L, D]
    vg = v_cache.index_select(0, flat).view(G, L, Hkv, D).transpose(1, 2).to(dtype)
    k_pos = torch.arange(L, device=gather.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, Qs, L]
    if sliding_window is not None:
        mask = mask & ((q_pos[:, :, None] - k_pos[None, None, :]) < sliding_window)
    if Qs == 1 and softcap is None:
        qg = q.reshape(G, Hkv, H // Hkv, D)  # [G, Hkv, heads per KV head, D]
        out = _attend(qg, kg, vg, mask[:, None], scale, softcap)
        return out.reshape(G, 1, H, D)
    out = _attend(q.transpose(1, 2), kg, vg, mask[:, None], scale, softcap)  # [G, H, Qs, D]
    return out.transpose(1, 2)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: PagedAttentionMetadata,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one layer over the paged cache: the one function of eager, compiled and graphed steps.

    The step's keys and values are written into the cache first (``PagedKVCache.write``, the cache's one
    write path), then every read comes from the cache: through flash-attn's kernels when ``meta.flash``
    is set (CUDA), else group by group with SDPA (see ``PagedAttentionMetadata``): the decode groups,
    then the prefill groups, whose outputs are scattered back to their rows.

    Cost of the SDPA groups: a decode row reads its request's keys padded to Ld. A prefill group of Qs rows
    reads Lp keys, Lp the longest request of the step's prefill groups: about T x Lp scores where a
    per-request causal call computes n_i x (context_i + n_i) per request; so as cheap when one request
    prefills, dearer for many requests of unequal length in one step. Masked keys read finite values (the
    cache starts zeroed and every write is a model's key or value) and no row is fully masked (every row
    sees key 0 of its group), so padding can never bring NaN into a real row.

    Args:
        module: the attention module (its ``layer_idx`` picks the cache layer and its layer group).
        query: [1, H, T, D]; key, value: [1, Hkv, T, D] (after rotary embedding).
        meta: the step's metadata (moved to the layer's device when the model is sharded).
        scaling: softmax scale (default D ** -0.5).
        sliding_window: keys further back than this many positions are masked (None: all).
        softcap: tanh soft-capping of the scores (Gemma 2), or None.

    Returns:
        [1, T, H, D] in the compute dtype (``_compute_dtype``; flash-attn: the query's dtype).

    Raises:
        RuntimeError: the layer attends further back than its cache group keeps (``group_of``).
    """
    layer = module.layer_idx
    cache = meta.cache
    g = meta.group_of(layer, sliding_window)
    k_cache, v_cache = cache.key[layer], cache.value[layer]
    meta = meta.on(k_cache.device)
    _, H, T, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    cache.write(layer, meta.slot_mapping[g], key[0].transpose(0, 1), value[0].transpose(0, 1))
    if meta.flash is not None:
        return _flash_attention(
            query, k_cache, v_cache, meta.flash, g, cache.block_size, scale, sliding_window, softcap
        )
    dtype = _compute_dtype(query)
    q = query[0].transpose(0, 1).to(dtype)  # [T, H, D]
    args = (k_cache, v_cache)
    rest = (dtype, scale, sliding_window, softcap)
    assert meta.decode_gather is not None
    if meta.decode_rows is None:  # the decode path: row i is decode group i
        out = _group_attention(q[:, None], *args, meta.decode_gather[g], meta.decode_pos[:, None], *rest)
        return out.reshape(1, T, H, D)
    rows_d, rows_p = meta.decode_rows, meta.prefill_rows
    assert rows_p is not None and meta.prefill_gather is not None and meta.prefill_pos is not None
    assert meta.decode_read is not None and meta.prefill_read is not None
    # Filler rows (index T) read the last row; their outputs land in a scratch row T, dropped below.
    out = q.new_zeros(T + 1, H, D)
    if rows_d.shape[0] > 0:  # an eager step may have no decode row (a padded one always has fillers)
        qd = q.index_select(0, meta.decode_read)[:, None]
        od = _group_attention(qd, *args, meta.decode_gather[g], meta.decode_pos[:, None], *rest)
        out = out.index_copy(0, rows_d, od[:, 0])
    if rows_p.shape[0] > 0:
        qp = q.index_select(0, meta.prefill_read.reshape(-1)).view(*rows_p.shape, H, D)
        op = _group_attention(qp, *args, meta.prefill_gather[g], meta.prefill_pos, *rest)
        out = out.index_copy(0, rows_p.reshape(-1), op.reshape(-1, H, D))
    return out[:T].unsqueeze(0)


def _flash_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    f: dict[str, Any],
    group: int,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """flash-attn over the paged cache: the decode fast path when ``f`` has ``cache_seqlens``, else varlen.

    Both kernels read the keys through ``f["block_tables"][group]`` and take the same scale, causal
    mask, window and softcap; they differ in how the query rows map to requests:

    - varlen (``flash_attn_varlen_func``): the whole flattened batch, ``q`` [T, H, D], split by
      ``cu_seqlens_q`` (keys counted by ``cu_seqlens_k``);
    - decode fast path (``flash_attn_with_kvcache``): every query row is one request's only token (row b
      is batch entry b, ``q`` [B, 1, H, D]). The step's keys and values are already in the cache
      (``paged_attention`` wrote them), so the kernel gets no ``k``/``v`` to append and ``cache_seqlens``
      counts this step's key. With one query token, flash-attn ignores ``causal`` and aligns the window
      to the last key, as the SDPA decode mask does.

    The kernels need q in the cache's dtype (fp16 or bf16, checked when the engine chose this path); a
    query in another dtype (an fp32 rotary embedding under autocast) is cast, and the output is returned
    in the query's dtype, which the model's output projection expects.

    Returns:
        [1, T, H, D] (T = B on the decode fast path).
    """
    q = query[0].transpose(0, 1).to(k_cache.dtype)  # [T, H, D]
    kc = k_cache.view(-1, block_size, *k_cache.shape[1:])  # [num_blocks, block_size, Hkv, D], no copy
    vc = v_cache.view(-1, block_size, *v_cache.shape[1:])
    shared: dict[str, Any] = dict(
        block_table=f["block_tables"][group],
        softmax_scale=scale,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window is not None else (-1, -1),
        softcap=softcap or 0.0,
    )
    lengths = {k: v for k, v in f.items() if k != "block_tables"}  # cache_seqlens, or cu_seqlens_* and max_seqlen_*
    if "cache_seqlens" in f:
        assert _flash_attn_with_kvcache is not None
        out = _flash_attn_with_kvcache(q.unsqueeze(1), kc, vc, **lengths, **shared)
        return out.to(query.dtype).transpose(0, 1)  # [B, 1, H, D] -> [1, B, H, D]
    assert _flash_attn_varlen_func is not None
    out = _flash_attn_varlen_func(q, kc, vc, **lengths, **shared)
    return out.to(query.dtype).unsqueeze(0)


class _ConfigAsOriginal:
    """A model config as the original attention function reads it: the config's own attributes, except
    the attention implementation, which names the original rather than the paged dispatcher.

    transformers' flash wrapper (``integrations/flash_attention.py``) picks its kernel from
    ``module.config._attn_implementation``; under the dispatcher's name it would look for a kernel
    called "rollout_paged|..." and fail. Read-only: a write raises.
    """

    __slots__ = ("_config", "_attn_implementation", "_attn_implementation_internal")

    def __init__(self, config: PretrainedConfig, original: str) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_attn_implementation", original)
        object.__setattr__(self, "_attn_implementation_internal", original)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the attention function's view of the config is read-only (setting {name!r})")


class _ModuleAsOriginal:
    """An attention module whose ``config`` is a ``_ConfigAsOriginal``; every other attribute is the module's."""

    __slots__ = ("_module", "config")

    def __init__(self, module: torch.nn.Module, original: str) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", _ConfigAsOriginal(module.config, original))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)


# Originals whose functions never read the implementation's name from the config: they get the module
# itself (the common path stays exactly what it was).
_PLAIN_ORIGINALS = frozenset({"eager", "sdpa"})


def _original_function(module: torch.nn.Module, original: str) -> Callable[..., Any]:
    if original == "eager":
        # Each model module defines its own eager function (Gemma 2's soft-caps, for one).
        modeling = sys.modules[type(module).__module__]
        fn = getattr(modeling, "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[original]


def _make_dispatch(original: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    plain = original in _PLAIN_ORIGINALS

    def rollout_paged_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = kwargs.pop(METADATA_KWARG, None)
        if meta is None:
            fn = _original_function(module, original)
            seen = module if plain or not hasattr(module, "config") else _ModuleAsOriginal(module, original)
            return fn(seen, query, key, value, attention_mask, **kwargs)
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("attention sinks (s_aux) are not supported by rollout's paged attention")
        out = paged_attention(
            module,
            query,
            key,
            value,
            meta,
            scaling=kwargs.get("scaling"),
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
        )
        return out, None

    rollout_paged_attention.__qualname__ = f"rollout_paged_attention[{original}]"
    return rollout_paged_attention


# Every dispatcher registered in this process: its name -> (the original it falls back to, its function).
_DISPATCHERS: dict[str, tuple[str, Callable[..., Any]]] = {}
_REGISTER_LOCK = threading.Lock()


def dispatcher_name(original: str) -> str:
    """The name under which the paged dispatcher falling back to ``original`` is registered.

    ``"rollout_paged|" + original`` with "flash" (any case) written "fa" and "/" written "--":
    transformers 5 treats an implementation name containing "flash" as a flash-kernel request
    (``is_flash_attention_requested``, then an import of a kernel of that name, which fails) and a name
    shaped like ``org/repo`` as a Hub kernel to download and register under that very name, which
    would replace the dispatcher. Examples: "sdpa" -> "rollout_paged|sdpa", "flash_attention_2" ->
    "rollout_paged|fa_attention_2", "kernels-community/flash-attn2" ->
    "rollout_paged|kernels-community--fa-attn2".
    """
    return PAGED_PREFIX + re.sub("flash", "fa", original, flags=re.IGNORECASE).replace("/", "--")


def register_paged_attention(original: str) -> str:
    """Register the paged function that falls back to ``original`` and return its name.

    Registration is idempotent; the registered function holds no state, so models and managers can
    share it. A registration that something else replaced under the same name is put back.

    Args:
        original: the model's attention implementation ("sdpa", "eager", "flash_attention_2", a Hub
            kernel such as "kernels-community/flash-attn2", ...).

    Returns:
        ``dispatcher_name(original)``.

    Raises:
        ValueError: ``original`` is itself a paged implementation, has no mask function, or its
            dispatcher name is already taken by another original.
    """
    if original.startswith(PAGED_PREFIX) or original.startswith(TRANSFORMERS_PAGED_PREFIX):
        raise ValueError(f"original attention must not be a paged implementation, got {original!r}")
    name = dispatcher_name(original)
    with _REGISTER_LOCK:
        entry = _DISPATCHERS.get(name)
        if entry is not None and entry[0] != original:
            raise ValueError(
                f"attention implementations {entry[0]!r} and {original!r} both map to the dispatcher name {name!r}"
            )
        if entry is None:
            entry = _DISPATCHERS[name] = (original, _make_dispatch(original))
        if ALL_ATTENTION_FUNCTIONS._global_mapping.get(name) is not entry[1]:
            AttentionInterface.register(name, entry[1])
        if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            mask_key = original if original in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "eager"
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask_key])
    return name


# transformers' own paged implementations: "paged|eager" and "paged|sdpa" are how its continuous-batching
# guide keeps generation off flash attention (transformers 5.24 loads "paged|sdpa" as "sdpa" with a
# deprecation warning, keeps "paged|eager", and a later ``set_attn_implementation`` may set either).
TRANSFORMERS_PAGED_PREFIX = "paged|"


def original_implementation(model: torch.nn.Module) -> str:
    """The attention kernel the engine falls back to for the model's forwards without engine metadata.

    That is the implementation the model had before the engine switched it; for one of transformers'
    paged implementations (``"paged|sdpa"``, ``"paged|eager"``), the kernel it names underneath (its
    paging is what rollout's dispatcher replaces). ``restore_attention`` puts back what the model had.
    """
    impl = model.config._attn_implementation or "eager"
    entry = _DISPATCHERS.get(impl)
    if entry is not None:
        return entry[0]
    return impl.removeprefix(PAGED_PREFIX).removeprefix(TRANSFORMERS_PAGED_PREFIX)


def _implementation_configs(model: torch.nn.Module) -> list[tuple[PretrainedConfig, Any]]:
    """Each config whose attention implementation ``set_attn_implementation`` may change, with its value now.

    That is the model's config, its sub-configs at any depth and the configs of its sub-models, the
    set transformers' ``set_attn_implementation`` walks.
    """
    found: dict[int, PretrainedConfig] = {}
    pending = [model.config]
    pending += [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, PretrainedConfig):
                pending.append(sub)
    return [(c, getattr(c, "_attn_implementation_internal", None)) for c in found.values()]


@dataclass
class _User:
    """A model on the paged dispatcher: its users, its original implementation, what to put back."""

    count: int
    original: str
    saved: list[tuple[PretrainedConfig, Any]]


# Models switched to the paged dispatcher. Several engines share one model (a persistent manager, a
# generate_batch or score call, a second manager): the first switches it, only the last restores it.
_USERS: weakref.WeakKeyDictionary[torch.nn.Module, _User] = weakref.WeakKeyDictionary()
_USERS_LOCK = threading.Lock()


def enable_paged_attention(model: torch.nn.Module) -> str:
    """Switch a model to the paged dispatcher for one more user; returns the original implementation's name.

    Reference-counted per model object: each call must be paired with one ``restore_attention``. The
    first user records every config's implementation, and the last one puts those values back as
    they were (no check and no kernel import runs again: the model already had them).

    Raises:
        ValueError: transformers refuses the dispatcher (``set_attn_implementation``), or see
            ``register_paged_attention``.
    """
    with _USERS_LOCK:
        entry = _USERS.get(model)
        if entry is not None and model.config._attn_implementation == dispatcher_name(entry.original):
            entry.count += 1
            return entry.original
        # First user, or the caller replaced the implementation since: start counting afresh.
        original = original_implementation(model)
        name = register_paged_attention(original)
        saved = _implementation_configs(model)
        if model.config._attn_implementation != name:
            model.set_attn_implementation(name)
        _USERS[model] = _User(1 if entry is None else entry.count + 1, original, saved)
        return original


def restore_attention(model: torch.nn.Module, original: str) -> None:
    """Release one user of the paged dispatcher; the last one puts the original implementation back.

    Args:
        model: the model.
        original: the implementation ``enable_paged_attention`` returned (used when the model was
            never counted, e.g. switched by hand).
    """
    with _USERS_LOCK:
        entry = _USERS.get(model)
        if entry is None:
            if model.config._attn_implementation != original:
                model.set_attn_implementation(original)
            return
        entry.count -= 1
        if entry.count > 0:
            return
        del _USERS[model]
        for config, value in entry.saved:
            config._attn_implementation_internal = value


def num_paged_users(model: torch.nn.Module) -> int:
    """Engines currently holding the model on the paged dispatcher (0 when none)."""
    with _USERS_LOCK:
        entry = _USERS.get(model)
        return entry.count if entry is not None else 0
