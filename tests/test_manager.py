"""The persistent manager: lifecycle, streaming, cancel, results, pause and weight updates, failures, stress.

Every manager comes from the ``make_manager`` fixture, which destroys it at teardown, so a failed
assertion never leaves a loop thread running. Tests that need the loop at a given point pace its
engine steps with ``StepControl`` (events, not sleeps).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import random
import threading
import time
import weakref

import pytest
import torch
from transformers import GenerationConfig

import rollout
from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    QueueFullError,
    RequestStatus,
    SamplingParams,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from rollout.engine import Engine
from rollout.manager.persistence import persistent_manager_of
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import StepControl, assert_close, reference_greedy, run_engine, teacher_forced_logprobs

GREEDY = GenerationConfig(max_new_tokens=8, do_sample=False)


class ManagerFactory:
    """Builds managers on tiny models (block_size 4, 128 blocks unless given) and their step controls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.managers: list[ContinuousBatchingManager] = []
        self.controls: list[StepControl] = []

    def __call__(self, model=None, gc=GREEDY, **cfg) -> ContinuousBatchingManager:  # noqa: ANN001
        cfg.setdefault("block_size", 4)
        cfg.setdefault("num_blocks", 128)
        m = init_continuous_batching(model or tiny_llama(), gc, ContinuousBatchingConfig(**cfg))
        self.managers.append(m)
        return m

    def steps(self, manager: ContinuousBatchingManager, delay: float = 0.0) -> StepControl:
        control = StepControl(self.monkeypatch, manager, delay)
        self.controls.append(control)
        return control

    def close(self) -> None:
        for control in self.controls:  # a held step would keep the loop from ending
            control.release()
        for m in self.managers:
            m.destroy()


@pytest.fixture
def make_manager(monkeypatch: pytest.MonkeyPatch):
    factory = ManagerFactory(monkeypatch)
    yield factory
    factory.close()


@pytest.fixture
def manager(make_manager: ManagerFactory) -> ContinuousBatchingManager:
    m = make_manager()
    m.start()
    return m


# ---------------------------------------------------------------- lifecycle
def test_results_match_generate_and_ids_in_input_order(manager: ContinuousBatchingManager) -> None:
    prompts = random_prompts(6, VOCAB_SIZE, 3, 20, seed=2)
    ids = manager.add_requests(prompts)
    assert len(set(ids)) == 6
    for rid, p in zip(ids, prompts):
        out = manager.get_result(rid, timeout=30)
        assert out is not None and out.status == RequestStatus.FINISHED
        assert out.prompt_ids == p
        assert out.generated_tokens == reference_greedy(manager.model, p, 8, EOS_TOKEN_ID)


def test_start_stop_restart_destroy_twice(make_manager: ManagerFactory) -> None:
    m = make_manager()
    assert not m.is_running()
    m.start()
    assert m.is_running()
    rid = m.add_request([5, 6, 7])
    m.stop()  # default stop finishes pending requests first
    assert not m.is_running() and m.join(0)
    assert m.get_result(rid).status == RequestStatus.FINISHED
    assert m.model.config._attn_implementation == "sdpa"  # engine closed on stop
    m.start()
    rid = m.add_request([8, 9])
    assert m.get_result(rid, timeout=30).status == RequestStatus.FINISHED
    m.destroy()
    m.destroy()
    assert m.model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="destroyed"):
        m.start()


def test_add_request_after_stop_warns_and_returns_none(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    m = make_manager()
    m.start()
    m.stop()
    with caplog.at_level(logging.WARNING):
        assert m.add_request([5, 6]) is None
        assert m.add_requests([[5, 6], [7]]) == [None, None]
    assert "after stop" in caplog.text
    m.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):  # documented apart from stop() (docs/api.md, docstring)
        m.add_request([5, 6])


def test_hard_stop_fails_requests_and_keeps_partial_tokens(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=None), num_blocks=512)
    steps = make_manager.steps(m)
    steps.hold()
    m.start()
    ids = [m.add_request(p, streaming=True) for p in random_prompts(3, VOCAB_SIZE, 3, 6, seed=3)]
    steps.allow(2)
    next(iter(m.request_id_iter(ids[0])))  # at least one token exists
    m.stop(hard_stop=True, block=False)
    steps.release()  # the step the loop waits in runs, then the loop sees the hard stop
    assert m.join(30)
    outs = [m.get_result(rid, timeout=5) for rid in ids]
    assert all(o.status == RequestStatus.FAILED and "hard_stop" in o.error for o in outs)
    assert 1 <= len(outs[0].generated_tokens) < 200


def test_persistent_context_manager_is_reused_by_next_call_and_generate_batch() -> None:
    model = tiny_llama()
    cfg = ContinuousBatchingConfig(block_size=4, num_blocks=64)
    with continuous_batching_context_manager(model, GREEDY, cfg, persistent_manager=True) as first:
        rid = first.add_request([5, 6, 7])
        assert first.get_result(rid, timeout=30).status == RequestStatus.FINISHED
    assert not first.is_running()
    with continuous_batching_context_manager(model, GREEDY, cfg, persistent_manager=True) as second:
        assert second is first
    prompts = random_prompts(3, VOCAB_SIZE, 3, 10, seed=4)
    out = generate_batch(model, prompts, GREEDY)  # runs on the persistent manager
    assert [o.generated_tokens for o in out.values()] == [reference_greedy(model, p, 8, EOS_TOKEN_ID) for p in prompts]
    first.destroy()
    assert getattr(model, "_rollout_manager", None) is None
    assert persistent_manager_of(model) is None
    with continuous_batching_context_manager(model, GREEDY, cfg) as third:
        assert third is not first
    assert model.config._attn_implementation == "sdpa"


def test_destroying_a_persistent_manager_releases_its_model() -> None:
    # The model-to-manager link is a weak mapping: once the manager is destroyed, nothing of
    # rollout's keeps the model (and its KV cache) alive.
    model = tiny_llama()
    cfg = ContinuousBatchingConfig(block_size=4, num_blocks=16)
    with continuous_batching_context_manager(model, GREEDY, cfg, persistent_manager=True) as manager:
        pass
    assert persistent_manager_of(model) is manager
    manager.destroy()
    assert persistent_manager_of(model) is None
    ref = weakref.ref(model)
    del model, manager
    gc.collect()
    assert ref() is None


def test_duplicate_request_id_is_refused(manager: ContinuousBatchingManager) -> None:
    manager.add_request([5, 6], request_id="a")
    with pytest.raises(ValueError, match="'a' is already in use"):
        manager.add_request([5, 6], request_id="a")


def test_sampling_params_are_taken_whole_and_keyword_overrides_apply_on_top(manager: ContinuousBatchingManager) -> None:
    params = rollout.SamplingParams(max_new_tokens=3, eos_token_ids=())
    rid = manager.add_request([5, 6, 7], sampling_params=params)
    assert len(manager.get_result(rid, timeout=30).generated_tokens) == 3
    rid = manager.add_request([5, 6, 7], max_new_tokens=2, sampling_params=params)
    assert len(manager.get_result(rid, timeout=30).generated_tokens) == 2
    ids = manager.add_requests([[5, 6], [7]], sampling_params=params, max_new_tokens=4)
    assert [len(manager.get_result(r, timeout=30).generated_tokens) for r in ids] == [4, 4]
    with pytest.raises(ValueError, match=r"eos_token_ids must be token ids in \[0, 256\)"):
        manager.add_request([5], sampling_params=rollout.SamplingParams(eos_token_ids=(256,)))


def test_bad_input_raises_before_queueing(manager: ContinuousBatchingManager) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        manager.add_request([])
    with pytest.raises(ValueError, match=r"inputs\[1\].*outside the vocabulary"):
        manager.add_requests([[5, 6], [5, 999]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        manager.add_request([5], max_new_tokens=0)
    assert manager.get_result(timeout=0.2) is None  # nothing was queued


# ---------------------------------------------------------------- results
def test_cancel_ends_request_with_partial_tokens_and_frees_blocks(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=500, do_sample=False, eos_token_id=None), num_blocks=256)
    steps = make_manager.steps(m)
    steps.hold()
    m.start()
    rid = m.add_request([5, 6, 7, 8, 9], streaming=True)
    it = m.request_id_iter(rid)
    steps.allow(3)
    next(it), next(it)
    m.cancel_request(rid)
    steps.release()
    out = m.get_result(rid, timeout=5)
    assert out.status == RequestStatus.CANCELLED
    assert 2 <= len(out.generated_tokens) < 500
    # The result is published after the cancel freed the blocks: no wait is needed.
    with m.pause():
        assert m.engine.block_manager.num_free_blocks == 256


def test_get_result_none_after_timeout_and_next_finished(manager: ContinuousBatchingManager) -> None:
    assert manager.get_result(timeout=0.1) is None
    rid = manager.add_request([5, 6])
    out = manager.get_result(timeout=30)
    assert out.request_id == rid
    with pytest.raises(KeyError, match="already delivered"):
        manager.get_result(rid, timeout=0.1)


def test_iterating_the_manager_yields_each_result_once(manager: ContinuousBatchingManager) -> None:
    ids = manager.add_requests(random_prompts(5, VOCAB_SIZE, 3, 8, seed=5))
    assert sorted(o.request_id for o in manager) == sorted(ids)


def test_streaming_snapshots_never_change(manager: ContinuousBatchingManager) -> None:
    rid = manager.add_request([5, 6, 7], streaming=True, max_new_tokens=6, eos_token_id=[])
    chunks = list(manager.request_id_iter(rid))
    assert [len(c.generated_tokens) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert [c.status for c in chunks[:-1]] == [RequestStatus.DECODING] * 5
    assert chunks[-1].status == RequestStatus.FINISHED
    for i, c in enumerate(chunks):
        assert c.generated_tokens == chunks[-1].generated_tokens[: i + 1]


def test_non_streaming_iter_yields_final_only(manager: ContinuousBatchingManager) -> None:
    rid = manager.add_request([5, 6, 7])
    chunks = list(manager.request_id_iter(rid))
    assert len(chunks) == 1 and chunks[0].status == RequestStatus.FINISHED


def test_result_handler_runs_in_the_asyncio_loop(manager: ContinuousBatchingManager) -> None:
    async def main() -> list[tuple[int, bool]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[int, bool]] = []
        done = asyncio.Event()

        def on_chunk(out: rollout.GenerationOutput) -> None:
            assert asyncio.get_running_loop() is loop
            seen.append((len(out.generated_tokens), out.status.is_final))
            if out.status.is_final:
                done.set()

        rid = manager.add_request([5, 6, 7], streaming=True, max_new_tokens=4, eos_token_id=[])
        manager.register_result_handler(rid, on_chunk)
        await asyncio.wait_for(done.wait(), 30)
        return seen

    seen = asyncio.run(main())
    assert seen[-1] == (4, True)
    assert [n for n, _ in seen] == sorted(n for n, _ in seen)


def test_result_handler_without_loop_is_called_once(manager: ContinuousBatchingManager) -> None:
    got = []
    done = threading.Event()
    rid = manager.add_request([5, 6, 7])
    manager.register_result_handler(rid, lambda out: (got.append(out), done.set()))
    assert done.wait(30)
    manager.stop()  # the loop has ended: no later call can come
    assert len(got) == 1 and got[0].status == RequestStatus.FINISHED


def test_max_queue_size_raises_or_blocks(make_manager: ManagerFactory) -> None:
    m = make_manager(max_queue_size=2)  # not started: nothing leaves the queue
    m.add_request([5])
    m.add_request([6])
    with pytest.raises(QueueFullError, match="max_queue_size=2"):
        m.add_request([7])
    t0 = time.monotonic()
    with pytest.raises(QueueFullError, match="still full"):
        m.add_request([7], block=True, timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.2, m.start).start()
    rid = m.add_request([7], block=True, timeout=30)  # room appears once the loop admits requests
    assert m.get_result(rid, timeout=30).status == RequestStatus.FINISHED


# ---------------------------------------------------------------- pause and weights
def test_no_token_while_any_thread_holds_a_pause(make_manager: ManagerFactory) -> None:
    manager = make_manager()
    steps = make_manager.steps(manager)
    manager.start()
    rid = manager.add_request([5, 6, 7], streaming=True, max_new_tokens=400, eos_token_id=[])
    it = manager.request_id_iter(rid)
    next(it)
    entered = threading.Barrier(3)
    release = threading.Event()

    def holder() -> None:
        with manager.pause():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=holder) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    before = manager.engine.stats.num_generated_tokens
    started = steps.started
    assert not steps.wait_started(started + 1, timeout=0.2)  # no step starts while the pauses are held
    assert manager.engine.stats.num_generated_tokens == before
    release.set()
    for t in threads:
        t.join()
    assert steps.wait_finished(started + 1)
    assert manager.engine.stats.num_generated_tokens > before
    manager.cancel_request(rid)


def test_pause_is_reentrant(make_manager: ManagerFactory) -> None:
    m = make_manager()
    m.start()
    with m.pause():
        with m.pause():
            pass
        assert m._pausing.holders == 1
    rid = m.add_request([5, 6])
    assert m.get_result(rid, timeout=30).status == RequestStatus.FINISHED


def test_pause_latency_is_at_most_one_step(make_manager: ManagerFactory) -> None:
    # pause() returns once the step in progress ends: no step starts between the call and the
    # return, and none runs while the pause is held.
    # 500 tokens: the prompt plus max_new_tokens stays within tiny_llama's context of 512 (refused past it).
    m = make_manager(gc=GenerationConfig(max_new_tokens=500, do_sample=False, eos_token_id=None), num_blocks=512)
    steps = make_manager.steps(m, delay=0.01)  # steps long enough for pauses to land mid-step
    m.start()
    m.add_request([5, 6, 7])
    for _ in range(5):
        assert steps.wait_started(steps.started + 1)
        started_at_call = steps.started
        with m.pause():
            assert steps.finished == steps.started  # no step in progress
            assert steps.started <= started_at_call + 1  # at most the step whose start raced the call


def _training_loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = torch.arange(3, 23).reshape(2, 10)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_forward_backward_under_pause_equals_fresh_copy(make_manager: ManagerFactory) -> None:
    model = tiny_llama()
    fresh = copy.deepcopy(model)
    m = make_manager(model, gc=GenerationConfig(max_new_tokens=300, do_sample=False, eos_token_id=None), num_blocks=256)
    m.start()
    m.add_request([5, 6, 7])
    with m.pause():
        loss, grads = _training_loss_and_grads(model)
    m.destroy()
    ref_loss, ref_grads = _training_loss_and_grads(fresh)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def _perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    return {n: p.detach() + 0.3 * torch.randn_like(p) for n, p in model.named_parameters() if "layers.1" in n}


@pytest.mark.parametrize("recompute", [False, True])
def test_update_weights_versions_and_continuations(make_manager: ManagerFactory, recompute: bool) -> None:
    model = tiny_llama()
    m = make_manager(model, gc=GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))
    make_manager.steps(m, delay=0.005)  # the update lands within a step of the third token
    m.start()
    prompt = [5, 6, 7, 8, 9]
    rid = m.add_request(prompt, streaming=True)
    it = m.request_id_iter(rid)
    next(it), next(it), next(it)
    version = m.update_weights(_perturbed(model), recompute=recompute)
    assert version == 1 == m.weight_version
    out = m.get_result(rid, timeout=30)
    k = out.weight_versions.index(1)  # first token sampled under the new weights
    assert 3 <= k < 12 and out.weight_versions == [0] * k + [1] * (12 - k)
    # A request admitted after the update equals model.generate with the new weights.
    later = m.add_request(prompt)
    assert m.get_result(later, timeout=30).generated_tokens == reference_greedy(model, prompt, 12, None)
    if recompute:
        before = out.generated_tokens[:k]
        fresh = reference_greedy(model, prompt + before, 12 - k, None)
        assert out.generated_tokens[k:] == fresh


def test_update_weights_refuses_bad_tensors_before_copying(make_manager: ManagerFactory) -> None:
    model = tiny_llama()
    m = make_manager(model)
    w = model.lm_head.weight.detach().clone()
    with pytest.raises(KeyError, match="no parameter or buffer named 'nope'"):
        m.update_weights({"lm_head.weight": w + 1, "nope": w})
    with pytest.raises(ValueError, match="shape"):
        m.update_weights([("lm_head.weight", w + 1), ("model.norm.weight", w)])
    with pytest.raises(ValueError, match="dtype"):
        m.update_weights({"lm_head.weight": w.double()})
    assert torch.equal(model.lm_head.weight, w) and m.weight_version == 0
    assert m.update_weights() == 1  # None: the caller changed the weights itself


def test_prefix_blocks_of_old_weights_are_not_reused(make_manager: ManagerFactory) -> None:
    model = tiny_llama()
    m = make_manager(model, gc=GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None))
    m.start()
    prompt = list(range(10, 30))  # 5 full blocks
    m.get_result(m.add_request(prompt), timeout=30)
    m.update_weights(_perturbed(model))
    out = m.get_result(m.add_request(prompt), timeout=30)
    assert out.num_cached_prompt_tokens == 0
    assert out.generated_tokens == reference_greedy(model, prompt, 4, None)
    again = m.get_result(m.add_request(prompt), timeout=30)
    assert again.num_cached_prompt_tokens == 16  # same version now: blocks reused (last block recomputed)


# ---------------------------------------------------------------- failure and stress
def test_step_that_raises_fails_every_request_and_unblocks_readers(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=50, do_sample=False, eos_token_id=None))
    steps = make_manager.steps(m)

    def fail_third_step(number: int) -> None:
        if number == 3:
            raise RuntimeError("injected step failure")

    steps.before = fail_third_step
    m.start()
    ids = m.add_requests(random_prompts(4, VOCAB_SIZE, 3, 8, seed=6))
    streamed = m.add_request([5, 6], streaming=True)
    chunks = list(m.request_id_iter(streamed))
    assert chunks[-1].status == RequestStatus.FAILED and "injected step failure" in chunks[-1].error
    outs = [m.get_result(rid, timeout=10) for rid in ids]
    assert all(o.status == RequestStatus.FAILED and "injected step failure" in o.error for o in outs)
    with pytest.raises(RuntimeError, match="injected step failure"):
        m.add_request([5, 6])


def test_stress_four_threads_add_cancel_read_with_pauses(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=6, do_sample=False), num_blocks=256)
    m.start()
    prompts = random_prompts(400, VOCAB_SIZE, 2, 12, seed=7)
    results: dict[str, RequestStatus] = {}
    lock = threading.Lock()
    stop_pauses = threading.Event()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            rng = random.Random(k)
            mine = prompts[k * 100 : (k + 1) * 100]
            ids = []
            for p in mine:
                ids.append(m.add_request(p, max_new_tokens=rng.randint(1, 6)))
                if rng.random() < 0.2:
                    m.cancel_request(rng.choice(ids))
            for rid in ids:
                out = m.get_result(rid, timeout=60)
                assert out is not None
                with lock:
                    assert rid not in results
                    results[rid] = out.status
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def pauser() -> None:
        while not stop_pauses.is_set():
            with m.pause():
                time.sleep(0.001)
            time.sleep(0.005)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    p = threading.Thread(target=pauser)
    p.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    stop_pauses.set()
    p.join(10)
    m.destroy()
    assert not errors, errors
    assert len(results) == 400
    assert set(results.values()) <= {RequestStatus.FINISHED, RequestStatus.CANCELLED}
    assert RequestStatus.CANCELLED in results.values()


def test_add_requests_with_one_seed_per_input_is_reproducible(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.0, eos_token_id=None))
    m.start()
    prompt = [5, 6, 7, 8]
    first = [m.get_result(r, timeout=30).generated_tokens for r in m.add_requests([prompt] * 4, seed=[1, 2, 3, 4])]
    again = [m.get_result(r, timeout=30).generated_tokens for r in m.add_requests([prompt] * 4, seed=[1, 2, 3, 4])]
    assert first == again and len({tuple(t) for t in first}) > 1
    with pytest.raises(ValueError, match="2 seeds for 4 inputs"):
        m.add_requests([prompt] * 4, seed=[1, 2])


# ---------------------------------------------------------------- regressions found by a new user
def test_update_weights_with_a_full_state_dict_of_a_tied_model(make_manager: ManagerFactory) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    m = make_manager(model)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    assert "lm_head.weight" in new
    assert m.update_weights(new) == 1
    assert torch.equal(model.lm_head.weight, new["lm_head.weight"])
    m.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        m.update_weights({"lm_head.weight": torch.zeros_like(model.lm_head.weight)})
    assert torch.equal(model.lm_head.weight, new["lm_head.weight"])  # nothing copied


def test_generate_batch_on_persistent_manager_keeps_input_order_keys() -> None:
    model = tiny_llama()
    cfg = ContinuousBatchingConfig(block_size=4, num_blocks=64)
    prompts = [[200, 5], [10, 6], [100]]  # sorted order differs from input order
    with continuous_batching_context_manager(model, GREEDY, cfg, persistent_manager=True) as manager:
        pass
    out = generate_batch(model, prompts, GREEDY)
    assert list(out) == ["req_0", "req_1", "req_2"]
    assert [o.prompt_ids for o in out.values()] == prompts
    assert [o.request_id for o in out.values()] == list(out)
    assert not manager.is_running()  # left as it was found
    grouped = generate_batch(model, prompts, GenerationConfig(max_new_tokens=3, do_sample=True, num_return_sequences=2))
    assert list(grouped) == [f"req_{i}_{g}" for i in range(3) for g in range(2)]
    manager.destroy()


def test_start_after_non_blocking_stop_restarts(make_manager: ManagerFactory) -> None:
    m = make_manager()
    m.start()
    m.stop(block=False)
    m.start()
    rid = m.add_request([51])
    assert rid is not None and m.get_result(rid, timeout=30).status == RequestStatus.FINISHED


def test_add_requests_queues_nothing_when_one_input_is_bad(make_manager: ManagerFactory) -> None:
    m = make_manager(max_queue_size=3)
    with pytest.raises(ValueError, match="seed"):
        m.add_requests([[5], [6], [7]], seed=[1, "x", 3], do_sample=True)
    m.add_request([9])
    with pytest.raises(QueueFullError, match="nothing was queued"):
        m.add_requests([[7], [8], [10]])
    assert m._inbox.num_waiting() == 1
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        m.add_request([5], temperature=float("nan"))
    with pytest.raises(ValueError, match="request_id must be a str"):
        m.add_request([5], request_id=7)


# ---------------------------------------------------------------- issue 10: silent wrong answers and hangs
def _change_weights_in_place(model: torch.nn.Module) -> None:
    """What a trainer's optimizer step does to the shared model: parameters written in place, no update_weights."""
    with torch.no_grad():
        for name, value in _perturbed(model).items():
            model.get_parameter(name).copy_(value)


def test_weights_changed_without_update_weights_never_serve_old_blocks() -> None:
    # Case 2: a persistent manager, then an optimizer step on the model without update_weights,
    # then the same prompt again: the prefix cache used to serve the blocks of the old weights.
    model = tiny_llama()
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=64)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    prompt = list(range(10, 30))  # 5 full blocks
    with continuous_batching_context_manager(model, gc, cfg, persistent_manager=True) as manager:
        assert manager.get_result(manager.add_request(prompt), timeout=30).status == RequestStatus.FINISHED
    _change_weights_in_place(model)  # the manager is stopped, its cache kept
    out = generate_batch(model, [prompt], gc)["req_0"]
    assert out.num_cached_prompt_tokens == 0
    assert out.generated_tokens == reference_greedy(model, prompt, 6, None)
    assert out.weight_versions == [1] * 6 and manager.weight_version == 1
    again = generate_batch(model, [prompt], gc)["req_0"]  # unchanged since: the new blocks are reused
    assert again.num_cached_prompt_tokens == 16 and again.generated_tokens == out.generated_tokens

    # A running manager: weights changed under a pause (the loop checks when the pause ends) and while
    # it idles (add_request checks); update_weights(None) after a change is one version, not two.
    manager.start()
    for change in ("under_pause", "while_idle", "recorded"):
        with manager.pause():
            if change != "while_idle":
                _change_weights_in_place(model)
            if change == "recorded":
                manager.update_weights(None)
        if change == "while_idle":
            _change_weights_in_place(model)
        out = manager.get_result(manager.add_request(prompt, max_new_tokens=6), timeout=30)
        assert out.num_cached_prompt_tokens == 0, change
        assert out.generated_tokens == reference_greedy(model, prompt, 6, None), change
    assert manager.weight_version == 4
    manager.destroy()


def test_one_int_seed_for_many_prompts_gives_distinct_reproducible_samples(make_manager: ManagerFactory) -> None:
    # Case 3: add_requests([p] * 8, seed=1234) gave 8 identical completions.
    m = make_manager(gc=GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.0, eos_token_id=None))
    m.start()
    prompt = [5, 6, 7, 8]

    def sample(**kw) -> list[list[int]]:  # noqa: ANN003
        return [m.get_result(r, timeout=30).generated_tokens for r in m.add_requests([prompt] * 8, **kw)]

    first = sample(seed=1234)
    assert len({tuple(t) for t in first}) == 8
    assert sample(seed=1234) == first  # reproducible
    assert sample(seed=[1234 + k for k in range(8)]) == first  # the rule: input k gets seed + k
    assert sample(sampling_params=rollout.SamplingParams(max_new_tokens=8, do_sample=True, seed=1234)) == first


def test_generate_batch_on_a_persistent_manager_seeds_like_a_fresh_engine() -> None:
    # Case 3, same rule everywhere: sample k of a generate_batch call gets seed + k, whether the call
    # runs on a fresh engine or on the model's persistent manager.
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, 3, 10, seed=4)
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, num_return_sequences=3)
    cfg = ContinuousBatchingConfig(page_size=4, num_blocks=64, seed=99)
    fresh = generate_batch(model, prompts, gc, cfg)
    with continuous_batching_context_manager(model, gc, cfg, persistent_manager=True) as manager:
        pass
    on_manager = generate_batch(model, prompts, gc)
    assert list(on_manager) == list(fresh)
    assert [o.generated_tokens for o in on_manager.values()] == [o.generated_tokens for o in fresh.values()]
    assert len({tuple(o.generated_tokens) for o in fresh.values()}) > 1
    manager.destroy()


def test_calls_that_wait_on_the_loop_raise_inside_the_callers_pause(make_manager: ManagerFactory) -> None:
    # Case 8: stop(block=True) inside pause() waited for ever (the loop waits for the pause, the pause
    # for the stop); transformers raises RuntimeError. Same for every call that waits on the loop.
    m = make_manager(max_queue_size=1)
    m.start()
    with m.pause():
        rid = m.add_request([5, 6, 7])  # queued under the pause: no step runs it until the pause ends
        for call in (
            lambda: m.stop(),
            lambda: m.stop(block=True, timeout=1),
            lambda: m.stop(hard_stop=True),
            lambda: m.destroy(),
            lambda: m.join(),
            lambda: m.get_result(rid),
            lambda: next(m.request_id_iter(rid)),
            lambda: list(m),
            lambda: m.add_request([9], block=True),  # the queue holds rid: no room can come
        ):
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="inside this thread's manager.pause"):
                call()
            assert time.monotonic() - t0 < 1.0  # raised, did not wait
        assert m.get_result(rid, timeout=0.05) is None  # a bounded wait is allowed
        with m.pause():  # re-entrant, still refused
            with pytest.raises(RuntimeError, match="pause"):
                m.stop()

        # Another thread is not inside the pause: its stop waits for the pause to end, as it should.
        stopper = threading.Thread(target=m.stop)
        stopper.start()
        stopper.join(0.3)
        assert stopper.is_alive() and m.is_running()
    stopper.join(30)
    assert not m.is_running()
    assert m.get_result(rid, timeout=5).status == RequestStatus.FINISHED  # the default stop finished it


def test_generate_batch_on_a_persistent_manager_inside_its_pause_raises() -> None:
    model = tiny_llama()
    with continuous_batching_context_manager(
        model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=64), persistent_manager=True
    ) as manager:
        with manager.pause(), pytest.raises(RuntimeError, match="pause"):
            generate_batch(model, [[5, 6]])
        assert manager.is_running()
    manager.destroy()


# ---------------------------------------------------------------- issue 10: persistence as transformers documents it
def test_stop_keep_for_next_session_leaves_the_manager_on_the_model(make_manager: ManagerFactory) -> None:
    model = tiny_llama()
    m = make_manager(model)
    m.start()
    first = m.get_result(m.add_request(list(range(10, 30))), timeout=30)
    m.stop(keep_for_next_session=True)
    assert persistent_manager_of(model) is m and init_continuous_batching(model) is m
    m.start()  # the kept engine and prefix cache serve the next session
    again = m.get_result(m.add_request(list(range(10, 30))), timeout=30)
    assert again.generated_tokens == first.generated_tokens and again.num_cached_prompt_tokens == 16
    m.destroy()
    assert persistent_manager_of(model) is None and init_continuous_batching(model) is not m


def test_destroy_on_a_running_manager_finishes_pending_requests(make_manager: ManagerFactory) -> None:
    m = make_manager(gc=GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None))
    steps = make_manager.steps(m)
    steps.hold()
    m.start()
    ids = m.add_requests(random_prompts(3, VOCAB_SIZE, 3, 6, seed=3))
    steps.release()
    m.destroy()  # the default stop: pending requests finish, as transformers' guide says
    assert not m.is_running() and m.state == "destroyed"
    outs = [m.get_result(rid, timeout=5) for rid in ids]
    assert [o.status for o in outs] == [RequestStatus.FINISHED] * 3
    assert all(len(o.generated_tokens) == 20 for o in outs)

    hard = make_manager(gc=GenerationConfig(max_new_tokens=200, do_sample=False, eos_token_id=None), num_blocks=512)
    hard.start()
    rid = hard.add_request([5, 6, 7])
    hard.stop(hard_stop=True)  # how to fail them instead
    hard.destroy()
    assert hard.get_result(rid, timeout=5).status == RequestStatus.FAILED

    never_started = make_manager()
    queued = never_started.add_request([5, 6])
    never_started.destroy()  # nothing will ever run it: it ends FAILED, no reader waits for ever
    out = never_started.get_result(queued, timeout=5)
    assert out.status == RequestStatus.FAILED and "destroyed" in out.error


def test_join_takes_transformers_arguments(make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture) -> None:
    m = make_manager()
    m.start()
    assert m.join(time.perf_counter(), 0.01) is False  # still running: (stop_trigger_time, timeout)
    m.stop(block=False)
    with caplog.at_level(logging.INFO, logger="rollout.manager.manager"):
        assert m.join(stop_trigger_time=time.perf_counter(), timeout=30) is True
    assert "ended" in caplog.text


# ---------------------------------------------------------------- async batching
class AsyncManagers:
    """``make_manager`` with ``use_async_batching=True``: the engine keeps a step in flight between steps."""

    def __init__(self, factory: ManagerFactory) -> None:
        self.factory = factory

    def __call__(self, model=None, gc=GREEDY, **cfg) -> ContinuousBatchingManager:  # noqa: ANN001
        return self.factory(model, gc, use_async_batching=True, **cfg)

    def steps(self, manager: ContinuousBatchingManager, delay: float = 0.0) -> StepControl:
        return self.factory.steps(manager, delay)


def test_async_manager_streams_snapshots_that_equal_generate(make_manager: ManagerFactory) -> None:
    m = AsyncManagers(make_manager)()
    m.start()
    prompts = random_prompts(5, VOCAB_SIZE, 3, 20, seed=60)
    ids = [m.add_request(p, streaming=True) for p in prompts]
    for rid, p in zip(ids, prompts):
        chunks = list(m.request_id_iter(rid))
        final = chunks[-1]
        assert final.status == RequestStatus.FINISHED
        assert final.generated_tokens == reference_greedy(m.model, p, 8, EOS_TOKEN_ID)
        assert [c.generated_tokens for c in chunks] == [final.generated_tokens[: i + 1] for i in range(len(chunks))]
    assert m.engine.async_batching and m.engine.stats.num_async_steps > 0


@pytest.mark.parametrize("recompute", [False, True])
def test_async_manager_pause_finds_no_step_in_flight_and_update_weights_labels_tokens(
    make_manager: ManagerFactory, recompute: bool
) -> None:
    model = tiny_llama()
    old = copy.deepcopy(model)
    make = AsyncManagers(make_manager)
    m = make(model, gc=GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))
    make.steps(m, delay=0.005)  # the update lands within a step of the third token
    m.start()
    prompt = [5, 6, 7, 8, 9]
    rid = m.add_request(prompt, streaming=True)
    it = m.request_id_iter(rid)
    next(it), next(it), next(it)
    with m.pause():
        assert not m.engine.in_flight  # the loop finished the step in flight before the pause began
    version = m.update_weights(_perturbed(model), recompute=recompute)
    assert version == 1
    out = m.get_result(rid, timeout=30)
    k = out.weight_versions.index(1)
    assert 3 <= k < 12 and out.weight_versions == [0] * k + [1] * (12 - k)
    # The tokens labelled with the old version were sampled under the old weights, every one of them.
    assert out.generated_tokens[:k] == reference_greedy(old, prompt, 12, None)[:k]
    if recompute:
        assert out.generated_tokens[k:] == reference_greedy(model, prompt + out.generated_tokens[:k], 12 - k, None)
    later = m.add_request(prompt)
    assert m.get_result(later, timeout=30).generated_tokens == reference_greedy(model, prompt, 12, None)


def test_async_manager_cancels_in_flight_and_survives_pauses_under_four_threads(make_manager: ManagerFactory) -> None:
    test_stress_four_threads_add_cancel_read_with_pauses(AsyncManagers(make_manager))  # type: ignore[arg-type]


def test_async_manager_step_that_raises_fails_every_request(make_manager: ManagerFactory) -> None:
    test_step_that_raises_fails_every_request_and_unblocks_readers(AsyncManagers(make_manager))  # type: ignore[arg-type]


@pytest.mark.parametrize("recompute", [False, True])
def test_a_request_added_after_a_weight_update_is_not_forked_from_an_old_weights_prefill(recompute: bool) -> None:
    # A 200-token prompt prefills in 64-token chunks. After its first chunk the weights change; a request
    # with the same prompt added now must be computed under the new weights, not forked from the prefill
    # in flight (whose first chunk's KV is the old weights'): the prefix cache keys blocks by weight
    # version, and forking must too (issue 22, item 1).
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, 200, 200, seed=31)[0]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=256, max_batch_tokens=64, return_logprobs=True)
    engine = Engine(model, config)
    try:
        params = SamplingParams(max_new_tokens=6)
        engine.add_request(prompt, params, request_id="old")
        engine.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_perturbed(model).get(name, p))
        engine.set_weight_version(engine.weight_version + 1)
        if recompute:
            engine.recompute_in_flight()
        engine.add_request(prompt, params, request_id="new")
        outputs = run_engine(engine)
    finally:
        engine.close()
    new = outputs["new"]
    assert new.generated_tokens == reference_greedy(model, prompt, 6, None)
    assert_close(new.logprobs, teacher_forced_logprobs(model, prompt, new.generated_tokens), atol=1e-4)
    if recompute:  # recomputed under the new weights: the old request is exact too, and the new one forks
        assert outputs["old"].generated_tokens == new.generated_tokens
        assert engine.stats.num_forks == 1
