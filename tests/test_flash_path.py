"""The CUDA flash-attn path's glue (varlen metadata, block table, window, softcap), checked on CPU.

flash-attn needs a GPU, so this test swaps ``flash_attn_varlen_func`` for a reference written from
flash-attn's documented semantics (paged KV through ``block_table``, causal masks aligned to the
bottom right, ``window_size=(left, right)``) and checks that the engine on that path generates what
the SDPA path generates. A wrong cu_seqlens, block table or window would change the tokens.
"""

from __future__ import annotations

import pytest
import torch

import rollout.attention as attention
from rollout import ContinuousBatchingConfig, Engine, SamplingParams
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import run_engine


def reference_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D]; k, v [num_blocks, page, Hk, D] with block_table [B, max_blocks]; returns [T, H, D]."""
    assert block_table is not None and block_table.dtype == torch.int32
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    H, D = q.shape[1], q.shape[2]
    page = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    out = torch.empty_like(q)
    for b in range(block_table.shape[0]):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        kv_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qe - qs <= max_seqlen_q and kv_len <= max_seqlen_k
        blocks = block_table[b, : -(-kv_len // page)].long()
        kb = k[blocks].reshape(-1, *k.shape[2:])[:kv_len]  # [L, Hk, D]
        vb = v[blocks].reshape(-1, *v.shape[2:])[:kv_len]
        groups = H // kb.shape[1]
        kb = kb.repeat_interleave(groups, 1).transpose(0, 1)  # [H, L, D]
        vb = vb.repeat_interleave(groups, 1).transpose(0, 1)
        qb = q[qs:qe].transpose(0, 1)  # [H, n, D]
        scores = qb @ kb.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        n = qe - qs
        i = torch.arange(n)[:, None] + (kv_len - n)  # bottom-right alignment
        j = torch.arange(kv_len)[None, :]
        allowed = torch.ones(n, kv_len, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        left, right = window_size
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = (torch.softmax(scores, -1) @ vb).transpose(0, 1)
    return out


def _generate(model, prompts, flash: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=96, max_batch_tokens=24))
    if flash:
        monkeypatch.setattr(attention, "_flash_attn_varlen_func", reference_flash_attn_varlen_func)
        engine.use_flash = engine.runner.use_flash = True
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=10), request_id=f"r{i}")
    try:
        out = run_engine(engine)
    finally:
        engine.close()
    return {rid: o.generated_tokens for rid, o in out.items()}


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding"])
def test_flash_path_generates_what_the_sdpa_path_generates(build, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build()
    # Shared prefixes (prefix-cache hits), prompts longer than the budget (chunks), mixed steps.
    prompts = random_prompts(6, VOCAB_SIZE, 3, 40, seed=21)
    prompts += [prompts[4][:20] + [7, 8, 9]]
    sdpa = _generate(model, prompts, flash=False, monkeypatch=monkeypatch)
    flash = _generate(model, prompts, flash=True, monkeypatch=monkeypatch)
    assert flash == sdpa
