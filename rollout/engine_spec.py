"""What an engine is, resolved once from config x model x device: ``EngineSpec``.

Every setting that depends on the device or the model (the page size and token budget per device type, the
compiled and CUDA-graphed paths, async batching, the KV layer groups, the cache's size, flash-attn or SDPA,
the decode fast path's width, the static step's padding) is decided here, in one place, before anything is
allocated; the engine builds its parts from the spec and reads no ``resolved_*`` method itself. Tensor
parallelism joins here too (``distributed.TensorParallel``): the ranks agree on the cache's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from .cache_sizing import num_blocks_for_model, offload_space_gib
from .config import ContinuousBatchingConfig
from .distributed import TensorParallel, tensor_parallel_mesh
from .flash import choose_flash
from .kv_cache import CacheLayout, CacheShape
from .models import attention_dtype, input_device, layer_devices, model_context_length, vocab_size
from .static_step import PaddingRule

__all__ = ["EngineSpec"]


def _check_static_paths(
    compile_configs: tuple[CompileConfig | None, CompileConfig | None],
    cuda_graphs: tuple[bool, bool],
    devices: Sequence[torch.device],
) -> None:
    """Refuse static-shape settings the engine cannot run, before anything is allocated.

    Raises:
        ValueError: a compiled or graphed path on a model whose layers span several devices (the
            padded step builds its metadata on one device), or a CUDA-graphed path whose compile mode
            captures CUDA graphs itself (inductor's ``triton.cudagraphs``: "reduce-overhead",
            "max-autotune"), which would capture inside our capture.
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
        num_blocks: block ids of the pool (the block manager's; a static path's cache has one more, the
            padding block).
        offload_gib: the CPU offload pool's GiB (0: none).
        context_length: the model's ``max_position_embeddings``, or None.
        vocab_size: the model's vocabulary.
        use_flash: the steps run flash-attn's paged kernels (CUDA), else SDPA.
        max_blocks_per_request: the CUDA decode fast path's table width (0: off).
        padding: how static-shape steps are padded; None when no path is compiled or graphed.
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
            model: the model (checked by ``models.check_model_supported`` already).
            config: the engine's configuration.
            max_tokens_hint: see ``Engine``: bounds the cache when ``config.num_blocks`` is None.
            fallback_compile_config: see ``Engine``.

        Raises:
            ValueError: ``use_async_batching=True`` under tensor parallelism (before any collective), KV
                heads not divisible by the TP size, CUDA graphs off CUDA, or a static path the engine
                cannot run (``_check_static_paths``); all before anything is allocated.
        """
        device = input_device(model)
        dev = device.type
        # Before any collective: async batching asked for under tensor parallelism raises on every rank.
        async_batching = config.resolved_async_batching(dev, tensor_parallel_mesh(model) is not None)
        # Before any sizing: the cache holds this rank's KV heads, which must split evenly.
        tp = TensorParallel.from_model(model, config)
        cuda_graphs = config.resolved_cuda_graphs(dev)
        compile_configs = config.resolved_compile_configs(fallback_compile_config)
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
        use_flash = choose_flash(devices, shape.dtype, odd[0] if odd else max(head_dims), block_size)
        padding = None
        if any(cuda_graphs) or any(c is not None for c in compile_configs):
            q_interval, kv_interval = config.resolved_padding_intervals(dev)
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
            safety_margin=config.resolved_safety_margin(),
            shape=shape,
            layout=layout,
            num_blocks=num_blocks,
            offload_gib=offload_gib,
            context_length=context_length,
            vocab_size=vocab_size(model),
            use_flash=use_flash,
            max_blocks_per_request=config.resolved_max_blocks_per_request(num_blocks, block_size, context_length),
            padding=padding,
            tp=tp,
        )
