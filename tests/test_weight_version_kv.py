"""The weight-version promise of the prefix cache (DESIGN.md, section 3), one test per path that puts KV in a block.

A request that spans a weight update without recompute keeps its own KV, old and new weights mixed; none of that KV
may reach another request. Each test changes the weights while a request is in one state (offloaded to the CPU pool,
part-way through the first or a later block of a chunked prefill or of a budget left by decoding requests, with forks
parked on its prefill, with a placeholder in flight, decoding in its first block), on full-attention, sliding-window
and hybrid models, lets it finish, then sends the same prompt (or its conversation's next turn) again: that request
must compute on the new weights only (the exact count of reused tokens is asserted), its greedy tokens equal to
``model.generate`` and its logprobs within 1e-4 of a teacher-forced forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rollout import ContinuousBatchingConfig, GenerationOutput, SamplingParams
from rollout.engine import Engine
from rollout.requests import Request
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama, tiny_mistral
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4
# A budget of 6 tokens: a 4-token prompt admitted first leaves the next prompt 2 tokens of its first block.
_CHUNKED = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=6, return_logprobs=True)


def _change_weights(engine: Engine, model: torch.nn.Module) -> None:
    """A trainer's in-place update between two steps, kept KV and all (``update_weights(..., recompute=False)``).

    The version is set first: ``set_weight_version`` finishes an async step in flight, which must run on the old
    weights (the manager's loop drains it before a pause); nothing runs on the model before the next ``step()``.
    """
    engine.set_weight_version(engine.weight_version + 1)
    torch.manual_seed(123)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.1" in name:
                p.add_(0.3 * torch.randn_like(p))


def _step_until(engine: Engine, done: Callable[[], bool], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError("the engine never reached the state under test")


def _same_prompt_again(
    engine: Engine, model: torch.nn.Module, prompt: list[int], request_id: str = "again"
) -> GenerationOutput:
    """The prompt once more after everything ended: exact on the current weights, whatever the cache holds."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id=request_id)
    out = run_engine(engine)[request_id]
    assert out.generated_tokens == reference_greedy(model, prompt, 6, None)
    assert_close(out.logprobs, teacher_forced_logprobs(model, prompt, out.generated_tokens), atol=LOGPROB_ATOL)
    assert out.weight_versions == [engine.weight_version] * 6
    return out


@pytest.mark.parametrize("update", [True, False])
def test_restored_kv_is_published_only_under_the_version_that_computed_it(update: bool) -> None:
    # b is preempted by offload, the weights change while its KV sits in the CPU pool, then it is restored:
    # its blocks hold the old weights' KV and must not be hashed under the new version (they were, through
    # the restore's re-hash; the same prompt then read 16 tokens of old KV, 2.7 nats off).
    model = tiny_llama()
    config = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=16,
        safety_margin=0.0,
        preemption_mode="offload",
        cpu_offload_space=0.01,
        return_logprobs=True,
    )
    engine = Engine(model, config)
    try:
        pa, pb = random_prompts(2, VOCAB_SIZE, 20, 20, seed=5)
        engine.add_request(pa, SamplingParams(max_new_tokens=24), request_id="a")
        b = engine.add_request(pb, SamplingParams(max_new_tokens=24), request_id="b")
        _step_until(engine, lambda: b.offloaded is not None)
        if update:
            _change_weights(engine, model)
        outputs = run_engine(engine)
        assert engine.stats.num_offloads >= 1 and b.offloaded is None
        again = _same_prompt_again(engine, model, pb)
    finally:
        engine.close()
    if update:
        assert set(outputs["b"].weight_versions) == {0, 1}
        assert again.num_cached_prompt_tokens == 0
    else:  # without an update the restored blocks serve the same prompt as before
        assert again.num_cached_prompt_tokens == 16


@pytest.mark.parametrize("num_forks", [0, 2])
def test_a_first_block_computed_across_an_update_is_never_published(num_forks: int) -> None:
    # A budget of 6 tokens: x takes 4, p's prefill starts with 2 tokens of its first block (and num_forks requests
    # of the same prompt park on it). The weights change; p computes the rest under the new ones (and the parked
    # requests fork from it once its prefill completes). The first block mixes versions, and every block chained
    # after it too: none may be found under the new version (it was: the chain starts from the root, so the hash of
    # the first block named only the new version).
    model = tiny_llama()
    engine = Engine(model, _CHUNKED)
    try:
        px, pp = random_prompts(1, VOCAB_SIZE, 4, 4, seed=9)[0], random_prompts(1, VOCAB_SIZE, 14, 14, seed=10)[0]
        engine.add_request(px, SamplingParams(max_new_tokens=3), request_id="x")
        p = engine.add_request(pp, SamplingParams(max_new_tokens=5), request_id="p")
        forks = [engine.add_request(pp, SamplingParams(max_new_tokens=5), request_id=f"f{i}") for i in range(num_forks)]
        engine.step()
        assert p.num_computed_tokens == 2 and all(f.fork_parent is p for f in forks)
        _change_weights(engine, model)
        outputs = run_engine(engine)
        assert engine.stats.num_forks == num_forks
        assert all(r.kv_version is None for r in (p, *forks))
        again = _same_prompt_again(engine, model, pp)
    finally:
        engine.close()
    assert again.num_cached_prompt_tokens == 0
    for r in ("p", *(f"f{i}" for i in range(num_forks))):
        assert outputs[r].generated_tokens == outputs["p"].generated_tokens and outputs[r].weight_versions == [1] * 5


@pytest.mark.parametrize("steps_before_update", [1, 2, 3, 4, 5])
def test_async_placeholders_hash_blocks_under_the_version_that_computed_them(steps_before_update: int) -> None:
    # Async batching hashes a block once the placeholder token that completes it is known, a step after its KV
    # was computed. A 3-token prompt: the update lands at each point of the first block's life.
    model = tiny_llama()
    config = ContinuousBatchingConfig(page_size=4, num_blocks=64, use_async_batching=True, return_logprobs=True)
    engine = Engine(model, config)
    try:
        prompt = random_prompts(1, VOCAB_SIZE, 3, 3, seed=11)[0]
        r: Request = engine.add_request(prompt, SamplingParams(max_new_tokens=10), request_id="r")
        for _ in range(steps_before_update):
            engine.step()
        _change_weights(engine, model)
        outputs = run_engine(engine)
        assert set(outputs["r"].weight_versions) == {0, 1} and r.kv_version is None
        # The same tokens again (prompt and the first generated ones): only blocks wholly computed under the new
        # weights may serve them, and none was.
        again = _same_prompt_again(engine, model, prompt + outputs["r"].generated_tokens[:6])
    finally:
        engine.close()
    assert again.num_cached_prompt_tokens == 0


# ---------------------------------------------------------------- pages of 16, every tensor changed (issue 37)
# The shapes of issue 37: 16-token blocks, every parameter changed. Block hashes chain from the first block, so a
# block computed across the update hides every block after it only if its own hash names no single version.

_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": tiny_llama,
    # A window of 24 over 2 layers: the last prompt token (position 47 or 45) reads the second layer's keys of
    # positions 24-31, which read the first layer's keys from position 1 on, so KV computed early in block 0 reaches
    # the tokens of a request that reuses blocks 0 and 1 (with a window of 16 it would not, whatever blocks 0-1 held).
    "mistral_sliding": lambda: tiny_mistral(sliding_window=24),
    "gemma_hybrid": tiny_gemma,  # sliding (window 8) and full layers: two layer groups
}


def _update_every_tensor(engine: Engine, model: torch.nn.Module) -> None:
    """``_change_weights`` with every parameter changed (what a full state dict through ``update_weights`` does)."""
    engine.set_weight_version(engine.weight_version + 1)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))


# name: (max_batch_tokens, prompt length, decoding requests beside it, its tokens computed when the update lands)
_PREFILL_SHAPES = {
    "first_block_chunk": (12, 48, 0, 12),  # a 12-token chunk of the first block
    "first_block_budget": (32, 48, 20, 12),  # 20 decoding requests leave 12 tokens of the budget
    # The first block whole, 4 tokens of the second. A guard: the chain already hid this one when blocks were hashed
    # under the version in force when they filled (the first block's hash names the old version only).
    "later_block_chunk": (20, 60, 0, 20),
}


@pytest.mark.parametrize(
    ("model_name", "shape", "num_forks", "async_batching"),
    [
        ("llama", "first_block_chunk", 0, False),
        ("llama", "first_block_budget", 0, False),
        ("llama", "later_block_chunk", 0, False),
        ("llama", "first_block_chunk", 2, False),
        ("llama", "first_block_chunk", 0, True),
        ("mistral_sliding", "first_block_chunk", 0, False),
        ("mistral_sliding", "later_block_chunk", 0, False),
        ("gemma_hybrid", "first_block_chunk", 0, False),
        ("gemma_hybrid", "later_block_chunk", 0, False),
    ],
)
def test_a_prefill_that_spans_an_update_serves_no_later_request(
    model_name: str, shape: str, num_forks: int, async_batching: bool
) -> None:
    # p's prefill is cut by the update (num_forks requests of the same prompt parked on it). The same prompt sent
    # afterwards must reuse none of p's blocks: each holds old-weight KV or attends to it (it took 32 tokens of them).
    # A prompt sharing 40 tokens, sent next, reuses that request's blocks: the cache works again on the new weights.
    model = _MODELS[model_name]()
    budget, length, num_decoding, computed_at_update = _PREFILL_SHAPES[shape]
    config = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=256,
        max_batch_tokens=budget,
        use_async_batching=async_batching,
        return_logprobs=True,
    )
    engine = Engine(model, config)
    try:
        prompt = random_prompts(1, VOCAB_SIZE, length, length, seed=21)[0]
        decoding = [
            engine.add_request(q, SamplingParams(max_new_tokens=40), request_id=f"d{i}")
            for i, q in enumerate(random_prompts(num_decoding, VOCAB_SIZE, 3, 3, seed=22))
        ]
        _step_until(engine, lambda: all(r.num_generated_tokens > 0 for r in decoding))
        p = engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id="p")
        forks = [
            engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id=f"f{i}") for i in range(num_forks)
        ]
        engine.step()
        assert p.num_computed_tokens == computed_at_update and all(f.fork_parent is p for f in forks)
        _update_every_tensor(engine, model)
        outputs = run_engine(engine)
        assert engine.stats.num_forks == num_forks
        for r in ("p", *(f"f{i}" for i in range(num_forks))):
            assert (
                outputs[r].weight_versions == [1] * 5 and outputs[r].generated_tokens == outputs["p"].generated_tokens
            )
        again = _same_prompt_again(engine, model, prompt)
        shared = _same_prompt_again(engine, model, prompt[:40] + random_prompts(1, VOCAB_SIZE, 8, 8, seed=23)[0], "s")
    finally:
        engine.close()
    assert again.num_cached_prompt_tokens == 0
    assert shared.num_cached_prompt_tokens == 32


@pytest.mark.parametrize(
    ("model_name", "async_batching"),
    [("llama", False), ("llama", True), ("mistral_sliding", False), ("gemma_hybrid", False)],
)
def test_a_turn_that_decoded_across_an_update_serves_not_its_follow_up(model_name: str, async_batching: bool) -> None:
    # A 10-token prompt decodes 30 tokens; the update lands after its third, while its first block (positions 0-15)
    # is still filling. The next turn of the conversation (prompt, completion, 6 more tokens) must reuse none of its
    # blocks (it took 32 tokens of them); the same turn once more reuses the blocks the first one computed.
    model = _MODELS[model_name]()
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=64, use_async_batching=async_batching, return_logprobs=True
    )
    engine = Engine(model, config)
    try:
        prompt, turn = random_prompts(2, VOCAB_SIZE, 10, 10, seed=24)
        r = engine.add_request(prompt, SamplingParams(max_new_tokens=30), request_id="r")
        for _ in range(3):
            engine.step()
        _update_every_tensor(engine, model)
        outputs = run_engine(engine)
        versions = outputs["r"].weight_versions
        k = versions.index(1)  # tokens sampled on the old weights
        assert 1 <= k <= 5 and versions == [0] * k + [1] * (30 - k) and r.num_computed_tokens >= 16
        follow_up = prompt + outputs["r"].generated_tokens + turn[:6]
        first = _same_prompt_again(engine, model, follow_up, "turn2")
        second = _same_prompt_again(engine, model, follow_up, "turn2_again")
    finally:
        engine.close()
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == 32
