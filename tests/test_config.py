"""ContinuousBatchingConfig: invalid values fail naming the field, defaults resolve as documented."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.config import ContinuousBatchingConfig

INVALID_CONFIG_VALUES = [
    ("block_size", 3),
    ("block_size", 0),
    ("block_size", "8"),
    ("block_size", True),
    ("num_blocks", 0),
    ("max_batch_tokens", 0),
    ("max_memory_percent", 0),
    ("max_memory_percent", 1.5),
    ("max_requests_per_batch", 0),
    ("scheduler_type", "lifo"),
    ("safety_margin", -0.1),
    ("safety_margin", 1.0),
    ("logprobs_mode", "foo"),
    ("preemption_mode", "swap"),
    ("cpu_offload_space", -1),
    ("max_queue_size", -1),
    ("seed", "x"),
    ("allow_block_sharing", "yes"),
    ("return_logprobs", 1),
    ("per_request_processors", None),
    ("drop_unsupported_processors", "no"),
    ("progress_log_interval", 0),
]


@pytest.mark.parametrize(
    ("field", "value"), INVALID_CONFIG_VALUES, ids=[f"{f}={v!r}" for f, v in INVALID_CONFIG_VALUES]
)
def test_invalid_config_value_raises_value_error_naming_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        ContinuousBatchingConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field} must be"), message
    assert repr(value) in message, message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 4),
        ("num_blocks", 1),
        ("max_batch_tokens", 1),
        ("max_memory_percent", 1.0),
        ("max_requests_per_batch", 1),
        ("scheduler_type", "prefill_first"),
        ("safety_margin", 0.0),
        ("logprobs_mode", "sampled"),
        ("preemption_mode", "offload"),
        ("cpu_offload_space", 0),
        ("max_queue_size", 0),
        ("seed", 0),
    ],
)
def test_boundary_config_value_is_accepted_and_stored(field: str, value: Any) -> None:
    config = ContinuousBatchingConfig(**{field: value})
    assert getattr(config, field) == value


def test_field_defaults_match_documentation() -> None:
    config = ContinuousBatchingConfig()
    assert config.block_size is None
    assert config.num_blocks is None
    assert config.max_batch_tokens is None
    assert config.max_memory_percent is None
    assert config.max_requests_per_batch is None
    assert config.allow_block_sharing is True
    assert config.scheduler_type == "fifo"
    assert config.safety_margin is None
    assert config.return_logprobs is False
    assert config.logprobs_mode == "temperature"
    assert config.seed is None
    assert config.preemption_mode == "recompute"
    assert config.cpu_offload_space == 0.0
    assert config.max_queue_size == 0
    assert config.per_request_processors is True
    assert config.drop_unsupported_processors is True
    assert config.progress_log_interval == 10.0


def test_field_names_lists_every_field_in_declaration_order() -> None:
    assert ContinuousBatchingConfig.field_names() == [
        "block_size",
        "num_blocks",
        "max_batch_tokens",
        "max_memory_percent",
        "max_requests_per_batch",
        "allow_block_sharing",
        "scheduler_type",
        "safety_margin",
        "return_logprobs",
        "logprobs_mode",
        "seed",
        "preemption_mode",
        "cpu_offload_space",
        "max_queue_size",
        "per_request_processors",
        "drop_unsupported_processors",
        "progress_log_interval",
    ]


@pytest.mark.parametrize(("device_type", "expected"), [("cpu", 32), ("cuda", 256)])
def test_default_block_size_is_32_on_cpu_and_256_on_cuda(device_type: str, expected: int) -> None:
    assert ContinuousBatchingConfig().resolved_block_size(device_type) == expected


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_explicit_block_size_wins_over_device_default(device_type: str) -> None:
    assert ContinuousBatchingConfig(block_size=16).resolved_block_size(device_type) == 16


@pytest.mark.parametrize(("device_type", "expected"), [("cpu", 512), ("cuda", 2048)])
def test_default_max_batch_tokens_is_512_on_cpu_and_2048_on_cuda(device_type: str, expected: int) -> None:
    assert ContinuousBatchingConfig().resolved_max_batch_tokens(device_type) == expected
    assert ContinuousBatchingConfig(max_batch_tokens=7).resolved_max_batch_tokens(device_type) == 7


@pytest.mark.parametrize(("device_type", "expected"), [("cpu", 0.25), ("cuda", 0.9)])
def test_default_memory_percent_is_quarter_on_cpu_and_090_on_cuda(device_type: str, expected: float) -> None:
    assert ContinuousBatchingConfig().resolved_memory_percent(device_type) == expected
    assert ContinuousBatchingConfig(max_memory_percent=0.5).resolved_memory_percent(device_type) == 0.5


@pytest.mark.parametrize(
    ("scheduler_type", "safety_margin", "expected"),
    [
        ("fifo", None, 0.15),
        ("prefill_first", None, 0.0),
        ("fifo", 0.0, 0.0),  # an explicit 0.0 is not mistaken for "unset"
        ("prefill_first", 0.3, 0.3),
    ],
)
def test_safety_margin_resolves_to_explicit_value_else_scheduler_default(
    scheduler_type: str, safety_margin: float | None, expected: float
) -> None:
    config = ContinuousBatchingConfig(scheduler_type=scheduler_type, safety_margin=safety_margin)
    assert config.resolved_safety_margin() == expected
