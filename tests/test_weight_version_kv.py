"""The weight-version promise of the prefix cache (DESIGN.md, section 3), one test per path that puts KV in a block.

A request that spans a weight update without recompute keeps its own KV, old and new weights mixed; none of that KV
may reach another request. Each test changes the weights while a request is in one state (offloaded to the CPU pool,
half-way through the first block of a chunked prefill, with forks parked on its prefill, with a placeholder in
flight), lets it finish, then sends the same prompt again: that request must compute on the new weights only, its
greedy tokens equal to ``model.generate`` and its logprobs within 1e-4 of a teacher-forced forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rollout import ContinuousBatchingConfig, Engine, GenerationOutput, SamplingParams
from rollout.requests import Request
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4
# A budget of 6 tokens: a 4-token prompt admitted first leaves the next prompt 2 tokens of its first block.
_CHUNKED = ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=6, return_logprobs=True)


def _change_weights(engine: Engine, model: torch.nn.Module) -> None:
    """A trainer's in-place update between two steps, kept KV and all (``update_weights(..., recompute=False)``)."""
    torch.manual_seed(123)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.1" in name:
                p.add_(0.3 * torch.randn_like(p))
    engine.set_weight_version(engine.weight_version + 1)


def _step_until(engine: Engine, done: Callable[[], bool], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError("the engine never reached the state under test")


def _same_prompt_again(engine: Engine, model: torch.nn.Module, prompt: list[int]) -> GenerationOutput:
    """The prompt once more after everything ended: exact on the current weights, whatever the cache holds."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=6), request_id="again")
    out = run_engine(engine)["again"]
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
