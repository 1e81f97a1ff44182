"""Async batching (``use_async_batching``): the engine prepares step k + 1 while step k runs, with outputs
identical to the synchronous loop's.

Every comparison runs the same requests through a synchronous and an async engine of the same config and
asserts equal tokens, logprobs (float equality, not a tolerance), finish reasons, weight versions, prompt
logprobs and cached prompt tokens; and that the async engine did schedule steps ahead (``num_async_steps``)
and took the synchronous order where it must (``async_fallbacks``), so that no test passes by never
scheduling ahead. Greedy cases are also checked against ``model.generate``. On CPU the steps run in the
runner's worker thread; the CUDA path (CUDA graphs included) is in ``test_cuda.py``.

Async batching composes with the KV cache per layer group (models with sliding-window layers: a step
scheduled ahead allocates in every group and gives back a sliding group's out-of-window blocks only when it
is kept, so the prefix cache and the free queue follow the synchronous loop's) and with the static-shape
step of compiled paths (the padded batch prepared ahead, its placeholder tokens written on the device). It
is refused under tensor parallelism (``test_tensor_parallel.py`` checks it on two ranks).
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers.generation import CompileConfig

import rollout.engine as engine_module
import rollout.model_runner as model_runner
from rollout import ContinuousBatchingConfig, Engine, EngineStats, GenerationOutput, RequestStatus, SamplingParams
from rollout.block_manager import NULL_BLOCK
from rollout.static_step import FORWARDS
from tests.tiny_models import (
    VOCAB_SIZE,
    random_prompts,
    tiny_byte_level_tokenizer,
    tiny_gemma,
    tiny_gemma3_5to1,
    tiny_gemma4,
    tiny_llama,
    tiny_mistral,
)
from tests.utils import reference_greedy, run_engine

# (request id, prompt, sampling parameters, add_request keyword arguments)
Job = tuple[str, list[int], SamplingParams, dict]


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return tiny_llama()


def run(model, jobs: list[Job], async_batching: bool, tokenizer=None, **config) -> tuple[dict, EngineStats]:  # noqa: ANN001, ANN003
    """The jobs through one engine until every request ends; outputs by id and the engine's stats."""
    config.setdefault("num_blocks", 128)
    cfg = ContinuousBatchingConfig(use_async_batching=async_batching, return_logprobs=True, **config)
    engine = Engine(model, cfg, tokenizer=tokenizer)
    try:
        assert engine.async_batching is async_batching
        for rid, prompt, params, kwargs in jobs:
            engine.add_request(prompt, params, request_id=rid, **kwargs)
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert engine.block_manager.num_free_blocks == engine.num_blocks  # every block given back
    return outputs, engine.stats


def fields(out: GenerationOutput) -> tuple:
    return (
        out.generated_tokens,
        out.logprobs,
        out.finish_reason,
        out.weight_versions,
        out.prompt_logprobs,
        out.num_cached_prompt_tokens,
        out.status,
    )


def sync_and_async(model, jobs: list[Job], tokenizer=None, **config) -> tuple[dict, EngineStats]:  # noqa: ANN001, ANN003
    """Run the jobs both ways, assert every output equal; the outputs and the async engine's stats."""
    sync, sync_stats = run(model, jobs, False, tokenizer, **config)
    async_, stats = run(model, jobs, True, tokenizer, **config)
    assert sync.keys() == async_.keys() == {job[0] for job in jobs}
    for rid in sync:
        assert fields(async_[rid]) == fields(sync[rid]), rid
    assert stats.num_steps == sync_stats.num_steps  # the same batches, one for one
    assert (sync_stats.num_async_steps, sync_stats.num_sync_steps) == (0, 0)
    assert stats.num_async_steps + stats.num_sync_steps == stats.num_steps
    return async_, stats


def plain_completions(model, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    return [reference_greedy(model, p, n, None) for p in prompts]


def test_greedy_with_stop_tokens_and_a_mix_of_max_new_tokens_equals_sync_and_generate(model) -> None:  # noqa: ANN001
    prompts = random_prompts(8, VOCAB_SIZE, min_len=5, max_len=30, seed=40)
    plain = plain_completions(model, prompts, 30)
    jobs, expected = [], {}
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        max_new = 12 + 2 * i
        # Request i stops on the token its plain completion has at position 2 * i + 5 (or where that token
        # first shows): stops spread over many steps.
        stop = full[2 * i + 5]
        cut = full[: full.index(stop) + 1]
        params = SamplingParams(max_new_tokens=max_new, eos_token_ids=(stop,))
        jobs.append((f"r{i}", prompt, params, {}))
        expected[f"r{i}"] = cut[:max_new]
    out, stats = sync_and_async(model, jobs, page_size=4)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 6
    assert stats.num_async_steps >= 10 and stats.async_fallbacks["finished"] >= 3


def test_seeded_and_unseeded_sampling_equal_sync_when_steps_are_scheduled_again(model) -> None:  # noqa: ANN001
    # Twenty stop tokens end samples early and often: the steps prepared ahead of them are scheduled again,
    # and the engine generator's draw for the unseeded rows of a dropped step is put back.
    prompts = random_prompts(8, VOCAB_SIZE, min_len=4, max_len=20, seed=41)
    stops = tuple(range(3, 23))
    jobs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=20, do_sample=True, temperature=1.2, top_p=0.95, seed=100 + i if i % 2 else None
        )
        jobs.append((f"r{i}", prompt, dataclasses.replace(params, eos_token_ids=stops), {}))
    out, stats = sync_and_async(model, jobs, page_size=4, seed=7)
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 4
    assert stats.async_fallbacks["finished"] >= 2 and stats.num_async_steps >= 5


def test_stop_strings_equal_sync(model) -> None:  # noqa: ANN001
    tokenizer = tiny_byte_level_tokenizer()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=6, max_len=24, seed=42)
    plain = plain_completions(model, prompts, 20)
    jobs = []
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        # The text of two tokens of the plain completion, from position 2 * i + 2: a stop string that ends
        # there (or where it first shows).
        text = tokenizer.decode(full[2 * i + 2 : 2 * i + 4])
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=20, stop=(text,)), {}))
    out, stats = sync_and_async(model, jobs, tokenizer=tokenizer, page_size=4)
    assert sum(o.finish_reason == "stop" for o in out.values()) >= 4
    assert stats.async_fallbacks["finished"] >= 2 and stats.num_async_steps >= 5


def test_scoring_requests_and_chunked_prefill_equal_sync(model) -> None:  # noqa: ANN001
    prompts = random_prompts(6, VOCAB_SIZE, min_len=20, max_len=40, seed=43)
    jobs: list[Job] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            jobs.append((f"s{i}", prompt, SamplingParams(max_new_tokens=1), {"score_from": 5 + i}))
        else:
            jobs.append((f"g{i}", prompt, SamplingParams(max_new_tokens=12), {}))
    # 16 tokens a step: prompts (and scored sequences) are computed in chunks across steps scheduled ahead.
    out, stats = sync_and_async(model, jobs, page_size=4, max_batch_tokens=16)
    assert all(len(out[f"s{i}"].prompt_logprobs) == len(prompts[i]) - 5 - i for i in (1, 3, 5))
    assert stats.num_async_steps >= 5
    for i in (0, 2, 4):
        assert out[f"g{i}"].generated_tokens == reference_greedy(model, prompts[i], 12, None)


@pytest.mark.parametrize("preemption_mode", ["recompute", "offload"])
def test_preemption_equals_sync(model, preemption_mode: str) -> None:  # noqa: ANN001
    # 6 requests of 12 + 20 tokens, 8 blocks each at the end; the cache has 24: requests are preempted.
    prompts = random_prompts(6, VOCAB_SIZE, min_len=12, max_len=12, seed=44)
    jobs = [(f"r{i}", p, SamplingParams(max_new_tokens=20), {}) for i, p in enumerate(prompts)]
    offload = {"cpu_offload_space": 0.01} if preemption_mode == "offload" else {}
    out, stats = sync_and_async(
        model, jobs, page_size=4, num_blocks=24, safety_margin=0.0, preemption_mode=preemption_mode, **offload
    )
    assert stats.num_preemptions > 0 and stats.num_async_steps >= 5
    assert stats.async_fallbacks["blocks"] + stats.async_fallbacks["waiting"] >= 2
    if preemption_mode == "offload":
        assert stats.num_offloads > 0
    assert [out[f"r{i}"].generated_tokens for i in range(6)] == plain_completions(model, prompts, 20)


def test_forked_samples_of_one_prompt_equal_sync(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=22, max_len=22, seed=45)[0]
    other = random_prompts(1, VOCAB_SIZE, min_len=9, max_len=9, seed=46)[0]
    jobs: list[Job] = [
        (f"g{g}", prompt, SamplingParams(max_new_tokens=14, do_sample=True, seed=g, eos_token_ids=(5, 9)), {})
        for g in range(4)
    ]
    jobs.append(("other", other, SamplingParams(max_new_tokens=14), {}))
    out, stats = sync_and_async(model, jobs, page_size=8)
    assert stats.num_forks == 3 and stats.num_block_copies >= 3
    assert stats.async_fallbacks["forks"] >= 1 and stats.num_async_steps >= 5
    assert [out[f"g{g}"].num_cached_prompt_tokens for g in range(4)] == [0, 22, 22, 22]


def test_logits_processors_take_the_synchronous_order_and_equal_sync(model) -> None:  # noqa: ANN001
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=12, seed=47)
    jobs = [
        (f"r{i}", p, SamplingParams(max_new_tokens=10 + 4 * i, repetition_penalty=1.5 if i == 0 else 1.0), {})
        for i, p in enumerate(prompts)
    ]
    _, stats = sync_and_async(model, jobs, page_size=4)
    # Request 0 has a processor for its 10 tokens; the others are scheduled ahead once it has ended.
    assert stats.async_fallbacks["logits_processors"] >= 8 and stats.num_async_steps >= 5


def test_a_request_cancelled_in_flight_has_its_row_dropped_and_its_blocks_serve_a_new_request(model) -> None:  # noqa: ANN001
    # Page size 4: the cancelled request's blocks go back to the head of the free queue while its row of the step
    # in flight still writes into its last block; the request admitted next takes those blocks and must find
    # none of that write in its own KV (the steps run one after the other, in order).
    prompts = random_prompts(4, VOCAB_SIZE, min_len=9, max_len=9, seed=48)
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
    try:
        for i in range(3):
            engine.add_request(prompts[i], SamplingParams(max_new_tokens=16), request_id=f"r{i}")
        for _ in range(4):
            engine.step()
        assert engine.in_flight
        victim = engine.requests["r1"]
        blocks = list(victim.block_table)
        cancelled = engine.finish_request("r1", RequestStatus.CANCELLED, "cancelled")
        assert cancelled is victim and victim.block_table == []
        new = engine.add_request(prompts[3], SamplingParams(max_new_tokens=16), request_id="new")
        updated = engine.step()  # collects the step in flight (r1's row dropped), admits "new"
        assert "r1" not in {r.request_id for r in updated}
        assert set(new.block_table) & set(blocks)  # it took blocks the cancelled row was writing
        outputs = run_engine(engine)
    finally:
        engine.close()
    plain = plain_completions(model, prompts, 16)
    assert cancelled.generated_tokens == plain[1][:4] and cancelled.status == RequestStatus.CANCELLED
    assert [outputs[rid].generated_tokens for rid in ("r0", "r2", "new")] == [plain[0], plain[2], plain[3]]
    assert engine.stats.num_async_steps >= 10


def test_a_weight_update_finishes_the_step_in_flight_first(model) -> None:  # noqa: ANN001
    prompts = random_prompts(3, VOCAB_SIZE, min_len=6, max_len=10, seed=49)
    versions = {}
    for async_batching in (False, True):
        engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=async_batching))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=8), request_id=f"r{i}")
            # Sync: 3 steps done. Async: 2 steps done and the third in flight, which the update finishes first.
            for _ in range(3 if not async_batching else 2):
                engine.step()
            engine.bump_weight_version()
            assert not engine.in_flight
            if async_batching:  # the finished step's updates come with the next step
                assert {r.request_id for r in engine.step()} == {"r0", "r1", "r2"}
            outputs = run_engine(engine)
        finally:
            engine.close()
        versions[async_batching] = {rid: o.weight_versions for rid, o in outputs.items()}
    assert versions[True] == versions[False] == {f"r{i}": [0, 0, 0] + [1] * 5 for i in range(3)}


def test_drain_applies_the_step_in_flight_and_launches_nothing(model) -> None:  # noqa: ANN001
    prompt = random_prompts(1, VOCAB_SIZE, min_len=6, max_len=6, seed=50)[0]
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True))
    try:
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id="r")
        engine.step()
        assert engine.in_flight and len(req.generated_tokens) == 1
        assert [r.request_id for r in engine.drain()] == ["r"]
        assert not engine.in_flight and len(req.generated_tokens) == 2 and engine.has_unfinished()
        assert engine.drain() == []
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert outputs["r"].generated_tokens == reference_greedy(model, prompt, 5, None)
    assert engine.stats.async_fallbacks["idle"] == 2  # the first step, and the first after the drain


def test_async_batching_is_off_by_default_on_cpu(model) -> None:  # noqa: ANN001
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64))
    try:
        assert engine.async_batching is False and engine.runner._worker is None
    finally:
        engine.close()


# ---------------------------------------------------------------- KV cache per layer group
def _sliding_jobs(model, seed: int) -> tuple[list[Job], dict[str, list[int]]]:  # noqa: ANN001
    """Six prompts, three of them sharing a 17-token prefix (prefix-cache hits in every group), each longer
    than a window of 8 or 16 with its generation; each stops on a token of its plain completion or at its
    ``max_new_tokens``. Returns the jobs and each request's expected tokens (``model.generate``'s, cut)."""
    shared = random_prompts(1, VOCAB_SIZE, min_len=17, max_len=17, seed=seed)[0]
    tails = random_prompts(3, VOCAB_SIZE, min_len=2, max_len=9, seed=seed + 1)
    prompts = [shared + t for t in tails] + random_prompts(3, VOCAB_SIZE, min_len=10, max_len=30, seed=seed + 2)
    plain = plain_completions(model, prompts, 24)
    jobs: list[Job] = []
    expected = {}
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        max_new = 14 + 2 * i
        stop = full[3 * i + 4] if i % 2 else -1  # odd requests stop early, even ones run to max_new
        eos = (stop,) if stop >= 0 else ()
        cut = full[: full.index(stop) + 1] if stop >= 0 else full
        jobs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, eos_token_ids=eos), {}))
        expected[f"r{i}"] = cut[:max_new]
    return jobs, expected


@pytest.mark.parametrize(
    "build",
    [lambda: tiny_gemma(sliding_window=8), lambda: tiny_gemma3_5to1(sliding_window=16), tiny_gemma4],
    ids=["gemma3_alternating_window8", "gemma3_5to1_window16", "gemma4_per_layer_head_dims"],
)
def test_sliding_window_layer_groups_equal_sync_with_stops_chunked_prefill_and_prefix_hits(build) -> None:  # noqa: ANN001
    model = build()
    jobs, expected = _sliding_jobs(model, seed=60)
    # 4-token pages: a window of 8 or 16 drops a block every 4 decode steps; 16 tokens a step: chunked prefill.
    out, stats = sync_and_async(model, jobs, page_size=4, max_batch_tokens=16)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert sum(o.num_cached_prompt_tokens > 0 for o in out.values()) >= 1  # a prefix hit
    assert stats.num_async_steps >= 10 and stats.async_fallbacks["finished"] >= 1


def test_sliding_window_layer_groups_equal_sync_through_preemption() -> None:
    model = tiny_gemma3_5to1(sliding_window=16)
    jobs, expected = _sliding_jobs(model, seed=61)
    # 6 groups; 16 whole-model blocks are 96 block ids, where the longest request holds up to 13 full and
    # 5 x 9 sliding blocks: requests are preempted, and steps that need a preemption go the synchronous way.
    out, stats = sync_and_async(model, jobs, page_size=4, num_blocks=16, max_batch_tokens=16, safety_margin=0.0)
    assert {rid: o.generated_tokens for rid, o in out.items()} == expected
    assert stats.num_preemptions > 0 and stats.num_async_steps >= 5
    assert stats.async_fallbacks["blocks"] + stats.async_fallbacks["waiting"] >= 1


def _cache_state(engine: Engine) -> tuple:
    """What of the block pool decides later steps' results: the free queue as the hash of each free block (None
    for an uncached one: which uncached block is where does not matter), every request's tables as the
    positions they hold (``NULL_BLOCK`` where a sliding group gave a block back) and their block hashes."""
    bm = engine.block_manager
    queue = [bm.blocks[b].block_hash for b in bm.free_queue]
    tables = {
        r.request_id: ([[b == NULL_BLOCK for b in t] for t in r.block_tables], r.group_block_hashes)
        for r in engine.scheduler.running
    }
    return queue, tables, sorted(bm.hash_to_block)


def test_steps_scheduled_ahead_on_sliding_groups_leave_the_block_pool_as_the_synchronous_loop_does() -> None:
    # Two engines in lockstep over the scheduler and runner: one schedules each step the synchronous way,
    # the other schedules it ahead of the step before it and, in turn, keeps it (commit_ahead) or takes it
    # back (unschedule, then schedule). After each scheduling, the batches and the block pools must agree.
    model = tiny_gemma3_5to1(sliding_window=16)
    prompts = random_prompts(4, VOCAB_SIZE, min_len=6, max_len=14, seed=62)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=16)
    sync, ahead = Engine(model, config), Engine(model, config)
    try:
        for engine in (sync, ahead):
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=12 + 4 * i), request_id=f"r{i}")
        s_out = sync.scheduler.schedule()
        a_out = ahead.scheduler.schedule()
        a_launched = ahead.runner.launch(ahead.runner.prepare_step(a_out))
        kept = taken_back = 0
        while True:
            s_result = sync.runner.execute(s_out)
            next_ahead, reason = ahead.scheduler.schedule_ahead(a_out)
            prepared = ahead.runner.prepare_step(next_ahead) if next_ahead is not None else None
            if next_ahead is not None:  # nothing dropped or hashed yet: every held block still held
                assert all(NULL_BLOCK not in t[-2:] for r in ahead.scheduler.running for t in r.block_tables)
            sync.scheduler.update_from_output(s_out, s_result)
            ahead.scheduler.update_from_output(a_out, ahead.runner.collect(a_launched))
            if not sync.has_unfinished():
                assert not ahead.has_unfinished()
                break
            s_out = sync.scheduler.schedule()
            if (
                next_ahead is not None
                and ahead.scheduler.ahead_still_valid(next_ahead)
                and (kept + taken_back) % 2 == 0
            ):
                ahead.scheduler.commit_ahead(next_ahead)
                a_launched, a_out = ahead.runner.launch(prepared, a_launched), next_ahead
                kept += 1
            else:
                if next_ahead is not None:
                    ahead.runner.discard(prepared)
                    ahead.scheduler.unschedule(next_ahead)
                    taken_back += 1
                a_out = ahead.scheduler.schedule()
                a_launched = ahead.runner.launch(ahead.runner.prepare_step(a_out))
            shape = [(e.request.request_id, e.num_scheduled_tokens, e.sample) for e in a_out.scheduled]
            assert shape == [(e.request.request_id, e.num_scheduled_tokens, e.sample) for e in s_out.scheduled]
            assert _cache_state(ahead) == _cache_state(sync)
        assert kept >= 5 and taken_back >= 5
        assert ahead.block_manager.num_free_blocks == ahead.num_blocks
    finally:
        sync.close()
        ahead.close()


# ---------------------------------------------------------------- compiled (static-shape) steps
@pytest.fixture
def padded_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled path runs its padded forward uncompiled: the static-shape step alone (as in test_static_step)."""
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral], ids=["llama", "mistral_sliding_window"])
def test_the_padded_step_of_a_compiled_path_prepared_ahead_equals_sync(build, padded_uncompiled: None) -> None:  # noqa: ANN001
    model = build()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=5, max_len=30, seed=63)
    plain = plain_completions(model, prompts, 20)
    jobs: list[Job] = []
    for i, (prompt, full) in enumerate(zip(prompts, plain)):
        # Greedy and seeded sampled rows; the greedy ones stop on a token of their plain completion.
        do_sample = i % 3 == 2
        eos = () if do_sample else (full[2 * i + 3],)
        params = SamplingParams(max_new_tokens=10 + 2 * i, do_sample=do_sample, seed=i, eos_token_ids=eos)
        jobs.append((f"r{i}", prompt, params, {"score_from": 3} if i == 5 else {}))
    jobs[5] = ("r5", prompts[5], SamplingParams(max_new_tokens=1), {"score_from": 3})  # a scoring request
    out, stats = sync_and_async(model, jobs, page_size=4, max_batch_tokens=16, default_compile_level=1)
    assert stats.num_padded_steps == stats.num_steps and stats.num_async_steps >= 5
    assert stats.async_fallbacks["finished"] >= 1
    assert len(out["r5"].prompt_logprobs) == len(prompts[5]) - 3
    for i in (0, 1, 3, 4):
        stop = plain[i][2 * i + 3]
        assert out[f"r{i}"].generated_tokens == plain[i][: plain[i].index(stop) + 1][: 10 + 2 * i]


def test_async_steps_through_dynamo_in_the_worker_thread_compile_nothing_after_warmup() -> None:
    # Dynamo's eager backend with fullgraph=True traces what inductor would compile, without compiling it;
    # the steps' forwards run in the runner's worker thread, where compilations are counted too.
    trace_only = CompileConfig(backend="eager", mode=None, fullgraph=True, dynamic=True)
    model = tiny_llama()
    prompts = random_prompts(5, VOCAB_SIZE, min_len=5, max_len=20, seed=64)
    config = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=128,
        max_batch_tokens=16,
        return_logprobs=True,
        varlen_compile_config=trace_only,
        decode_compile_config=trace_only,
    )
    outputs, stats = {}, {}
    for async_batching in (False, True):
        engine = Engine(model, dataclasses.replace(config, use_async_batching=async_batching))
        try:
            engine.warmup(progress_bar=False)
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=8 + i), request_id=f"r{i}")
            outputs[async_batching] = {rid: fields(o) for rid, o in run_engine(engine).items()}
            stats[async_batching] = engine.stats
        finally:
            engine.close()
    assert outputs[True] == outputs[False]
    assert stats[True].num_padded_steps == stats[True].num_steps and stats[True].num_async_steps >= 5
    assert stats[True].num_compiles_after_warmup == 0 and stats[True].num_cuda_graph_captures == 0


# ---------------------------------------------------------------- tensor parallelism
def test_async_batching_under_tensor_parallelism_is_refused_before_any_collective(model, monkeypatch) -> None:  # noqa: ANN001
    # A stand-in mesh makes the model look TP-sharded; the real two-rank check is in test_tensor_parallel.py.
    joined = []

    def from_model(model, config):  # noqa: ANN001, ANN202
        joined.append(config.use_async_batching)
        return None  # run on as one process

    monkeypatch.setattr(engine_module, "tensor_parallel_mesh", lambda m: object())
    monkeypatch.setattr(engine_module.TensorParallel, "from_model", staticmethod(from_model))
    with pytest.raises(ValueError, match="use_async_batching=True is not supported under tensor parallelism"):
        Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16, use_async_batching=True))
    assert joined == []  # raised before the CPU group was joined
    for value in (None, False):
        engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16, use_async_batching=value))
        try:
            assert engine.async_batching is False and engine.runner._worker is None
        finally:
            engine.close()
    assert joined == [None, False]
