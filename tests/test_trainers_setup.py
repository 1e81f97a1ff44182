"""trainers/setup.py: the engine's memory share next to a trainer (``training_memory_percent``)."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_llama
from trainers.setup import MIN_TRAINING_MEMORY_PERCENT, training_memory_percent, training_state_bytes


def test_training_share_sets_aside_three_times_the_trainable_bytes_then_takes_half() -> None:
    model = tiny_llama()
    state = 3 * sum(p.numel() * 4 for p in model.parameters())
    assert training_state_bytes(model) == state
    # usable 1.5 x state: half of the remaining third is 1/6 of the usable memory.
    assert training_memory_percent(model, usable_bytes=3 * state // 2) == pytest.approx(1 / 6)
    # Never above the engine's own default for the device (0.25 on CPU).
    assert training_memory_percent(model, usable_bytes=10 * state) == 0.25
    # The state alone fills the memory: the floor, not 0 (max_memory_percent must be > 0).
    assert training_memory_percent(model, usable_bytes=state) == MIN_TRAINING_MEMORY_PERCENT
    # Frozen parameters get no gradient nor optimizer state.
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = 3 * model.model.embed_tokens.weight.numel() * 4
    assert training_state_bytes(model) == state - frozen


@pytest.mark.cuda
def test_cuda_training_share_is_half_of_what_the_training_state_leaves() -> None:
    model = tiny_llama().cuda()
    state = training_state_bytes(model)
    usable = 100 * state
    assert training_memory_percent(model, usable_bytes=usable) == pytest.approx(0.5 * 99 / 100)
    measured = training_memory_percent(model)
    assert 0.4 < measured <= 0.5  # a GPU has far more than 3 x the tiny model's bytes free
