"""onednn: the engine's float32 CPU linear layers (eager and static-shape steps): oneDNN on weights packed once per
engine (issue 23), else MKL; ``ROLLOUT_ONEDNN_LINEAR`` and ``ROLLOUT_PACK_WEIGHTS`` choose (issues 11, 22 and 31)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout import SamplingParams
from rollout.engine import Engine
from rollout.engine.worker import forward as static_step
from rollout.engine.worker import onednn
from rollout.engine.worker import runner as model_runner
from rollout.engine.worker.forward import FORWARDS
from rollout.engine.worker.onednn import (
    MKLDNN_AVAILABLE,
    OneDNNLinear,
    linear_kernel_policy,
    linear_plan,
    onednn_linear,
)
from tests.test_static_step import TRACE_ONLY, _config
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama, tiny_qwen2
from tests.utils import reference_greedy, run_engine

pytestmark = pytest.mark.skipif(not MKLDNN_AVAILABLE, reason="this torch build has no oneDNN")


def _kernel(name: str) -> str:
    """``name``, skipping the test where it is rollout's GEMM and the CPU extension does not load here."""
    if name == onednn.ROLLOUT:
        from rollout.engine.attention.cpu import load_kernel

        reason = load_kernel()
        if reason is not None:
            pytest.skip(f"rollout's CPU extension: {reason}")
    return name


# The packed weights' two kernels, and the op each runs a packed layer with.
KERNELS = pytest.mark.parametrize("kernel", [onednn.ONEDNN, onednn.ROLLOUT])
PACKED_OPS = {onednn.ONEDNN: "mkldnn::_linear_pointwise", onednn.ROLLOUT: "rollout_cpu::packed_linear"}


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


def test_the_forced_mode_maps_float32_cpu_linear_only() -> None:
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
        engine.set_weight_version(engine.weight_version + 1)
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


@pytest.mark.parametrize(
    "setting", [None, "auto", "1", "0", "False", "off"], ids=["unset", "auto", "1", "0", "False", "off"]
)
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

    monkeypatch.setattr(static_step, "OneDNNLinear", Counting)  # the one forward of eager and compiled steps
    packed_linear = onednn.PackedWeights.linear

    def counted_linear(self: onednn.PackedWeights, *args: torch.Tensor) -> torch.Tensor:
        entered.append(1)  # the fused forward runs the packed weights without the mode
        return packed_linear(self, *args)

    monkeypatch.setattr(onednn.PackedWeights, "linear", counted_linear)
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
        assert (len(entered) > 0) == (setting in (None, "auto", "1")), level


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_an_unknown_switch_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("ROLLOUT_ONEDNN_LINEAR", value)
    with pytest.raises(ValueError, match=f"ROLLOUT_ONEDNN_LINEAR must be one of auto.*got '{value}'"):
        linear_kernel_policy()


@KERNELS
def test_the_mode_runs_packed_copies_in_eager_code_and_the_custom_op_when_traced(kernel: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 32))
    packs = onednn.PackedWeights(kernel=_kernel(kernel))
    op = PACKED_OPS[kernel]
    x = torch.randn(4, 16)
    with torch.inference_mode():
        expected = model(x)
        with torch.profiler.profile() as prof, OneDNNLinear(), packs.active():
            out = model(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        names = [e.name for e in prof.events()]
        assert names.count(op) == 3 and "aten::linear" not in names
        assert "rollout::onednn_linear" not in names  # eager calls the packed copies directly
        assert len(packs) == 3
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with OneDNNLinear(), packs.active():
            compiled(x)  # traced here, so that the profile below holds the run only
        with torch.profiler.profile() as prof, OneDNNLinear(), packs.active():
            out = compiled(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        names = [e.name for e in prof.events()]
        assert names.count("rollout::onednn_linear") == 3 and names.count(op) == 3
    assert len(packs) == 3  # the traced run found the eager run's copies


@pytest.mark.parametrize(
    ("linear", "pack", "plan"),
    [
        (None, None, (True, True)),
        ("auto", "0", (False, False)),
        ("1", "0", (True, False)),
        ("1", None, (True, True)),
        ("0", None, (False, False)),
    ],
    ids=["default", "auto-unpacked-mkl", "forced-unpacked", "forced-packed", "mkl"],
)
def test_linear_plan_packs_for_onednn_or_keeps_mkl(monkeypatch, linear: str | None, pack: str | None, plan) -> None:
    for var, value in (("ROLLOUT_ONEDNN_LINEAR", linear), (onednn.PACK_ENV_VAR, pack)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    model = tiny_llama()
    assert linear_plan(model, torch.device("cpu")) == plan
    assert linear_plan(model, torch.device("cuda")) == (False, False)  # CUDA keeps cuBLAS (nothing is allocated)


@pytest.mark.parametrize("forced", [False, True], ids=["auto-mkl", "forced-onednn"])
def test_without_packing_auto_runs_mkl_and_forced_onednn_the_plain_weights(monkeypatch, forced: bool) -> None:
    monkeypatch.setenv(onednn.PACK_ENV_VAR, "0")
    monkeypatch.setenv("ROLLOUT_ONEDNN_LINEAR", "1" if forced else "auto")
    model = tiny_llama()
    engine = Engine(model, _config(num_blocks=64))
    prompts = random_prompts(3, VOCAB_SIZE, min_len=4, max_len=12, seed=63)
    try:
        assert engine.runner.packs is None
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=5), request_id=f"p{i}")
        with torch.profiler.profile() as prof:
            out = run_engine(engine)
    finally:
        engine.close()
    names = [e.name for e in prof.events()]
    assert ("rollout::onednn_linear" in names) == forced and ("mkldnn::_linear_pointwise" in names) == forced
    assert [out[f"p{i}"].generated_tokens for i in range(3)] == [reference_greedy(model, p, 5, None) for p in prompts]


@KERNELS
def test_packed_weights_equal_f_linear_and_follow_in_place_updates(kernel: str) -> None:
    torch.manual_seed(0)
    packs = onednn.PackedWeights(kernel=_kernel(kernel))
    x, w, b = torch.randn(3, 5, 64), torch.randn(48, 64), torch.randn(48)
    torch.testing.assert_close(packs.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=1e-5)
    torch.testing.assert_close(packs.linear(x[0], w, None), F.linear(x[0], w), rtol=0, atol=1e-5)
    first = packs.packed(w)
    assert len(packs) == 1 and packs.packed(w) is first  # made once, reused
    # A transposed weight and a strided input, as onednn_linear takes them.
    wt, xs = torch.randn(64, 48).t(), torch.randn(3, 5, 128)[..., ::2]
    torch.testing.assert_close(packs.linear(xs, wt, b), F.linear(xs, wt, b), rtol=0, atol=1e-5)
    assert len(packs) == 2
    with torch.no_grad():
        w.mul_(-2.0)  # an in-place update bumps the version counter: the copy is remade
    torch.testing.assert_close(packs.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=1e-5)
    assert packs.packed(w) is not first and len(packs) == 2
    packs.clear()
    assert len(packs) == 0


@KERNELS
def test_an_inference_tensor_weight_is_not_packed(kernel: str) -> None:
    # An inference tensor has no version counter, so a change to it could not be seen: it runs unpacked.
    with torch.inference_mode():
        w = torch.randn(8, 16)
    x = torch.randn(2, 16)
    packs = onednn.PackedWeights(kernel=_kernel(kernel))
    assert packs.packed(w) is None
    torch.testing.assert_close(packs.linear(x, w, None), F.linear(x, w), rtol=0, atol=1e-5)
    assert len(packs) == 0


def test_packing_fits_counts_the_float32_matrices() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4).double())
    matrices = 16 * 8 * 4  # the float64 layer and the biases are not counted
    assert onednn.packing_fits(model, 2 * matrices)
    assert not onednn.packing_fits(model, 2 * matrices - 1)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-biases"])
def test_the_engine_packs_each_linear_weight_once_and_drops_them_on_a_new_weight_version(
    monkeypatch, make_model
) -> None:
    monkeypatch.delenv("ROLLOUT_ONEDNN_LINEAR", raising=False)
    monkeypatch.delenv(onednn.PACK_ENV_VAR, raising=False)
    model = make_model()
    engine = Engine(model, _config(num_blocks=64))
    prompts = random_prompts(3, VOCAB_SIZE, min_len=4, max_len=12, seed=62)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_new_tokens=5), request_id=f"p{i}")
    out = run_engine(engine)
    # Per layer q/k/v stacked, o, gate/up stacked and down; then the lm_head.
    assert len(engine.runner.packs) == 4 * model.config.num_hidden_layers + 1
    assert engine.runner.packs.kernel == onednn.packed_kernel()
    assert [out[f"p{i}"].generated_tokens for i in range(3)] == [reference_greedy(model, p, 5, None) for p in prompts]
    engine.set_weight_version(engine.weight_version + 1)
    assert len(engine.runner.packs) == 0


@pytest.mark.parametrize("value", ["0", "off"])
def test_rollout_pack_weights_off_leaves_the_weights_unpacked(monkeypatch, value: str) -> None:
    monkeypatch.delenv("ROLLOUT_ONEDNN_LINEAR", raising=False)
    monkeypatch.setenv(onednn.PACK_ENV_VAR, value)
    assert Engine(tiny_llama(), _config(num_blocks=64)).runner.packs is None


def test_a_bad_rollout_pack_weights_value_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(onednn.PACK_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="ROLLOUT_PACK_WEIGHTS must be one of auto, 1, true, on, yes or 0"):
        onednn.packing_wanted()


@KERNELS
def test_sibling_projections_run_as_one_gemm_with_each_part_equal_to_its_own_linear(kernel: str) -> None:
    # tiny_qwen2's q/k/v projections have biases; its MLP's gate/up have none.
    model = tiny_qwen2()
    groups = onednn.sibling_groups(model)
    layers = model.config.num_hidden_layers
    assert len(groups) == 2 * layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert groups[0] == (attn.q_proj, attn.k_proj, attn.v_proj) and groups[1] == (mlp.gate_proj, mlp.up_proj)
    packs = onednn.PackedWeights(groups, kernel=_kernel(kernel))
    x, other = torch.randn(1, 5, attn.q_proj.in_features), torch.randn(1, 5, attn.q_proj.in_features)
    with torch.no_grad(), packs.active():
        outs = [packs.linear(x, m.weight, m.bias) for m in groups[0]]
        assert len(packs) == 1  # one stacked copy, no copy of a member alone
        # Out of order (k first) or on another input: the member's own copy.
        k_first = packs.linear(other, attn.k_proj.weight, attn.k_proj.bias)
        assert len(packs) == 2
        one_row = x[:, :1]  # a one-row part is contiguous as a view: each part still has memory of its own
        single = [packs.linear(one_row, m.weight, m.bias) for m in groups[0]]
        assert len({t.untyped_storage().data_ptr() for t in single}) == 3 and len(packs) == 2
        for m, out in zip(groups[0], outs):
            assert out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=0, atol=1e-5)
        torch.testing.assert_close(k_first, F.linear(other, attn.k_proj.weight, attn.k_proj.bias), rtol=0, atol=1e-5)
        # An update of one member remakes the stacked copy.
        attn.v_proj.bias.add_(1.0)
        outs = [packs.linear(x, m.weight, m.bias) for m in groups[0]]
        torch.testing.assert_close(outs[2], F.linear(x, attn.v_proj.weight, attn.v_proj.bias), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_an_optimizer_step_on_the_shared_model_reaches_the_next_forward(monkeypatch, fused: bool) -> None:
    # A fused AdamW (transformers' default adamw_torch_fused) writes the parameters without bumping their version
    # counters: the packed copies are dropped on any optimizer step (found by a break-test of the packing).
    monkeypatch.delenv("ROLLOUT_ONEDNN_LINEAR", raising=False)
    monkeypatch.delenv(onednn.PACK_ENV_VAR, raising=False)
    model = tiny_llama()
    engine = Engine(model, _config(num_blocks=64, allow_block_sharing=False))
    first, second = (random_prompts(3, VOCAB_SIZE, min_len=4, max_len=12, seed=s) for s in (64, 65))
    for i, p in enumerate(first):
        engine.add_request(p, SamplingParams(max_new_tokens=6), request_id=f"a{i}")
    run_engine(engine)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused, foreach=None if fused else True)
    ids = torch.tensor([first[0] + first[1]])
    model(ids, labels=ids).loss.backward()
    versions = [p._version for p in model.parameters()]
    optimizer.step()
    assert ([p._version for p in model.parameters()] == versions) == fused  # fused: no version moved
    for i, p in enumerate(second):
        engine.add_request(p, SamplingParams(max_new_tokens=6), request_id=f"b{i}")
    out = run_engine(engine)
    assert [out[f"b{i}"].generated_tokens for i in range(3)] == [reference_greedy(model, p, 6, None) for p in second]


def test_packed_weights_run_rollout_s_gemm_on_avx512_under_auto_else_onednn(monkeypatch) -> None:
    monkeypatch.delenv("ROLLOUT_ONEDNN_LINEAR", raising=False)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert onednn.packed_kernel() == _kernel(onednn.ROLLOUT)
    assert onednn.packed_kernel(extension=False) == onednn.ONEDNN  # cpu_attention="sdpa": no extension built
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert onednn.packed_kernel() == onednn.ONEDNN  # its loops would be scalar without 16-lane registers
    monkeypatch.undo()
    monkeypatch.setenv("ROLLOUT_ONEDNN_LINEAR", "1")
    assert onednn.packed_kernel() == onednn.ONEDNN  # forced oneDNN
    with pytest.raises(ValueError, match="kernel must be 'onednn' or 'rollout'; got 'mkl'"):
        onednn.PackedWeights(kernel="mkl")


def test_rollout_s_gemm_writes_each_sibling_into_its_own_tensor_with_its_bias() -> None:
    # Members whose widths are not whole panels (32 columns): each padded apart, so no panel mixes two outputs.
    _kernel(onednn.ROLLOUT)
    torch.manual_seed(0)
    sizes = (40, 7, 33)
    members = [torch.nn.Linear(24, n) for n in sizes]
    packs = onednn.PackedWeights([members], kernel=onednn.ROLLOUT)
    for rows in (1, 9, 300):  # a tile of one row, edge tiles, more than one task of 128 rows
        x = torch.randn(rows, 24)
        with torch.no_grad(), packs.active():
            outs = [packs.linear(x, m.weight, m.bias) for m in members]
            for m, out in zip(members, outs):
                assert out.shape == (rows, m.out_features) and out.is_contiguous()
                torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=0, atol=1e-5)
    assert len({out.untyped_storage().data_ptr() for out in outs}) == 3 and len(packs) == 1
