"""Every in-place weight change made under ``pause()`` is seen, however it was written (issue 36, item 1), and one
weight version per model object across managers (issue 37, item 2).

Each write idiom changes every weight of the model under ``manager.pause()`` without calling ``update_weights``;
the same prompt sent again must compute on the new weights only: greedy tokens equal ``model.generate``, logprobs
within 1e-4 of a teacher-forced forward, the new version recorded on every token, no prefix-cache block of the old
weights reused. With packed oneDNN weights and without (``ROLLOUT_PACK_WEIGHTS=0``). Before the content check,
``.data`` writes bumped no version counter: the old version was reported, old KV was served and the packed copies of
the old weights stayed in use.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, init_continuous_batching
from rollout.weights.versions import weights_contents
from tests.tiny_models import tiny_llama
from tests.utils import StepControl, assert_close, reference_greedy, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4
PROMPT = list(range(10, 30))  # 5 full blocks of 4
NEW_TOKENS = 8
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)


def _noise(p: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype)


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def _data_copy(model: torch.nn.Module) -> None:
    for i, p in enumerate(_params(model)):
        p.data.copy_(p.data + _noise(p, i))


def _data_assign(model: torch.nn.Module) -> None:
    for i, p in enumerate(_params(model)):
        p.data = p.data + _noise(p, i)


def _load_state_dict(model: torch.nn.Module) -> None:
    state = {n: t + _noise(t, i) for i, (n, t) in enumerate(model.state_dict().items()) if t.is_floating_point()}
    model.load_state_dict(state, strict=False)


def _vector_to_parameters(model: torch.nn.Module) -> None:
    params = _params(model)
    vec = torch.nn.utils.parameters_to_vector(params).detach()
    torch.nn.utils.vector_to_parameters(vec + _noise(vec, 0), params)


def _optimizer_step(**kwargs: bool) -> Callable[[torch.nn.Module], None]:
    def step(model: torch.nn.Module) -> None:
        ids = torch.tensor([PROMPT + [3, 4, 5]])
        model(ids, labels=ids).loss.backward()
        torch.optim.AdamW(model.parameters(), lr=0.05, **kwargs).step()
        model.zero_grad(set_to_none=True)

    return step


def _view_write(model: torch.nn.Module) -> None:
    for i, p in enumerate(_params(model)):
        flat = p.data.view(-1)  # a view of .data: it shares no version counter with the parameter
        flat[::2] += _noise(flat[::2], i)


def _numpy_write(model: torch.nn.Module) -> None:
    for i, p in enumerate(_params(model)):
        array = p.detach().numpy()  # the parameter's own storage, written by another library
        array += _noise(p, i).numpy()


WRITES: dict[str, Callable[[torch.nn.Module], None]] = {
    "data_copy": _data_copy,
    "data_assign": _data_assign,
    "load_state_dict": _load_state_dict,
    "vector_to_parameters": _vector_to_parameters,
    "foreach_optimizer": _optimizer_step(foreach=True),
    "fused_optimizer": _optimizer_step(fused=True),
    "view_write": _view_write,
    "numpy_write": _numpy_write,
}


@pytest.fixture
def managers():
    made: list[ContinuousBatchingManager] = []

    def make(model: torch.nn.Module, **cfg: object) -> ContinuousBatchingManager:
        config = ContinuousBatchingConfig(page_size=4, num_blocks=128, return_logprobs=True, **cfg)  # type: ignore[arg-type]
        m = init_continuous_batching(model, GREEDY, config)
        made.append(m)
        return m

    yield make
    for m in made:
        m.destroy()


def _assert_exact_on_current_weights(model: torch.nn.Module, out, version: int) -> None:  # noqa: ANN001
    assert out.generated_tokens == reference_greedy(model, PROMPT, NEW_TOKENS, None)
    expected = teacher_forced_logprobs(model, PROMPT, out.generated_tokens)
    assert_close(out.logprobs, expected, atol=LOGPROB_ATOL)
    assert out.weight_versions == [version] * NEW_TOKENS


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("write", list(WRITES))
def test_a_weight_change_under_pause_is_seen_however_it_was_written(
    managers, monkeypatch: pytest.MonkeyPatch, write: str, packed: bool
) -> None:
    monkeypatch.setenv("ROLLOUT_PACK_WEIGHTS", "1" if packed else "0")
    model = tiny_llama()
    m = managers(model)
    assert (m.engine.runner.packs is not None) == packed
    m.start()
    before = m.get_result(m.add_request(PROMPT), timeout=30)
    _assert_exact_on_current_weights(model, before, 0)
    with m.pause():
        WRITES[write](model)
    out = m.get_result(m.add_request(PROMPT), timeout=30)
    assert m.weight_version == 1
    assert out.num_cached_prompt_tokens == 0  # the old weights' blocks are not served
    _assert_exact_on_current_weights(model, out, 1)
    assert max(abs(a - b) for a, b in zip(out.logprobs, before.logprobs)) > 1e-2  # the change mattered
    again = m.get_result(m.add_request(PROMPT), timeout=30)
    assert again.num_cached_prompt_tokens == 16  # unchanged since: the new version's blocks are reused
    _assert_exact_on_current_weights(model, again, 1)


def test_a_pause_that_changes_nothing_keeps_the_version_and_the_cache(managers) -> None:
    model = tiny_llama()
    m = managers(model)
    m.start()
    m.get_result(m.add_request(PROMPT), timeout=30)
    with m.pause():
        for p in model.parameters():
            p.data.copy_(p.data.clone())  # written, same values
    with m.pause():
        pass
    out = m.get_result(m.add_request(PROMPT), timeout=30)
    assert m.weight_version == 0 and out.num_cached_prompt_tokens == 16
    _assert_exact_on_current_weights(model, out, 0)


def test_check_weight_contents_off_misses_data_writes_as_documented(managers) -> None:
    model = tiny_llama()
    m = managers(model, check_weight_contents=False)
    m.start()
    m.get_result(m.add_request(PROMPT), timeout=30)
    with m.pause():
        _data_copy(model)
    m.get_result(m.add_request(PROMPT), timeout=30)
    assert m.weight_version == 0  # only for callers who always call update_weights
    assert m.update_weights(None) == 1  # the documented way to record such a change
    out = m.get_result(m.add_request(PROMPT), timeout=30)
    assert out.num_cached_prompt_tokens == 0
    _assert_exact_on_current_weights(model, out, 1)


def _flip_sign(model: torch.nn.Module) -> None:
    model.lm_head.weight.view(-1)[7].neg_()  # one sign bit


def _swap_two(model: torch.nn.Module) -> None:
    flat = model.lm_head.weight.view(-1)
    flat[[3, 4]] = flat[[4, 3]].clone()


def _one_ulp(model: torch.nn.Module) -> None:
    flat = model.model.norm.weight.view(-1)
    flat[5] = torch.nextafter(flat[5], torch.tensor(9.0))


def _buffer(model: torch.nn.Module) -> None:
    model.model.rotary_emb.inv_freq.mul_(1.5)


@pytest.mark.parametrize("on_device", [False, True], ids=["xxh3", "torch"])
@pytest.mark.parametrize("change", [_flip_sign, _swap_two, _one_ulp, _buffer], ids=lambda f: f.__name__)
def test_the_content_checksum_sees_any_change(on_device: bool, change: Callable[[torch.nn.Module], None]) -> None:
    base = weights_contents(tiny_llama(), on_device)
    model = tiny_llama()  # same seed: same weights
    assert weights_contents(model, on_device) == base
    with torch.no_grad():
        change(model)
    assert weights_contents(model, on_device) != base


# ---------------------------------------------------------------- one weight version per model object
def test_update_weights_through_one_manager_reaches_another_on_the_same_model(
    managers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 37.2: B stayed at version 0 to the end: its queued request reused 32 old-weight tokens and the
    # long request's tokens computed under the new weights were labelled 0.
    model = tiny_llama()
    old_model = copy.deepcopy(model)
    torch.manual_seed(7)
    new_state = {n: t + 0.05 * torch.randn_like(t) for n, t in model.state_dict().items() if t.is_floating_point()}
    a = managers(model)
    b = managers(model, max_requests_per_batch=1)  # the second request waits behind the long one
    b.start()
    assert b.get_result(b.add_request(PROMPT), timeout=30).weight_versions == [0] * NEW_TOKENS  # cached in B
    StepControl(monkeypatch, b, delay=0.01)  # the update lands while the long request decodes
    long_prompt, long_tokens = [7, 8, 9, 10, 11, 12], 60
    long_id = b.add_request(long_prompt, max_new_tokens=long_tokens, streaming=True)
    queued_id = b.add_request(PROMPT)
    stream = b.request_id_iter(long_id)
    while len(next(stream).generated_tokens) < 6:
        pass
    assert a.update_weights(new_state) == 1  # A never ran a step: its update is the model's
    long_out = b.get_result(long_id, timeout=60)
    queued = b.get_result(queued_id, timeout=60)
    assert a.weight_version == b.weight_version == 1
    # The long request: the tokens sampled before the update under version 0 (the old weights' greedy tokens),
    # every later one under version 1.
    k = long_out.weight_versions.index(1)
    assert 6 <= k < long_tokens and long_out.weight_versions == [0] * k + [1] * (long_tokens - k)
    assert long_out.generated_tokens[:k] == reference_greedy(old_model, long_prompt, k, None)
    # The queued request, admitted after the update, reuses no KV of the old weights.
    assert queued.num_cached_prompt_tokens == 0
    _assert_exact_on_current_weights(model, queued, 1)


def test_a_pause_through_one_manager_holds_every_manager_on_the_model(
    managers, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama()
    a, b = managers(model), managers(model)
    b.start()
    steps = StepControl(monkeypatch, b, delay=0.01)
    rid = b.add_request(PROMPT, max_new_tokens=40)
    assert steps.wait_started(3)
    with a.pause():
        started = steps.started
        assert steps.finished == started  # B's step in progress ended before the pause began
        _data_copy(model)
        time.sleep(0.2)  # B runs no step meanwhile: none of its tokens mixes the two weights
        assert steps.started == started
    out = b.get_result(rid, timeout=60)
    k = out.weight_versions.index(1)
    assert k >= 3 and out.weight_versions == [0] * k + [1] * (40 - k)
