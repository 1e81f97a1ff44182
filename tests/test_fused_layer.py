"""The Llama family's fused decoder layers on CPU (``rollout.engine.worker.fused_layer``, issue 45 item 2).

With ``fused_layers="auto"`` an engine on a Llama, Mistral (sliding window), Qwen2 or Qwen3 model runs its eager
steps through ``fused_forward``: greedy tokens must equal ``model.generate``'s and logprobs a teacher-forced forward
of the unmodified model (1e-4), through prefill, chunked prefill and decode, with an adapter too (its products added
by ``lora_add_group_``, 4 calls a layer, no ``LoraHook`` call, bitwise as the hooks added them; a user's hooks on a
projection still run around it); models outside the family (Gemma) keep transformers' forward and say why once in the
log; the kernels match torch's ops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch

from rollout import ContinuousBatchingConfig, FieldError, SamplingParams
from rollout.engine import Engine
from rollout.engine.attention.cpu import load_kernel
from rollout.engine.worker import fused_layer
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3
from tests.utils import assert_close, generate_in_order, reference_greedy, run_engine, teacher_forced_logprobs

pytestmark = pytest.mark.skipif(load_kernel() is not None, reason="rollout's CPU extension does not build here")

LOGPROB_ATOL = 1e-4


def config(**kwargs: object) -> ContinuousBatchingConfig:
    values = dict(page_size=4, num_blocks=256, max_batch_tokens=24, return_logprobs=True, fused_layers="auto")
    values.update(kwargs)
    return ContinuousBatchingConfig(**values)


def tiny_qwen2_sliding() -> torch.nn.Module:
    """tiny_qwen2's shapes with its second layer on a sliding window of 8 (Qwen2's attention keeps it per layer)."""
    config = tiny_qwen2().config
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 1
    config.layer_types = ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = type(tiny_qwen2())(config).eval()
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 8]
    return model


@pytest.mark.parametrize(
    "make", [tiny_llama, tiny_qwen2, tiny_qwen2_sliding, tiny_qwen3, tiny_mistral], ids=lambda f: f.__name__
)
def test_fused_engine_matches_transformers(make: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests (prompts up to 40 tokens: chunked prefill at 24 tokens a step), 10 greedy tokens each: tokens
    equal ``generate``'s, logprobs the teacher-forced forward's; every step ran ``fused_forward`` and its own
    attention block (rotary embedding and cache write fused), never transformers' attention module."""
    model = make()  # type: ignore[operator]
    calls = []
    real = fused_layer.fused_forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    def module_attention(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' attention module ran inside the fused forward")

    monkeypatch.setattr("rollout.engine.worker.forward.fused_forward", counted)
    monkeypatch.setattr("rollout.engine.attention.registry.paged_attention", module_attention)
    prompts = random_prompts(6, VOCAB_SIZE, max_len=40, seed=7)
    engine = Engine(model, config())
    assert engine.runner.fused_layers
    out = generate_in_order(engine, prompts, 10)
    assert len(calls) == engine.stats.num_steps > 0
    for i, p in enumerate(prompts):
        tokens = out[i].generated_tokens
        assert tokens == reference_greedy(model, p, 10, None), i
        assert_close(out[i].logprobs, teacher_forced_logprobs(model, p, tokens), atol=LOGPROB_ATOL)


def test_a_model_outside_the_family_keeps_transformers_forward_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_gemma()
    with caplog.at_level(logging.INFO, logger="rollout.engine.build"):
        engine = Engine(model, config())
    try:
        assert not engine.runner.fused_layers
        assert any("fused decoder layers off" in r.getMessage() and "gemma" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()


def test_on_by_default_off_on_request_and_a_bad_value_is_refused_naming_the_field() -> None:
    for fused, expected in ((None, True), ("off", False)):
        extra = {} if fused is None else {"fused_layers": fused}
        engine = Engine(tiny_llama(), ContinuousBatchingConfig(page_size=4, num_blocks=64, **extra))
        try:
            assert engine.runner.fused_layers == expected
        finally:
            engine.close()
    with pytest.raises(FieldError, match="fused_layers"):
        ContinuousBatchingConfig(fused_layers="on")  # type: ignore[arg-type]


def test_kernels_match_torch() -> None:
    """rms_norm, fused_add_rms_norm_ (residual updated in place, the input overwritten by the norm) and
    silu_and_mul against torch's ops (1e-6), on rows with a stride, for few rows (inline) and many (threaded)."""
    g = torch.Generator().manual_seed(0)
    for rows in (3, 900):
        x = torch.randn(rows, 100, generator=g)[:, :64]
        w, residual = torch.randn(64, generator=g), torch.randn(rows, 64, generator=g)

        def norm(t: torch.Tensor, w: torch.Tensor = w) -> torch.Tensor:
            return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

        torch.testing.assert_close(torch.ops.rollout_cpu.rms_norm(x, w, 1e-6), norm(x), rtol=1e-6, atol=1e-6)
        x2, r2 = x.clone(), residual.clone()
        torch.ops.rollout_cpu.fused_add_rms_norm_(x2, r2, w, 1e-6)
        torch.testing.assert_close(r2, residual + x, rtol=0, atol=0)
        torch.testing.assert_close(x2, norm(residual + x), rtol=1e-6, atol=1e-6)
        gate, up = torch.randn(rows, 50, generator=g), torch.randn(rows, 50, generator=g)
        expected = torch.nn.functional.silu(gate) * up
        torch.testing.assert_close(torch.ops.rollout_cpu.silu_and_mul(gate, up), expected, rtol=1e-6, atol=1e-6)


def _hook_on(model: torch.nn.Module, where: str) -> None:
    """Change what ``model`` computes through a hook or an instance ``forward`` on a module the fused forward would
    not call itself."""
    layers = model.model.layers
    if where == "mlp_hook":
        layers[0].mlp.register_forward_hook(lambda m, args, out: out + 0.5)
    elif where == "final_norm_hook":
        model.model.norm.register_forward_hook(lambda m, args, out: out + 0.5)
    elif where == "layer_pre_hook":
        layers[1].register_forward_pre_hook(lambda m, args: (args[0] + 0.5, *args[1:]))
    elif where == "model_hook":  # the whole model's output: its logits
        model.register_forward_hook(lambda m, args, out: out.__class__(logits=-out.logits))
    else:  # an instance forward of its own (as accelerate's device hooks set)
        mlp_forward = layers[0].mlp.forward
        layers[0].mlp.forward = lambda x: 2 * mlp_forward(x)


@pytest.mark.parametrize("where", ["mlp_hook", "final_norm_hook", "layer_pre_hook", "model_hook", "mlp_forward"])
def test_a_hook_on_a_module_the_fused_forward_skips_sends_the_step_to_transformers_forward(where: str) -> None:
    """A hook (or an instance forward) on a module that the fused forward does not call is honoured: the engine's
    greedy tokens and logprobs are those of ``generate`` and a forward with the hook (found by a break test: the
    fused forward skipped them)."""
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, max_len=20, seed=11)
    before = [reference_greedy(model, p, 8, None) for p in prompts]
    _hook_on(model, where)
    assert fused_layer.hooks_in_the_way(model)
    engine = Engine(model, config())
    assert engine.runner.fused_layers
    out = generate_in_order(engine, prompts, 8)
    after = [reference_greedy(model, p, 8, None) for p in prompts]
    assert after != before  # the hook changes what the model computes
    for i, p in enumerate(prompts):
        assert out[i].generated_tokens == after[i], i
        assert_close(out[i].logprobs, teacher_forced_logprobs(model, p, after[i]), atol=LOGPROB_ATOL)
    assert not fused_layer.hooks_in_the_way(tiny_llama())


def test_rotary_cache_write_matches_transformers_rotary_and_the_cache_write() -> None:
    """rotary_cache_write_: q and k rotated in place as transformers' apply_rotary_pos_emb does (1e-6), the rotated
    keys and the values at their slots of a cache layer whose rows are padded (a strided view), every other row
    untouched; few rows (inline) and many (threaded)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 4, 2, 16
    for T in (3, 700):
        q, k, v = (torch.randn(T, h * D, generator=g) for h in (H, Hkv, Hkv))
        angles = torch.rand(T, D // 2, generator=g) * 6
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        rows = 2 * T + 5
        k_store, v_store = torch.zeros(rows, Hkv * D + 8), torch.zeros(rows, Hkv * D + 8)
        k_cache, v_cache = (t[:, : Hkv * D].view(rows, Hkv, D) for t in (k_store, v_store))
        slots = torch.randperm(rows, generator=g)[:T]
        q_ref, k_ref = apply_rotary_pos_emb(
            q.view(1, T, H, D).transpose(1, 2), k.view(1, T, Hkv, D).transpose(1, 2), cos[None], sin[None]
        )
        q2, k2 = q.clone(), k.clone()
        torch.ops.rollout_cpu.rotary_cache_write_(q2, k2, v, cos, sin, k_cache, v_cache, slots)
        torch.testing.assert_close(q2.view(T, H, D), q_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_cache[slots], k_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        assert torch.equal(v_cache[slots], v.view(T, Hkv, D))
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[slots] = False
        assert not k_store[untouched].any() and not v_store[untouched].any() and not k_store[:, Hkv * D :].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.rollout_cpu.rotary_cache_write_(q2, k2, v, cos, sin, k_cache, v_cache, slots + rows)


def test_fused_engine_serves_an_adapter_as_peft_computes_it() -> None:
    """An adapter is served inside the fused forward too (its MLP projections see [T, H] rows): greedy tokens of a
    request under the adapter equal its peft model's, logprobs its teacher-forced forward's (1e-4); a base request in
    the same steps is the base model's."""
    pytest.importorskip("peft")
    from tests.test_lora import adapter_of, peft_model

    base = tiny_llama()
    x = peft_model(base, seed=1)
    engine = Engine(base, config(enable_lora=True, max_loras=1))
    assert engine.runner.fused_layers
    engine.load_lora(adapter_of(x, "x"))
    prompts = random_prompts(2, VOCAB_SIZE, seed=3)
    try:
        engine.add_request(prompts[0], SamplingParams(max_new_tokens=8), request_id="lora", lora="x")
        engine.add_request(prompts[1], SamplingParams(max_new_tokens=8), request_id="base")
        out = run_engine(engine)
    finally:
        engine.close()
    for rid, model, p in (("lora", x, prompts[0]), ("base", base, prompts[1])):
        tokens = out[rid].generated_tokens
        assert tokens == reference_greedy(model, p, 8, None), rid
        assert_close(out[rid].logprobs, teacher_forced_logprobs(model, p, tokens), atol=LOGPROB_ATOL)
    assert reference_greedy(x, prompts[0], 8, None) != reference_greedy(base, prompts[0], 8, None)


def _lora_engine(base: torch.nn.Module, pack: str, monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> Engine:
    """A fused engine on ``base`` serving adapters x and y (peft's, on all seven projections), its linear layers on
    packed weights (``pack="1"``) or through ``F.linear`` (``"0"``)."""
    from tests.test_lora import adapter_of, peft_model

    monkeypatch.setenv("ROLLOUT_PACK_WEIGHTS", pack)
    engine = Engine(base, config(enable_lora=True, max_loras=2, **kwargs))
    assert engine.runner.fused_layers and engine.runner.lora.cpu_kernel
    assert (engine.runner.packs is not None) == (pack == "1")
    engine.load_lora(adapter_of(peft_model(base, seed=1), "x"))
    engine.load_lora(adapter_of(peft_model(base, seed=2), "y"))
    return engine


def _serve(engine: Engine, prompts: list[list[int]], which: list[str | None], n: int) -> dict:
    try:
        for i, (p, lora) in enumerate(zip(prompts, which)):
            engine.add_request(p, SamplingParams(max_new_tokens=n), request_id=f"r{i}", lora=lora)
        return run_engine(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("pack", ["1", "0"])
def test_fused_engine_adds_sibling_adapters_in_one_kernel_call_as_the_hooks_did(
    pack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters x and y on all seven projections and the base model in the same steps: the fused forward adds them
    with 4 ``lora_add_group_`` calls per layer a step (q/k/v, o, gate/up, down) and calls no ``LoraHook``; tokens and
    logprobs equal, bitwise, a run where the fused forward replays the hooks (each its own ``lora_add_``), and each
    request's peft model (greedy tokens, teacher-forced logprobs within 1e-4)."""
    pytest.importorskip("peft")
    from rollout.lora import LoraHook
    from tests.test_lora import peft_model

    base = tiny_llama()
    refs = {None: base, "x": peft_model(base, seed=1), "y": peft_model(base, seed=2)}
    prompts = random_prompts(4, VOCAB_SIZE, max_len=30, seed=5)
    which = ["x", None, "y", "x"]
    hook_calls, group_calls = [], []
    real_call, real_group = LoraHook.__call__, torch.ops.rollout_cpu.lora_add_group_
    monkeypatch.setattr(LoraHook, "__call__", lambda *a: hook_calls.append(1) or real_call(*a))
    monkeypatch.setattr(torch.ops.rollout_cpu, "lora_add_group_", lambda *a: group_calls.append(1) or real_group(*a))
    engine = _lora_engine(base, pack, monkeypatch)
    planned = []  # per step: whether it has rows under an adapter
    step = engine.runner.lora.step

    @contextlib.contextmanager
    def spy(*args: object, **kwargs: object) -> Iterator[None]:
        with step(*args, **kwargs):
            planned.append(getattr(engine.runner.lora._local, "plan", None) is not None)
            yield

    engine.runner.lora.step = spy
    grouped = _serve(engine, prompts, which, 8)
    assert len(planned) == engine.stats.num_steps and any(planned)
    assert hook_calls == [] and len(group_calls) == 4 * 2 * sum(planned)

    class NotTheHook:  # the fused forward no longer recognises the adapter's hook: it replays it
        pass

    monkeypatch.setattr(fused_layer, "LoraHook", NotTheHook)
    group_calls.clear()
    engine = _lora_engine(base, pack, monkeypatch)
    replayed = _serve(engine, prompts, which, 8)
    assert group_calls == [] and len(hook_calls) == 7 * 2 * engine.stats.num_steps
    for i, (p, lora) in enumerate(zip(prompts, which)):
        out = grouped[f"r{i}"]
        assert out.generated_tokens == replayed[f"r{i}"].generated_tokens, i
        assert out.logprobs == replayed[f"r{i}"].logprobs, i  # bitwise
        assert out.generated_tokens == reference_greedy(refs[lora], p, 8, None), (i, lora)
        expected = teacher_forced_logprobs(refs[lora], p, out.generated_tokens)
        assert_close(out.logprobs, expected, atol=LOGPROB_ATOL)


def test_a_users_hooks_on_q_proj_run_once_a_step_around_the_fused_adapter() -> None:
    """A user's forward hooks on layer 0's q_proj, one registered before the adapter's hook and one after, each run
    once a step inside the fused forward: the first sees the projection without the adapter, the second with x's
    product added (x @ A^T @ B^T * scaling, 1e-5), as the module's call would order them; the tokens stay x's."""
    pytest.importorskip("peft")
    from tests.test_lora import adapter_of, peft_model

    base = tiny_llama()
    x = peft_model(base, seed=1)
    adapter = adapter_of(x, "x")
    q_proj = base.model.layers[0].self_attn.q_proj
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"before": [], "after": []}

    def record(where: str) -> object:
        return lambda module, args, out: seen[where].append((args[0].clone(), out.clone()))

    handles = [q_proj.register_forward_hook(record("before"))]
    engine = Engine(base, config(enable_lora=True, max_loras=1))
    assert engine.runner.fused_layers
    engine.load_lora(adapter)  # the adapter's hook on q_proj is set here
    handles.append(q_proj.register_forward_hook(record("after")))
    prompts = random_prompts(2, VOCAB_SIZE, seed=3)
    try:
        out = _serve(engine, prompts, ["x", "x"], 6)
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen["before"]) == len(seen["after"]) == engine.stats.num_steps > 0
    a, b = adapter.weights["model.layers.0.self_attn.q_proj"]
    for (x_in, plain), (x_after, added) in zip(seen["before"], seen["after"]):
        assert torch.equal(x_in, x_after)
        torch.testing.assert_close(added, plain + (x_in @ a.t() @ b.t()) * adapter.scaling, rtol=1e-5, atol=1e-5)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].generated_tokens == reference_greedy(x, p, 6, None), i
