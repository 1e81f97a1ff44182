"""ContinuousBatchingConfig: invalid values fail naming the field, defaults resolve as documented."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any

import pytest
from transformers import ContinuousBatchingConfig as TransformersConfig
from transformers import GenerationConfig

from rollout.config import ContinuousBatchingConfig, resolve_continuous_batching_config, workload_tokens_hint
from rollout.engine.spec import (
    resolve_async_batching,
    resolve_compile_configs,
    resolve_cuda_graphs,
    resolve_padding_intervals,
    resolve_safety_margin,
)
from rollout.engine.worker.distributed import disable_nccl_graph_mixing

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
    ("sliding_window_cache", 0),
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
        "sliding_window_cache",
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
        "default_compile_level",
        "varlen_compile_config",
        "decode_compile_config",
        "use_cuda_graph",
        "q_padding_interval_size",
        "kv_padding_interval_size",
        "max_blocks_per_request",
        "cpu_attention",
        "use_async_batching",
        "disable_nccl_graph_mixing",
        "cpu_group_timeout",
        "progress_log_interval",
        "block_size",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "check_weight_contents",
        "fused_layers",
        "batch_invariant",
        "regional_compile",
    ]


# ---------------------------------------------------------------- issue 12: tensor parallelism
def test_tensor_parallel_fields_default_to_transformers_values_and_refuse_bad_ones() -> None:
    config = ContinuousBatchingConfig()
    theirs = TransformersConfig()
    assert config.cpu_group_timeout == theirs.cpu_group_timeout == 300.0
    assert config.disable_nccl_graph_mixing is theirs.disable_nccl_graph_mixing is True
    assert ContinuousBatchingConfig(cpu_group_timeout=None).cpu_group_timeout is None
    assert ContinuousBatchingConfig(cpu_group_timeout=0.5).cpu_group_timeout == 0.5
    for bad in (0, -1.0, float("inf"), "60"):
        with pytest.raises(ValueError, match=f"cpu_group_timeout must be .*> 0.*got {bad!r}"):
            ContinuousBatchingConfig(cpu_group_timeout=bad)
    with pytest.raises(ValueError, match="disable_nccl_graph_mixing must be a bool, got 1"):
        ContinuousBatchingConfig(disable_nccl_graph_mixing=1)


def test_tensor_parallel_fields_are_copied_from_a_transformers_config(caplog: pytest.LogCaptureFixture) -> None:
    theirs = TransformersConfig(cpu_group_timeout=12.5, disable_nccl_graph_mixing=False)
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        ours = ContinuousBatchingConfig.from_transformers(theirs)
    assert (ours.cpu_group_timeout, ours.disable_nccl_graph_mixing) == (12.5, False)
    assert not [r for r in caplog.records if r.name.startswith("rollout")]  # nothing dropped
    assert (
        ContinuousBatchingConfig.from_transformers(TransformersConfig(cpu_group_timeout=None)).cpu_group_timeout is None
    )


def test_building_a_config_leaves_the_nccl_variable_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "unset")  # so that monkeypatch restores the original
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT")
    ContinuousBatchingConfig(disable_nccl_graph_mixing=True)
    assert "NCCL_GRAPH_MIXING_SUPPORT" not in os.environ


@pytest.mark.parametrize(("preset", "expected", "changed"), [(None, "0", True), ("1", "1", False), ("0", "0", False)])
def test_the_tp_code_turns_nccl_graph_mixing_off_unless_the_user_set_the_variable(
    monkeypatch: pytest.MonkeyPatch, preset: str | None, expected: str, changed: bool
) -> None:
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", preset or "unset")  # so that monkeypatch restores the original
    if preset is None:
        monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT")
    assert disable_nccl_graph_mixing() is changed
    assert os.environ["NCCL_GRAPH_MIXING_SUPPORT"] == expected


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        (0, None),
        (1, ("default", True)),
        (2, ("max-autotune-no-cudagraphs", True)),
        (3, ("max-autotune-no-cudagraphs", False)),
    ],
)
def test_compile_levels_are_transformers_levels(level: int, expected: tuple[str, bool] | None) -> None:
    varlen, decode = resolve_compile_configs(ContinuousBatchingConfig(default_compile_level=level))
    if expected is None:
        assert varlen is None and decode is None
    else:
        assert (varlen.mode, varlen.dynamic) == expected
        assert (decode.mode, decode.dynamic) == expected
        assert varlen.fullgraph is False


def test_a_paths_own_compile_config_wins_over_the_level_and_the_level_over_the_fallback() -> None:
    from transformers.generation import CompileConfig

    fallback = CompileConfig(mode="default", dynamic=False)
    config = ContinuousBatchingConfig(decode_compile_config={"mode": "max-autotune", "dynamic": False})
    varlen, decode = resolve_compile_configs(config, fallback)
    assert varlen is fallback
    assert isinstance(decode, CompileConfig) and decode.mode == "max-autotune"
    varlen, _ = resolve_compile_configs(ContinuousBatchingConfig(default_compile_level=1), fallback)
    assert varlen.mode == "default" and varlen.dynamic is True


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("default_compile_level", 4, "default_compile_level must be an int in [0, 3]"),
        ("varlen_compile_config", "yes", "varlen_compile_config must be None"),
        ("decode_compile_config", {"no_such_field": 1}, "decode_compile_config:"),
        ("use_cuda_graph", (True, 1), "use_cuda_graph must be None, a bool or a (varlen, decode) pair"),
        ("q_padding_interval_size", -1, "q_padding_interval_size must be an int >= 0"),
        ("kv_padding_interval_size", 1.5, "kv_padding_interval_size must be an int >= 0"),
        ("max_blocks_per_request", -1, "max_blocks_per_request must be None or an int >= 0"),
        ("use_async_batching", "on", "use_async_batching must be a bool"),
    ],
)
def test_speed_fields_refuse_bad_values_naming_the_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ContinuousBatchingConfig(**{field: value})
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("graphs", [True, (False, True), (True, False)])
def test_cuda_graphs_on_a_device_without_cuda_is_an_error_naming_the_field(graphs: Any) -> None:
    with pytest.raises(ValueError, match="use_cuda_graph=.* needs a CUDA device"):
        resolve_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=graphs), "cpu")


@pytest.mark.parametrize(
    ("graphs", "expected"), [(None, (False, False)), (True, (True, True)), ([False, True], (False, True))]
)
def test_cuda_graph_flags_on_cuda(graphs: Any, expected: tuple[bool, bool]) -> None:
    assert resolve_cuda_graphs(ContinuousBatchingConfig(use_cuda_graph=graphs), "cuda") == expected


@pytest.mark.parametrize(("device_type", "expected"), [("cpu", (4, 32)), ("cuda", (64, 1024))])
def test_padding_intervals_have_device_presets_and_explicit_values_win(device_type: str, expected: tuple) -> None:
    assert resolve_padding_intervals(ContinuousBatchingConfig(), device_type) == expected
    explicit = ContinuousBatchingConfig(q_padding_interval_size=8, kv_padding_interval_size=32)
    assert resolve_padding_intervals(explicit, device_type) == (8, 32)


@pytest.mark.parametrize(
    ("device_type", "fields", "expected"),
    [
        ("cpu", {}, False),
        ("cuda", {}, False),
        ("cuda", {"use_cuda_graph": True}, True),
        ("cuda", {"use_cuda_graph": (False, True)}, True),
        ("cuda", {"use_cuda_graph": False}, False),
        ("cpu", {"use_async_batching": True}, True),
        ("cuda", {"use_cuda_graph": True, "use_async_batching": False}, False),
    ],
)
def test_async_batching_is_off_on_cpu_and_follows_cuda_graphs_on_cuda_unless_set(
    device_type: str, fields: dict, expected: bool
) -> None:
    assert resolve_async_batching(ContinuousBatchingConfig(**fields), device_type) is expected


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_async_batching_under_tensor_parallelism_is_off_unless_asked_which_raises(device_type: str) -> None:
    for fields in ({}, {"use_async_batching": False}, {"use_cuda_graph": device_type == "cuda"}):
        assert resolve_async_batching(ContinuousBatchingConfig(**fields), device_type, tensor_parallel=True) is False
    with pytest.raises(ValueError, match="use_async_batching=True is not supported under tensor parallelism"):
        resolve_async_batching(ContinuousBatchingConfig(use_async_batching=True), device_type, tensor_parallel=True)


def test_transformers_speed_fields_are_copied_not_dropped() -> None:
    from transformers.generation import ContinuousBatchingConfig as TransformersConfig

    theirs = TransformersConfig(
        default_compile_level=2,
        use_cuda_graph=False,
        q_padding_interval_size=32,
        max_blocks_per_request=0,
        use_async_batching=True,
    )
    ours = ContinuousBatchingConfig.from_transformers(theirs)
    assert (ours.default_compile_level, ours.use_cuda_graph, ours.q_padding_interval_size) == (2, False, 32)
    assert (ours.max_blocks_per_request, ours.use_async_batching) == (0, True)


@pytest.mark.parametrize(("device_type", "expected"), [("cpu", 32), ("cuda", 256)])
def test_default_block_size_is_32_on_cpu_and_256_on_cuda(device_type: str, expected: int) -> None:
    assert ContinuousBatchingConfig().resolved_page_size(device_type) == expected


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_explicit_block_size_wins_over_device_default(device_type: str) -> None:
    assert ContinuousBatchingConfig(block_size=16).resolved_page_size(device_type) == 16


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
    assert resolve_safety_margin(config) == expected


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
    assert not [r for r in caplog.records if r.name.startswith("rollout")]  # every field set is one rollout uses
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
        ContinuousBatchingConfig.from_transformers(TransformersConfig(max_cached_graphs=4, auto_switch_to_flash=False))
    # transformers itself may log (max_cached_graphs is deprecated there): count rollout's records only.
    ours_logged = [record.getMessage() for record in caplog.records if record.name == "rollout.config"]
    assert len(ours_logged) == 1
    for name in ("max_cached_graphs=4", "auto_switch_to_flash=False"):
        assert name in ours_logged[0]
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
