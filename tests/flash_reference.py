"""Stand-ins for flash-attn's kernels on CPU, written from flash-attn 2.8's documented semantics, that refuse
what the real kernels refuse.

Semantics (flash_attn/flash_attn_interface.py docstrings): q [T, H, D], keys [.., Hk, D] with H a multiple
of Hk (query head h reads KV head h // (H / Hk)); the causal mask is aligned to the bottom right of the
(queries x keys) matrix; ``window_size=(left, right)`` keeps keys j with i - left <= j <= i + right (-1:
unbounded), i the query's position counted from the bottom right; ``softcap`` > 0 caps the scores as
softcap * tanh(scores / softcap). The result is computed in fp32 and returned in q's dtype.

Rules (csrc/flash_attn/flash_api.cpp, ``mha_fwd``, ``mha_varlen_fwd`` and ``mha_fwd_kvcache``) enforced
with a ``FlashRuleError`` naming the rule: q, k and v of one dtype, fp16 or bf16; head dim at most 256 and
a multiple of 8 (the kernel's own check: the Python wrapper pads other head dims, which for a paged
cache would copy the whole cache at every call, so rollout must never rely on it); contiguous last
dimensions; ``cu_seqlens_*``, ``cache_seqlens`` and ``block_table`` int32; a paged cache's block size a
multiple of 256; every tensor on q's device. The real kernels also need a CUDA device of compute
capability 8.0 or more, which no CPU test can have: these checks stand for everything else.

``flash_attn_with_kvcache`` (the decode fast path's kernel): q [B, Sq, H, D]; with ``block_table``
[B, max_blocks] the cache is paged, [num_blocks, page, Hk, D], and sequence b's keys are its first
``cache_seqlens[b]`` positions read through row b of the table. The kernel does not check that those
positions fit in the table's width (it would read past the row): the reference refuses it, as it
refuses what rollout does not use (appending ``k``/``v``, rotary, ALiBi, ``cache_batch_idx``, left
padding) rather than stand in for it untested.
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashRuleError(RuntimeError):
    """An input the real flash-attn kernel would refuse."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise FlashRuleError(message)


def check_flash_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *index_tensors: torch.Tensor) -> None:
    """The rules every flash-attn 2 entry point applies to q, k, v and its int32 index tensors.

    Raises:
        FlashRuleError: naming the first rule broken.
    """
    _check(q.dtype in FLASH_DTYPES, f"FlashAttention only supports fp16 and bf16, got {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, f"q, k, v must share a dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    head_dim = q.shape[-1]
    _check(head_dim <= 256, f"head dim must be at most 256, got {head_dim}")
    _check(head_dim % 8 == 0, f"head dim must be a multiple of 8, got {head_dim}")
    _check(k.shape[-1] == head_dim and v.shape[-1] == head_dim, "q, k and v must share the head dim")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.stride(-1) == 1, f"{name} must have a contiguous last dimension")
    _check(q.shape[-2] % k.shape[-2] == 0, f"KV heads ({k.shape[-2]}) must divide query heads ({q.shape[-2]})")
    for t in (k, v, *index_tensors):
        _check(t.device == q.device, f"every tensor must be on q's device {q.device}, got one on {t.device}")
    for t in index_tensors:
        _check(t.dtype == torch.int32, f"cu_seqlens and block_table must be int32, got {t.dtype}")
        _check(t.stride(-1) == 1, "cu_seqlens and block_table must have a contiguous last dimension")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
) -> torch.Tensor:
    """Attention of one sequence: q [n, H, D] over k, v [L, Hk, D]; returns [n, H, D] in q's dtype."""
    n, H, D = q.shape
    L = k.shape[0]
    scale = scale if scale is not None else D**-0.5
    groups = H // k.shape[1]
    kf = k.float().repeat_interleave(groups, 1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(groups, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [H, n, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(n, device=q.device)[:, None] + (L - n)  # bottom-right alignment
    j = torch.arange(L, device=q.device)[None, :]
    allowed = torch.ones(n, L, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ vf).transpose(0, 1).to(q.dtype)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func``: q [T, H, D]; k, v [Tk, Hk, D], or with ``block_table``
    [B, max_blocks] a paged cache [num_blocks, page, Hk, D]; returns [T, H, D].

    Raises:
        FlashRuleError: an input the kernel refuses (see the module docstring), a page size that is not a
            multiple of 256, a sequence longer than its max_seqlen, or dropout.
    """
    index = (cu_seqlens_q, cu_seqlens_k) + ((block_table,) if block_table is not None else ())
    check_flash_inputs(q, k, v, *index)
    _check(dropout_p == 0.0, "the reference computes no dropout")
    batch = cu_seqlens_q.shape[0] - 1
    _check(cu_seqlens_k.shape[0] == batch + 1, "cu_seqlens_q and cu_seqlens_k must have batch + 1 entries")
    if block_table is not None:
        _check(k.dim() == 4, f"a paged cache is [num_blocks, page, Hk, D], got {tuple(k.shape)}")
        page = k.shape[1]
        _check(page % 256 == 0, f"Paged KV cache block size must be divisible by 256, got {page}")
        _check(block_table.shape[0] == batch, f"block_table has {block_table.shape[0]} rows for {batch} sequences")
    out = torch.empty_like(q)
    for b in range(batch):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        _check(qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k, "a sequence is longer than max_seqlen")
        if block_table is None:
            kb, vb = k[ks:ke], v[ks:ke]
        else:
            # Paged: cu_seqlens_k gives each sequence's key count; its keys are read through its block row.
            blocks = block_table[b, : -(-(ke - ks) // page)].long()
            kb = k[blocks].reshape(-1, *k.shape[2:])[: ke - ks]
            vb = v[blocks].reshape(-1, *v.shape[2:])[: ke - ks]
        out[qs:qe] = reference_attention(q[qs:qe], kb, vb, softmax_scale, causal, window_size, softcap)
    return out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_func``: q [B, S, H, D], k, v [B, Sk, Hk, D]; returns [B, S, H, D].

    Raises:
        FlashRuleError: an input the kernel refuses, or dropout.
    """
    check_flash_inputs(q, k, v)
    _check(dropout_p == 0.0, "the reference computes no dropout")
    return torch.stack(
        [reference_attention(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap) for b in range(q.shape[0])]
    )


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` over a paged cache: q [B, Sq, H, D]; k_cache, v_cache
    [num_blocks, page, Hk, D]; cache_seqlens int32 [B]; block_table int32 [B, max_blocks]. Returns
    [B, Sq, H, D]: query i of sequence b attends to its keys 0 .. cache_seqlens[b] - 1, with the causal
    mask and the window aligned to the last key.

    Raises:
        FlashRuleError: an input the kernel refuses (see the module docstring), a page size that is not a
            multiple of 256, a table or lengths of the wrong shape, a length past the table's width or a
            block id outside the cache, or a feature the reference does not implement.
    """
    _check(block_table is not None, "the reference implements the paged cache only (block_table)")
    _check(isinstance(cache_seqlens, torch.Tensor), "the reference takes cache_seqlens as an int32 tensor")
    assert block_table is not None and isinstance(cache_seqlens, torch.Tensor)
    for name, value in (
        ("k", k),
        ("v", v),
        ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin),
        ("cache_leftpad", cache_leftpad),
        ("alibi_slopes", alibi_slopes),
    ):
        _check(value is None, f"the reference does not implement {name}")
    _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
    _check(not return_softmax_lse, "the reference does not return the softmax lse")
    check_flash_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    _check(q.dim() == 4, f"q is [batch, seqlen_q, heads, head_dim], got {tuple(q.shape)}")
    _check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "a paged cache is [num_blocks, page, Hk, D]")
    batch, num_blocks, page = q.shape[0], k_cache.shape[0], k_cache.shape[1]
    _check(batch > 0, "batch size must be positive")
    _check(page % 256 == 0, f"Paged KV cache block size must be divisible by 256, got {page}")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch, f"block_table must be [{batch}, max_blocks]")
    _check(tuple(cache_seqlens.shape) == (batch,), f"cache_seqlens must be [{batch}], got {tuple(cache_seqlens.shape)}")
    _check(cache_seqlens.is_contiguous(), "cache_seqlens must be contiguous")
    width = block_table.shape[1]
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(cache_seqlens[b])
        _check(length > 0, f"cache_seqlens[{b}] is {length}: the reference attends to at least one key")
        _check(length <= width * page, f"cache_seqlens[{b}] = {length} is past the table's {width} blocks")
        blocks = block_table[b, : -(-length // page)].long()
        _check(bool(((blocks >= 0) & (blocks < num_blocks)).all()), f"block_table row {b} names a missing block")
        kb = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:length]
        vb = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:length]
        out[b] = reference_attention(q[b], kb, vb, softmax_scale, causal, window_size, softcap)
    return out
