"""static_step: the static-shape ("padded") step of compiled and CUDA-graphed paths (issue 11).

The padded path is checked first without ``torch.compile`` (the ``padded_uncompiled`` fixture makes a
compiled path run its padded forward as plain Python): token for token against ``model.generate`` and
logprob for logprob against the eager path, on every kind of step at once (chunked prefill, prefix-cache
hits, prompt forks, scoring requests, preemption). Then through dynamo: one graph per path with no
graph break (``fullgraph=True`` on dynamo's eager backend, which traces exactly what inductor would
compile), no compilation after ``warmup()``, and, marked slow, inductor itself at compile level 1.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import CompileConfig

import rollout.engine.build as build_module
import rollout.engine.spec as engine_spec
import rollout.engine.worker.runner as model_runner
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, generate_batch
from rollout.engine import Engine
from rollout.engine.kv.block_pool import NULL_BLOCK
from rollout.engine.sched.output import ScheduledRequest
from rollout.engine.staging import HostStaging
from rollout.engine.worker.forward import FORWARDS, warmup_shapes
from rollout.engine.worker.inputs import PaddingRule, StepBatch, build_step_batch, pad_to_interval, synthetic_batch
from rollout.requests import Request
from tests.tiny_models import (
    VOCAB_SIZE,
    random_prompts,
    tiny_gemma2,
    tiny_gemma3_5to1,
    tiny_gemma4,
    tiny_llama,
    tiny_mistral,
)
from tests.utils import CPUGraphs, assert_close, reference_greedy, run_engine, teacher_forced_logprobs

# Dynamo's eager backend: traces the forward as inductor would, runs the traced graph without compiling it.
TRACE_ONLY = CompileConfig(backend="eager", mode=None, fullgraph=True, dynamic=True)
MAX_NEW = 8


@pytest.fixture
def padded_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled path runs its padded forward uncompiled: the static-shape step alone."""
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])


def _config(**overrides: object) -> ContinuousBatchingConfig:
    values = dict(page_size=4, max_batch_tokens=24, return_logprobs=True, logprobs_mode="raw", safety_margin=0.0)
    values.update(overrides)
    return ContinuousBatchingConfig(**values)


def _workload() -> tuple[list[list[int]], list[int]]:
    """Prompts of every kind of step: three with a common 12-token prefix (prefix-cache hits), one
    submitted three times (prompt forks), longer ones than the token budget (chunked prefill); and the
    index of the prompt that is scored instead of generated."""
    shared = random_prompts(1, VOCAB_SIZE, min_len=12, max_len=12, seed=41)[0]
    tails = random_prompts(3, VOCAB_SIZE, min_len=2, max_len=9, seed=42)
    others = random_prompts(4, VOCAB_SIZE, min_len=5, max_len=40, seed=43)
    forked = others[0]
    prompts = [shared + t for t in tails] + [forked, forked, forked] + others[1:]
    return prompts, [len(prompts) - 1]


def _run(model: torch.nn.Module, config: ContinuousBatchingConfig) -> tuple[Engine, dict]:
    prompts, scored = _workload()
    engine = Engine(model, config)
    try:
        for i, p in enumerate(prompts):
            if i in scored:
                engine.add_request(p, SamplingParams(max_new_tokens=1), request_id=f"r{i}", score_from=3)
            else:
                engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW), request_id=f"r{i}")
        return engine, run_engine(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "build",
    [tiny_llama, tiny_mistral, tiny_gemma2],
    ids=["llama_gqa", "mistral_sliding_window", "gemma2_softcap"],
)
@pytest.mark.parametrize("num_blocks", [96, 22], ids=["roomy", "preempting"])
def test_padded_path_matches_generate_and_the_eager_paths_logprobs(
    build, num_blocks: int, padded_uncompiled: None
) -> None:
    model = build()
    eager, eager_out = _run(model, _config(num_blocks=num_blocks))
    padded, padded_out = _run(model, _config(num_blocks=num_blocks, default_compile_level=1))
    stats = padded.stats
    assert eager.runner.static_paths == [] and padded.runner.static_paths == ["varlen", "decode"]
    assert stats.num_padded_steps == stats.num_steps
    assert 0 < len(stats.decode_step_batch) < stats.num_steps  # both paths ran
    assert stats.num_prefix_cache_hit_blocks > 0 and stats.num_forks >= 2  # a preempted fork forks again
    assert (stats.num_preemptions > 0) == (num_blocks == 22)
    prompts, scored = _workload()
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        if i in scored:
            assert len(padded_out[rid].prompt_logprobs) == len(prompt) - 3
            assert_close(padded_out[rid].prompt_logprobs, eager_out[rid].prompt_logprobs, atol=1e-5)
            continue
        assert padded_out[rid].generated_tokens == reference_greedy(model, prompt, MAX_NEW, None)
        assert padded_out[rid].generated_tokens == eager_out[rid].generated_tokens
        assert_close(padded_out[rid].logprobs, eager_out[rid].logprobs, atol=1e-5)


def test_pad_to_interval_rounds_up_with_a_floor_of_two_and_a_cap() -> None:
    assert [pad_to_interval(n, 16) for n in (0, 1, 2, 16, 17)] == [16, 16, 16, 16, 32]
    assert [pad_to_interval(n, 1) for n in (0, 1, 2, 3)] == [2, 2, 2, 3]
    assert pad_to_interval(500, 16, cap=505) == 505  # capped at the budget
    assert pad_to_interval(510, 16, cap=505) == 510  # never below the real size


def test_padded_batch_of_a_decode_and_a_chunk_by_hand() -> None:
    # Block size 4, padding block 20 (slot 80). Request a decodes position 5 (blocks [3, 7]); request b
    # computes positions 2..4 (blocks [9, 11]), cut into sub-chunks of 2 rows.
    rule = PaddingRule(q_interval=4, kv_interval=8, max_batch_tokens=16, max_keys=80, block_size=4, pad_block=20)
    rule = PaddingRule(**{**rule.__dict__, "subchunk_rows": 2})
    a = Request("a", list(range(10, 16)), SamplingParams())
    a.num_computed_tokens, a.block_table = 5, [3, 7]
    b = Request("b", [30, 31, 32, 33, 34], SamplingParams())
    b.num_computed_tokens, b.block_table = 2, [9, 11]
    scheduled = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 3, True)]
    batch, (extra,) = build_step_batch(scheduled, [0, 3], False, rule, HostStaging(torch.device("cpu")), [np.arange(3)])
    assert batch.shape == (4, 4, 4, 2, 2, 2)  # T, R, Bd, Wd, G, Wp
    assert batch.input_ids.tolist() == [15, 32, 33, 34]
    assert batch.positions.tolist() == [5, 2, 3, 4]
    assert batch.slot_mapping.tolist() == [[7 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 11 * 4 + 0]]  # one layer group
    assert batch.logits_rows.tolist() == [0, 3, 0, 0]
    assert batch.decode_rows.tolist() == [0, 4, 4, 4]  # fillers point past the rows
    assert batch.decode_tables.tolist() == [[[3, 7], [20, 20], [20, 20], [20, 20]]]
    assert batch.decode_pos.tolist() == [5, 0, 0, 0]
    assert batch.prefill_rows.tolist() == [[1, 2], [3, 4]]
    assert batch.prefill_pos.tolist() == [[2, 3], [4, 0]]
    assert batch.prefill_tables.tolist() == [[[9, 20], [9, 11]]]  # each group's blocks up to its last key
    assert extra.tolist() == [0, 1, 2]


def test_padded_batch_has_each_layer_groups_slots_and_tables_with_null_blocks_read_as_padding() -> None:
    # Two layer groups, block size 4, padding block 20: group 1 is a sliding group whose first block left
    # the window (NULL_BLOCK). Request a decodes position 9; request b computes positions 0..2.
    rule = PaddingRule(q_interval=4, kv_interval=4, max_batch_tokens=16, max_keys=80, block_size=4, pad_block=20)
    a = Request("a", list(range(10, 20)), SamplingParams())
    a.num_computed_tokens, a.block_tables = 9, [[3, 7, 8], [NULL_BLOCK, 5, 6]]
    b = Request("b", [30, 31, 32], SamplingParams())
    b.block_tables = [[9], [11]]
    scheduled = [ScheduledRequest(a, 1, True), ScheduledRequest(b, 3, True)]
    batch, _ = build_step_batch(scheduled, [0, 3], False, rule, HostStaging(torch.device("cpu")), num_groups=2)
    assert batch.slot_mapping.tolist() == [[8 * 4 + 1, 36, 37, 38], [6 * 4 + 1, 44, 45, 46]]
    assert batch.decode_tables[:, 0].tolist() == [[3, 7, 8], [20, 5, 6]]  # the NULL block reads the padding block
    assert batch.prefill_tables[:, 0, :1].tolist() == [[9], [11]]


def test_warmup_shapes_differ_in_every_axis_that_can_vary() -> None:
    rule = PaddingRule(q_interval=16, kv_interval=32, max_batch_tokens=512, max_keys=4096, block_size=32, pad_block=128)
    assert warmup_shapes("decode", rule) == [(16, 2), (32, 3)]
    assert warmup_shapes("varlen", rule) == [(16, 16, 16, 2, 2, 2), (32, 32, 16, 3, 4, 3)]
    one_size = PaddingRule(
        q_interval=512, kv_interval=32, max_batch_tokens=512, max_keys=64, block_size=32, pad_block=2
    )
    assert warmup_shapes("decode", one_size) == [(512, 2)]


def _state(engine: Engine) -> tuple:
    """What a warmup must not change: the cache's blocks (all but the padding block), the block pool and
    prefix cache, the requests, the counters and the random generator."""
    blocks = engine.num_blocks * engine.block_size
    cache = [t[:blocks].clone() for t in (*engine.cache.key, *engine.cache.value)]
    bm = engine.block_manager
    return (
        cache,
        bm.num_free_blocks,
        dict(bm.hash_to_block),
        list(bm.free_queue),
        [(b.ref_count, b.block_hash) for b in bm.blocks],
        {rid: (r.num_computed_tokens, list(r.token_ids), list(r.block_table)) for rid, r in engine.requests.items()},
        engine.stats.num_steps,
        engine.stats.num_generated_tokens,
        engine.stats.num_prefix_cache_hit_blocks,
        engine.runner.generator.get_state(),
        torch.get_rng_state(),
    )


def test_warmup_changes_no_cache_block_request_counter_or_generator(padded_uncompiled: None) -> None:
    model = tiny_llama()
    engine = Engine(model, _config(num_blocks=64, default_compile_level=1, seed=3))
    try:
        for i, p in enumerate(random_prompts(3, VOCAB_SIZE, min_len=8, max_len=20, seed=44)):
            engine.add_request(p, SamplingParams(max_new_tokens=6, do_sample=True), request_id=f"r{i}")
        for _ in range(3):
            engine.step()
        before = _state(engine)
        assert engine.warmup(progress_bar=False) > 0 and engine.warmed_up
        after = _state(engine)
        for x, y in zip(before[0], after[0], strict=True):
            assert torch.equal(x, y)
        assert before[1:-2] == after[1:-2]
        assert torch.equal(before[-2], after[-2]) and torch.equal(before[-1], after[-1])
        assert engine.stats.warmup_seconds is not None
    finally:
        engine.close()


def test_seeded_samples_are_the_same_with_and_without_warmup(padded_uncompiled: None) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=20, seed=45)
    gc = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.3, num_return_sequences=2)

    def sample(warmup: bool) -> list[list[int]]:
        torch.manual_seed(0)  # the same global state: only the engine's own streams may differ
        outs = generate_batch(
            model, prompts, gc, _config(num_blocks=96, default_compile_level=1, seed=7), warmup=warmup
        )
        return [o.generated_tokens for o in outs.values()]

    assert sample(True) == sample(False)


def test_manager_warmup_then_requests_gives_the_unwarmed_managers_tokens(padded_uncompiled: None) -> None:
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, min_len=6, max_len=20, seed=46)

    def run(warmup: bool) -> tuple[list[list[int]], bool]:
        manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=6), _config(default_compile_level=1))
        try:
            if warmup:
                manager.warmup(progress_bar=False)
            manager.start()
            ids = manager.add_requests(prompts, seed=11, do_sample=True)
            tokens = [manager.get_result(rid, timeout=60).generated_tokens for rid in ids]
            return tokens, manager.engine.warmed_up
        finally:
            manager.destroy()

    warm, warmed = run(True)
    cold, not_warmed = run(False)
    assert warmed and not not_warmed
    assert warm == cold


def test_warmup_of_a_running_manager_runs_inside_its_pause_and_changes_no_result(
    padded_uncompiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=30, seed=47)
    manager = ContinuousBatchingManager(model, GenerationConfig(max_new_tokens=12), _config(default_compile_level=1))
    paused: list[bool] = []
    warmup = manager.engine.warmup

    def recording_warmup(progress_bar: bool = True) -> float:
        paused.append(manager.holds_pause())
        return warmup(progress_bar)

    monkeypatch.setattr(manager.engine, "warmup", recording_warmup)
    try:
        manager.start()
        ids = manager.add_requests(prompts)
        manager.warmup(progress_bar=False)
        outs = [manager.get_result(rid, timeout=60) for rid in ids]
    finally:
        manager.destroy()
    assert paused == [True]
    assert [o.generated_tokens for o in outs] == [reference_greedy(model, p, 12, None) for p in prompts]


def test_warmup_is_a_logged_no_op_when_nothing_is_compiled(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tiny_llama(), _config(num_blocks=32))
    try:
        with caplog.at_level(logging.DEBUG, logger="rollout.engine.warmup"):
            assert engine.warmup() == 0.0
        assert "nothing to do" in caplog.text
        assert not engine.warmed_up and engine.stats.warmup_seconds is None
        assert engine.cache.num_blocks == 32  # no padding block either
    finally:
        engine.close()


def test_cuda_graphs_off_cuda_raise_naming_the_field_before_any_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cache(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cache was allocated before the config was checked")

    monkeypatch.setattr(build_module, "PagedKVCache", no_cache)
    model = tiny_llama()
    for graphs in (True, (False, True)):
        with pytest.raises(ValueError, match="use_cuda_graph"):
            generate_batch(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=2), _config(use_cuda_graph=graphs))
        with pytest.raises(ValueError, match="use_cuda_graph"):
            ContinuousBatchingManager(model, continuous_batching_config=_config(use_cuda_graph=graphs))


def test_the_generation_configs_compile_config_is_the_fallback_only_when_set() -> None:
    model = tiny_llama()
    assert GenerationConfig().compile_config is None  # transformers' default: compile stays off

    def paths(gc: GenerationConfig, config: ContinuousBatchingConfig) -> list[str]:
        manager = ContinuousBatchingManager(model, gc, config)
        try:
            return manager.engine.runner.static_paths
        finally:
            manager.destroy()

    assert paths(GenerationConfig(max_new_tokens=2), _config()) == []
    fallback = GenerationConfig(max_new_tokens=2, compile_config=CompileConfig(dynamic=True))
    assert paths(fallback, _config()) == ["varlen", "decode"]
    assert paths(fallback, _config(decode_compile_config=TRACE_ONLY)) == ["varlen", "decode"]
    runner = Engine(model, _config(varlen_compile_config=TRACE_ONLY), fallback_compile_config=None).runner
    assert runner.static_paths == ["varlen"] and runner.compile_configs["varlen"] is TRACE_ONLY


def _varied_workload(engine: Engine, seed: int) -> dict:
    """Batch sizes that rise and fall: prompts of many lengths arriving in three waves."""
    waves = [random_prompts(n, VOCAB_SIZE, min_len=3, max_len=45, seed=seed + n) for n in (1, 7, 3)]
    outs = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=5 + 3 * i), request_id=f"w{w}_{i}")
        outs.update(run_engine(engine))
    return outs


def test_one_graph_per_path_without_graph_breaks_and_no_compile_after_warmup() -> None:
    # fullgraph=True: dynamo raises on any graph break, in our attention or in the model around it.
    model = tiny_llama()
    engine = Engine(model, _config(num_blocks=160, varlen_compile_config=TRACE_ONLY, decode_compile_config=TRACE_ONLY))
    try:
        engine.warmup(progress_bar=False)
        compiled = engine.stats.num_compiles
        outs = _varied_workload(engine, seed=50)
        stats = engine.stats
        assert stats.num_padded_steps == stats.num_steps and len(set(stats.decode_step_batch)) > 3
        assert stats.num_compiles == compiled and stats.num_compiles_after_warmup == 0
        for out in outs.values():
            assert out.generated_tokens == reference_greedy(model, out.prompt_ids, len(out.generated_tokens), None)
    finally:
        engine.close()
    # A second engine on the model, with another cache size, finds every graph compiled: its warmup
    # has nothing to run (dynamic=True graphs take the cache size as a symbol) and nothing compiles.
    second = Engine(model, _config(num_blocks=100, varlen_compile_config=TRACE_ONLY, decode_compile_config=TRACE_ONLY))
    try:
        assert second.warmup(progress_bar=False) == 0.0 and second.warmed_up
        _varied_workload(second, seed=53)
        assert second.stats.num_padded_steps == second.stats.num_steps
        assert second.stats.num_compiles == 0
    finally:
        second.close()


@pytest.mark.slow
def test_compile_level_1_matches_generate_and_compiles_nothing_after_warmup() -> None:
    # inductor at level 1 (mode "default", dynamic=True): minutes on the loaded 2-core machine.
    model = tiny_llama()
    outputs = generate_batch(
        model,
        random_prompts(5, VOCAB_SIZE, min_len=3, max_len=40, seed=51),
        GenerationConfig(max_new_tokens=10, do_sample=False),
        _config(num_blocks=160, default_compile_level=1),
        warmup=True,
    )
    for out in outputs.values():
        assert out.generated_tokens == reference_greedy(model, out.prompt_ids, 10, None)
    engine = Engine(model, _config(num_blocks=160, default_compile_level=1))
    try:
        engine.warmup(progress_bar=False)
        _varied_workload(engine, seed=52)
        assert engine.stats.num_padded_steps == engine.stats.num_steps
        assert engine.stats.num_compiles_after_warmup == 0
    finally:
        engine.close()


def test_graph_lru_replays_with_the_steps_inputs_and_evicts_the_least_recently_used() -> None:
    rule = PaddingRule(q_interval=4, kv_interval=4, max_batch_tokens=16, max_keys=64, block_size=4, pad_block=15)
    graphs = CPUGraphs(torch.device("cpu"), capacity=2)

    def forward(b: StepBatch) -> torch.Tensor:
        return (b.input_ids * 10 + b.positions).float()

    def batch(T: int, token: int) -> StepBatch:
        b = synthetic_batch("decode", (T, 2), rule, HostStaging(torch.device("cpu")))
        b.input_ids.fill_(token)
        return b

    for T, token in ((4, 1), (8, 2), (4, 3), (12, 4)):
        b = batch(T, token)
        assert graphs.run(("decode", b.shape), forward, b).tolist() == [token * 10.0] * T
    assert graphs.num_captures == 3 and graphs.num_evictions == 1
    assert list(graphs.graphs) == [("decode", (4, 2)), ("decode", (12, 2))]  # (8, 2) was least recently used
    # A hit copies the step's inputs into the graph's own buffers before replaying.
    assert graphs.graphs[("decode", (4, 2))].inputs.input_ids.tolist() == [3] * 4


def test_static_paths_are_refused_on_a_sharded_model_and_under_a_compile_mode_that_captures_graphs() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    with pytest.raises(ValueError, match="one device"):
        engine_spec._check_static_paths((TRACE_ONLY, None), (False, False), [cpu, meta])
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match="use_cuda_graph"):
            engine_spec._check_static_paths((None, CompileConfig(mode=mode)), (False, True), [cpu])
    engine_spec._check_static_paths((CompileConfig(mode="reduce-overhead"), None), (False, True), [cpu])
    engine_spec._check_static_paths((None, CompileConfig(mode="max-autotune-no-cudagraphs")), (True, True), [cpu])


@pytest.mark.parametrize(
    "build",
    [tiny_mistral, tiny_gemma3_5to1, tiny_gemma4],
    ids=["all_sliding", "gemma3_5to1", "gemma4_per_layer_shapes"],
)
def test_a_padded_path_keeps_the_eager_layer_groups_and_its_greedy_tokens_equal_generate(  # noqa: ANN001
    build, padded_uncompiled: None
) -> None:
    # The padded step reads each layer through its own group's block table: sliding-window groups keep only
    # their window, and layers of other KV shapes get groups of their own, as on the eager path.
    model = build()
    eager = Engine(model, _config(num_blocks=96))
    padded = Engine(model, _config(num_blocks=96, default_compile_level=1))
    try:
        assert padded.cache.layout.sliding_windows == eager.cache.layout.sliding_windows
        assert [g.name for g in padded.cache.groups] == [g.name for g in eager.cache.groups]
        prompts = random_prompts(3, VOCAB_SIZE, min_len=10, max_len=24, seed=5)
        for i, prompt in enumerate(prompts):
            padded.add_request(prompt, SamplingParams(max_new_tokens=20), request_id=f"p{i}")
        out = run_engine(padded)
        assert padded.stats.num_padded_steps == padded.stats.num_steps
    finally:
        eager.close()
        padded.close()
    for i, prompt in enumerate(prompts):
        assert out[f"p{i}"].generated_tokens == reference_greedy(model, prompt, 20, None)
        assert_close(out[f"p{i}"].logprobs, teacher_forced_logprobs(model, prompt, out[f"p{i}"].generated_tokens), 1e-4)
