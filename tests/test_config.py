"""ContinuousBatchingConfig: invalid values fail naming the field, defaults resolve as documented."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import pytest
from transformers import ContinuousBatchingConfig as TransformersConfig
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig, resolve_continuous_batching_config, workload_tokens_hint

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
        "page_size",
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
        "cpu_offload_space_safety_threshold",
        "max_queue_size",
        "per_request_processors",
        "drop_unsupported_processors",
        "progress_log_interval",
        "block_size",
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


# ---------------------------------------------------------------- issue 10: transformers' names and objects
def test_page_size_is_canonical_and_block_size_its_deprecated_alias() -> None:
    assert ContinuousBatchingConfig(page_size=16).resolved_page_size("cpu") == 16
    with pytest.warns(FutureWarning, match="block_size=...\\) is deprecated.*use page_size"):
        old = ContinuousBatchingConfig(block_size=16)
    assert old.page_size == 16 and old.resolved_page_size("cuda") == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replace() passes both back, equal: no second warning
        assert dataclasses.replace(old, seed=1).page_size == 16
    with pytest.raises(ValueError, match="page_size and its deprecated alias block_size must agree"):
        ContinuousBatchingConfig(page_size=8, block_size=16)
    with pytest.raises(ValueError, match="page_size must be None or an int >= 4, got 2"):
        ContinuousBatchingConfig(page_size=2)


def test_a_transformers_config_converts_field_by_field(caplog: pytest.LogCaptureFixture) -> None:
    theirs = TransformersConfig(
        page_size=16, num_blocks=40, max_batch_tokens=128, max_memory_percent=0.5, max_requests_per_batch=8,
        allow_block_sharing=False, scheduler_type="prefill_first", safety_margin=0.1, return_logprobs=True, seed=7,
        cpu_offload_space=1.5, cpu_offload_space_safety_threshold=0.5, max_queue_size=9,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        ours = ContinuousBatchingConfig.from_transformers(theirs)
    assert caplog.text == ""  # every field set is one rollout uses
    for name in (
        "page_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
        "allow_block_sharing", "scheduler_type", "safety_margin", "return_logprobs", "seed", "cpu_offload_space",
        "cpu_offload_space_safety_threshold", "max_queue_size",
    ):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    # Fields left at transformers' defaults keep rollout's (page_size 256 reads as unset: 32 on CPU).
    default = ContinuousBatchingConfig.from_transformers(TransformersConfig())
    assert default == ContinuousBatchingConfig()
    assert default.resolved_page_size("cpu") == 32 and default.resolved_page_size("cuda") == 256
    assert ContinuousBatchingConfig.from_transformers(TransformersConfig(block_size=8)).page_size == 8
    # Fields rollout does not have are named, all in one warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        ContinuousBatchingConfig.from_transformers(
            TransformersConfig(use_cuda_graph=True, default_compile_level=2, auto_switch_to_flash=False)
        )
    assert len(caplog.records) == 1
    for name in ("use_cuda_graph=True", "default_compile_level=2", "auto_switch_to_flash=False"):
        assert name in caplog.text
    with pytest.raises(ValueError, match="scheduler_type must be one of"):
        ContinuousBatchingConfig.from_transformers(TransformersConfig(scheduler_type="lifo"))


def test_resolve_takes_ours_theirs_none_or_the_one_inside_a_generation_config() -> None:
    ours = ContinuousBatchingConfig(page_size=8)
    assert resolve_continuous_batching_config(ours) is ours
    assert resolve_continuous_batching_config(None) == ContinuousBatchingConfig()
    assert resolve_continuous_batching_config(TransformersConfig(page_size=8)).page_size == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gc = GenerationConfig(continuous_batching_config=ours)
    with pytest.warns(FutureWarning, match="inside the GenerationConfig is deprecated"):
        assert resolve_continuous_batching_config(None, gc) is ours
    assert resolve_continuous_batching_config(ContinuousBatchingConfig(), gc).page_size is None  # explicit wins
    with pytest.raises(TypeError, match="continuous_batching_config must be"):
        resolve_continuous_batching_config({"page_size": 8})


@pytest.mark.parametrize(
    ("space", "threshold", "available_gib", "expected"),
    [
        (0.0, 0.8, 10, 0.0),  # no pool: recompute
        (2.0, 0.8, 10, 2.0),  # > 0 turns offload on by itself
        (20.0, 0.8, 10, 8.0),  # capped at the safety threshold of the available RAM
        (None, 0.5, 10, 5.0),  # None sizes the pool from the threshold alone
        (None, 0.0, 10, 0.0),
    ],
)
def test_cpu_offload_space_resolves_against_the_safety_threshold(
    space: float | None, threshold: float, available_gib: float, expected: float
) -> None:
    config = ContinuousBatchingConfig(cpu_offload_space=space, cpu_offload_space_safety_threshold=threshold)
    assert config.resolved_cpu_offload_gib(int(available_gib * 1024**3)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="cpu_offload_space_safety_threshold must be a finite number in"):
        ContinuousBatchingConfig(cpu_offload_space_safety_threshold=1.5)


def test_workload_hints_become_per_request_token_counts() -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    assert workload_tokens_hint(None) is None
    assert workload_tokens_hint(WorkloadHints(max_prompt_length=5, max_generated_length=3, num_requests=2)) == [8, 8]
    assert workload_tokens_hint({"max_prompt_length": 5, "num_requests": 0}) is None
    with pytest.raises(ValueError, match="workload_hints.max_prompt_length must be an int >= 0, got None"):
        workload_tokens_hint(object())
