"""The CUDA flash-attn path's glue (varlen metadata, the decode fast path's fixed-width block table, window,
softcap), checked on CPU.

flash-attn needs a GPU, so these tests swap ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` for
the references in ``tests/flash_reference.py``, written from flash-attn's documented semantics (paged KV
through ``block_table``, causal masks aligned to the bottom right, ``window_size=(left, right)``) and
refusing what the real kernels refuse (page size, dtype, head dim, device, int32 indices). The engine on
that path must compute the logprobs the SDPA path computes, for decode steps and for prefills: a wrong
cu_seqlens, cache_seqlens, block table or window would change them by whole nats, and an input the kernel
would refuse fails the test.

Issue 13, case 8: the reference used to accept a 4-token page and fp32 keys, so the test ran the flash
path on a cache the real kernel refuses.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

import rollout.attention as attention
import rollout.cpu_attention as cpu_attention
import rollout.model_runner as model_runner
from rollout import ContinuousBatchingConfig, Engine, SamplingParams
from rollout.engine_spec import resolve_max_blocks_per_request
from rollout.requests import Request
from rollout.scheduler import ScheduledRequest, SchedulerOutput
from rollout.scoring import score_with_engine
from rollout.static_step import FORWARDS
from tests import flash_reference
from tests.flash_reference import FlashRuleError
from tests.tiny_models import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    random_prompts,
    tiny_gemma,
    tiny_llama,
)
from tests.utils import assert_close, assert_greedy_agrees, generate_in_order, run_engine

PAGE = 256  # the smallest page flash-attn's paged kernel accepts
# Two kernels in half precision round differently: a greedy token can flip at a near-tie, so the paths are
# compared on the same tokens, by logprob. A wrong cu_seqlens, block table or window is off by whole nats.
ATOL = 0.02


def _engine(
    model,  # noqa: ANN001
    flash: bool,
    monkeypatch: pytest.MonkeyPatch,
    max_blocks_per_request: int | None = None,
    max_batch_tokens: int = 96,
    **overrides: object,
) -> Engine:
    config = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=32,
        max_batch_tokens=max_batch_tokens,
        return_logprobs=True,
        max_blocks_per_request=max_blocks_per_request,
        cpu_attention="sdpa",  # the SDPA reference; flash=True below turns the (stand-in) paged kernels on
        **overrides,
    )
    engine = Engine(model, config)
    assert engine.cache.dtype == torch.float16 and engine.block_size == PAGE
    if flash:
        monkeypatch.setattr(attention, "_flash_attn_varlen_func", flash_reference.flash_attn_varlen_func)
        monkeypatch.setattr(attention, "_flash_attn_with_kvcache", flash_reference.flash_attn_with_kvcache)
        # The cache is on the CPU, where the steps would call rollout's kernel: the stand-ins check flash-attn's rules.
        monkeypatch.setattr(cpu_attention, "flash_attn_varlen_func", flash_reference.flash_attn_varlen_func)
        monkeypatch.setattr(cpu_attention, "flash_attn_with_kvcache", flash_reference.flash_attn_with_kvcache)
        engine.use_flash = engine.runner.use_flash = True
    return engine


def tiny_gemma2_softcap(seed: int = 0) -> Gemma2ForCausalLM:
    """Gemma 2: 2 layers (sliding window 8, then full), attention scores soft-capped at 2.0 (scores of these
    weights run past 2, so the cap changes them), GQA 4/2, head_dim 16; the tiny models' other shapes."""
    config = Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(seed)
    return Gemma2ForCausalLM(config).eval()


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


@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_gemma, tiny_gemma2_softcap], ids=["llama_gqa", "gemma3_sliding", "gemma2_softcap"]
)
def test_decode_fast_path_generates_what_the_varlen_and_sdpa_paths_generate(build, monkeypatch) -> None:  # noqa: ANN001
    model = build().to(torch.float16)
    reference_model = build()  # the same weights in fp32
    # Prompts over one page (two-block table rows), chunked prefills, decode steps of 7 requests.
    prompts = random_prompts(7, VOCAB_SIZE, 20, 300, seed=23)
    fast_engine = _engine(model, flash=True, monkeypatch=monkeypatch)  # max_blocks_per_request None: 32
    varlen_engine = _engine(model, flash=True, monkeypatch=monkeypatch, max_blocks_per_request=0)
    sdpa_engine = _engine(model, flash=False, monkeypatch=monkeypatch)
    fast = generate_in_order(fast_engine, prompts)
    varlen = generate_in_order(varlen_engine, prompts)
    sdpa = generate_in_order(sdpa_engine, prompts)
    # Every decode-only step took the fast path (no request is wider than 32 blocks); with 0, none did.
    assert fast_engine.runner.max_blocks_per_request == 32
    assert fast_engine.stats.num_decode_fast_path_steps == len(fast_engine.stats.decode_step_batch) >= 9
    assert varlen_engine.stats.num_decode_fast_path_steps == 0 and sdpa_engine.stats.num_decode_fast_path_steps == 0
    for f, v in zip(fast, varlen):
        assert len(f.generated_tokens) == 10
        # The two flash kernels read the same keys in the same order: the same numbers, bit for bit.
        assert f.generated_tokens == v.generated_tokens and f.logprobs == v.logprobs
    assert_greedy_agrees(fast, sdpa, prompts, reference_model, ATOL)


def test_a_request_wider_than_the_table_sends_its_steps_to_the_varlen_kernel(monkeypatch) -> None:  # noqa: ANN001
    model = tiny_llama().to(torch.float16)
    long, short = random_prompts(1, VOCAB_SIZE, 250, 250, seed=3)[0], random_prompts(1, VOCAB_SIZE, 100, 100)[0]
    # One step prefills both prompts and samples their first tokens, then 9 decode steps. The long request
    # decodes positions 250..258: its keys fit one 256-token block up to position 255 (6 steps); from 256
    # it needs a second block, wider than max_blocks_per_request=1, and those 3 steps take the varlen kernel.
    narrow = _engine(model, True, monkeypatch, max_blocks_per_request=1, max_batch_tokens=512)
    off = _engine(model, True, monkeypatch, max_blocks_per_request=0, max_batch_tokens=512)
    sdpa = _engine(model, False, monkeypatch, max_batch_tokens=512)
    outputs = [generate_in_order(engine, [long, short]) for engine in (narrow, off, sdpa)]
    assert narrow.stats.num_steps == 10 and len(narrow.stats.decode_step_batch) == 9
    assert narrow.stats.num_decode_fast_path_steps == 6
    assert off.stats.num_decode_fast_path_steps == 0
    for n, o in zip(outputs[0], outputs[1]):
        assert n.generated_tokens == o.generated_tokens and n.logprobs == o.logprobs
    assert_greedy_agrees(outputs[0], outputs[2], [long, short], tiny_llama(), ATOL)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama_gqa", "gemma3_sliding"])
def test_the_padded_decode_path_calls_flash_attn_with_kvcache_and_generates_what_sdpa_generates(  # noqa: ANN001
    build, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiled and CUDA-graphed decode path runs this padded forward (uncompiled here): its kernel inputs
    # come from the padded batch itself, so its padded rows read one key of the padding block.
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = build().to(torch.float16)
    prompts = random_prompts(5, VOCAB_SIZE, 20, 300, seed=29)
    padded_engine = _engine(model, True, monkeypatch, default_compile_level=1)
    sdpa_engine = _engine(model, False, monkeypatch)
    padded = generate_in_order(padded_engine, prompts)
    sdpa = generate_in_order(sdpa_engine, prompts)
    stats = padded_engine.stats
    assert padded_engine.runner.static_paths == ["varlen", "decode"] and stats.num_padded_steps == stats.num_steps
    assert stats.num_decode_fast_path_steps == len(stats.decode_step_batch) >= 9
    assert_greedy_agrees(padded, sdpa, prompts, build(), ATOL)


def prepared_flash(engine: Engine, scheduled: list[ScheduledRequest]) -> dict:
    """The flash-attn metadata of a step of ``scheduled``, as the runner prepares it."""
    return engine.runner.prepare_step(SchedulerOutput(scheduled=scheduled)).batch.flash


def test_decode_fast_path_inputs_are_lengths_and_a_fixed_width_int32_block_table() -> None:
    model = tiny_llama()
    config = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_blocks_per_request=3)
    engine = Engine(model, config)
    try:
        engine.runner.use_flash = True
        a = Request("a", list(range(3, 12)), SamplingParams())  # decoding position 8: 9 keys in 3 blocks
        a.num_computed_tokens, a.block_table = 8, [7, 2, 9]
        b = Request("b", [5, 6, 7, 8, 9], SamplingParams())  # decoding position 4: 5 keys in 2 blocks
        b.num_computed_tokens, b.block_table = 4, [4, 11]
        decode = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 1, True)]
        flash = prepared_flash(engine, decode)
        assert set(flash) == {"cache_seqlens", "block_tables"}
        assert flash["cache_seqlens"].dtype == flash["block_tables"].dtype == torch.int32
        assert flash["cache_seqlens"].tolist() == [9, 5]
        assert flash["block_tables"].tolist() == [[[7, 2, 9], [4, 11, 0]]]
        assert engine.runner.num_decode_fast_path_steps == 1
        # 13 keys need a 4th block: the step takes the varlen kernel, whose table is as wide as the longest row.
        a.num_computed_tokens, a.block_table = 12, [7, 2, 9, 5]
        decode = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 1, True)]  # entries keep their start
        flash = prepared_flash(engine, decode)
        assert "cache_seqlens" not in flash and flash["block_tables"].tolist() == [[[7, 2, 9, 5], [4, 11, 0, 0]]]
        # A prefill chunk in the step: varlen as well.
        a.num_computed_tokens, a.block_table = 3, [7, 2, 9]
        flash = prepared_flash(engine, [ScheduledRequest(a, 6, True), decode[1]])
        assert flash["cu_seqlens_q"].tolist() == [0, 6, 7]
        assert engine.runner.num_decode_fast_path_steps == 1
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("value", "num_blocks", "context", "width"),
    [
        (None, 16, 512, 32),  # short cache and context: transformers' fallback width
        (None, 1000, 65536, 256),  # the model's context (65536 / 256) is the longest request
        (None, 100, 65536, 100),  # the cache (100 blocks) is
        (None, 100, None, 100),  # no context length: the cache
        (0, 1000, 65536, 0),  # off
        (5, 1000, 65536, 5),  # explicit
    ],
)
def test_max_blocks_per_request_resolves_to_the_longest_request_at_least_32(value, num_blocks, context, width) -> None:  # noqa: ANN001
    config = ContinuousBatchingConfig(max_blocks_per_request=value)
    assert resolve_max_blocks_per_request(config, num_blocks, 256, context) == width


def test_max_blocks_per_request_refuses_a_negative_width() -> None:
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        ContinuousBatchingConfig(max_blocks_per_request=-1)


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


def _kvcache_inputs(**change):  # noqa: ANN003, ANN202
    """Valid decode inputs: 2 sequences of one query token over 5 and 300 keys in a 3-block paged cache."""
    g = torch.Generator().manual_seed(1)
    args = dict(
        q=torch.randn(2, 1, 4, 16, generator=g).to(torch.bfloat16),
        k_cache=torch.randn(3, PAGE, 2, 16, generator=g).to(torch.bfloat16),
        v_cache=torch.randn(3, PAGE, 2, 16, generator=g).to(torch.bfloat16),
        cache_seqlens=torch.tensor([5, 300], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [0, 1]], dtype=torch.int32),
        causal=True,
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (
            {
                "k_cache": torch.zeros(12, 64, 2, 16, dtype=torch.bfloat16),
                "v_cache": torch.zeros(12, 64, 2, 16, dtype=torch.bfloat16),
            },
            "divisible by 256",
        ),
        ({"q": torch.zeros(2, 1, 4, 16)}, "fp16 and bf16"),
        ({"k_cache": torch.zeros(3, PAGE, 2, 16, dtype=torch.float16)}, "share a dtype"),
        ({"q": torch.zeros(2, 1, 4, 12, dtype=torch.bfloat16)}, "multiple of 8"),
        ({"block_table": torch.tensor([[2, 0], [0, 1]])}, "int32"),
        ({"cache_seqlens": torch.tensor([5, 300])}, "int32"),
        ({"q": torch.zeros(2, 1, 16, 4, dtype=torch.bfloat16).transpose(2, 3)}, "contiguous last dimension"),
        ({"block_table": torch.tensor([[2, 0]], dtype=torch.int32)}, r"block_table must be \[2, max_blocks\]"),
        ({"cache_seqlens": torch.tensor([5, 600], dtype=torch.int32)}, "past the table's 2 blocks"),
        ({"block_table": torch.tensor([[3, 0], [0, 1]], dtype=torch.int32)}, "missing block"),
        ({"k": torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16)}, "does not implement k"),
        ({"cache_batch_idx": torch.tensor([0, 1], dtype=torch.int32)}, "cache_batch_idx"),
        ({"block_table": None}, "paged cache only"),
    ],
    ids=[
        "page_size",
        "fp32",
        "mixed_dtypes",
        "head_dim_12",
        "int64_table",
        "int64_seqlens",
        "strided",
        "table_rows",
        "past_the_table",
        "missing_block",
        "append",
        "batch_idx",
        "unpaged",
    ],
)
def test_kvcache_reference_refuses_what_the_kernel_refuses(change: dict, rule: str) -> None:
    with pytest.raises(FlashRuleError, match=rule):
        flash_reference.flash_attn_with_kvcache(**_kvcache_inputs(**change))


def test_kvcache_reference_reads_each_sequence_through_its_table_row_up_to_its_length() -> None:
    args = _kvcache_inputs()
    k, v = args["k_cache"], args["v_cache"]
    out = flash_reference.flash_attn_with_kvcache(**args)
    assert out.shape == (2, 1, 4, 16) and out.dtype == torch.bfloat16
    # Sequence 0: keys 0..4 of block 2. Sequence 1: block 0, then 44 keys of block 1.
    keys = [k[2, :5], torch.cat([k[0], k[1, :44]])]
    values = [v[2, :5], torch.cat([v[0], v[1, :44]])]
    for b in range(2):
        q = args["q"][b, 0].float()  # [H, D]; query head h reads KV head h // 2
        k_rep, v_rep = keys[b].float().repeat_interleave(2, 1), values[b].float().repeat_interleave(2, 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q, k_rep) * 16**-0.5, -1)
        torch.testing.assert_close(out[b, 0].float(), torch.einsum("hl,lhd->hd", probs, v_rep), atol=1e-2, rtol=0)
    # A window of (2, 0) keeps the last 3 keys; a softcap of 0.5 bounds every score.
    windowed = flash_reference.flash_attn_with_kvcache(**_kvcache_inputs(window_size=(2, 0), softcap=0.5))
    expected = flash_reference.reference_attention(args["q"][0], k[2, 2:5], v[2, 2:5], None, False, (-1, -1), 0.5)
    assert torch.equal(windowed[0], expected)
