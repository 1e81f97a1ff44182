"""Paged attention: one layer's attention over the paged KV cache, for every kind of step.

One metadata class (``PagedAttentionMetadata``) and one function (``paged_attention``, reached through
``registry``'s dispatcher) serve eager, compiled and CUDA-graphed steps alike, on inputs exact or padded
(``worker.inputs.PaddingRule``). Keys and values go into the cache through ``PagedKVCache.write`` (or, in the fused
decoder layers' attention, ``rollout_cpu::rotary_cache_write_``, which writes the same rows); every read then comes
from the cache (``attend_cache``). SDPA path (CPU with ``cpu_attention="sdpa"`` or without a C++ compiler, CUDA without
flash-attn): the query rows attend in groups over their request's keys, gathered through the block tables: decode
rows one per group (the query heads sharing a KV head folded into the query axis: no copy of the keys for
grouped-query attention), prefill chunks in sub-chunks. CUDA path (``flash.choose_flash``): a step that fits it
(``worker.inputs.fits_decode_kernel``) goes through ``flash_attn_with_kvcache``, any other through
``flash_attn_varlen_func`` over the flattened batch with a block table (vLLM's and nano-vllm's approach). CPU path
(the default there): the same calls, served by rollout's C++ kernel (``cpu``), which reads the cache in
place as flash-attn does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from rollout.engine.attention import cpu as cpu_attention
from rollout.engine.attention.flash import flash_attn_varlen_func as _flash_attn_varlen_func
from rollout.engine.attention.flash import flash_attn_with_kvcache as _flash_attn_with_kvcache
from rollout.engine.kv.cache import PagedKVCache

# The forward kwarg that carries a step's ``PagedAttentionMetadata`` to every layer.
METADATA_KWARG = "rollout_batch"


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata of paged attention, shared by every layer: tensors only, no host read.

    Built by ``from_batch`` inside the step's forward (eager, compiled or CUDA-graphed: the same
    function), so it traces into one graph per layer. The query rows attend in groups, each group over
    the keys of one request, read from the cache through that request's block table:

    - the decode group: one query row per group (a request computing one token);
    - the prefill group (varlen path only): the chunks of the other requests, cut into sub-chunks of
      Qs consecutive rows; a sub-chunk reads its request's keys from position 0.

    Shapes are the input builder's (``worker.inputs``): T query rows; Bd decode groups reading Ld keys; G prefill
    groups of Qs rows reading Lp keys; N KV layer groups, a layer reading its group's (``group_of``). Filler
    groups and rows point at row T, read the padding block and are dropped. Padded query rows write the padding
    slot and belong to no group: their attention output is 0.

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
        flash: the flash-attn (or CPU kernel) inputs of the step (``worker.inputs.StepBatch.flash``: names,
            dtypes and shapes), else None.
        invariant: the CPU kernel's batch-invariant form (``ContinuousBatchingConfig.batch_invariant``).
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
    invariant: bool = False
    _on_device: dict[torch.device, PagedAttentionMetadata] = field(default_factory=dict, repr=False)

    @classmethod
    def from_batch(
        cls, cache: PagedKVCache, block_size: int, batch: Any, invariant: bool = False
    ) -> PagedAttentionMetadata:
        """The metadata of a step from its inputs (traceable: no host read).

        Args:
            cache: the paged KV cache.
            block_size: tokens per block.
            batch: the step's ``worker.inputs.StepBatch`` (the builder sits above this module): its slots, rows,
                positions and ``flash`` inputs as the attributes here; its ``decode_tables`` int64 [N, Bd, Wd]
                and ``prefill_tables`` int64 [N, G, Wp] (None on the decode path), each group's block table,
                gathered into [N, Bd, Ld = Wd * block_size] and [N, G, Lp = Wp * block_size].
            invariant: as the attribute.
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
            invariant,
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

    The step's keys and values are written into the cache first (``PagedKVCache.write``), then every read comes
    from the cache (``attend_cache``): through flash-attn's kernels when ``meta.flash``
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
    meta = meta.on(cache.key[layer].device)
    cache.write(layer, meta.slot_mapping[g], key[0].transpose(0, 1), value[0].transpose(0, 1))
    return attend_cache(query[0].transpose(0, 1), layer, meta, g, scaling, sliding_window, softcap)[None]


def attend_cache(
    query: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
    group: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The read half of ``paged_attention``: the step's queries against the cache, whose keys and values for this
    step are already written (by ``PagedKVCache.write``, or by the fused layer's ``rollout_cpu::rotary_cache_write_``).

    Args:
        query: [T, H, D] (after rotary embedding).
        layer: the cache layer; group: its layer group (``meta.group_of``).
        meta: the step's metadata, on the layer's device.
        scaling, sliding_window, softcap: as ``paged_attention``'s.

    Returns:
        [T, H, D] in the compute dtype (``_compute_dtype``; flash-attn: the query's dtype).
    """
    cache = meta.cache
    k_cache, v_cache = cache.key[layer], cache.value[layer]
    T, H, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    g = group
    if meta.flash is not None:
        return _flash_attention(
            query, k_cache, v_cache, meta.flash, g, cache.block_size, scale, sliding_window, softcap, meta.invariant
        )
    dtype = _compute_dtype(query)
    q = query.to(dtype)  # [T, H, D]
    args = (k_cache, v_cache)
    rest = (dtype, scale, sliding_window, softcap)
    assert meta.decode_gather is not None
    if meta.decode_rows is None:  # the decode path: row i is decode group i
        out = _group_attention(q[:, None], *args, meta.decode_gather[g], meta.decode_pos[:, None], *rest)
        return out.reshape(T, H, D)
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
    return out[:T]


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
    invariant: bool = False,
) -> torch.Tensor:
    """flash-attn over the paged cache: the decode fast path when ``f`` has ``cache_seqlens``, else varlen.

    Both kernels read the keys through ``f["block_tables"][group]`` and take the same scale, causal
    mask, window and softcap; they differ in how the query rows map to requests:

    - varlen (``flash_attn_varlen_func``): the whole flattened batch, ``q`` [T, H, D], split by
      ``cu_seqlens_q`` (keys counted by ``cu_seqlens_k``). The rows past ``cu_seqlens_q[-1]`` (a padded step's
      padding rows) belong to no sequence, and flash-attn leaves their output unwritten: it is zeroed here,
      as SDPA's is (not after a kernel that zeroes them itself: ``zeroes_rows_past_sequences``, rollout's CPU
      kernel);
    - decode fast path (``flash_attn_with_kvcache``): row b is request b's only token (``q`` [B, 1, H, D]). The
      step's keys and values are already in the cache, so the kernel gets no ``k``/``v`` and ``cache_seqlens``
      counts this step's key. With one query token flash-attn aligns the window to the last key, as SDPA's mask.

    q is cast to the cache's dtype (fp16 or bf16 on CUDA: an fp32 rotary embedding under autocast gives another);
    the output is returned in the query's dtype, which the model's output projection expects.

    Args:
        query: [T, H, D].

    Returns:
        [T, H, D] (T = B on the decode fast path).
    """
    q = query.to(k_cache.dtype)
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
    on_cpu = k_cache.device.type == "cpu"
    if invariant:  # rollout's CPU kernel only (ContinuousBatchingConfig.batch_invariant is refused elsewhere)
        shared["invariant"] = True
    if "cache_seqlens" in f:
        with_kvcache = cpu_attention.flash_attn_with_kvcache if on_cpu else _flash_attn_with_kvcache
        assert with_kvcache is not None
        out = with_kvcache(q.unsqueeze(1), kc, vc, **lengths, **shared)
        return out.to(query.dtype)[:, 0]  # [B, 1, H, D] -> [B, H, D]
    varlen = cpu_attention.flash_attn_varlen_func if on_cpu else _flash_attn_varlen_func
    assert varlen is not None
    out = varlen(q, kc, vc, **lengths, **shared)
    if not getattr(varlen, "zeroes_rows_past_sequences", False):
        # flash-attn leaves the padded rows (past cu_seqlens_q[-1]) unwritten, and unwritten memory may hold NaN: it
        # would flow on into the padding slot's keys and values, and from there into a real row that reads the
        # padding block under a mask (0 x NaN). No host read: traceable, graphable. (rollout's CPU kernel writes 0
        # there itself, and says so: its ``zeroes_rows_past_sequences``.)
        real = torch.arange(q.shape[0], device=q.device) < f["cu_seqlens_q"][-1]
        out = torch.where(real[:, None, None], out, 0)
    return out.to(query.dtype)
