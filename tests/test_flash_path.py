"""The CUDA flash-attn path's glue (varlen metadata, block table, window, softcap), checked on CPU.

flash-attn needs a GPU, so these tests swap ``flash_attn_varlen_func`` for the reference in
``tests/flash_reference.py``, written from flash-attn's documented semantics (paged KV through
``block_table``, causal masks aligned to the bottom right, ``window_size=(left, right)``) and refusing
what the real kernel refuses (page size, dtype, head dim, device, int32 indices). The engine on that
path must compute the logprobs the SDPA path computes, for decode steps and for prefills: a wrong
cu_seqlens, block table or window would change them by whole nats, and an input the kernel would
refuse fails the test.

Issue 13, case 8: the reference used to accept a 4-token page and fp32 keys, so the test ran the flash
path on a cache the real kernel refuses.
"""

from __future__ import annotations

import pytest
import torch

import rollout.attention as attention
from rollout import ContinuousBatchingConfig, Engine, SamplingParams
from rollout.scoring import score_with_engine
from tests import flash_reference
from tests.flash_reference import FlashRuleError
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import assert_close, run_engine

PAGE = 256  # the smallest page flash-attn's paged kernel accepts
# Two kernels in half precision round differently: a greedy token can flip at a near-tie, so the paths are
# compared on the same tokens, by logprob. A wrong cu_seqlens, block table or window is off by whole nats.
ATOL = 0.02


def _engine(model, flash: bool, monkeypatch: pytest.MonkeyPatch) -> Engine:  # noqa: ANN001
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=32, max_batch_tokens=96, return_logprobs=True)
    engine = Engine(model, config)
    assert engine.cache.dtype == torch.float16 and engine.block_size == PAGE
    if flash:
        monkeypatch.setattr(attention, "_flash_attn_varlen_func", flash_reference.flash_attn_varlen_func)
        engine.use_flash = engine.runner.use_flash = True
    return engine


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding"])
def test_flash_path_computes_what_the_sdpa_path_computes(build, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build().to(torch.float16)  # the kernel reads only fp16/bf16
    # Prompts over one page (two-block tables), shared prefixes longer than a page (prefix-cache hits:
    # a block table whose first block another request wrote), prompts longer than the step budget
    # (chunked prefill with context), and mixed decode/prefill steps.
    prompts = random_prompts(5, VOCAB_SIZE, 200, 300, seed=21)
    prompts += [prompts[4][:260] + [7, 8, 9], prompts[1][:270] + [11]]
    flash = _engine(model, flash=True, monkeypatch=monkeypatch)
    sdpa = _engine(model, flash=False, monkeypatch=monkeypatch)
    try:
        for i, p in enumerate(prompts):
            flash.add_request(p, SamplingParams(max_new_tokens=10), request_id=f"r{i}")
        generated = run_engine(flash)  # decode steps on the flash path
        completions = [generated[f"r{i}"].generated_tokens for i in range(len(prompts))]
        assert all(len(c) == 10 for c in completions)
        # The same tokens scored by prefill on both paths (the flash engine's prefix cache now holds the
        # prompts' blocks, so its prefills also read blocks written by other requests).
        flash_scores = score_with_engine(flash, prompts, completions)
        sdpa_scores = score_with_engine(sdpa, prompts, completions)
    finally:
        flash.close()
        sdpa.close()
    assert flash.stats.num_prefix_cache_hit_blocks > 0
    for i in range(len(prompts)):
        expected = sdpa_scores[i].completion_logprobs
        assert_close(generated[f"r{i}"].logprobs, expected, atol=ATOL)
        assert_close(flash_scores[i].completion_logprobs, expected, atol=ATOL)


def _paged_inputs(**change):  # noqa: ANN003, ANN202
    """Valid paged-kernel inputs (one 3-token query over 5 keys), with some replaced."""
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(3, 4, 16, generator=g).to(torch.bfloat16),
        k=torch.randn(2, PAGE, 2, 16, generator=g).to(torch.bfloat16),
        v=torch.randn(2, PAGE, 2, 16, generator=g).to(torch.bfloat16),
        cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32),
        max_seqlen_q=3,
        max_seqlen_k=5,
        causal=True,
        block_table=torch.tensor([[1]], dtype=torch.int32),
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (
            {
                "k": torch.zeros(16, 4, 2, 16, dtype=torch.bfloat16),
                "v": torch.zeros(16, 4, 2, 16, dtype=torch.bfloat16),
            },
            "divisible by 256",
        ),
        ({"q": torch.zeros(3, 4, 16)}, "fp16 and bf16"),
        ({"k": torch.zeros(2, PAGE, 2, 16, dtype=torch.float16)}, "share a dtype"),
        (
            {
                "q": torch.zeros(3, 4, 12, dtype=torch.bfloat16),
                "k": torch.zeros(2, PAGE, 2, 12, dtype=torch.bfloat16),
                "v": torch.zeros(2, PAGE, 2, 12, dtype=torch.bfloat16),
            },
            "multiple of 8",
        ),
        ({"q": torch.zeros(3, 4, 264, dtype=torch.bfloat16)}, "at most 256"),
        ({"block_table": torch.tensor([[1]], dtype=torch.int64)}, "int32"),
        ({"cu_seqlens_k": torch.tensor([0, 5])}, "int32"),
        ({"block_table": torch.tensor([[1]], dtype=torch.int32, device="meta")}, "q's device"),
        ({"q": torch.zeros(16, 3, 4, dtype=torch.bfloat16).permute(1, 2, 0)}, "contiguous last dimension"),
    ],
    ids=[
        "page_size",
        "fp32",
        "mixed_dtypes",
        "head_dim_12",
        "head_dim_264",
        "int64_table",
        "int64_cu",
        "device",
        "strided",
    ],
)
def test_reference_refuses_what_the_kernel_refuses(change: dict, rule: str) -> None:
    with pytest.raises(FlashRuleError, match=rule):
        flash_reference.flash_attn_varlen_func(**_paged_inputs(**change))


def test_reference_reads_keys_through_the_block_table() -> None:
    # The 5 keys live in block 1 of 2; block 0 holds other values that must not be read.
    args = _paged_inputs()
    out = flash_reference.flash_attn_varlen_func(**args)
    keys, values = args["k"][1, :5], args["v"][1, :5]
    expected = flash_reference.reference_attention(args["q"], keys, values, None, True, (-1, -1), 0.0)
    assert torch.equal(out, expected)
    # Query 0 sits at key position 2 (bottom-right alignment): it sees keys 0..2 only.
    q0 = args["q"][0].float()  # [H, D]
    k_rep = keys.float().repeat_interleave(2, 1)[:3]  # [3, H, D], query head h reads KV head h // 2
    v_rep = values.float().repeat_interleave(2, 1)[:3]
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q0, k_rep) * 16**-0.5, -1)
    torch.testing.assert_close(out[0].float(), torch.einsum("hl,lhd->hd", probs, v_rep), atol=1e-2, rtol=0)
