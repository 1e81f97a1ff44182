"""generate_batch against transformers on tiny models: greedy parity, logprobs, caching, preemption, chunking."""

from __future__ import annotations

import time

import psutil
import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, GenerationOutput, RequestStatus, SamplingParams, generate_batch
from rollout.engine import Engine
from tests.tiny_models import ALL_TINY_MODELS, EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama, tiny_mistral
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

MAX_NEW = 12


@pytest.mark.parametrize("name", sorted(ALL_TINY_MODELS))
def test_greedy_matches_generate_and_logprobs_match_teacher_forcing(name: str) -> None:
    model = ALL_TINY_MODELS[name]()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=3, max_len=40, seed=1)
    outputs = generate_batch(
        model,
        prompts,
        GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False),
        ContinuousBatchingConfig(block_size=4, return_logprobs=True, logprobs_mode="raw"),
    )
    assert list(outputs) == [f"req_{i}" for i in range(8)]
    assert model.config._attn_implementation == "sdpa"
    for prompt, out in zip(prompts, outputs.values()):
        assert out.prompt_ids == prompt
        assert out.generated_tokens == reference_greedy(model, prompt, MAX_NEW, EOS_TOKEN_ID)
        assert len(out.logprobs) == len(out.generated_tokens)
        assert_close(out.logprobs, teacher_forced_logprobs(model, prompt, out.generated_tokens), atol=1e-4)


def test_sliding_window_is_applied_not_ignored() -> None:
    # Same weights, window 8 vs no window: the engine must follow the model it is given.
    prompts = random_prompts(4, VOCAB_SIZE, min_len=20, max_len=30, seed=2)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None)
    windowed = generate_batch(tiny_mistral(sliding_window=8), prompts, gc, ContinuousBatchingConfig(block_size=4))
    full = generate_batch(tiny_mistral(sliding_window=None), prompts, gc, ContinuousBatchingConfig(block_size=4))
    assert [o.generated_tokens for o in windowed.values()] != [o.generated_tokens for o in full.values()]


def _greedy_engine(model, prompts, config: ContinuousBatchingConfig, max_new: int = MAX_NEW) -> tuple[Engine, dict]:
    engine = Engine(model, config)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=max_new), request_id=f"r{i}")
        outputs = run_engine(engine)
    finally:
        engine.close()
    return engine, {rid: outputs[rid].generated_tokens for rid in sorted(outputs)}


def test_prefix_caching_on_off_same_outputs_and_shared_prefix_computed_once() -> None:
    model = tiny_llama()
    prefix = random_prompts(1, VOCAB_SIZE, min_len=24, max_len=24, seed=3)[0]  # 6 full blocks of 4
    suffixes = random_prompts(4, VOCAB_SIZE, min_len=3, max_len=9, seed=4)
    prompts = [prefix + s for s in suffixes]
    on, out_on = _greedy_engine(model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=64))
    off, out_off = _greedy_engine(
        model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=64, allow_block_sharing=False)
    )
    assert out_on == out_off
    total = sum(len(p) for p in prompts)
    assert off.stats.num_prompt_tokens_computed == total
    # The first request computes the prefix; the 3 others find its 6 blocks in the cache.
    assert on.stats.num_prompt_tokens_computed == total - 3 * 24


def test_group_samples_share_prompt_blocks() -> None:
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, min_len=18, max_len=18, seed=5)[0]
    G = 8
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=128, seed=0))
    try:
        for g in range(G):
            engine.add_request(prompt, SamplingParams(max_new_tokens=6, do_sample=True, seed=g), request_id=f"s{g}")
        engine.step()
        # One request computed the prompt; the 7 others were forked from it with their own first
        # token: all 5 blocks shared (4 full, the 5th with 2 tokens), nothing computed for them.
        running = engine.scheduler.running
        shared = running[0].block_table
        assert len(running) == G and len(shared) == 5
        assert all(r.block_table == shared for r in running)
        assert [engine.block_manager.blocks[b].ref_count for b in shared] == [G] * 5
        assert engine.stats.num_prompt_tokens_computed == 18 and engine.stats.num_forks == G - 1
        run_engine(engine)
    finally:
        engine.close()
    assert engine.stats.num_prompt_tokens_computed == 18
    # The 5th block was copied by the first G - 1 to write into it; the last wrote it in place.
    assert engine.stats.num_block_copies == G - 1
    assert engine.block_manager.num_free_blocks == 128


G_SAMPLES = 8


@pytest.mark.parametrize(
    ("block_size", "prompt_len", "max_batch_tokens"),
    [(256, 100, 512), (32, 100, 512), (256, 300, 512), (32, 100, 48)],
    ids=["bs256", "bs32-longer-than-a-block", "bs256-longer-than-a-block", "bs32-chunked"],
)
def test_group_of_8_prefills_its_prompt_once_whatever_the_block_size_and_matches_generate(
    block_size: int, prompt_len: int, max_batch_tokens: int
) -> None:
    # Issue 13 case 5: with block_size 256 the prefix cache shares nothing of a 100-token prompt, and
    # the G samples each computed it (8 x 100 prompt tokens); with 32, the 4 tokens of the partial
    # block were computed again by each (100 + 7 x 4).
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, min_len=prompt_len, max_len=prompt_len, seed=14)[0]
    num_blocks = 64
    full = prompt_len // block_size  # the prompt's full blocks; the partial one follows
    engine = Engine(
        model, ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    )
    bm = engine.block_manager
    try:
        requests = [
            engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW), request_id=f"s{g}")
            for g in range(G_SAMPLES)
        ]
        while any(r.num_generated_tokens == 0 for r in requests):
            engine.step()
        # Every sample has its first token: the prompt was computed once, by s0.
        assert engine.stats.num_prompt_tokens_computed == prompt_len
        assert all(r.num_generated_tokens == 1 for r in requests)
        table = requests[0].block_table
        assert len(table) == full + 1
        assert all(r.block_table == table for r in requests)
        assert [bm.blocks[b].ref_count for b in table] == [G_SAMPLES] * (full + 1)
        assert bm.num_free_blocks == num_blocks - (full + 1)
        assert engine.stats.num_forks == G_SAMPLES - 1
        # The first decode: the full blocks stay shared; the partial block is copied by 7, kept by 1.
        engine.step()
        assert engine.stats.num_block_copies == G_SAMPLES - 1
        assert all(r.block_table[:full] == table[:full] for r in requests)
        assert [bm.blocks[b].ref_count for b in table[:full]] == [G_SAMPLES] * full
        assert len({r.block_table[full] for r in requests}) == G_SAMPLES
        assert [bm.blocks[r.block_table[full]].ref_count for r in requests] == [1] * G_SAMPLES
        assert bm.num_free_blocks == num_blocks - full - G_SAMPLES
        outputs = run_engine(engine)
    finally:
        engine.close()
    assert engine.stats.num_prompt_tokens_computed == prompt_len
    expected = reference_greedy(model, prompt, MAX_NEW, None)
    assert [outputs[f"s{g}"].generated_tokens for g in range(G_SAMPLES)] == [expected] * G_SAMPLES
    assert [outputs[f"s{g}"].num_cached_prompt_tokens for g in range(G_SAMPLES)] == [0] + [prompt_len] * 7
    assert bm.num_free_blocks == num_blocks


def _seeded_group(model: torch.nn.Module, prompt: list[int], seeds: list[int]) -> tuple[Engine, list[list[int]]]:
    engine = Engine(model, ContinuousBatchingConfig(page_size=256, num_blocks=16))
    try:
        for s in seeds:
            params = SamplingParams(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, seed=s)
            engine.add_request(prompt, params, request_id=f"seed{s}")
        outputs = run_engine(engine)
    finally:
        engine.close()
    return engine, [outputs[f"seed{s}"].generated_tokens for s in seeds]


def test_seeded_forked_samples_are_reproducible_and_equal_each_sample_run_alone() -> None:
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, min_len=100, max_len=100, seed=15)[0]
    seeds = [11, 12, 13, 14]
    engine, together = _seeded_group(model, prompt, seeds)
    assert engine.stats.num_prompt_tokens_computed == 100 and engine.stats.num_forks == 3
    assert _seeded_group(model, prompt, seeds)[1] == together
    # Each fork sampled its first token from the parent's logits with its own generator: the same
    # tokens as the request alone, which computes the prompt itself.
    assert [_seeded_group(model, prompt, [s])[1][0] for s in seeds] == together
    assert len({tuple(t) for t in together}) > 1  # distinct seeds, distinct samples


@pytest.mark.parametrize("preemption_mode", ["recompute", "offload"])
def test_forked_groups_under_preemption_match_generate(preemption_mode: str) -> None:
    # 2 prompts x 4 samples of 18 + 16 tokens: a group needs 4 shared + 4 x 5 own blocks of 4, the
    # cache has 20, so forked samples (and parents) are preempted.
    model = tiny_llama()
    prompts = random_prompts(2, VOCAB_SIZE, min_len=18, max_len=18, seed=16)
    cfg = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=20,
        safety_margin=0.0,
        preemption_mode=preemption_mode,
        cpu_offload_space=0.01 if preemption_mode == "offload" else 0,
    )
    engine, out = _greedy_engine(model, [p for p in prompts for _ in range(4)], cfg, max_new=16)
    assert engine.stats.num_preemptions > 0 and engine.stats.num_forks >= 6
    if preemption_mode == "offload":
        assert engine.stats.num_offloads > 0
    for i, p in enumerate(prompts):
        expected = reference_greedy(model, p, 16, None)
        assert [out[f"r{4 * i + g}"] for g in range(4)] == [expected] * 4
    assert engine.block_manager.num_free_blocks == 20


def test_cancelling_parked_and_forked_samples_leaves_the_others_exact() -> None:
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, min_len=40, max_len=40, seed=17)[0]
    engine = Engine(model, ContinuousBatchingConfig(page_size=32, num_blocks=32, max_batch_tokens=16))
    try:
        for g in range(4):
            engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW), request_id=f"s{g}")
        engine.step()  # 16 of 40 prompt tokens; s1..s3 parked on s0
        assert engine.requests["s2"].fork_parent is engine.requests["s0"]
        engine.finish_request("s2", RequestStatus.CANCELLED, "cancelled")
        while engine.stats.num_forks == 0:
            engine.step()
        engine.step()
        s1 = engine.finish_request("s1", RequestStatus.CANCELLED, "cancelled")
        assert s1 is not None and len(s1.generated_tokens) == 2
        outputs = run_engine(engine)
    finally:
        engine.close()
    expected = reference_greedy(model, prompt, MAX_NEW, None)
    assert outputs["s0"].generated_tokens == expected and outputs["s3"].generated_tokens == expected
    assert s1.generated_tokens == expected[:2]
    assert engine.stats.num_prompt_tokens_computed == 40 and engine.stats.num_forks == 2
    assert engine.block_manager.num_free_blocks == 32


def test_num_return_sequences_forks_the_samples_of_each_prompt() -> None:
    model = tiny_llama()
    prompts = random_prompts(2, VOCAB_SIZE, min_len=100, max_len=100, seed=18)
    # transformers refuses num_return_sequences with greedy decoding; top_k=1 sampling is greedy.
    gc = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=1, num_return_sequences=4)
    out = generate_batch(model, prompts, gc, ContinuousBatchingConfig(page_size=256))
    for i, p in enumerate(prompts):
        expected = reference_greedy(model, p, 8, EOS_TOKEN_ID)
        group = [out[f"req_{i}_{g}"] for g in range(4)]
        assert [o.generated_tokens for o in group] == [expected] * 4
        # The first sample computed the prompt; the 3 others were forked from it.
        assert [o.num_cached_prompt_tokens for o in group] == [0, 100, 100, 100]


def test_preemption_and_chunked_prefill_give_unconstrained_outputs() -> None:
    model = tiny_llama()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=10, max_len=30, seed=6)
    _, reference = _greedy_engine(model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=256), max_new=16)
    tight, tight_out = _greedy_engine(
        model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=14, safety_margin=0.0), max_new=16
    )
    assert tight.stats.num_preemptions > 0
    assert tight_out == reference
    chunked, chunked_out = _greedy_engine(
        model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=256, max_batch_tokens=16), max_new=16
    )
    assert chunked_out == reference
    # Every prompt longer than 16 tokens needed more than one step.
    assert chunked.stats.num_steps > sum(-(-len(p) // 16) for p in prompts[:1])


@pytest.mark.parametrize("scheduler_type", ["fifo", "prefill_first"])
def test_scheduler_policies_match_generate(scheduler_type: str) -> None:
    model = tiny_llama()
    prompts = random_prompts(6, VOCAB_SIZE, min_len=5, max_len=25, seed=7)
    config = ContinuousBatchingConfig(block_size=8, num_blocks=64, scheduler_type=scheduler_type, max_batch_tokens=32)
    _, out = _greedy_engine(model, prompts, config)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == reference_greedy(model, p, MAX_NEW, None)


def _sample_alone_and_in_crowd(params: SamplingParams) -> tuple[list[int], list[int]]:
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, min_len=9, max_len=9, seed=8)[0]
    others = random_prompts(15, VOCAB_SIZE, min_len=3, max_len=30, seed=9)
    cfg = ContinuousBatchingConfig(block_size=4, num_blocks=256)
    alone = Engine(model, cfg)
    alone.add_request(prompt, params, request_id="me")
    alone_out = run_engine(alone)["me"].generated_tokens
    alone.close()
    crowd = Engine(model, cfg)
    for i, p in enumerate(others[:7]):
        crowd.add_request(p, SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.3), request_id=f"o{i}")
    crowd.add_request(prompt, params, request_id="me")
    for i, p in enumerate(others[7:]):
        crowd.add_request(p, SamplingParams(max_new_tokens=5, do_sample=True, top_k=5), request_id=f"p{i}")
    crowd_out = run_engine(crowd)["me"].generated_tokens
    crowd.close()
    return alone_out, crowd_out


def test_same_seed_same_completion_alone_or_among_15_others() -> None:
    params = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.0, top_p=0.95, seed=1234)
    alone, crowd = _sample_alone_and_in_crowd(params)
    assert alone == crowd
    other_seed, _ = _sample_alone_and_in_crowd(
        SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.0, top_p=0.95, seed=99)
    )
    assert other_seed != alone  # the seed matters


def test_top_k_1_equals_greedy() -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=3, max_len=20, seed=10)
    gc = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, top_k=1, temperature=0.8)
    out = generate_batch(model, prompts, gc, ContinuousBatchingConfig(block_size=4, seed=0))
    for p, o in zip(prompts, out.values()):
        assert o.generated_tokens == reference_greedy(model, p, MAX_NEW, EOS_TOKEN_ID)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_temperature_logprobs_match_teacher_forced_forward(temperature: float) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=3, max_len=20, seed=11)
    gc = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=temperature)
    cfg = ContinuousBatchingConfig(block_size=4, seed=3, return_logprobs=True, logprobs_mode="temperature")
    out = generate_batch(model, prompts, gc, cfg)
    for p, o in zip(prompts, out.values()):
        assert_close(o.logprobs, teacher_forced_logprobs(model, p, o.generated_tokens, temperature), atol=1e-4)


def test_num_return_sequences_groups_samples_in_input_order() -> None:
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, min_len=5, max_len=12, seed=12)
    gc = GenerationConfig(max_new_tokens=5, do_sample=True, num_return_sequences=4)
    out = generate_batch(model, prompts, gc, ContinuousBatchingConfig(block_size=4, seed=0))
    assert list(out) == [f"req_{i}_{g}" for i in range(3) for g in range(4)]
    for i, p in enumerate(prompts):
        assert all(out[f"req_{i}_{g}"].prompt_ids == p for g in range(4))
    # Seeded per sample: the same call gives the same batch.
    again = generate_batch(model, prompts, gc, ContinuousBatchingConfig(block_size=4, seed=0))
    assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in out.values()]


def test_eos_list_and_timestamps() -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=3, max_len=10, seed=13)
    free = generate_batch(model, prompts, GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None))
    # Stop on the third token each prompt produced: every output ends there.
    stops = sorted({o.generated_tokens[2] for o in free.values()})
    out = generate_batch(
        model, prompts, GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=stops), record_timestamps=True
    )
    for o, f in zip(out.values(), free.values()):
        n = next(i for i, t in enumerate(f.generated_tokens) if t in stops) + 1
        assert o.generated_tokens == f.generated_tokens[:n]
        assert o.finish_reason == "stop"
        assert len(o.timestamps) == n and o.timestamps == sorted(o.timestamps)


def test_progress_bar_runs(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_llama()
    out = generate_batch(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=3), progress_bar=True)
    assert len(out["req_0"].generated_tokens) <= 3
    assert "generate_batch" in capsys.readouterr().err


def test_empty_inputs_give_empty_dict() -> None:
    assert generate_batch(tiny_llama(), []) == {}


def test_cpu_fp32_default_block_size() -> None:
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(num_blocks=4))
    assert engine.block_size == 32 and engine.cache.key[0].shape == (4 * 32, 2, 16)
    assert engine.cache.key[0].dtype == torch.float32
    engine.close()


def test_offload_preemption_restores_kv_instead_of_recomputing() -> None:
    model = tiny_llama()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=10, max_len=30, seed=6)
    _, reference = _greedy_engine(model, prompts, ContinuousBatchingConfig(block_size=4, num_blocks=256), max_new=16)
    cfg = ContinuousBatchingConfig(
        block_size=4,
        num_blocks=14,
        safety_margin=0.0,
        preemption_mode="offload",
        cpu_offload_space=0.01,
        allow_block_sharing=False,
    )
    engine, out = _greedy_engine(model, prompts, cfg, max_new=16)
    assert out == reference
    assert engine.stats.num_preemptions > 0
    assert engine.stats.num_offloads == engine.stats.num_preemptions
    # Nothing was computed twice: each prompt token once, each generated token (but the last) once.
    assert engine.stats.num_prompt_tokens_computed == sum(len(p) for p in prompts)
    assert engine.offload_pool is not None and len(engine.offload_pool.free_blocks) == engine.offload_pool.num_blocks


def test_default_cache_holds_every_request_of_the_batch_at_once() -> None:
    # 4 requests of 19 tokens need 4 blocks of 32 (one each), not ceil(76 / 32) = 3.
    model = tiny_llama()
    engine = Engine(model, ContinuousBatchingConfig(), max_tokens_hint=[19] * 4)
    assert engine.num_blocks == 5
    engine.close()


# ---------------------------------------------------------------- issue 10: transformers' outputs and offload switch
def test_status_is_ordered_as_in_transformers_and_outputs_carry_their_lifespan() -> None:
    from transformers.generation.continuous_batching import RequestStatus as TransformersStatus

    for name in ("PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED"):
        assert RequestStatus[name] == TransformersStatus[name]
    assert [s for s in RequestStatus if s >= RequestStatus.FINISHED] == [
        RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED,
    ]  # fmt: skip
    assert all(s.is_final == (s >= RequestStatus.FINISHED) for s in RequestStatus)
    t0 = time.perf_counter()
    out = generate_batch(tiny_llama(), [[5, 6, 7]], GenerationConfig(max_new_tokens=4), record_timestamps=True)
    req = out["req_0"]
    start, end = req.lifespan
    assert req.created_time <= start <= req.timestamps[0] <= req.timestamps[-1] <= end <= time.perf_counter()
    assert t0 <= req.created_time and req.is_finished()
    assert GenerationOutput("x", []).lifespan == (-1.0, -1.0)


@pytest.mark.parametrize("space", [0.01, None])
def test_cpu_offload_space_alone_turns_offload_on(space: float | None) -> None:
    model = tiny_llama()
    prompts = random_prompts(8, VOCAB_SIZE, min_len=10, max_len=30, seed=6)
    _, reference = _greedy_engine(model, prompts, ContinuousBatchingConfig(page_size=4, num_blocks=256), max_new=16)
    # None: the pool is the safety threshold's share of the available RAM (tiny here).
    cfg = ContinuousBatchingConfig(
        page_size=4, num_blocks=14, safety_margin=0.0, allow_block_sharing=False, cpu_offload_space=space,
        cpu_offload_space_safety_threshold=0.01 / (psutil.virtual_memory().available / 1024**3),
    )  # fmt: skip
    assert cfg.preemption_mode == "recompute"  # not asked for: the space decides
    engine, out = _greedy_engine(model, prompts, cfg, max_new=16)
    assert out == reference
    assert engine.offload_pool is not None and engine.stats.num_offloads == engine.stats.num_preemptions > 0
    no_pool = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=14, cpu_offload_space=0.0))
    assert no_pool.offload_pool is None
    no_pool.close()


@pytest.mark.parametrize(("mode", "temperature"), [("raw", 1.0), ("temperature", 0.7)])
def test_top_logprobs_equal_topk_of_a_teacher_forced_log_softmax(mode: str, temperature: float) -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=3, max_len=20, seed=12)
    # Requests 0 and 2 sample and ask for 5 and 3 alternatives; 1 and 3 are greedy, 3 asks for 1, 1 for none.
    asked = [5, 0, 3, 1]
    cfg = ContinuousBatchingConfig(page_size=4, seed=3, return_logprobs=True, logprobs_mode=mode)
    engine = Engine(model, cfg)
    for i, (prompt, n) in enumerate(zip(prompts, asked)):
        params = SamplingParams(max_new_tokens=8, do_sample=i % 2 == 0, temperature=temperature, num_top_logprobs=n)
        engine.add_request(prompt, params, request_id=f"r{i}")
    outputs = run_engine(engine)
    for i, (prompt, n) in enumerate(zip(prompts, asked)):
        out = outputs[f"r{i}"]
        if n == 0:
            assert out.top_token_ids == [] and out.top_logprobs == []
            continue
        t = temperature if (mode == "temperature" and i % 2 == 0) else 1.0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.generated_tokens])).logits[0].float()
        dist = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)  # row k predicts token k
        values, ids = torch.topk(dist, n, dim=-1)
        assert len(out.top_token_ids) == len(out.top_logprobs) == len(out.generated_tokens)
        assert out.top_token_ids == ids.tolist()
        assert_close([v for row in out.top_logprobs for v in row], values.flatten(), atol=1e-4)


def test_top_logprobs_without_return_logprobs_are_refused_naming_the_field() -> None:
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(page_size=4))
    with pytest.raises(ValueError, match=r"^num_top_logprobs: .*return_logprobs=True"):
        engine.add_request([5, 6], SamplingParams(num_top_logprobs=2))
    assert not engine.requests
