"""Paged attention, registered with ``transformers.AttentionInterface``.

The engine runs the user's own model object. It switches the model's attention
implementation to ``"rollout_paged|<original>"``, a function that:

- when the forward carries engine metadata (the ``rollout_batch`` kwarg), writes the
  step's keys and values into the paged cache and attends over each request's
  blocks;
- otherwise calls the model's original implementation (``sdpa``, ``eager``, ...)
  with the mask that implementation's own mask function builds, so a training
  forward of the same model is exactly what it was before the engine touched it.

CPU path: torch SDPA. Decoding requests (one query token each) are attended in one
batched call over their gathered, padded keys; the query heads that share a KV head
are folded into the query-length axis, so grouped-query attention needs no copy of
the keys. Each prefill chunk is one call, causal (and windowed for sliding-window
layers) with an offset for the tokens already in the cache. CUDA path: flash-attn's
``flash_attn_varlen_func`` over the whole flattened batch with a block table
(vLLM's and nano-vllm's approach), used when flash-attn is importable.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kv_cache import PagedKVCache

PAGED_PREFIX = "rollout_paged|"
METADATA_KWARG = "rollout_batch"

try:  # pragma: no cover - exercised on CUDA machines only
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_varlen_func = None


def flash_attn_available() -> bool:
    """True when flash-attn's varlen kernel can be imported."""
    return _flash_attn_varlen_func is not None


@dataclass
class PrefillSegment:
    """One request's prefill chunk inside the flattened batch.

    Attributes:
        start, end: its query rows [start, end) in the flattened batch.
        context: tokens of the request already in the cache before this step.
        gather: int64 [context + end - start]; slots of all its keys, or None when
            context is 0 (the chunk attends to its own keys only).
    """

    start: int
    end: int
    context: int
    gather: torch.Tensor | None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
        """bool [n, L] (True = attend), or None for plain causal attention without context."""
        if sliding_window in self._masks:
            return self._masks[sliding_window]
        n = self.end - self.start
        if self.context == 0 and sliding_window is None:
            mask = None
        else:
            q_pos = torch.arange(self.context, self.context + n, device=device)[:, None]
            k_pos = torch.arange(self.context + n, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= (q_pos - k_pos) < sliding_window
        self._masks[sliding_window] = mask
        return mask


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata shared by every layer's paged attention call.

    Attributes:
        cache: the paged KV cache.
        slot_mapping: int64 [T]; the cache slot of each query token.
        decode_rows: int64 [Bd]; rows of the decoding requests (one query each), or None.
        decode_gather: int64 [Bd, Lmax]; slots of each decoding request's keys, padded.
        decode_lengths: int64 [Bd]; keys of each decoding request (its query position + 1).
        prefills: the prefill chunks.
        flash: CUDA varlen inputs (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            block_table) when the flash-attn path is used, else None.
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    decode_gather: torch.Tensor | None
    decode_lengths: torch.Tensor | None
    prefills: list[PrefillSegment]
    flash: dict[str, Any] | None = None
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """bool [Bd, 1, 1, Lmax]: which padded key slots each decoding request attends to."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            assert self.decode_gather is not None and self.decode_lengths is not None
            k_pos = torch.arange(self.decode_gather.shape[1], device=self.decode_gather.device)[None, :]
            lengths = self.decode_lengths[:, None]
            mask = k_pos < lengths
            if sliding_window is not None:
                mask &= (lengths - 1 - k_pos) < sliding_window
            mask = mask[:, None, None, :]
            self._decode_masks[sliding_window] = mask
        return mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """Attention of q [B, H, n, D] over k, v [B, Hkv, L, D] (H a multiple of Hkv); returns [B, H, n, D]."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale, enable_gqa=groups > 1
        )
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        n, L = scores.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


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
    """Attention of one layer over the paged cache.

    Args:
        module: the attention module (its ``layer_idx`` picks the cache layer).
        query: [1, H, T, D]; key, value: [1, Hkv, T, D] (after rotary embedding).
        meta: the step's metadata.
        scaling: softmax scale (default D ** -0.5).
        sliding_window: keys further back than this many positions are masked (None: all).
        softcap: tanh soft-capping of the scores (Gemma 2), or None.

    Returns:
        [1, T, H, D], the layout the model's attention modules expect back.
    """
    layer = module.layer_idx
    cache = meta.cache
    _, H, T, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    cache.write(layer, meta.slot_mapping, k_new, v_new)
    k_cache, v_cache = cache.key[layer], cache.value[layer]

    if meta.flash is not None:
        return _flash_paged_attention(query, k_cache, v_cache, meta, scale, sliding_window, softcap)

    q = query[0]  # [H, T, D]
    out = query.new_empty(T, H, D)
    if meta.decode_rows is not None:
        Hkv = k_cache.shape[1]
        bd = meta.decode_rows.shape[0]
        qd = q.index_select(1, meta.decode_rows).transpose(0, 1)  # [Bd, H, D]
        if softcap is None:
            # Fold the query heads of each KV head into the query axis: no copy of the keys.
            qd = qd.reshape(bd, Hkv, H // Hkv, D)
        else:
            qd = qd.unsqueeze(2)
        # index_select on the flat slot list is several times faster than advanced indexing on CPU.
        flat = meta.decode_gather.view(-1)
        lmax = meta.decode_gather.shape[1]
        kd = k_cache.index_select(0, flat).view(bd, lmax, Hkv, D).transpose(1, 2)  # [Bd, Hkv, Lmax, D]
        vd = v_cache.index_select(0, flat).view(bd, lmax, Hkv, D).transpose(1, 2)
        od = _attend(qd, kd, vd, meta.decode_mask(sliding_window), scale, softcap, is_causal=False)
        out[meta.decode_rows] = od.reshape(bd, H, D)
    for seg in meta.prefills:
        qs = q[:, seg.start : seg.end].unsqueeze(0)  # [1, H, n, D]
        if seg.gather is None:
            ks = key[:, :, seg.start : seg.end]
            vs = value[:, :, seg.start : seg.end]
        else:
            ks = k_cache.index_select(0, seg.gather).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vs = v_cache.index_select(0, seg.gather).transpose(0, 1).unsqueeze(0)
        mask = seg.mask(sliding_window, query.device)
        os_ = _attend(qs, ks, vs, mask, scale, softcap, is_causal=True)
        out[seg.start : seg.end] = os_[0].transpose(0, 1)
    return out.unsqueeze(0)


def _flash_paged_attention(  # pragma: no cover - needs CUDA and flash-attn
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """flash-attn varlen over the whole batch, keys read through the block table."""
    f = meta.flash
    assert f is not None and _flash_attn_varlen_func is not None
    block_size = meta.cache.block_size
    q = query[0].transpose(0, 1)  # [T, H, D]
    kc = k_cache.view(-1, block_size, *k_cache.shape[1:])
    vc = v_cache.view(-1, block_size, *v_cache.shape[1:])
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    out = _flash_attn_varlen_func(
        q,
        kc,
        vc,
        cu_seqlens_q=f["cu_seqlens_q"],
        cu_seqlens_k=f["cu_seqlens_k"],
        max_seqlen_q=f["max_seqlen_q"],
        max_seqlen_k=f["max_seqlen_k"],
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=softcap or 0.0,
        block_table=f["block_table"],
    )
    return out.unsqueeze(0)


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
            return _original_function(module, original)(module, query, key, value, attention_mask, **kwargs)
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


def register_paged_attention(original: str) -> str:
    """Register the paged function that falls back to ``original`` and return its name.

    Registration is idempotent; the registered function holds no state, so models
    and managers can share it.

    Args:
        original: the model's attention implementation ("sdpa", "eager", "flash_attention_2", ...).

    Returns:
        ``"rollout_paged|" + original``.

    Raises:
        ValueError: ``original`` is itself a paged implementation, or has no mask function.
    """
    if original.startswith(PAGED_PREFIX) or original.startswith("paged|"):
        raise ValueError(f"original attention must not be a paged implementation, got {original!r}")
    name = PAGED_PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, _make_dispatch(original))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        mask_key = original if original in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "eager"
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask_key])
    return name


def original_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the model had before the engine switched it."""
    impl = model.config._attn_implementation or "eager"
    return impl.removeprefix(PAGED_PREFIX)


# Models switched to the paged dispatcher, with the number of engines using each and the implementation
# to put back when the last one closes. Several engines share one model (a persistent manager, a
# generate_batch or score call, a second manager): the first switches it, only the last restores it.
_USERS: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()  # model -> [count, original]
_USERS_LOCK = threading.Lock()


def enable_paged_attention(model: torch.nn.Module) -> str:
    """Switch a model to the paged dispatcher for one more user; returns the original implementation's name.

    Reference-counted per model object: each call must be paired with one ``restore_attention``.
    """
    with _USERS_LOCK:
        entry = _USERS.get(model)
        if entry is not None and model.config._attn_implementation == PAGED_PREFIX + entry[1]:
            entry[0] += 1
            return entry[1]
        # First user, or the caller replaced the implementation since: start counting afresh.
        original = original_implementation(model)
        name = register_paged_attention(original)
        if model.config._attn_implementation != name:
            model.set_attn_implementation(name)
        _USERS[model] = [1 if entry is None else entry[0] + 1, original]
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
        if entry is not None:
            entry[0] -= 1
            if entry[0] > 0:
                return
            del _USERS[model]
            original = entry[1]
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def num_paged_users(model: torch.nn.Module) -> int:
    """Engines currently holding the model on the paged dispatcher (0 when none)."""
    with _USERS_LOCK:
        entry = _USERS.get(model)
        return entry[0] if entry is not None else 0
