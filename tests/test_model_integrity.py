"""The engine shares the trainer's model object: training forwards must be unchanged, bad input refused early."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

import rollout
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, UnsupportedModelError, generate_batch
from rollout.engine import Engine
from tests.tiny_models import ALL_TINY_MODELS, VOCAB_SIZE, random_prompts, tiny_gemma, tiny_llama
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs


def _training_step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one padded causal-LM batch (right padding exercises the mask)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB_SIZE, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return loss.detach(), grads


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_training_step_after_generate_batch_equals_fresh_copy(name: str) -> None:
    model = ALL_TINY_MODELS[name]()
    fresh = copy.deepcopy(model)
    generate_batch(model, random_prompts(4, VOCAB_SIZE, 5, 20, seed=1), GenerationConfig(max_new_tokens=6))
    loss, grads = _training_step(model)
    ref_loss, ref_grads = _training_step(fresh)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_training_forward_while_engine_attached_equals_fresh_copy() -> None:
    # A persistent engine keeps the paged dispatcher installed; plain forwards must fall through.
    model = tiny_gemma()
    fresh = copy.deepcopy(model)
    engine = Engine(model, ContinuousBatchingConfig(block_size=4, num_blocks=16))
    assert model.config._attn_implementation.startswith("rollout_paged|")
    loss, grads = _training_step(model)
    ref_loss, ref_grads = _training_step(fresh)
    engine.close()
    assert torch.equal(loss, ref_loss)
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    assert model.config._attn_implementation == "sdpa"


def test_attention_restored_after_generate_batch_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    fresh = copy.deepcopy(model)

    def broken_step(self):  # noqa: ANN001
        raise RuntimeError("injected failure")

    monkeypatch.setattr(Engine, "step", broken_step)
    with pytest.raises(RuntimeError, match="injected failure"):
        generate_batch(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=3))
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_training_step(model)[0], _training_step(fresh)[0])


def test_eager_model_keeps_its_eager_attention() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    fresh = copy.deepcopy(model)
    out = generate_batch(model, [[5, 6, 7, 8]], GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None))
    assert len(out["req_0"].generated_tokens) == 4
    assert model.config._attn_implementation == "eager"
    assert torch.equal(_training_step(model)[0], _training_step(fresh)[0])


# ---------------------------------------------------------------- bad input
GC = GenerationConfig(max_new_tokens=4)


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ([[5, 6], []], "non-empty"),
        ([[5, 6], [5, VOCAB_SIZE]], r"outside the vocabulary \[0, 256\)"),
        ([[5, 6], [-1, 4]], "outside the vocabulary"),
        ([[5, 6], "abc"], "non-empty list of token ids"),
    ],
)
def test_bad_prompts_raise_before_generation(inputs, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    calls = []
    monkeypatch.setattr(Engine, "step", lambda self: calls.append(1) or [])
    with pytest.raises(ValueError, match=match):
        generate_batch(model, inputs, GC)
    assert calls == []
    assert model.config._attn_implementation == "sdpa"


def test_max_new_tokens_below_one_raises() -> None:
    gc = GenerationConfig()
    gc.max_new_tokens = 0  # GenerationConfig refuses 0 in its constructor; set it afterwards
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(tiny_llama(), [[5, 6]], gc)


def test_request_that_can_never_fit_the_cache_raises() -> None:
    with pytest.raises(ValueError, match="needs 5 blocks of 4 tokens, but the cache has 4"):
        generate_batch(
            tiny_llama(),
            [[5, 6, 7]],
            GenerationConfig(max_new_tokens=15),
            ContinuousBatchingConfig(block_size=4, num_blocks=4),
        )


def test_encoder_only_model_is_refused() -> None:
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    with pytest.raises(UnsupportedModelError, match="not a causal language model"):
        generate_batch(BertForMaskedLM(config), [[5, 6]], GC)


def _longrope_llama(max_positions: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=40, intermediate_size=72, num_attention_heads=4, num_key_value_heads=2,
        head_dim=10, num_hidden_layers=2, max_position_embeddings=max_positions, initializer_range=0.2,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
            short_factor=[1.0] * 5, long_factor=[2.0] * 5, factor=4.0,
        ),
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_longrope_past_its_original_context_is_refused_and_within_it_served() -> None:
    # longrope switches factors when the batch's longest position passes the original context: in a continuous batch
    # a request's rotary embedding would depend on the others' (a break test found a 4-token prompt batched with a
    # 30-token one decoded other tokens than generate).
    with pytest.raises(UnsupportedModelError, match="rope_type='longrope'.*max_position_embeddings to 16"):
        generate_batch(_longrope_llama(256), [[5, 6]], GC)
    model = _longrope_llama(16)  # never past the original context: the short factors only
    prompts = [[5, 17, 33, 60], list(range(3, 13))]
    out = generate_batch(model, prompts, GenerationConfig(max_new_tokens=4, do_sample=False))
    assert [o.generated_tokens for o in out.values()] == [reference_greedy(model, p, 4, None) for p in prompts]


def test_unpageable_attention_kinds_are_refused() -> None:
    model = tiny_llama()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        generate_batch(model, [[5, 6]], GC)
    bidirectional = tiny_gemma()
    bidirectional.config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        generate_batch(bidirectional, [[5, 6]], GC)


def _tiny_gemma4(**per_layer: int):  # noqa: ANN202
    """A 4-layer Gemma-4 text model: sliding layers with head_dim 16, full layers as ``per_layer`` says."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=16, **per_layer,
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("per_layer", "groups"),
    [
        ({"global_head_dim": 32}, ["sliding8:0,2:2x16", "full:1,3:2x32"]),
        (
            {"global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": True},
            ["sliding8:0,2:2x16", "full:1,3:1x16"],
        ),
    ],
    ids=["head_dim", "kv_heads"],
)
def test_layers_with_different_kv_shapes_run_like_plain_forwards(per_layer: dict, groups: list[str]) -> None:
    # Issue 10, case 5 was refused up front; issue 12 supports it: a Gemma-4 style config (a separate
    # global head dim or KV-head count) gets a KV cache group per shape, through every entry point.
    model = _tiny_gemma4(**per_layer)
    prompts = random_prompts(3, VOCAB_SIZE, 5, 20, seed=7)
    outs = generate_batch(model, prompts, GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None))
    assert [o.generated_tokens for o in outs.values()] == [reference_greedy(model, p, 6, None) for p in prompts]
    engine = Engine(model, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    assert [g.name for g in engine.cache.groups] == groups
    engine.close()
    rollout.init_continuous_batching(model, GC).destroy()
    [scored] = rollout.score(model, [prompts[0]], [[7, 8]])
    assert_close(scored.completion_logprobs, teacher_forced_logprobs(model, prompts[0], [7, 8]), atol=1e-4)
    assert model.config._attn_implementation == "sdpa"  # every engine put the original back


def test_duplicate_request_id_is_refused() -> None:
    engine = Engine(tiny_llama(), ContinuousBatchingConfig(block_size=4, num_blocks=16))
    from rollout import SamplingParams

    engine.add_request([5, 6], SamplingParams(max_new_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        engine.add_request([5, 6], SamplingParams(max_new_tokens=2), request_id="a")
    engine.close()


@pytest.mark.parametrize(
    ("inputs", "kwargs", "error", "match"),
    [
        ([5, 6, 7], {}, ValueError, "one flat list of ints"),
        ([None], {}, ValueError, r"inputs\[0\] must be a non-empty list"),
        ([[5.0, 6]], {}, ValueError, r"inputs\[0\] must hold integer token ids"),
        ([[5, 6]], {"max_new_tokens": 2}, TypeError, "unexpected keyword arguments"),
    ],
)
def test_malformed_inputs_name_the_argument(inputs, kwargs, error, match: str) -> None:
    with pytest.raises(error, match=match):
        generate_batch(tiny_llama(), inputs, GC, **kwargs)


def test_tensor_and_numpy_prompts_are_accepted() -> None:
    import numpy as np

    model = tiny_llama()
    gc = GenerationConfig(max_new_tokens=4, do_sample=False)
    ref = generate_batch(model, [[5, 6, 7]], gc)["req_0"].generated_tokens
    assert generate_batch(model, torch.tensor([[5, 6, 7]]), gc)["req_0"].generated_tokens == ref
    assert generate_batch(model, [np.array([5, 6, 7])], gc)["req_0"].generated_tokens == ref


@pytest.mark.parametrize("gc", [GenerationConfig(max_new_tokens=4, do_sample=True), GenerationConfig(max_new_tokens=4)])
def test_bad_sample_counts_and_temperatures_raise(gc: GenerationConfig) -> None:
    gc.num_return_sequences = 0
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate_batch(tiny_llama(), [[5]], gc)
    gc.num_return_sequences = 1
    gc.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        generate_batch(tiny_llama(), [[5]], gc)


def test_a_request_past_the_model_context_is_refused_before_any_work() -> None:
    # Issue 22, item 3: it used to warn and generate on past the context (for minutes, degraded).
    model = tiny_llama()  # max_position_embeddings 512
    greedy = GenerationConfig(max_new_tokens=20, do_sample=False)
    message = (
        r"max_new_tokens: request 'req_0': prompt \(500 tokens\) plus max_new_tokens \(20\) is past the model's "
        r"context of 512 tokens \(max_position_embeddings\); lower max_new_tokens to at most 12"
    )
    with pytest.raises(ValueError, match=message):
        generate_batch(model, [[5] * 500], greedy)
    manager = ContinuousBatchingManager(model, greedy, ContinuousBatchingConfig(num_blocks=256))
    try:
        with pytest.raises(ValueError, match="input_ids: max_new_tokens: .* past the model's context of 512"):
            manager.add_request([5] * 500)
        with pytest.raises(ValueError, match=r"inputs\[1\]: max_new_tokens: .*shorten the prompt to at most 511"):
            manager.add_requests([[5] * 10, [5] * 512])
        assert not manager.engine.has_unfinished()  # nothing of the refused batch was queued
    finally:
        manager.destroy()
    assert len(generate_batch(model, [[5] * 492], greedy)["req_0"].generated_tokens) == 20  # exactly the context
