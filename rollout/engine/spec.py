"""What an engine is, resolved once from config x model x device: ``EngineSpec``.

Every setting that depends on the device or the model (the compiled and CUDA-graphed paths, async batching, the KV layer
groups, the cache's size, flash-attn or SDPA, the decode fast path's width, the static step's padding) is decided here
(``EngineSpec.resolve`` and its ``resolve_*`` functions), in one place, before anything is allocated; ``build`` makes
the engine's parts from the spec. The config keeps only the device defaults that the cache's sizing reads below this
module (page size, token budget, memory share, offload GiB). Tensor parallelism joins here too
(``worker.distributed.TensorParallel``): the ranks agree on the cache's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.attention.cpu import choose_cpu_attention
from rollout.engine.attention.flash import choose_flash
from rollout.engine.kv.cache import CacheLayout, CacheShape
from rollout.engine.kv.sizing import num_blocks_for_model, offload_space_gib
from rollout.engine.worker.distributed import TensorParallel, tensor_parallel_mesh
from rollout.engine.worker.forward import PaddingRule
from rollout.weights.model_info import (
    attention_dtype,
    input_device,
    layer_devices,
    logits_width,
    model_context_length,
    vocab_size,
)

__all__ = ["EngineSpec"]

# Padding intervals (tokens) of the padded step. With dynamic shapes (levels 1-2) an interval changes a step's work, not
# what is compiled; with static shapes (level 3, CUDA graphs) a smaller one means more shapes to compile or capture.
# CPU (SmolLM2-135M fp32, the 2-core machine, gsm8k decodes of 60-150 keys, 1 thread): keys padded to 64 made the padded
# decode step of 32 requests 4-7% slower than eager, to 32 (one page) 0-1%; a decode row past 4 costs about 4 ms (1 row
# 43 ms, 4 rows 66, 32 rows 176), so query rows pad to a multiple of 4 (1.5 padded rows on average, 7.5 with 16).
# CUDA: transformers' query preset (continuous_batching/initialization.py FALLBACK_DEFAULTS: 64); its key preset of 64
# pages sizes flash-attn's table reads, while the padded step gathers every padded key, so 4 pages here.
DEFAULT_Q_PADDING_CUDA = 64
DEFAULT_KV_PADDING_CUDA = 4 * 256
DEFAULT_Q_PADDING_CPU = 4
DEFAULT_KV_PADDING_CPU = 32
# transformers' fallback width of the decode fast path's block table.
DEFAULT_MAX_BLOCKS_PER_REQUEST = 32


def resolve_compile_configs(
    config: ContinuousBatchingConfig, fallback: CompileConfig | None = None
) -> tuple[CompileConfig | None, CompileConfig | None]:
    """The (varlen, decode) compile configs, each a ``CompileConfig`` or None (eager): the path's own, else
    ``default_compile_level``'s, else ``fallback``, the generation config's ``compile_config`` (transformers' order of
    precedence)."""
    level = config.default_compile_level
    default = None
    if level > 0:
        mode = "max-autotune-no-cudagraphs" if level >= 2 else "default"
        default = CompileConfig(fullgraph=False, dynamic=level <= 2, mode=mode)
    chosen = default if default is not None else fallback
    varlen = config.varlen_compile_config if config.varlen_compile_config is not None else chosen
    decode = config.decode_compile_config if config.decode_compile_config is not None else chosen
    return varlen, decode  # type: ignore[return-value]


def resolve_cuda_graphs(config: ContinuousBatchingConfig, device_type: str) -> tuple[bool, bool]:
    """(varlen, decode): whether each path replays CUDA graphs on a device type.

    ``use_cuda_graph=None`` picks (False, False) on every device: on CUDA too, since the capture path has not yet run on
    a GPU (transformers turns graphs on when its attention needs no mask).

    Raises:
        ValueError: ``use_cuda_graph`` asks for a graph on a device that is not CUDA.
    """
    graphs = config.use_cuda_graph
    if graphs is None:
        return (False, False)
    pair = (graphs, graphs) if isinstance(graphs, bool) else (bool(graphs[0]), bool(graphs[1]))
    if any(pair) and device_type != "cuda":
        raise ValueError(
            f"use_cuda_graph={graphs!r} needs a CUDA device, but the model runs on {device_type!r}; "
            "set use_cuda_graph to None or False"
        )
    return pair


def resolve_padding_intervals(config: ContinuousBatchingConfig, device_type: str) -> tuple[int, int]:
    """(query, kv) padding intervals in tokens of the static-shape path on a device type (the config's field, else the
    device's preset: ``DEFAULT_Q_PADDING_*`` / ``DEFAULT_KV_PADDING_*``)."""
    cuda = device_type == "cuda"
    q = config.q_padding_interval_size or (DEFAULT_Q_PADDING_CUDA if cuda else DEFAULT_Q_PADDING_CPU)
    kv = config.kv_padding_interval_size or (DEFAULT_KV_PADDING_CUDA if cuda else DEFAULT_KV_PADDING_CPU)
    return q, kv


def resolve_async_batching(config: ContinuousBatchingConfig, device_type: str, tensor_parallel: bool = False) -> bool:
    """Whether the engine prepares step k+1 while step k runs on a device type.

    The explicit value, else: off on CPU (its worker thread's second OpenMP team slows every kernel more than the host
    work it hides: 0.80x-0.95x the synchronous tokens/s; docs/engine.md "Async batching"); on CUDA, on when a path is
    CUDA-graphed, as transformers' ``decide_use_async_batching``. Off under tensor parallelism: a step scheduled ahead
    would read its rank's own sampled tokens, not the driver's (``TensorParallel.share_output``).

    Args:
        config: the engine's configuration.
        device_type: the model's device type ("cpu", "cuda", ...).
        tensor_parallel: the model is sharded by a ``tp_plan`` (the engine runs in lockstep with other ranks).

    Raises:
        ValueError: ``use_async_batching=True`` under tensor parallelism.
    """
    if tensor_parallel:
        if config.use_async_batching:
            raise ValueError(
                "use_async_batching=True is not supported under tensor parallelism (a step scheduled ahead "
                "would read each rank's own sampled tokens, not the driver's); set use_async_batching to "
                "None or False"
            )
        return False
    if config.use_async_batching is not None:
        return bool(config.use_async_batching)
    if device_type != "cuda":
        return False
    graphs = config.use_cuda_graph
    return bool(graphs) if isinstance(graphs, bool) else graphs is not None and any(graphs)


def resolve_safety_margin(config: ContinuousBatchingConfig) -> float:
    """Safety margin: the explicit value, else 0.15 for fifo and 0.0 for prefill_first."""
    if config.safety_margin is not None:
        return float(config.safety_margin)
    return 0.15 if config.scheduler_type == "fifo" else 0.0


def resolve_max_blocks_per_request(
    config: ContinuousBatchingConfig, num_blocks: int, block_size: int, context_length: int | None
) -> int:
    """Width in blocks of the decode fast path's block table (0: off): the explicit ``max_blocks_per_request``, else the
    blocks of the longest request a cache of ``num_blocks`` blocks of ``block_size`` tokens can hold (fewer when the
    model's ``context_length`` needs fewer), at least 32 (transformers' fallback width)."""
    if config.max_blocks_per_request is not None:
        return config.max_blocks_per_request
    longest = num_blocks
    if context_length is not None:
        longest = min(longest, -(-context_length // block_size))
    return max(DEFAULT_MAX_BLOCKS_PER_REQUEST, longest)


def _check_static_paths(
    compile_configs: tuple[CompileConfig | None, CompileConfig | None],
    cuda_graphs: tuple[bool, bool],
    devices: Sequence[torch.device],
) -> None:
    """Refuse static-shape settings the engine cannot run, before anything is allocated.

    Raises:
        ValueError: a compiled or graphed path on a model whose layers span several devices (the padded step builds its
            metadata on one device), or a CUDA-graphed path whose compile mode captures CUDA graphs itself (inductor's
            ``triton.cudagraphs``: "reduce-overhead", "max-autotune"), which would capture inside our capture.
    """
    static = any(cuda_graphs) or any(c is not None for c in compile_configs)
    if static and len(set(devices)) > 1:
        raise ValueError(
            "default_compile_level, varlen_compile_config, decode_compile_config and use_cuda_graph need the "
            f"model's layers on one device, but they span {sorted({str(d) for d in devices})}; leave them unset"
        )
    for path, config, graphed in zip(("varlen", "decode"), compile_configs, cuda_graphs, strict=True):
        if not graphed or config is None:
            continue
        options = dict(config.options or {})
        if config.mode is not None:
            options.update(torch._inductor.list_mode_options(config.mode))
        if options.get("triton.cudagraphs", False):
            raise ValueError(
                f"use_cuda_graph captures the {path} path, whose compile config (mode={config.mode!r}) captures CUDA "
                "graphs itself; use mode='default' or 'max-autotune-no-cudagraphs', or set use_cuda_graph=False"
            )


@dataclass(frozen=True)
class EngineSpec:
    """An engine's settings for one model on one device, every ``None`` of the config decided.

    Attributes:
        device: the model's input device.
        layer_devices: the device each layer runs on (a ``device_map``-sharded model's cache follows them).
        async_batching: the step in flight runs while the next is scheduled (``AsyncScheduler``).
        compile_configs: the (varlen, decode) paths' compile configs; None runs a path uncompiled.
        cuda_graphs: (varlen, decode): replay that path as CUDA graphs.
        block_size: tokens per cache block (``page_size``).
        max_batch_tokens: the token budget of a step.
        safety_margin: the share of blocks kept free when admitting while requests run.
        shape: what each layer keeps per token, in the dtype attention computes in.
        layout: the cache's layer groups.
        num_blocks: block ids of the pool (the block manager's; a static path's cache has one more, the padding block).
        offload_gib: the CPU offload pool's GiB (0: none).
        context_length: the model's ``max_position_embeddings``, or None.
        vocab_size: the model's vocabulary.
        logits_width: columns of the model's logits (``model_info.logits_width``; structured outputs' bitmasks).
        use_flash: the steps run paged kernels (flash-attn's on CUDA, ``attention.cpu``'s on CPU), else SDPA.
        max_blocks_per_request: the decode fast path's table width (0: off).
        padding: how static-shape steps are padded; None when no path is compiled or graphed.
        return_logprobs: the engine records a logprob per generated token (the config's).
        logprobs_mode: the distribution those logprobs are taken from (the config's: "temperature", "raw", "sampled").
        tp: the tensor-parallel group of a ``tp_plan``-sharded model, else None.
    """

    device: torch.device
    layer_devices: list[torch.device]
    async_batching: bool
    compile_configs: tuple[CompileConfig | None, CompileConfig | None]
    cuda_graphs: tuple[bool, bool]
    block_size: int
    max_batch_tokens: int
    safety_margin: float
    shape: CacheShape
    layout: CacheLayout
    num_blocks: int
    offload_gib: float
    context_length: int | None
    vocab_size: int
    use_flash: bool
    max_blocks_per_request: int
    padding: PaddingRule | None
    return_logprobs: bool = False
    logprobs_mode: str = "temperature"
    logits_width: int = 0
    tp: TensorParallel | None = field(default=None, compare=False)

    @property
    def static(self) -> bool:
        """True when a path runs the static-shape step (compiled or CUDA-graphed)."""
        return self.padding is not None

    @classmethod
    def resolve(
        cls,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig,
        max_tokens_hint: int | Sequence[int] | None = None,
        fallback_compile_config: CompileConfig | None = None,
    ) -> EngineSpec:
        """Decide every setting, in the order the checks must run.

        Args:
            model: the model (checked by ``weights.model_info.check_model_supported`` already).
            config: the engine's configuration.
            max_tokens_hint: see ``Engine``: bounds the cache when ``config.num_blocks`` is None.
            fallback_compile_config: see ``Engine``.

        Raises:
            ValueError: ``use_async_batching=True`` under tensor parallelism (before any collective), KV heads not
                divisible by the TP size, CUDA graphs off CUDA, or a static path the engine cannot run
                (``_check_static_paths``); all before anything is allocated.
        """
        device = input_device(model)
        dev = device.type
        # Before any collective: async batching asked for under tensor parallelism raises on every rank.
        async_batching = resolve_async_batching(config, dev, tensor_parallel_mesh(model) is not None)
        # Before any sizing: the cache holds this rank's KV heads, which must split evenly.
        tp = TensorParallel.from_model(model, config)
        cuda_graphs = resolve_cuda_graphs(config, dev)
        compile_configs = resolve_compile_configs(config, fallback_compile_config)
        devices = layer_devices(model)
        _check_static_paths(compile_configs, cuda_graphs, devices)
        block_size = config.resolved_page_size(dev)
        max_batch_tokens = config.resolved_max_batch_tokens(dev)
        shape = CacheShape.from_model(model, attention_dtype(model), sliding_windows=config.sliding_window_cache)
        layout = CacheLayout.build(shape, devices)
        # num_blocks counts whole-model blocks (page_size tokens in every layer); the pool of the
        # layer groups holds the block ids that memory buys (CacheLayout.pool_blocks).
        model_blocks = config.num_blocks if config.num_blocks is not None else num_blocks_for_model(model, config)
        num_blocks = layout.pool_blocks(shape, model_blocks, block_size)
        if config.num_blocks is None and max_tokens_hint is not None:
            if isinstance(max_tokens_hint, int):  # that many tokens in all: in every group
                wanted = len(layout.groups) * -(-max_tokens_hint // block_size)
            else:  # these requests at once: each group holds what it keeps of each
                wanted = sum(layout.max_blocks_needed(t, max_batch_tokens, block_size) for t in max_tokens_hint)
            num_blocks = min(num_blocks, wanted + 1)  # one spare block for slack
        offload_gib = offload_space_gib(config)
        if tp is not None:  # every rank's scheduler must see the same cache and pool
            num_blocks = int(tp.agree_min(num_blocks))
            offload_gib = tp.agree_min(offload_gib)
        context_length = model_context_length(model)
        head_dims = [shape.layer(i).head_dim for i in range(shape.num_layers)]
        odd = [d for d in head_dims if d % 8]
        if all(d.type == "cpu" for d in devices):
            use_flash = choose_cpu_attention(config.cpu_attention)
        else:
            use_flash = choose_flash(devices, shape.dtype, odd[0] if odd else max(head_dims), block_size)
        padding = None
        if any(cuda_graphs) or any(c is not None for c in compile_configs):
            q_interval, kv_interval = resolve_padding_intervals(config, dev)
            # The padding block is the cache's last, past the block manager's blocks.
            padding = PaddingRule(
                q_interval, kv_interval, max_batch_tokens, num_blocks * block_size, block_size, pad_block=num_blocks
            )
        return cls(
            device=device,
            layer_devices=devices,
            async_batching=async_batching,
            compile_configs=compile_configs,
            cuda_graphs=cuda_graphs,
            block_size=block_size,
            max_batch_tokens=max_batch_tokens,
            safety_margin=resolve_safety_margin(config),
            shape=shape,
            layout=layout,
            num_blocks=num_blocks,
            offload_gib=offload_gib,
            context_length=context_length,
            vocab_size=vocab_size(model),
            use_flash=use_flash,
            max_blocks_per_request=resolve_max_blocks_per_request(config, num_blocks, block_size, context_length),
            padding=padding,
            return_logprobs=config.return_logprobs,
            logprobs_mode=config.logprobs_mode,
            logits_width=logits_width(model),
            tp=tp,
        )
