"""plan_weight_copy and copy_weights: everything is checked before anything is copied; tied weights keep both names.
WeightWatch: changes made without update_weights are noticed once, and bump the engine's weight version."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.weights.versions import WeightWatch, copy_weights, plan_weight_copy, watch_of
from tests.tiny_models import VOCAB_SIZE, tiny_llama


def tied_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_a_full_state_dict_of_a_tied_model_is_copied() -> None:
    model = tied_llama()
    new = {k: v + 0.5 for k, v in model.state_dict().items()}
    plan = plan_weight_copy(model, new)
    assert len(plan) == len(new)
    copy_weights(plan)
    assert torch.equal(model.lm_head.weight, new["lm_head.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_pairs_and_none_are_accepted() -> None:
    model = tiny_llama()
    w = model.lm_head.weight.detach() * 2
    copy_weights(plan_weight_copy(model, [("lm_head.weight", w)]))
    assert torch.equal(model.lm_head.weight, w)
    assert plan_weight_copy(model, None) == []


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda w: {"nope": w}, KeyError, "no parameter or buffer named 'nope'"),
        (lambda w: {"lm_head.weight": w[:, :3]}, ValueError, "shape"),
        (lambda w: {"lm_head.weight": w.double()}, ValueError, "dtype"),
        (lambda w: {"lm_head.weight": w.tolist()}, TypeError, "must be a torch.Tensor"),
    ],
)
def test_bad_tensors_are_refused(make, error: type[Exception], match: str) -> None:  # noqa: ANN001
    model = tiny_llama()
    with pytest.raises(error, match=match):
        plan_weight_copy(model, make(model.lm_head.weight.detach()))


class VersionCounter:
    """What a WeightWatch needs of an engine: ``weight_version`` and ``set_weight_version``."""

    def __init__(self) -> None:
        self.weight_version = 0

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version


def test_a_watch_notices_in_place_writes_and_replaced_tensors_once() -> None:
    model = tiny_llama()
    watch = WeightWatch(model)
    assert not watch.changed() and not watch.record()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert watch.changed() and watch.changed()  # looking records nothing
    assert watch.record() and not watch.changed() and not watch.record()
    model.lm_head.weight.data = model.lm_head.weight.detach().clone()
    assert watch.changed()


def test_a_watch_bumps_the_version_only_when_the_weights_changed(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama()
    watch, engine = WeightWatch(model), VersionCounter()
    assert not watch.bump_if_changed(engine) and engine.weight_version == 0
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    with caplog.at_level("INFO", logger="rollout.weights.versions"):
        assert watch.bump_if_changed(engine) and engine.weight_version == 1
    assert "changed without update_weights: weight version 1" in caplog.text
    assert not watch.bump_if_changed(engine) and engine.weight_version == 1
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert watch.bump_if_changed(None) and not watch.changed()  # no engine: only recorded


def test_a_fused_optimizer_step_is_noticed_though_it_bumps_no_version() -> None:
    model = tiny_llama()
    watch = WeightWatch(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    versions = [p._version for p in model.parameters()]
    torch.optim.AdamW(model.parameters(), lr=0.01, fused=True).step()
    assert [p._version for p in model.parameters()] == versions
    assert watch.changed() and watch.record() and not watch.changed()


def test_one_watch_per_model_object_held_weakly() -> None:
    model = tiny_llama()
    watch = watch_of(model)
    assert watch_of(model) is watch and watch.model is model
    twin = copy.deepcopy(model)  # other weights: a version of their own
    assert watch_of(twin) is not watch
    ref = weakref.ref(model)
    del model, twin
    gc.collect()
    assert ref() is None  # the registry does not keep the model alive
    with pytest.raises(RuntimeError, match="no longer exists"):
        watch.changed()


def test_a_data_write_bumps_the_model_version_once_whoever_checks() -> None:
    model = tiny_llama()
    watch = watch_of(model)
    a, b = VersionCounter(), VersionCounter()
    assert not watch.bump_if_changed(a)  # the first content record
    with torch.no_grad():
        model.lm_head.weight.data.mul_(2.0)  # bumps no version counter
    assert not watch.changed()  # the cheap fingerprint misses it
    assert not watch.bump_if_changed(b, contents=False)
    assert watch.bump_if_changed(a) and a.weight_version == watch.version == 1
    assert not watch.bump_if_changed(b) and b.weight_version == 1  # b adopts the model's version
