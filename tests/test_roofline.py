"""rollout-bench's roofline (benchmarks.roofline): FLOPs per token counted from the model's own layers,
sliding windows capping attention, the decode rate's arithmetic, and a GEMM rate that is measured, not assumed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.roofline import TokenFlops, decode_rate, gemm_gflops, machine_limit, widest_linear
from tests.tiny_models import tiny_gemma, tiny_gemma4, tiny_llama, tiny_mistral


def _linear_flops_by_hand(model: torch.nn.Module) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q_o = 2 * c.hidden_size * c.num_attention_heads * head_dim
    k_v = 2 * c.hidden_size * c.num_key_value_heads * head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    return 2 * (c.num_hidden_layers * (q_o + k_v + mlp) + c.hidden_size * c.vocab_size)


def test_a_token_costs_its_linear_layers_and_attention_over_its_context() -> None:
    model = tiny_llama()
    c = model.config
    flops = TokenFlops(model)
    assert flops.linear == _linear_flops_by_hand(model)
    per_position = 4 * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * c.num_hidden_layers
    assert flops.attention(10) == 10 * per_position
    # Tokens 0, 1, 2 after a 5-token prompt come out of forwards at contexts 5, 6, 7.
    assert flops.generated(5, 3) == 3 * flops.linear + (5 + 6 + 7) * per_position


def test_sliding_windows_cap_the_attended_positions_per_layer() -> None:
    gemma = TokenFlops(tiny_gemma(sliding_window=8))  # layers: sliding, full, sliding, full
    per_layer = gemma.per_position
    assert gemma.windows == [8, None, 8, None]
    assert gemma.attention(100) == per_layer * (8 + 100 + 8 + 100)
    assert gemma.attention(5) == per_layer * 5 * 4
    mistral = TokenFlops(tiny_mistral(sliding_window=8))  # no layer_types: every layer slides
    assert mistral.attention(100) == mistral.per_position * 8 * 2
    assert TokenFlops(tiny_mistral(sliding_window=None)).attention(100) == mistral.per_position * 100 * 2


def test_layers_of_different_head_widths_count_their_own_queries() -> None:
    """Gemma 4's full layers have wider heads than its sliding ones, and its config refuses a global ``head_dim``:
    each layer counts 4 x its q_proj's output features per attended position."""
    model = tiny_gemma4(global_head_dim=32, sliding_window=8)  # layers: sliding (head dim 16), full (32), ...
    flops = TokenFlops(model)
    widths = [layer.self_attn.q_proj.out_features for layer in model.model.layers]
    assert widths[0] != widths[1]
    assert flops.per_layer == [4 * w for w in widths] and flops.per_position is None
    assert flops.windows == [8, None, 8, None]
    assert flops.attention(100) == 4 * (widths[0] * 8 + widths[1] * 100 + widths[2] * 8 + widths[3] * 100)


def test_decode_rate_is_generated_flops_over_wall_time_against_the_peak() -> None:
    flops = TokenFlops(tiny_llama())
    # Two prompts, G = 2: sequences 0 and 1 follow prompt 0 (4 tokens), 2 and 3 prompt 1 (7 tokens).
    rate = decode_rate(flops, [4, 7], [3, 1, 2, 0], 2, wall_s=0.5, peak_gflops=10.0)
    total = flops.generated(4, 3) + flops.generated(4, 1) + flops.generated(7, 2)
    assert rate["generated_gflop"] == pytest.approx(total / 1e9)
    assert rate["decode_gflops"] == pytest.approx(total / 0.5 / 1e9)
    assert rate["decode_fraction_of_peak"] == pytest.approx(rate["decode_gflops"] / 10.0)
    # Each prompt's positions but the last, once (its G samples share them), without the LM head.
    per_position = flops.linear - flops.head
    prefill = sum(per_position + flops.attention(p + 1) for n in (4, 7) for p in range(n - 1))
    config = tiny_llama().config
    assert flops.head == 2 * config.hidden_size * config.vocab_size
    assert rate["prefill_gflop"] == pytest.approx(prefill / 1e9)
    assert rate["decode_fraction_ceiling"] == pytest.approx(total / (total + prefill))
    assert rate["model_gflops"] == pytest.approx((total + prefill) / 0.5 / 1e9)
    assert rate["model_fraction_of_peak"] == pytest.approx(rate["model_gflops"] / 10.0)


def test_the_gemm_rates_are_measured_on_the_model_s_widest_layer() -> None:
    model = tiny_llama()
    assert widest_linear(model) == (model.config.hidden_size, model.config.intermediate_size)
    limit = machine_limit(model, "cpu", torch.float32, repeats=2)
    assert limit["decode_shape"] == [64, model.config.hidden_size, model.config.intermediate_size]
    assert limit["gemm_peak_gflops"] > 0 and limit["decode_shape_gflops"] > 0
    assert limit["threads"] == torch.get_num_threads()
    with pytest.raises(ValueError, match="repeats"):
        gemm_gflops(4, 4, 4, repeats=0)
