"""Shared helpers of the test suite: reference generation, teacher forcing, running an engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from rollout import Engine, GenerationOutput, RequestStatus


def assert_close(actual: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor, atol: float) -> None:
    """The one float comparison of the suite: elementwise |a - e| <= atol, same length."""
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0
    )


def reference_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """``model.generate`` greedy on one prompt (no padding), generated tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each completion token under one plain forward of prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(completion)]


def run_engine(engine: Engine, max_steps: int = 10_000) -> dict[str, GenerationOutput]:
    """Step an engine until no request is left; outputs of the requests that ended, by id."""
    outputs: dict[str, GenerationOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for req in engine.step():
            if req.status == RequestStatus.FINISHED:
                outputs[req.request_id] = req.to_output()
    raise AssertionError(f"engine did not finish within {max_steps} steps")
