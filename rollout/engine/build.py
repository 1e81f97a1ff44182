"""An engine's parts, built from its spec: ``build_parts``.

Everything that depends on the model or the device is decided first (``spec.EngineSpec.resolve``), and every refusal is
raised before anything is allocated; then each part is built from the spec, in the order they depend on one another:
the KV cache and its CPU offload pool, the block pool and the KV cache manager over them, the LoRA slots, the scheduler
(the async one with async batching) and the model runner. nano-vllm's ``LLMEngine.__init__`` and vLLM's ``EngineCore``
construction are the models; ``Engine`` holds the parts and runs the steps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.generation import CompileConfig

from rollout.config import ContinuousBatchingConfig
from rollout.engine.attention.registry import original_implementation
from rollout.engine.kv.block_pool import BlockManager
from rollout.engine.kv.cache import PagedKVCache
from rollout.engine.kv.manager import KVCacheManager
from rollout.engine.kv.offload import CPUOffloadPool
from rollout.engine.kv.sizing import allocation_error, check_cache_fits
from rollout.engine.sched.async_scheduler import AsyncScheduler
from rollout.engine.sched.scheduler import Scheduler
from rollout.engine.spec import EngineSpec
from rollout.engine.worker.compile_cache import CompileCache, cache_key
from rollout.engine.worker.fused_layer import fused_support
from rollout.engine.worker.regions import install
from rollout.engine.worker.runner import ModelRunner
from rollout.lora import LoraSlots
from rollout.weights.model_info import check_model_supported
from rollout.weights.versions import WeightWatch, watch_of

logger = logging.getLogger(__name__)

__all__ = ["EngineParts", "build_parts"]


@dataclass
class EngineParts:
    """The parts of one engine.

    Attributes:
        spec: the settings resolved for this model on this device.
        cache: the paged KV cache (one padding block past the pool's when a path runs padded).
        offload_pool: the pinned CPU pool of offload preemption, or None (``cpu_offload_space`` 0).
        block_manager: the block pool and prefix cache.
        kv_cache_manager: the requests' blocks, per layer group.
        lora: the LoRA adapters' slots and hooks (``enable_lora``), or None.
        scheduler: the scheduler (``AsyncScheduler`` with async batching).
        runner: the model runner.
        watch: the model's weight version, shared with every engine on the model; the scheduler starts at it.
    """

    spec: EngineSpec
    cache: PagedKVCache
    offload_pool: CPUOffloadPool | None
    block_manager: BlockManager
    kv_cache_manager: KVCacheManager
    lora: LoraSlots | None
    scheduler: Scheduler
    runner: ModelRunner
    watch: WeightWatch


def fused_layers_of(model: torch.nn.Module, config: ContinuousBatchingConfig, cpu_kernels: bool) -> bool:
    """Whether the engine's eager steps run ``engine.worker.fused_layer`` (``config.fused_layers``): ``"auto"`` where
    rollout's CPU kernels are loaded and the model is supported; a model that is not gets one log line saying why."""
    if config.fused_layers == "off" or config.batch_invariant or not cpu_kernels:
        return False
    reason = fused_support(model)
    if reason is not None:
        logger.info("fused decoder layers off for this model (transformers' forward instead): %s", reason)
    return reason is None


def check_batch_invariant(model: torch.nn.Module, config: ContinuousBatchingConfig, spec: EngineSpec) -> None:
    """Refuse ``batch_invariant=True`` where the engine cannot keep its promise, before anything is allocated.

    Raises:
        ValueError: naming ``batch_invariant`` and what conflicts: a device other than the CPU, a parameter that is
            not float32, a compiled or CUDA-graphed path, LoRA, tensor parallelism, rollout's CPU kernels not in use
            (``cpu_attention='sdpa'``, or the build failed: the reason is in the log), or a model whose own attention
            is not SDPA (what a trainer's forward of it would run, and the mode routes).
    """
    if not config.batch_invariant:
        return
    why = None
    if spec.device.type != "cpu":
        why = f"it runs on the CPU only for now, the engine's device is {spec.device.type!r}"
    elif any(p.dtype != torch.float32 for p in model.parameters()):
        why = "the model's parameters must be float32"
    elif any(c is not None for c in spec.compile_configs) or any(spec.cuda_graphs):
        why = "steps must be eager: set default_compile_level=0 and no compile configs or CUDA graphs"
    elif config.enable_lora:
        why = "LoRA adapters are not served in this mode yet (enable_lora must be False)"
    elif spec.tp is not None:
        why = "a tensor-parallel model is not supported in this mode"
    elif not spec.use_flash:
        why = "it needs rollout's CPU kernels: cpu_attention must be 'auto' or 'paged' and the kernels must build"
    elif original_implementation(model) != "sdpa":
        why = (
            f"the model's own forward runs {original_implementation(model)!r} attention, which batch_invariant() does "
            "not route (only SDPA): a trainer's forward could not match the engine; load it with "
            "attn_implementation='sdpa' (models that need eager attention, such as Gemma 2's softcapping, are not "
            "supported)"
        )
    if why is not None:
        raise ValueError(f"batch_invariant=True: {why}")


def check_regional_compile(config: ContinuousBatchingConfig, spec: EngineSpec) -> None:
    """Refuse ``regional_compile=True`` with what it cannot run, before anything is allocated.

    Raises:
        ValueError: naming ``regional_compile`` and the conflict: a device other than the CPU, a compiled or
            CUDA-graphed path (compile levels and configs compile the whole forward), LoRA, ``batch_invariant`` or
            tensor parallelism.
    """
    if not config.regional_compile:
        return
    why = None
    if spec.device.type != "cpu":
        why = f"it runs on the CPU only for now, the engine's device is {spec.device.type!r}"
    elif any(c is not None for c in spec.compile_configs) or any(spec.cuda_graphs):
        why = "it compiles the decoder layers of eager steps: set default_compile_level=0, no compile configs (the "
        why += "generation config's compile_config included) and no CUDA graphs"
    elif config.enable_lora:
        why = "LoRA adapters are not served with it yet (enable_lora must be False)"
    elif config.batch_invariant:
        why = "batch_invariant=True runs its own kernels, eager"
    elif spec.tp is not None:
        why = "a tensor-parallel model is not supported with it"
    if why is not None:
        raise ValueError(f"regional_compile=True: {why}")


def regional_compile_of(
    model: torch.nn.Module, config: ContinuousBatchingConfig, spec: EngineSpec, fused: bool
) -> CompileCache | None:
    """Install the decoder layers' dispatchers for ``regional_compile`` and load the model's compile cache.

    Returns:
        The compile cache the runner saves new compilations to, or None where nothing is compiled: the option off,
        the fused decoder layers running the steps, or layers the dispatchers cannot take (said once in the log).
    """
    if not config.regional_compile:
        return None
    if fused:
        logger.info("regional_compile: the fused decoder layers run this model's steps; nothing to compile")
        return None
    reason = install(model)
    if reason is not None:
        logger.info("regional_compile off for this model (transformers' eager forward instead): %s", reason)
        return None
    cache = CompileCache(
        cache_key(model, {"dynamic": True, "cpu_kernels": spec.use_flash, "regions": "norms and MLPs"})
    )
    cache.load()
    return cache


def build_parts(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    max_tokens_hint: int | Sequence[int] | None = None,
    fallback_compile_config: CompileConfig | None = None,
) -> EngineParts:
    """Resolve the spec of ``model`` under ``config``, then build the parts an engine runs.

    Args:
        model: a ``transformers`` decoder-only causal LM (its attention is switched by the engine, not here).
        config: the engine's configuration.
        max_tokens_hint: bounds the cache when ``config.num_blocks`` is None (see ``Engine``).
        fallback_compile_config: the generation config's ``compile_config`` (see ``Engine``).

    Returns:
        The parts, the scheduler at the model's weight version (weights changed since the model's last check make a
        new one first: ``check_weight_contents``).

    Raises:
        UnsupportedModelError: the model cannot be paged (``weights.model_info.check_model_supported``).
        ValueError: what ``EngineSpec.resolve`` refuses (async batching or KV heads under tensor parallelism, CUDA
            graphs off CUDA, a static path the engine cannot run), or ``enable_lora=True`` on a tensor-parallel model;
            FieldError (``num_blocks``): a cache larger than the usable memory (``kv.sizing.check_cache_fits``); all
            before anything is allocated.
        CacheAllocationError: the cache's allocation failed (a ``MemoryError`` naming ``num_blocks`` and
            ``max_memory_percent``).
    """
    check_model_supported(model)
    spec = EngineSpec.resolve(model, config, max_tokens_hint, fallback_compile_config)
    check_batch_invariant(model, config, spec)
    check_regional_compile(config, spec)
    if config.enable_lora and spec.tp is not None:
        raise ValueError("enable_lora=True: LoRA adapters are not served on a tensor-parallel model yet")
    check_cache_fits(model, config)
    try:
        cache = PagedKVCache(
            spec.shape, spec.num_blocks + int(spec.static), spec.block_size, spec.device, spec.layer_devices
        )
    except (MemoryError, RuntimeError) as e:
        failure = allocation_error(model, config, e)
        if failure is None:
            raise
        raise failure from e
    offload_pool = None
    if spec.offload_gib > 0:
        pin = spec.device.type == "cuda"
        offload_pool = CPUOffloadPool(spec.shape, spec.offload_gib, spec.block_size, pin, cache.layout)
    block_manager = BlockManager(spec.num_blocks, spec.block_size, config.allow_block_sharing)
    kv_cache_manager = KVCacheManager(block_manager, spec.safety_margin, offload_pool, cache.layout.sliding_windows)
    # The LoRA adapters (enable_lora): hooks on the targeted linear layers, each token under its request's; on CPU
    # through rollout's kernel where the paged-attention extension (which holds it) is loaded.
    cpu_kernels = spec.use_flash and spec.device.type == "cpu"  # rollout's C++ extension is loaded
    lora = None
    if config.enable_lora:
        lora = LoraSlots(model, config.max_loras, config.max_lora_rank, cpu_kernel=cpu_kernels)
    scheduler_class = AsyncScheduler if spec.async_batching else Scheduler
    scheduler = scheduler_class(
        kv_cache_manager, spec.max_batch_tokens, config.max_requests_per_batch, config.scheduler_type
    )
    fused = fused_layers_of(model, config, cpu_kernels)
    compile_cache = regional_compile_of(model, config, spec, fused)
    runner = ModelRunner(
        model,
        cache,
        spec.use_flash,
        offload_pool,
        seed=config.seed,
        logprobs_mode=config.logprobs_mode,
        return_logprobs=config.return_logprobs,
        max_blocks_per_request=spec.max_blocks_per_request,
        compile_configs=spec.compile_configs,
        cuda_graphs=spec.cuda_graphs,
        padding=spec.padding,
        async_batching=spec.async_batching,
        lora=lora,
        fused_layers=fused,
        batch_invariant=config.batch_invariant,
        regional=compile_cache is not None,
        compile_cache=compile_cache,
    )
    # The model's weight version, shared with every engine on it: weights changed since the last check (by any means:
    # check_weight_contents) make a new one before this engine starts at it.
    watch = watch_of(model)
    watch.bump_if_changed(None, config.check_weight_contents)
    scheduler.weight_version, scheduler.base_version = watch.version, watch.base_version
    return EngineParts(spec, cache, offload_pool, block_manager, kv_cache_manager, lora, scheduler, runner, watch)
