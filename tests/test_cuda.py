"""Issue 13 on a GPU: flash-attn's paged kernel on real hardware, bf16 mixed precision through it, the manager
thread's current device, and a model sharded over a GPU and the CPU. Issue 11: the decode fast path
(``flash_attn_with_kvcache``) against the varlen kernel and against SDPA, in bf16; CUDA graphs of the
static-shape step (replay equals the uncaptured step and the eager path; nothing captured or compiled after
warmup; issue 21: graphed and compiled varlen steps run flash-attn's varlen kernel as eager ones do). Issue 11
item 4: async batching on a GPU (inputs staged on a side stream into two buffer sets, results read back through
pinned memory) gives the synchronous loop's outputs, also with CUDA graphs, and the staging's events keep a copy
from overwriting a buffer still being read.

Every test here is marked ``cuda`` and skipped without a CUDA GPU (tests/conftest.py). The CPU tests of the
same logic, with faked GPUs, are in test_attention.py, test_engine.py, test_models.py and test_kv_cache.py.
Half-precision results are compared with a tolerance: two kernels round differently, while a wrong block
table, cu_seqlens or window would be off by whole nats.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, generate_batch
from rollout.engine import Engine
from rollout.engine.attention.flash import flash_attn_available, flash_support
from rollout.engine.staging import HostStaging
from rollout.scoring.offline import score_with_engine
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import (
    assert_close,
    assert_greedy_agrees,
    generate_in_order,
    reference_greedy,
    run_engine,
    teacher_forced_logprobs,
)

pytestmark = pytest.mark.cuda

# The last GPU: with several, a thread that stayed on cuda:0 would show.
GPU = torch.device("cuda", max(torch.cuda.device_count() - 1, 0))
GREEDY = GenerationConfig(max_new_tokens=12, do_sample=False)
# Logprob tolerances between two attention kernels: on CPU the fp16 paths differ by under 0.008
# (tests/test_flash_path.py); bf16 keeps 3 fewer mantissa bits. A wrong block table is off by ~8 nats.
FP16_ATOL = 0.05
BF16_ATOL = 0.25


def _prompts() -> list[list[int]]:
    # Two-block tables, shared prefixes longer than a page, chunked prefills (max_batch_tokens 128).
    prompts = random_prompts(4, VOCAB_SIZE, 150, 300, seed=5)
    return prompts + [prompts[0][:270] + [9, 10], prompts[2][:257]]


def test_flash_checks_pass_on_this_gpu_for_a_bf16_cache() -> None:
    if not flash_attn_available():
        assert flash_support([GPU], torch.bfloat16, 128, 256) == "flash-attn is not installed"
        return
    major, _ = torch.cuda.get_device_capability(GPU)
    reason = flash_support([GPU], torch.bfloat16, 128, 256)
    assert reason is None if major >= 8 else "compute capability" in reason
    if major >= 8:
        assert "float16 and bfloat16" in flash_support([GPU], torch.float32, 128, 256)
        assert "page_size is 32" in flash_support([GPU], torch.bfloat16, 128, 32)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding"])
def test_flash_path_scores_and_generates_like_the_model_itself(build) -> None:
    pytest.importorskip("flash_attn")
    model = build().to(GPU, torch.float16)
    prompts = _prompts()
    completions = random_prompts(len(prompts), VOCAB_SIZE, 20, 20, seed=6)
    engine = Engine(model, ContinuousBatchingConfig(page_size=256, num_blocks=32, max_batch_tokens=128))
    try:
        assert engine.use_flash and engine.cache.dtype == torch.float16
        assert engine.cache.key[0].device == GPU
        scored = score_with_engine(engine, prompts, completions)
    finally:
        engine.close()
    for prompt, completion, row in zip(prompts, completions, scored):
        assert_close(row.completion_logprobs, teacher_forced_logprobs(model, prompt, completion), atol=FP16_ATOL)
    # Decoding: each sampled token's logprob (the engine's) against a plain forward over the same tokens.
    cfg = ContinuousBatchingConfig(page_size=256, num_blocks=32, max_batch_tokens=128, return_logprobs=True)
    out = generate_batch(model, prompts, GREEDY, cfg)
    for prompt, o in zip(prompts, out.values()):
        assert o.generated_tokens and len(o.logprobs) == len(o.generated_tokens)
        assert_close(o.logprobs, teacher_forced_logprobs(model, prompt, o.generated_tokens), atol=FP16_ATOL)


def test_bf16_mixed_precision_on_gpu(accelerate_state) -> None:
    # fp32 weights under bf16 autocast: the cache holds bf16 (flash-attn's dtype), queries are cast to it.
    model = Accelerator(mixed_precision="bf16").prepare(tiny_llama())
    assert next(model.parameters()).device.type == "cuda"
    prompts = _prompts()
    cfg = ContinuousBatchingConfig(page_size=256, num_blocks=32, max_batch_tokens=128, return_logprobs=True)
    engine = Engine(model, cfg)
    try:
        assert engine.cache.dtype == torch.bfloat16
        assert engine.use_flash == (flash_support(engine.cache.layer_devices, torch.bfloat16, 16, 256) is None)
    finally:
        engine.close()
    out = generate_batch(model, prompts, GREEDY, cfg)
    for prompt, o in zip(prompts, out.values()):
        assert o.generated_tokens
        assert_close(o.logprobs, teacher_forced_logprobs(model, prompt, o.generated_tokens), atol=BF16_ATOL)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_manager_thread_launches_on_the_model_gpu() -> None:
    model = tiny_llama().to(GPU)
    seen: list[int] = []

    def record(module, args, kwargs):  # noqa: ANN001, ANN202
        if threading.current_thread().name == "rollout-manager":
            seen.append(torch.cuda.current_device())

    model.register_forward_pre_hook(record, with_kwargs=True)
    prompt = random_prompts(1, VOCAB_SIZE, 10, 10, seed=4)[0]
    manager = ContinuousBatchingManager(model, GREEDY, ContinuousBatchingConfig(num_blocks=8))
    manager.start()
    try:
        out = manager.get_result(manager.add_request(prompt), timeout=120)
    finally:
        manager.destroy()
    assert seen and set(seen) == {GPU.index}
    assert out.generated_tokens == reference_greedy(model, prompt, 12, EOS_TOKEN_ID)


def test_a_model_sharded_over_the_gpu_and_the_cpu_keeps_each_layers_cache_beside_it() -> None:
    # device_map-style dispatch done by hand (one GPU suffices): layer 1 runs on the CPU through accelerate's
    # hook, which moves its inputs there and its outputs back; everything else runs on the GPU.
    model = tiny_llama().to(GPU)
    model.model.layers[1].to("cpu")
    add_hook_to_module(model.model.layers[1], AlignDevicesHook(execution_device="cpu", io_same_device=True))
    prompts = random_prompts(4, VOCAB_SIZE, 5, 40, seed=7)
    expected = [reference_greedy(model, p, 12, EOS_TOKEN_ID) for p in prompts]
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64)
    engine = Engine(model, cfg)
    try:
        assert [t.device.type for t in engine.cache.key] == ["cuda", "cpu"] and not engine.use_flash
        assert engine.device == GPU
    finally:
        engine.close()
    out = generate_batch(model, prompts, GREEDY, cfg)
    assert [o.generated_tokens for o in out.values()] == expected


def _bf16_engine(model, max_blocks_per_request: int | None, flash: bool = True, **overrides: object) -> Engine:  # noqa: ANN001
    """An engine over a bf16 model on the GPU; ``flash=False`` puts it on the SDPA path (the engine picks flash)."""
    config = ContinuousBatchingConfig(
        page_size=256,
        num_blocks=32,
        max_batch_tokens=512,
        return_logprobs=True,
        max_blocks_per_request=max_blocks_per_request,
        **overrides,
    )
    engine = Engine(model, config)
    if not engine.use_flash:
        engine.close()
        pytest.skip("the engine does not use flash-attn on this GPU (see the log for the reason)")
    if not flash:
        engine.use_flash = engine.runner.use_flash = False
    return engine


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding"])
def test_decode_fast_path_equals_the_varlen_path_and_sdpa_in_bf16(build) -> None:
    pytest.importorskip("flash_attn")
    model = build().to(GPU, torch.bfloat16)
    reference = build().to(GPU)  # fp32, the model's own (SDPA) attention
    prompts = _prompts()
    fast_engine = _bf16_engine(model, None)
    varlen_engine = _bf16_engine(model, 0)
    sdpa_engine = _bf16_engine(model, None, flash=False)
    fast, varlen, sdpa = (generate_in_order(e, prompts) for e in (fast_engine, varlen_engine, sdpa_engine))
    decode_steps = len(fast_engine.stats.decode_step_batch)
    assert fast_engine.stats.num_decode_fast_path_steps == decode_steps > 0
    assert varlen_engine.stats.num_decode_fast_path_steps == sdpa_engine.stats.num_decode_fast_path_steps == 0
    assert_greedy_agrees(fast, varlen, prompts, reference, BF16_ATOL)
    assert_greedy_agrees(fast, sdpa, prompts, reference, BF16_ATOL)


@pytest.mark.parametrize("async_batching", [False, True], ids=["inputs_shared", "inputs_copied"])
def test_cuda_graphed_decode_steps_call_flash_attn_with_kvcache_like_eager_steps(async_batching: bool) -> None:
    # Issue 21: a graphed decode step runs flash-attn's decode kernel, its inputs computed inside the graph from
    # the padded batch; synchronous, the graph replays on the staged inputs themselves (no copy).
    pytest.importorskip("flash_attn")
    model = tiny_gemma().to(GPU, torch.bfloat16)
    prompts = _prompts()
    graphed_engine = _bf16_engine(model, None, use_cuda_graph=(False, True), use_async_batching=async_batching)
    assert graphed_engine.runner.graphs.share_inputs is not async_batching
    graphed, eager = generate_in_order(graphed_engine, prompts), generate_in_order(_bf16_engine(model, None), prompts)
    stats = graphed_engine.stats
    assert stats.num_decode_fast_path_steps == len(stats.decode_step_batch) > 0 and stats.num_cuda_graph_captures > 0
    assert_greedy_agrees(graphed, eager, prompts, tiny_gemma().to(GPU), BF16_ATOL)


@pytest.mark.parametrize("async_batching", [False, True], ids=["inputs_shared", "inputs_copied"])
def test_cuda_graphed_varlen_steps_call_flash_attn_varlen_func_like_eager_steps(async_batching: bool) -> None:
    # Issue 21: a graphed varlen step (prefill chunks beside decode rows) runs flash-attn's varlen kernel on
    # inputs padded to its shape (filler sequences, padded tables, max_seqlen bounds fixed per shape), and the
    # rows the kernel leaves unwritten (padded rows) are zeroed inside the graph.
    pytest.importorskip("flash_attn")
    model = tiny_gemma().to(GPU, torch.bfloat16)
    prompts = _prompts()
    graphed_engine = _bf16_engine(model, None, use_cuda_graph=True, use_async_batching=async_batching)
    graphed, eager = generate_in_order(graphed_engine, prompts), generate_in_order(_bf16_engine(model, None), prompts)
    stats = graphed_engine.stats
    assert stats.num_padded_steps == stats.num_steps and 0 < len(stats.decode_step_batch) < stats.num_steps
    assert stats.num_decode_fast_path_steps == len(stats.decode_step_batch) and stats.num_cuda_graph_captures > 0
    assert_greedy_agrees(graphed, eager, prompts, tiny_gemma().to(GPU), BF16_ATOL)


def test_a_flash_engine_compiles_and_captures_nothing_after_warmup() -> None:
    # Issue 21: the warmup stages each shape's flash varlen inputs, so inductor (level 1, flash-attn's custom ops
    # in the graph) and the CUDA graphs of its shapes serve every later step: one decode shape, two varlen ones.
    pytest.importorskip("flash_attn")
    model = tiny_llama().to(GPU, torch.bfloat16)
    flash_sizes = dict(page_size=256, num_blocks=32, kv_padding_interval_size=32 * 256)
    engine = Engine(model, _graph_config(use_cuda_graph=True, default_compile_level=1, **flash_sizes))
    try:
        if not engine.use_flash:
            pytest.skip("the engine does not use flash-attn on this GPU (see the log for the reason)")
        engine.warmup(progress_bar=False)
        stats = engine.stats
        assert stats.num_cuda_graph_captures == len(engine.warmup_plan()) == 3
        for i, prompt in enumerate(_prompts()):
            engine.add_request(prompt, SamplingParams(max_new_tokens=12), request_id=f"r{i}")
        graphed = run_engine(engine)
        stats = engine.stats
        assert stats.num_padded_steps == stats.num_steps > 0
        assert stats.num_decode_fast_path_steps == len(stats.decode_step_batch) > 0
        assert stats.num_cuda_graph_captures_after_warmup == 0 and stats.num_compiles_after_warmup == 0
    finally:
        engine.close()
    eager = generate_in_order(Engine(model, _graph_config(**flash_sizes)), _prompts(), max_new_tokens=12)
    graphed_in_order = [graphed[f"r{i}"] for i in range(len(eager))]
    assert_greedy_agrees(graphed_in_order, eager, _prompts(), tiny_llama().to(GPU), BF16_ATOL)


def test_a_request_wider_than_the_decode_table_takes_the_varlen_kernel_on_gpu() -> None:
    pytest.importorskip("flash_attn")
    model = tiny_llama().to(GPU, torch.bfloat16)
    long, short = random_prompts(1, VOCAB_SIZE, 250, 250, seed=3)[0], random_prompts(1, VOCAB_SIZE, 100, 100)[0]
    # As on CPU (tests/test_flash_path.py): one prefill step, then 9 decode steps, of which the long
    # request's positions 250..255 fit one block (6 fast-path steps) and 256..258 need a second.
    narrow_engine = _bf16_engine(model, 1)
    narrow = generate_in_order(narrow_engine, [long, short])
    varlen = generate_in_order(_bf16_engine(model, 0), [long, short])
    assert len(narrow_engine.stats.decode_step_batch) == 9
    assert narrow_engine.stats.num_decode_fast_path_steps == 6
    assert_greedy_agrees(narrow, varlen, [long, short], tiny_llama().to(GPU), BF16_ATOL)


# Issue 11: CUDA graphs of the static-shape step. One padded shape per axis but the prefill groups (2 or 4):
# 16-token pages, 64 blocks (1,024 keys), 64-token steps of at most 4 requests, both intervals at their caps.
def _graph_config(**overrides: object) -> ContinuousBatchingConfig:
    values = dict(
        page_size=16,
        num_blocks=64,
        max_batch_tokens=64,
        max_requests_per_batch=4,
        q_padding_interval_size=64,
        kv_padding_interval_size=1024,
        return_logprobs=True,
    )
    values.update(overrides)
    return ContinuousBatchingConfig(**values)


def _graph_prompts() -> list[list[int]]:
    return random_prompts(6, VOCAB_SIZE, 5, 60, seed=8)


def test_cuda_graph_replay_matches_generate_in_fp32() -> None:
    model = tiny_llama().to(GPU)
    prompts = _graph_prompts()
    out = generate_batch(model, prompts, GREEDY, _graph_config(use_cuda_graph=True))
    for prompt, o in zip(prompts, out.values()):
        assert o.generated_tokens == reference_greedy(model, prompt, 12, EOS_TOKEN_ID)
        assert_close(o.logprobs, teacher_forced_logprobs(model, prompt, o.generated_tokens), atol=1e-3)


@pytest.mark.parametrize("level", [0, 1])
def test_cuda_graph_replay_equals_the_uncaptured_step_and_the_eager_path_in_bf16(level: int, monkeypatch) -> None:
    import rollout.engine.worker.runner as model_runner
    from rollout.engine.worker.forward import FORWARDS

    model = tiny_llama().to(GPU, torch.bfloat16)
    prompts = _graph_prompts()
    graphed = generate_batch(model, prompts, GREEDY, _graph_config(use_cuda_graph=True, default_compile_level=level))
    eager = generate_batch(model, prompts, GREEDY, _graph_config())
    with monkeypatch.context() as patch:  # the same padded step, uncompiled and not captured
        patch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
        uncaptured = generate_batch(model, prompts, GREEDY, _graph_config(default_compile_level=1))
    for g, e, u in zip(graphed.values(), eager.values(), uncaptured.values()):
        if level == 0:  # the captured kernels are the uncaptured ones: the same numbers
            assert g.generated_tokens == u.generated_tokens
            assert_close(g.logprobs, u.logprobs, atol=1e-6)
        n = min(len(g.generated_tokens), len(e.generated_tokens))
        assert n > 0 and g.generated_tokens[0] == e.generated_tokens[0]
        # bf16 kernels that differ may flip a near-tie later on; before it the logprobs agree.
        agree = next((i for i in range(n) if g.generated_tokens[i] != e.generated_tokens[i]), n)
        assert_close(g.logprobs[:agree], e.logprobs[:agree], atol=BF16_ATOL)


def test_no_capture_or_compilation_after_warmup() -> None:
    model = tiny_llama().to(GPU)
    engine = Engine(model, _graph_config(use_cuda_graph=True, default_compile_level=1))
    try:
        engine.warmup(progress_bar=False)
        stats = engine.stats
        assert stats.num_cuda_graph_captures == len(engine.warmup_plan()) == 3
        for i, prompt in enumerate(_graph_prompts()):
            engine.add_request(prompt, SamplingParams(max_new_tokens=12), request_id=f"r{i}")
        while engine.has_unfinished():
            engine.step()
        assert stats.num_padded_steps == stats.num_steps > 0
        assert stats.num_cuda_graph_captures_after_warmup == 0 and stats.num_compiles_after_warmup == 0
    finally:
        engine.close()


# ---------------------------------------------------------------- async batching (issue 11)
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma], ids=["llama", "gemma_sliding_groups"])
@pytest.mark.parametrize(
    ("dtype", "page_size"), [(torch.float32, 16), (torch.bfloat16, 256)], ids=["fp32_sdpa", "bf16_flash_if_any"]
)
def test_async_batching_on_the_gpu_gives_the_synchronous_loops_tokens(
    build, dtype: torch.dtype, page_size: int
) -> None:  # noqa: ANN001
    model = build().to(GPU, dtype)
    prompts = random_prompts(8, VOCAB_SIZE, 5, 60, seed=8)
    results = []
    for async_batching in (False, True):
        cfg = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=64, seed=1, return_logprobs=True, use_async_batching=async_batching
        )
        engine = Engine(model, cfg)
        try:
            assert (engine.runner._input_staging.copy_stream is not None) is async_batching
            results.append(_run_mixed_requests(engine, prompts, first_max_new_tokens=16))
            stats = engine.stats
        finally:
            engine.close()
    # Rows after a stop are computed and dropped, so batches differ: tokens equal, logprobs close.
    _assert_tokens_equal_logprobs_close(results[1], results[0], 1e-4 if dtype == torch.float32 else 5e-2)
    assert stats.num_async_steps >= 5


def _assert_tokens_equal_logprobs_close(got: dict, expected: dict, atol: float) -> None:
    assert got.keys() == expected.keys()
    for rid, (tokens, logprobs, reason) in expected.items():
        assert got[rid][0] == tokens and got[rid][2] == reason, rid
        if logprobs is None:
            assert got[rid][1] is None
        else:
            assert_close(got[rid][1], logprobs, atol)


def _run_mixed_requests(
    engine: Engine, prompts: list[list[int]], first_max_new_tokens: int
) -> dict[str, tuple[list[int], list[float] | None, str | None]]:
    """Greedy and sampled rows, seeded and not, with stop tokens that end requests early: each request's
    tokens, logprobs and finish reason."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=first_max_new_tokens + i,
            do_sample=i % 2 == 1,
            seed=i if i % 4 == 1 else None,
            eos_token_ids=(3, 4, 5),
        )
        engine.add_request(prompt, params, request_id=f"r{i}")
    return {rid: (o.generated_tokens, o.logprobs, o.finish_reason) for rid, o in run_engine(engine).items()}


@pytest.mark.parametrize("level", [0, 1])
def test_async_batching_with_cuda_graphs_gives_the_synchronous_loops_tokens(level: int) -> None:
    # With use_cuda_graph, None turns async batching on (transformers' rule): the padded batch of each step is
    # prepared behind the step in flight, its placeholder tokens written into the batch before the graph copies
    # its inputs.
    model = tiny_llama().to(GPU)
    prompts = _graph_prompts()
    results = []
    for async_batching in (False, None):
        config = _graph_config(use_cuda_graph=True, default_compile_level=level, seed=1)
        engine = Engine(model, dataclasses.replace(config, use_async_batching=async_batching))
        try:
            assert engine.async_batching is (async_batching is None)
            engine.warmup(progress_bar=False)
            results.append(_run_mixed_requests(engine, prompts, first_max_new_tokens=12))
            stats = engine.stats
        finally:
            engine.close()
    _assert_tokens_equal_logprobs_close(results[1], results[0], 1e-4)
    assert stats.num_padded_steps == stats.num_steps and stats.num_async_steps >= 5
    assert stats.num_cuda_graph_captures_after_warmup == 0


def test_host_staging_on_a_copy_stream_never_overwrites_a_buffer_still_being_read() -> None:
    side = torch.cuda.Stream(GPU)
    staging = HostStaging(GPU, num_buffers=2, copy_stream=side)
    arrays = [np.full(1 << 16, i, dtype=np.int64) for i in range(3)]
    with torch.cuda.device(GPU):
        (a,) = staging.upload(arrays[0])
        torch.cuda._sleep(200_000_000)  # the current stream is busy long after the next uploads are queued
        read_a = a.sum()
        staging.release(staging.last_slot)
        (b,) = staging.upload(arrays[1])
        read_b = b.sum()
        staging.release(staging.last_slot)
        (c,) = staging.upload(arrays[2])  # the first set again: its copy must wait for read_a
        read_c = c.sum()
        torch.cuda.synchronize(GPU)
    assert [read_a.item(), read_b.item(), read_c.item()] == [0, 1 << 16, 2 << 16]
