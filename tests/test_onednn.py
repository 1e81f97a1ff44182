"""onednn: the engine's float32 CPU linear layers (eager and static-shape steps) through oneDNN (issue 11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout import Engine, SamplingParams, model_runner, static_step
from rollout.onednn import MKLDNN_AVAILABLE, OneDNNLinear, onednn_linear
from rollout.static_step import FORWARDS
from tests.test_static_step import TRACE_ONLY, _config
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import reference_greedy, run_engine

pytestmark = pytest.mark.skipif(not MKLDNN_AVAILABLE, reason="this torch build has no oneDNN")


def test_onednn_linear_equals_f_linear_within_float32_rounding() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 64), torch.randn(48, 64), torch.randn(48)
    out = onednn_linear(x, w, b)
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=1e-5)
    torch.testing.assert_close(onednn_linear(x, w, None), F.linear(x, w), rtol=0, atol=1e-5)
    # Views as inputs: a strided or expanded bias, a transposed weight, a strided input.
    strided_bias, expanded_bias = torch.randn(96)[::2], torch.randn(1).expand(48)
    for bias in (strided_bias, expanded_bias):
        torch.testing.assert_close(onednn_linear(x, w, bias), F.linear(x, w, bias), rtol=0, atol=1e-5)
    wt, xs = torch.randn(64, 48).t(), torch.randn(3, 5, 128)[..., ::2]
    torch.testing.assert_close(onednn_linear(xs, wt, b), F.linear(xs, wt, b), rtol=0, atol=1e-5)


def test_the_mode_maps_float32_cpu_linear_only() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.profiler.profile() as prof, torch.inference_mode(), OneDNNLinear():
        layer(x)  # float32: oneDNN
        layer.double()(x.double())  # float64: F.linear as without the mode
    names = [e.name for e in prof.events()]
    assert names.count("rollout::onednn_linear") == 1
    assert names.count("aten::linear") == 1


def test_under_cpu_autocast_linear_keeps_autocasts_dtype() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
        with OneDNNLinear():
            out = layer(x)
    assert expected.dtype == out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_a_weight_updated_in_place_after_compile_is_seen_by_the_next_step() -> None:
    # The traced step reads the live parameters (no freezing): an in-place update, as update_weights
    # makes (with its version bump, so that no prefix-cache block of the old weights is reused),
    # changes the next step's tokens exactly as it changes generate's.
    model = tiny_llama()
    engine = Engine(model, _config(num_blocks=64, varlen_compile_config=TRACE_ONLY, decode_compile_config=TRACE_ONLY))
    prompts = random_prompts(3, VOCAB_SIZE, min_len=4, max_len=12, seed=61)
    try:
        engine.warmup(progress_bar=False)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=6), request_id=f"a{i}")
        before = run_engine(engine)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-1.5)
        engine.bump_weight_version()
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=6), request_id=f"b{i}")
        after = run_engine(engine)
        assert engine.stats.num_padded_steps == engine.stats.num_steps
    finally:
        engine.close()
    for i, p in enumerate(prompts):
        new = reference_greedy(model, p, 6, None)
        assert after[f"b{i}"].generated_tokens == new
        assert before[f"a{i}"].generated_tokens != new


@pytest.mark.parametrize("setting", [None, "0", "False", "off"], ids=["unset", "0", "False", "off"])
def test_the_environment_switch_is_read_when_an_engine_is_built_for_both_paths(
    monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    # Set after `import rollout`, as a user would: the eager and the padded (compiled) steps both follow it.
    if setting is None:
        monkeypatch.delenv("ROLLOUT_ONEDNN_LINEAR", raising=False)
    else:
        monkeypatch.setenv("ROLLOUT_ONEDNN_LINEAR", setting)
    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    entered: list[int] = []

    class Counting(OneDNNLinear):
        def __enter__(self) -> OneDNNLinear:
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(model_runner, "OneDNNLinear", Counting)
    monkeypatch.setattr(static_step, "OneDNNLinear", Counting)
    prompts = random_prompts(2, VOCAB_SIZE, min_len=4, max_len=8, seed=62)
    for level in (0, 1):
        entered.clear()
        engine = Engine(tiny_llama(), _config(num_blocks=32, default_compile_level=level))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(p, SamplingParams(max_new_tokens=3), request_id=f"r{i}")
            run_engine(engine)
            assert (engine.stats.num_padded_steps > 0) == (level == 1)
        finally:
            engine.close()
        assert (len(entered) > 0) == (setting is None), level
