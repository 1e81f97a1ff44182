"""The machine's own limit beside the benchmark's numbers: a GEMM peak measured in the same run, the model's FLOPs.

A ratio against a peer says how far ahead or behind the peer a system is; it does not say how far either is from
what the hardware allows, and it moves with the CPU (issue 35 measured rollout/vLLM at 0.81x on one 2-core machine
and 1.60x on another). So every ``rollout-bench`` run also measures:

- ``gemm_peak_gflops``: torch's own float32 (or the run's dtype) matrix product of ``PEAK_GEMM_SIZE`` cubed, best of
  ``repeats`` timed products on the threads torch uses, in GFLOP/s (2 m k n FLOPs per product);
- ``decode_shape_gflops``: the same at a decode step's shape, ``DECODE_ROWS`` rows through the model's widest
  linear layer, what a decode step's GEMMs can reach at best (a thin GEMM reads each weight for few rows);
- the model's FLOPs per generated token: 2 in out for every ``nn.Linear`` (projections, MLP, the LM head, tied or
  not) and 4 h d c for attention at context c (``QK^T`` and ``PV`` of h query heads of width d per layer, c capped
  at a layer's sliding window), the convention of the scaling-law papers (Kaplan et al. 2020, "Scaling Laws for
  Neural Language Models", section 2.1) with attention counted per position.

A system's ``decode_gflops`` is the FLOPs of the tokens it generated (each token's forward at its own context)
over its wall time, and ``decode_fraction_of_peak`` that over ``gemm_peak_gflops``. The wall time includes the
prompts' prefill, so this is a lower bound of the decode phase's own rate. The prefill's own FLOPs are left out of
the numerator, so that every system, vLLM's too, is measured from what it returns alone; how much that leaves out
depends on the workload, so each run also reports:

- ``prefill_gflop``: the FLOPs of the prompts' other positions (each prompt once: its G samples share it, as
  prefix caching computes it), the LM head left out (only a prompt's last position needs logits, and its forward is
  the first generated token's);
- ``decode_fraction_ceiling``: generated FLOPs over generated plus prefill FLOPs, the ``decode_fraction_of_peak`` of
  a system that ran every FLOP at the GEMM peak. gsm8k-greedy's prompts (about 92 tokens) are as long as its
  completions, so its ceiling is near one half; gsm8k-grpo's 8 prompts serve 64 completions;
- ``model_gflops`` and ``model_fraction_of_peak``: all the FLOPs (generated and prefill) over the wall time, what
  share of the GEMM peak the system used (model FLOPs utilisation).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

PEAK_GEMM_SIZE = 2048
DECODE_ROWS = 64
GEMM_REPEATS = 10


def gemm_gflops(
    m: int, k: int, n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 10
) -> float:
    """The best rate of ``repeats`` timed ``[m, k] @ [k, n]`` products (after two untimed ones), in GFLOP/s.

    Raises:
        ValueError: a size or ``repeats`` below 1.
    """
    if min(m, k, n, repeats) < 1:
        raise ValueError(f"m, k, n and repeats must be >= 1, got {(m, k, n, repeats)}")
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device, dtype)
    b = torch.randn(k, n, generator=generator).to(device, dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best / 1e9


def widest_linear(model: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of the model's largest ``nn.Linear`` inside its layers (the LM head left out:
    one per step, not one per layer)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    if not shapes:
        raise ValueError("the model has no nn.Linear layer")
    return max(shapes, key=lambda s: s[0] * s[1])


def machine_limit(
    model: nn.Module, device: torch.device | str, dtype: torch.dtype, repeats: int = GEMM_REPEATS
) -> dict:
    """The ``roofline`` record of a report: the GEMM peak and the decode-shaped GEMM rate, measured now.

    Returns:
        ``{"gemm_peak_gflops", "gemm_peak_shape", "decode_shape_gflops", "decode_shape", "dtype", "threads"}``.
    """
    k, n = widest_linear(model)
    size = PEAK_GEMM_SIZE
    return {
        "gemm_peak_gflops": gemm_gflops(size, size, size, device, dtype, repeats),
        "gemm_peak_shape": [size, size, size],
        "decode_shape_gflops": gemm_gflops(DECODE_ROWS, k, n, device, dtype, repeats * 10),
        "decode_shape": [DECODE_ROWS, k, n],
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }


class TokenFlops:
    """FLOPs of one token's forward through ``model`` at a given context (see the module docstring).

    Args:
        model: a ``transformers`` causal LM (its ``config`` gives layers, heads, head width and sliding windows).
    """

    def __init__(self, model: nn.Module) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.linear = sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head = 2 * head.in_features * head.out_features if isinstance(head, nn.Linear) else 0
        window = getattr(config, "sliding_window", None)
        # No layer_types and a window (Mistral): every layer slides.
        default = "sliding_attention" if window else "full_attention"
        layer_types = getattr(config, "layer_types", None) or [default] * config.num_hidden_layers
        # None: a full-attention layer; an int: the positions a sliding layer attends to at most.
        self.windows = [window if kind == "sliding_attention" and window else None for kind in layer_types]
        # Each layer's query width (heads x head width): its attention's q_proj where it has one (Gemma 4's layers
        # differ in head width, and its config refuses a global head_dim), else the config's.
        try:
            head_dim = getattr(config, "head_dim", None)
        except Exception:  # noqa: BLE001 - transformers' per-layer attributes raise their own error type
            head_dim = None
        width = config.num_attention_heads * (head_dim or config.hidden_size // config.num_attention_heads)
        widths = [width] * len(self.windows)
        for module in model.modules():
            layer, q_proj = getattr(module, "layer_idx", None), getattr(module, "q_proj", None)
            if isinstance(layer, int) and 0 <= layer < len(widths) and isinstance(q_proj, nn.Linear):
                widths[layer] = q_proj.out_features
        self.per_layer = [4 * w for w in widths]  # attention FLOPs per layer and attended position
        # The same for every layer (None where layers differ).
        self.per_position = self.per_layer[0] if len(set(self.per_layer)) == 1 else None

    def attention(self, context: int) -> int:
        """Attention FLOPs of a token that attends to ``context`` positions (itself included)."""
        return sum(f * (context if w is None else min(context, w)) for f, w in zip(self.per_layer, self.windows))

    def generated(self, prompt_len: int, num_generated: int) -> int:
        """FLOPs of the ``num_generated`` tokens after a ``prompt_len``-token prompt, each at its own context.

        Each token is charged the forward that produced it: token 0 comes out of the prompt's last position
        (context ``prompt_len``), token j out of token j - 1 fed back (context ``prompt_len + j``). With G samples of
        a prompt each sample's token 0 is charged that position, which rollout computes once for the G (prompt forks)
        and vLLM once per sample: for rollout the generated FLOPs count G - 1 forwards a prompt that it does not run
        (about 0.7% of gsm8k-grpo's), so its ceiling and model FLOPs are that much too high.
        """
        return sum(self.linear + self.attention(prompt_len + j) for j in range(num_generated))

    def prompt(self, prompt_len: int) -> int:
        """FLOPs of a prompt's positions 0 .. ``prompt_len`` - 2 (position p at context p + 1), without the LM head:
        the prefill work that produces no token (the last position's forward is charged to token 0: ``generated``)."""
        return sum(self.linear - self.head + self.attention(p + 1) for p in range(prompt_len - 1))


def decode_rate(
    flops: TokenFlops,
    prompt_lens: Sequence[int],
    generated_lens: Sequence[int],
    num_samples: int,
    wall_s: float,
    peak_gflops: float,
) -> dict:
    """``decode_gflops`` and ``decode_fraction_of_peak`` of one run, with ``generated_gflop``, ``prefill_gflop``,
    ``decode_fraction_ceiling``, ``model_gflops`` and ``model_fraction_of_peak`` (the module docstring).

    Args:
        flops: the model's FLOPs per token.
        prompt_lens: tokens per prompt.
        generated_lens: tokens generated per sequence, the ``num_samples`` sequences of a prompt adjacent.
        num_samples: sequences per prompt (G).
        wall_s: the run's wall seconds.
        peak_gflops: ``gemm_peak_gflops`` of the same run.
    """
    total = sum(flops.generated(prompt_lens[i // num_samples], n) for i, n in enumerate(generated_lens))
    prefill = sum(flops.prompt(n) for n in prompt_lens)
    gflops = total / wall_s / 1e9 if wall_s > 0 else float("nan")
    model_gflops = (total + prefill) / wall_s / 1e9 if wall_s > 0 else float("nan")
    return {
        "decode_gflops": gflops,
        "decode_fraction_of_peak": gflops / peak_gflops,
        "generated_gflop": total / 1e9,
        "prefill_gflop": prefill / 1e9,
        "decode_fraction_ceiling": total / (total + prefill) if total + prefill > 0 else float("nan"),
        "model_gflops": model_gflops,
        "model_fraction_of_peak": model_gflops / peak_gflops,
    }
