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

Issue 21: padded (compiled or CUDA-graphed) steps run the same kernels as eager ones. Their varlen inputs are
padded to sizes fixed by the step's shape (filler sequences, padded tables, bounds for max_seqlen), checked by
hand and on every step of an engine; rows past ``cu_seqlens_q[-1]``, which the kernel leaves unwritten, come
out zero even when the kernel leaves NaN there; warmup stages the same inputs, so (with CPU stand-ins for a
CUDA graph and for flash-attn's custom op under dynamo) nothing is captured or compiled after it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.generation import CompileConfig

import rollout.engine.attention.cpu as cpu_attention
import rollout.engine.attention.paged as attention
import rollout.engine.worker.runner as model_runner
from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine import Engine
from rollout.engine.kv.block_pool import NULL_BLOCK
from rollout.engine.sched.output import ScheduledRequest, SchedulerOutput
from rollout.engine.spec import resolve_max_blocks_per_request
from rollout.engine.staging import HostStaging
from rollout.engine.worker.forward import FORWARDS
from rollout.engine.worker.inputs import PaddingRule, build_step_batch, synthetic_batch, varlen_sizes
from rollout.requests import Request
from rollout.scoring.offline import score_with_engine
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
from tests.utils import CPUGraphs, assert_close, assert_greedy_agrees, generate_in_order, run_engine

PAGE = 256  # the smallest page flash-attn's paged kernel accepts
# Two kernels in half precision round differently: a greedy token can flip at a near-tie, so the paths are
# compared on the same tokens, by logprob. A wrong cu_seqlens, block table or window is off by whole nats.
ATOL = 0.02


def use_kernel(monkeypatch: pytest.MonkeyPatch, kind: str, kernel: Callable[..., torch.Tensor]) -> None:
    """Route the steps' flash-attn calls of ``kind`` ("varlen" or "kvcache") to ``kernel``: flash-attn's own (a
    CUDA cache) and rollout's CPU kernel (a CPU cache, where these tests run: the stand-ins check flash-attn's
    rules on the inputs both take)."""
    name = "flash_attn_varlen_func" if kind == "varlen" else "flash_attn_with_kvcache"
    monkeypatch.setattr(attention, "_" + name, kernel)
    monkeypatch.setattr(cpu_attention, name, kernel)


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
        use_kernel(monkeypatch, "varlen", flash_reference.flash_attn_varlen_func)
        use_kernel(monkeypatch, "kvcache", flash_reference.flash_attn_with_kvcache)
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


# ---------------------------------------------------------------- padded varlen steps (issue 21)
def _padded_rule(**change: int) -> PaddingRule:
    """Block size 4 (the inputs' layout needs no 256-token page), padding block 20, 2-row prefill groups."""
    values = dict(q_interval=4, kv_interval=8, max_batch_tokens=16, max_keys=80, block_size=4, pad_block=20)
    return PaddingRule(**{**values, **change}, subchunk_rows=2)


def test_padded_varlen_inputs_by_hand_have_filler_sequences_and_padded_tables() -> None:
    # Request a decodes position 5 (6 keys, blocks [3, 7]); request b computes positions 2..4 (5 keys) in 2
    # sub-chunks, its table a block ahead of its keys. Group 1 is a sliding group whose first block of a left.
    a = Request("a", list(range(10, 16)), SamplingParams())
    a.num_computed_tokens, a.block_tables = 5, [[3, 7], [NULL_BLOCK, 8]]
    b = Request("b", [30, 31, 32, 33, 34], SamplingParams())
    b.num_computed_tokens, b.block_tables = 2, [[9, 11, 13], [10, 12, 14]]
    scheduled = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 3, True)]
    staging = HostStaging(torch.device("cpu"))
    batch, _ = build_step_batch(scheduled, [0, 3], False, _padded_rule(), staging, num_groups=2, flash_varlen=True)
    assert batch.shape == (4, 4, 4, 2, 2, 2) and batch.kernel == "flash_varlen"  # T, R, Bd, Wd, G, Wp
    # B = Bd + G = 6 sequences, 4 of them fillers (no query, no key); tables max(Wd, Wp) = 2 blocks wide.
    assert varlen_sizes(batch.shape) == (6, 2)
    flash = batch.flash
    assert flash["cu_seqlens_q"].tolist() == [0, 1, 4, 4, 4, 4, 4]
    assert flash["cu_seqlens_k"].tolist() == [0, 6, 11, 11, 11, 11, 11]
    assert flash["block_tables"].tolist() == [
        [[3, 7], [9, 11], [20, 20], [20, 20], [20, 20], [20, 20]],  # b's block 13 holds no key yet
        [[20, 8], [10, 12], [20, 20], [20, 20], [20, 20], [20, 20]],  # the NULL block reads the padding block
    ]
    assert (flash["max_seqlen_q"], flash["max_seqlen_k"]) == (4, 8)  # T rows, 2 blocks of keys: fixed per shape
    tensors = (flash["cu_seqlens_q"], flash["cu_seqlens_k"], flash["block_tables"])
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors)

    # The decode path: one sequence per row (B = T = 4), the table as wide as the decode rows' (Wd = 2).
    decode = [ScheduledRequest(a, 1, True)]
    batch, _ = build_step_batch(decode, [0], True, _padded_rule(), staging, num_groups=2, flash_varlen=True)
    assert batch.shape == (4, 2) and varlen_sizes(batch.shape) == (4, 2)
    assert batch.flash["cu_seqlens_q"].tolist() == [0, 1, 1, 1, 1]
    assert batch.flash["cu_seqlens_k"].tolist() == [0, 6, 6, 6, 6]
    assert batch.flash["block_tables"][:, :2].tolist() == [[[3, 7], [20, 20]], [[20, 8], [20, 20]]]
    assert (batch.flash["max_seqlen_q"], batch.flash["max_seqlen_k"]) == (4, 8)

    # An eager step keeps the exact sizes: its two requests, their longest table, their longest lengths.
    exact = PaddingRule.exact_rule(4)
    batch, _ = build_step_batch(scheduled, [0, 3], False, exact, staging, num_groups=2, flash_varlen=True)
    assert batch.flash["cu_seqlens_q"].tolist() == [0, 1, 4] and batch.flash["cu_seqlens_k"].tolist() == [0, 6, 11]
    assert batch.flash["block_tables"].tolist() == [[[3, 7], [9, 11]], [[0, 8], [10, 12]]]
    assert (batch.flash["max_seqlen_q"], batch.flash["max_seqlen_k"]) == (3, 6)


def test_a_warmup_batch_stages_the_flash_varlen_inputs_of_its_shape_as_a_real_step_does() -> None:
    # A graph captured on the warmup's batch replays real steps of its shape: same tensors, same sizes, same bounds.
    a = Request("a", list(range(10, 16)), SamplingParams())
    a.num_computed_tokens, a.block_table = 5, [3, 7]
    b = Request("b", [30, 31, 32, 33, 34], SamplingParams())
    b.num_computed_tokens, b.block_table = 2, [9, 11]
    staging = HostStaging(torch.device("cpu"))
    for path, scheduled in (("varlen", [(a, 1), (b, 3)]), ("decode", [(a, 1), (b, 1)])):
        steps = [ScheduledRequest(r, n, True) for r, n in scheduled]
        real, _ = build_step_batch(steps, [0, 1], path == "decode", _padded_rule(), staging, flash_varlen=True)
        warm = synthetic_batch(path, real.shape, _padded_rule(), staging, kernel="flash_varlen")
        assert warm.kernel == real.kernel == "flash_varlen" and warm.shape == real.shape
        shapes = {name: tuple(t.shape) for name, t in real.tensors().items()}
        assert {name: tuple(t.shape) for name, t in warm.tensors().items()} == shapes
        assert warm.varlen_max_seqlens == real.varlen_max_seqlens
        # Every warmup sequence is a filler: no row is computed, every row's output is zeroed.
        assert warm.varlen_cu_seqlens.abs().sum() == 0 and (warm.varlen_tables == 20).all()


class _Steps:
    """Records each step's inputs as the runner prepares them: (scheduled, rule, batch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[list[ScheduledRequest], PaddingRule, object]] = []
        prepare = model_runner.prepare_inputs

        def recording(scheduled, decode_path, rule, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            out = prepare(scheduled, decode_path, rule, *args, **kwargs)
            self.steps.append((list(scheduled), rule, out[0]))
            return out

        monkeypatch.setattr(model_runner, "prepare_inputs", recording)


def _record_varlen_calls(monkeypatch: pytest.MonkeyPatch, kernel=flash_reference.flash_attn_varlen_func) -> list:  # noqa: ANN001
    """Swap ``kernel`` in for flash_attn_varlen_func, recording each call's (T, cu_seqlens_q, cu_seqlens_k, block
    table shape, max_seqlen_q, max_seqlen_k)."""
    calls: list[tuple] = []

    def recording(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):  # noqa: ANN001, ANN003, ANN202
        table = kwargs["block_table"]
        calls.append(
            (q.shape[0], cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), tuple(table.shape), max_seqlen_q, max_seqlen_k)
        )
        return kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)

    use_kernel(monkeypatch, "varlen", recording)
    return calls


def _assert_padded_varlen_inputs(scheduled: list[ScheduledRequest], rule: PaddingRule, batch) -> None:  # noqa: ANN001
    """A padded step's varlen inputs: B = ``varlen_sizes`` sequences (the requests, then fillers of nothing),
    tables as wide as the rule pads its longest request's keys, bounds fixed by the shape."""
    B, W = varlen_sizes(batch.shape)
    T, n = batch.input_ids.shape[0], len(scheduled)
    q_lens = [e.num_scheduled_tokens for e in scheduled]
    k_lens = [e.num_computed_tokens + e.num_scheduled_tokens for e in scheduled]
    cu = batch.varlen_cu_seqlens
    assert tuple(cu.shape) == (2, B + 1) and B >= n
    assert cu[0, : n + 1].tolist() == [0, *itertools.accumulate(q_lens)]
    assert cu[1, : n + 1].tolist() == [0, *itertools.accumulate(k_lens)]
    assert (cu[:, n:] == cu[:, n : n + 1]).all()  # the fillers repeat the last entry
    assert W == rule.table_width(max(k_lens)) and batch.varlen_tables.shape[1:] == (B, W)
    assert (batch.varlen_tables[:, n:] == rule.pad_block).all()
    assert batch.varlen_max_seqlens == (T, W * rule.block_size)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama_gqa", "gemma3_sliding"])
def test_the_padded_varlen_path_calls_flash_attn_varlen_func_and_generates_what_eager_and_sdpa_generate(  # noqa: ANN001
    build, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiled and CUDA-graphed varlen path runs this padded forward (uncompiled here).
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = build().to(torch.float16)
    # Chunked prefills beside other requests' decode rows (96-token steps), query rows padded to a multiple of 32.
    prompts = random_prompts(5, VOCAB_SIZE, 20, 300, seed=29)
    padded_engine = _engine(model, True, monkeypatch, default_compile_level=1, q_padding_interval_size=32)
    eager = generate_in_order(_engine(model, True, monkeypatch), prompts)
    sdpa = generate_in_order(_engine(model, False, monkeypatch), prompts)
    steps, calls = _Steps(monkeypatch), _record_varlen_calls(monkeypatch)
    padded = generate_in_order(padded_engine, prompts)
    stats = padded_engine.stats
    assert padded_engine.runner.static_paths == ["varlen", "decode"] and stats.num_padded_steps == stats.num_steps
    varlen = [(s, rule, b) for s, rule, b in steps.steps if b.path == "varlen"]
    assert len(varlen) == stats.num_steps - len(stats.decode_step_batch) >= 5
    assert all(b.kernel == "flash_varlen" for _, _, b in varlen)  # no varlen step on SDPA any more
    assert any(any(e.num_scheduled_tokens == 1 for e in s) and len(s) > 1 for s, _, _ in varlen)  # mixed steps
    for scheduled, rule, batch in varlen:
        _assert_padded_varlen_inputs(scheduled, rule, batch)
    # The kernel got them as built: per step, one call per layer with the padded sizes.
    expected = [
        (b.input_ids.shape[0], *b.varlen_cu_seqlens.tolist(), tuple(b.varlen_tables.shape[1:]), *b.varlen_max_seqlens)
        for _, _, b in varlen
    ]
    layers = model.config.num_hidden_layers
    assert calls == [call for call in expected for _ in range(layers)]
    assert any(call[1][-1] < call[0] for call in calls)  # padded rows past the last sequence
    # The same kernels as the eager engine's, on padded inputs: its tokens; SDPA's up to a half-precision near-tie.
    for p, e in zip(padded, eager):
        assert p.generated_tokens == e.generated_tokens
        assert_close(p.logprobs, e.logprobs, atol=1e-3)
    assert_greedy_agrees(padded, sdpa, prompts, build(), ATOL)


def test_a_padded_decode_step_too_wide_for_the_decode_table_takes_the_padded_varlen_kernel(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = tiny_llama().to(torch.float16)
    long, short = random_prompts(1, VOCAB_SIZE, 250, 250, seed=3)[0], random_prompts(1, VOCAB_SIZE, 100, 100)[0]
    # As the eager test above: 9 decode steps, the last 3 of which need a second block for the long request.
    narrow = dict(max_blocks_per_request=1, max_batch_tokens=512)
    padded_engine = _engine(model, True, monkeypatch, default_compile_level=1, **narrow)
    eager = generate_in_order(_engine(model, True, monkeypatch, **narrow), [long, short])
    steps = _Steps(monkeypatch)
    padded = generate_in_order(padded_engine, [long, short])
    stats = padded_engine.stats
    assert stats.num_padded_steps == stats.num_steps == 10 and stats.num_decode_fast_path_steps == 6
    wide = [(s, rule, b) for s, rule, b in steps.steps if b.path == "decode" and b.kernel == "flash_varlen"]
    assert len(wide) == 3
    for scheduled, rule, batch in wide:
        _assert_padded_varlen_inputs(scheduled, rule, batch)
        # Two requests on 4 padded rows (CPU's interval): 4 sequences, 2 of them fillers; 2 blocks of 256 keys.
        assert batch.shape == (4, 2) and batch.flash["cu_seqlens_q"].tolist() == [0, 1, 2, 2, 2]
        assert (batch.flash["max_seqlen_q"], batch.flash["max_seqlen_k"]) == (4, 2 * PAGE)
    for p, e in zip(padded, eager):
        assert p.generated_tokens == e.generated_tokens
        assert_close(p.logprobs, e.logprobs, atol=1e-3)


def _nan_past_the_sequences(q, k, v, cu_seqlens_q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    """flash_reference's varlen kernel, leaving NaN where the real one leaves memory unwritten: the rows past
    ``cu_seqlens_q[-1]``."""
    out = flash_reference.flash_attn_varlen_func(q, k, v, cu_seqlens_q, *args, **kwargs)
    out[int(cu_seqlens_q[-1]) :] = float("nan")
    return out


def test_rows_past_the_last_sequence_come_out_zero_when_the_kernel_leaves_nan_there(monkeypatch) -> None:  # noqa: ANN001
    use_kernel(monkeypatch, "varlen", _nan_past_the_sequences)
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 4, 2, 16
    k_cache = torch.randn(3 * PAGE, Hkv, D, generator=g).to(torch.float16)
    v_cache = torch.randn(3 * PAGE, Hkv, D, generator=g).to(torch.float16)
    query = torch.randn(6, H, D, generator=g).to(torch.float16)  # 6 rows: 3 real, 3 padding
    # Two sequences (2 rows over 300 keys in blocks [2, 0]; 1 row over 5 keys in block 1), then a filler.
    flash = {
        "cu_seqlens_q": torch.tensor([0, 2, 3, 3], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 300, 305, 305], dtype=torch.int32),
        "max_seqlen_q": 6,
        "max_seqlen_k": 2 * PAGE,
        "block_tables": torch.tensor([[[2, 0], [1, 2], [2, 2]]], dtype=torch.int32),
    }
    out = attention._flash_attention(query, k_cache, v_cache, flash, 0, PAGE, D**-0.5, None, None)
    assert out.shape == (6, H, D) and out.dtype == torch.float16
    assert torch.equal(out[3:], torch.zeros(3, H, D, dtype=torch.float16))
    # The real rows are the kernel's, untouched by the guard.
    q = query
    kc, vc = k_cache.view(3, PAGE, Hkv, D), v_cache.view(3, PAGE, Hkv, D)
    keys = [torch.cat([kc[2], kc[0, :44]]), kc[1, :5]]
    values = [torch.cat([vc[2], vc[0, :44]]), vc[1, :5]]
    for rows, k, v in zip((slice(0, 2), slice(2, 3)), keys, values):
        expected = flash_reference.reference_attention(q[rows], k, v, D**-0.5, True, (-1, -1), 0.0)
        assert torch.equal(out[rows], expected)


def test_nan_left_in_padded_rows_reaches_neither_the_padding_slot_nor_a_token(monkeypatch) -> None:  # noqa: ANN001
    # Gemma 3's sliding layers (window 8) read the padding block where a block left the window (past position
    # 263), under the mask: a NaN written there by a padded row would turn their outputs to NaN (0 x NaN).
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = tiny_gemma().to(torch.float16)
    prompts = random_prompts(5, VOCAB_SIZE, 250, 300, seed=31)
    outputs, pads = [], []
    for kernel in (flash_reference.flash_attn_varlen_func, _nan_past_the_sequences):
        engine = _engine(model, True, monkeypatch, default_compile_level=1, max_blocks_per_request=0)
        calls = _record_varlen_calls(monkeypatch, kernel)
        pad_block = engine.runner.padding.pad_block
        pad = slice(pad_block * PAGE, (pad_block + 1) * PAGE)
        try:
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=10), request_id=f"r{i}")
            out = run_engine(engine)
            pads.append(torch.stack([t[pad] for t in (*engine.cache.key, *engine.cache.value)]))
        finally:
            engine.close()
        outputs.append([out[f"r{i}"] for i in range(len(prompts))])
        assert sum(call[1][-1] < call[0] for call in calls) > 20  # steps with rows left NaN
    assert all(torch.isfinite(p).all() for p in pads) and torch.equal(pads[0], pads[1])
    for clean, nan in zip(*outputs):
        assert clean.generated_tokens == nan.generated_tokens and clean.logprobs == nan.logprobs
        assert all(math.isfinite(x) for x in nan.logprobs)


def test_graphed_flash_steps_replay_the_warmups_graphs_on_their_own_varlen_inputs(monkeypatch) -> None:  # noqa: ANN001
    # One padded size per axis but the prefill groups (2 or 4), as tests/test_cuda.py's graph tests: 64-token
    # steps of at most 4 requests, both intervals at their caps. Replays copy each step's inputs into the
    # warmup's batch: a varlen input left out of the copy would replay the warmup's filler sequences.
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    model = tiny_llama().to(torch.float16)
    prompts = random_prompts(6, VOCAB_SIZE, 20, 300, seed=37)
    sizes = dict(max_batch_tokens=64, max_requests_per_batch=4)
    engine = _engine(
        model,
        True,
        monkeypatch,
        default_compile_level=1,
        q_padding_interval_size=64,
        kv_padding_interval_size=32 * PAGE,
        **sizes,
    )
    engine.runner.graphs = CPUGraphs(torch.device("cpu"))
    engine.runner.cuda_graph_paths = {"varlen": True, "decode": True}
    engine.warmup(progress_bar=False)
    assert list(engine.runner.graphs.graphs) == [  # keys end with whether a row has an adapter: none here
        ("varlen", (64, 64, 64, 32, 2, 32), "flash_varlen", False),
        ("varlen", (64, 64, 64, 32, 4, 32), "flash_varlen", False),
        ("decode", (64, 32), "flash_decode", False),
    ]
    graphed = generate_in_order(engine, prompts)
    eager = generate_in_order(_engine(model, True, monkeypatch, **sizes), prompts)
    stats = engine.stats
    assert stats.num_padded_steps == stats.num_steps > 10 and 0 < len(stats.decode_step_batch) < stats.num_steps
    assert stats.num_cuda_graph_captures == 3 and stats.num_cuda_graph_captures_after_warmup == 0
    for g, e in zip(graphed, eager):
        assert g.generated_tokens == e.generated_tokens
        assert_close(g.logprobs, e.logprobs, atol=1e-3)


@torch.library.custom_op("rollout_tests::flash_attn_varlen", mutates_args=())
def _varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """flash_reference's varlen kernel as a custom op, opaque to dynamo as flash-attn's own op is (flash-attn
    >= 2.7 registers ``flash_attn::_flash_attn_varlen_forward`` with a fake implementation)."""
    window = (window_left, window_right)
    return flash_reference.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        0.0,
        softmax_scale,
        causal,
        window,
        softcap,
        block_table=block_table,
    )


@_varlen_op.register_fake
def _(q: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(q)


def _traceable_varlen(  # noqa: ANN202
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    softcap,  # noqa: ANN001
    block_table,  # noqa: ANN001
):
    """``flash_attn_varlen_func``'s signature over ``_varlen_op``."""
    return _varlen_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        *window_size,
        softcap,
        block_table,
    )


def test_the_padded_flash_varlen_step_traces_whole_and_compiles_nothing_after_warmup(monkeypatch) -> None:  # noqa: ANN001
    # fullgraph=True on dynamo's eager backend, dynamic=True: no graph break in the varlen inputs, the int32
    # casts or the padded rows' guard, and no recompilation for a step size or bound the warmup did not see.
    model = tiny_gemma().to(torch.float16)
    prompts = random_prompts(6, VOCAB_SIZE, 20, 300, seed=41)
    config = CompileConfig(backend="eager", mode=None, fullgraph=True, dynamic=True)
    engine = _engine(model, True, monkeypatch, varlen_compile_config=config, q_padding_interval_size=16)
    eager = generate_in_order(_engine(model, True, monkeypatch), prompts)
    use_kernel(monkeypatch, "varlen", _traceable_varlen)
    steps = _Steps(monkeypatch)
    engine.warmup(progress_bar=False)
    assert engine.runner.static_paths == ["varlen"] and engine.stats.num_compiles > 0
    compiled = generate_in_order(engine, prompts)
    stats = engine.stats
    padded = [b for _, rule, b in steps.steps if not rule.exact]
    assert padded and all(b.kernel == "flash_varlen" for b in padded)
    # Steps of a size (so a max_seqlen_q) and group count (so a sequence count) the warmup's did not have.
    warm = {shape for _, shape in engine.warmup_plan()}
    assert {b.shape[0] for b in padded} - {shape[0] for shape in warm} and len({b.shape[4] for b in padded}) == 2
    assert stats.num_compiles_after_warmup == 0
    for c, e in zip(compiled, eager):
        assert c.generated_tokens == e.generated_tokens
        assert_close(c.logprobs, e.logprobs, atol=1e-3)
