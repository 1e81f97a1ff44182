"""The KV cache per layer group on real models (issue 12, item 3): a Gemma-3-style model (5 sliding layers,
window 64, to 1 global layer) holds only the window in its sliding groups, block counts computed by hand,
and every greedy output equals ``model.generate`` token for token with chunked prefill, prefix-cache hits,
preemption (recompute and offload) and prompt forks; models whose layers differ in head dim or KV heads
run too.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.engine import Engine
from rollout.engine.kv.block_pool import NULL_BLOCK
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_gemma3_5to1, tiny_gemma4, tiny_mistral
from tests.utils import reference_greedy, run_engine

WINDOW = 64
PAGE = 16


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens)  # no EOS: every request runs to max_new_tokens


def run_and_compare(engine: Engine, prompts: list[list[int]], max_new_tokens: int, ids: list[str]) -> dict:
    """Queue the prompts, step the engine to the end, assert each output is model.generate's; the outputs."""
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(prompt, greedy(max_new_tokens), request_id=rid)
    outs = run_engine(engine)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert outs[rid].generated_tokens == reference_greedy(engine.model, prompt, max_new_tokens, None), rid
    return outs


def test_sliding_groups_hold_exactly_the_window_of_the_next_queries_and_free_the_rest() -> None:
    model = tiny_gemma3_5to1(WINDOW)
    engine = Engine(model, ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=64))
    try:
        kv = engine.kv_cache_manager
        assert [g.name for g in engine.cache.groups] == [f"sliding64:{i}" for i in range(5)] + ["full:5"]
        assert engine.num_blocks == 6 * 64  # one pool of block ids; 6 per whole-model block
        prompt = random_prompts(1, VOCAB_SIZE, 100, 100, seed=40)[0]
        req = engine.add_request(prompt, greedy(40), request_id="r")
        held: list[tuple[int, int, list[int]]] = []  # (computed, scheduled, blocks held per group) after schedule
        while engine.has_unfinished():
            out = engine.scheduler.schedule()  # engine.step's three calls, with a look after the schedule
            c, n = out.scheduled[0].num_computed_tokens, out.scheduled[0].num_scheduled_tokens
            counts = [sum(1 for b in table if b != NULL_BLOCK) for table in req.block_tables]  # blocks held per group
            held.append((c, n, counts))
            # The step reads keys from c - 63 and writes up to c + n - 1: a sliding group holds the blocks
            # from (c - 63) // 16 to (c + n - 1) // 16, the full group every block up to there.
            last = -(-(c + n) // PAGE)
            assert counts == [last - max(0, c - WINDOW + 1) // PAGE] * 5 + [last], (c, n, counts)
            assert kv.num_free_blocks == engine.num_blocks - sum(counts)  # everything else is back in the pool
            assert all(t[: max(0, c - WINDOW + 1) // PAGE] == [NULL_BLOCK] * (max(0, c - WINDOW + 1) // PAGE)
                       for t in req.block_tables[:5])  # fmt: skip
            result = engine.runner.execute(out)
            engine.scheduler.update_from_output(out, result)
        assert req.generated_tokens == reference_greedy(model, prompt, 40, None)
        assert kv.num_free_blocks == engine.num_blocks
    finally:
        engine.close()
    # By hand: the prompt in chunks of 64 and 36 tokens, then one decode at 100 and at 120.
    assert held[0] == (0, 64, [4] * 5 + [4])
    assert held[1] == (64, 36, [7] * 5 + [7])  # 64 - 63 = 1: block 0 still read
    assert held[2] == (100, 1, [5] * 5 + [7])  # blocks 2..6: 37 // 16 = 2 blocks back in the pool
    assert held[22] == (120, 1, [5] * 5 + [8])  # blocks 3..7
    assert held[29] == (127, 1, [4] * 5 + [8])  # positions 64..127: exactly the 4 blocks 4..7
    assert held[-1] == (138, 1, [5] * 5 + [9])  # the 40th token: blocks 4..8
    assert {counts[0] for _, n, counts in held if n == 1} == {4, 5}  # 64 / 16 blocks, or 5 when not aligned


def test_gemma3_pattern_matches_generate_with_chunked_prefill_and_prefix_hits() -> None:
    model = tiny_gemma3_5to1(WINDOW)
    shared = random_prompts(1, VOCAB_SIZE, 130, 130, seed=41)[0]
    tails = random_prompts(6, VOCAB_SIZE, 1, 30, seed=42)
    prompts = [shared + t for t in tails]
    engine = Engine(model, ContinuousBatchingConfig(page_size=PAGE, num_blocks=96, max_batch_tokens=48))
    try:
        first = run_and_compare(engine, prompts[:3], 12, ["a0", "a1", "a2"])
        hits_before = engine.stats.num_prefix_cache_hit_blocks
        second = run_and_compare(engine, prompts[3:], 12, ["b0", "b1", "b2"])
    finally:
        engine.close()
    # Every prompt is over 48 tokens: chunked. The second wave finds the 8 full blocks of the shared
    # 130 tokens: the full group's blocks 0..7, each sliding group's 4..7 (position 128 reads 65..128).
    assert all(len(p) > 48 for p in prompts)
    assert [second[f"b{i}"].num_cached_prompt_tokens for i in range(3)] == [128] * 3
    assert engine.stats.num_prefix_cache_hit_blocks - hits_before == 3 * (8 + 5 * 4)
    assert first["a0"].generated_tokens != first["a1"].generated_tokens


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_gemma3_pattern_matches_generate_through_preemption(offload: bool) -> None:
    model = tiny_gemma3_5to1(WINDOW)
    prompts = random_prompts(6, VOCAB_SIZE, 60, 120, seed=43)
    # 16 whole-model blocks = 96 block ids: each request needs up to 9 full and 5 x 6 sliding blocks.
    config = ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=16, max_batch_tokens=64, safety_margin=0.0, cpu_offload_space=0.05 if offload else 0
    )
    engine = Engine(model, config)
    try:
        run_and_compare(engine, prompts, 24, [f"r{i}" for i in range(6)])
    finally:
        engine.close()
    assert engine.stats.num_preemptions > 0
    assert (engine.stats.num_offloads > 0) == offload


def test_gemma3_pattern_forks_share_the_window_and_copy_each_group_s_partial_block() -> None:
    model = tiny_gemma3_5to1(WINDOW)
    prompts = random_prompts(2, VOCAB_SIZE, 150, 170, seed=44)
    engine = Engine(model, ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, max_batch_tokens=48))
    try:
        forks = [p for p in prompts for _ in range(3)]
        run_and_compare(engine, forks, 10, [f"s{i}" for i in range(6)])
    finally:
        engine.close()
    # 2 of each 3 samples are forked; each writes its first token into the shared partial last block of
    # the 6 groups (prompts of 150-170 tokens are not multiples of 16): 6 copies per fork.
    assert all(len(p) % PAGE for p in prompts)
    assert engine.stats.num_forks == 4 and engine.stats.num_block_copies == 4 * 6


def test_a_cache_of_full_layers_holds_the_same_bytes_and_gives_the_same_tokens() -> None:
    model = tiny_gemma3_5to1(WINDOW)
    prompts = random_prompts(3, VOCAB_SIZE, 70, 90, seed=45)
    stats = []
    for sliding in (True, False):
        config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=40, sliding_window_cache=sliding)
        engine = Engine(model, config)
        try:
            run_and_compare(engine, prompts, 8, ["x", "y", "z"])
        finally:
            engine.close()
        stats.append(engine.stats)
    grouped, full = stats
    assert grouped.kv_cache_bytes == full.kv_cache_bytes == 40 * PAGE * 6 * 2 * 2 * 16 * 4
    assert grouped.kv_cache_capacity_tokens == {
        **{f"sliding64:{i}": 6 * 40 * PAGE for i in range(5)},
        "full:5": 6 * 40 * PAGE,
    }
    assert full.kv_cache_capacity_tokens == {"full:0,1,2,3,4,5": 40 * PAGE}


@pytest.mark.parametrize(
    "build",
    [lambda: tiny_gemma4(global_head_dim=32), lambda: tiny_gemma4(global_head_dim=16, num_global_key_value_heads=1)],
    ids=["head_dim", "kv_heads"],
)
def test_layers_with_other_head_dims_or_kv_heads_match_generate_through_hits_preemption_and_forks(build) -> None:
    model = build()
    shared = random_prompts(1, VOCAB_SIZE, 20, 20, seed=46)[0]
    prompts = [shared + t for t in random_prompts(6, VOCAB_SIZE, 5, 25, seed=47)]
    prompts += [prompts[0]] * 2  # two more samples of the first prompt, forked from it
    config = ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=16, safety_margin=0.0)
    engine = Engine(model, config)
    try:
        run_and_compare(engine, prompts, 12, [f"r{i}" for i in range(8)])
    finally:
        engine.close()
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_blocks > 0 and stats.num_forks > 0
    assert len(engine.cache.groups) == 2


def test_a_layer_attending_past_the_window_its_cache_keeps_fails_loudly() -> None:
    # The cache gives back what a layer's window no longer reads; a model that attends further than the
    # window read from its config must fail the step, not attend to reused blocks.
    model = tiny_mistral(sliding_window=8)
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=16))
    try:
        model.config.sliding_window = None  # Mistral reads it at every call
        engine.add_request([5, 6, 7, 8, 9], greedy(2))
        with pytest.raises(RuntimeError, match=r"layer 0 attends with sliding_window=None.*last 8 positions"):
            engine.step()
    finally:
        model.config.sliding_window = 8
        engine.close()


def test_generate_batch_sizes_a_sliding_model_s_cache_for_its_windows() -> None:
    # Default settings (page 32, prefill chunks of up to 512 tokens): one chunk per prompt, then the
    # sliding groups give back all but the window.
    model = tiny_gemma3_5to1(WINDOW)
    prompts = random_prompts(4, VOCAB_SIZE, 290, 290, seed=48)
    outs = generate_batch(model, prompts, GenerationConfig(max_new_tokens=10, do_sample=False))
    expected = [reference_greedy(model, p, 10, EOS_TOKEN_ID) for p in prompts]
    assert [o.generated_tokens for o in outs.values()] == expected
    # A cache sized for 4 requests of 2,000 tokens: 63 blocks each in the full group, and in each sliding
    # group at most 1 + ceil((64 + 512 - 2) / 32) = 19 (a window and a 512-token chunk); one spare block.
    engine = Engine(model, max_tokens_hint=[2000] * 4)
    try:
        assert engine.num_blocks == 4 * (63 + 5 * 19) + 1
    finally:
        engine.close()


def test_without_prefix_caching_a_sliding_group_claims_no_prefix_hit() -> None:
    # With prefix caching off the block lookup returns no entry at all; an empty window was read as all found,
    # so a 13-token prompt (window 8) was admitted as 12 tokens already computed, with no blocks behind them.
    model = tiny_mistral(sliding_window=8)
    prompt = random_prompts(4, VOCAB_SIZE, min_len=4, max_len=30, seed=7)[0]
    assert len(prompt) == 13
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=64, allow_block_sharing=False))
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=4), request_id="x")
    assert engine.kv_cache_manager.get_computed_blocks(request, engine.weight_version) == ([], 0)
    assert run_engine(engine)["x"].generated_tokens == reference_greedy(model, prompt, 4, None)
