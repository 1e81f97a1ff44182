"""Engine configuration: one validated dataclass, and the one conversion of what callers pass for it.

Every field is checked in ``__post_init__``: a bad value fails with a ``ValueError`` naming the field and its allowed
values. Building a config has no side effect; what depends on the device or the model is resolved by ``engine.spec``.
``resolve_continuous_batching_config``, which every entry point calls, accepts rollout's config, a transformers
``ContinuousBatchingConfig``, None, or (deprecated, as in transformers) one inside the ``GenerationConfig``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from rollout.checks import check_bool, check_choice, check_int, check_number

if TYPE_CHECKING:  # imported where used: the console scripts parse their flags from this module before transformers
    from transformers.generation import CompileConfig
    from transformers.generation import ContinuousBatchingConfig as TransformersContinuousBatchingConfig

logger = logging.getLogger(__name__)

SCHEDULER_TYPES = ("fifo", "prefill_first")
LOGPROBS_MODES = ("temperature", "raw", "sampled")
# vLLM's names of the two modes that give logprobs (``--logprobs-mode``), read as rollout's: ``raw_logprobs`` is the
# model's unprocessed distribution, ``processed_logprobs`` the one the token was drawn from (penalties, structured
# outputs' mask, temperature, top-k/top-p). vLLM's ``raw_logits`` and ``processed_logits`` return logits: not offered.
LOGPROBS_MODE_ALIASES = {"raw_logprobs": "raw", "processed_logprobs": "sampled"}
PREEMPTION_MODES = ("recompute", "offload")
CPU_ATTENTION_CHOICES = ("auto", "paged", "sdpa")
FUSED_LAYERS_CHOICES = ("auto", "off")

# Block size that measured fastest on a 2-core CPU with SmolLM2-135M (see scripts/bench.py); on CUDA 256 matches
# transformers' continuous batching default.
DEFAULT_BLOCK_SIZE_CPU = 32
DEFAULT_BLOCK_SIZE_CUDA = 256
DEFAULT_MEMORY_PERCENT_CPU = 0.25
DEFAULT_MEMORY_PERCENT_CUDA = 0.9
MAX_COMPILE_LEVEL = 3


@dataclass
class ContinuousBatchingConfig:
    """Configuration of the continuous-batching engine.

    Field names follow ``transformers.ContinuousBatchingConfig`` where the two overlap.

    Attributes:
        page_size: tokens per KV-cache block (>= 4). ``None`` picks 256 on CUDA and 32 on CPU (measured fastest).
        num_blocks: blocks in the paged KV cache (>= 1). ``None`` sizes the cache from ``max_memory_percent`` of the
            usable memory (``engine.kv.sizing.num_blocks_for_memory``).
        max_batch_tokens: token budget of one engine step: query tokens (prefill chunks plus one per decoding request)
            computed in one forward (>= 1). ``None`` picks 2048 on CUDA and 512 on CPU.
        max_memory_percent: fraction (0, 1] of the usable memory the engine may take when ``num_blocks`` is ``None``:
            the KV cache plus one step's logits and sampling temporaries (``max_batch_tokens`` x vocabulary x (the model
            dtype's bytes + 8 float32), ``engine.kv.sizing.logits_workspace_bytes``). Usable memory is psutil's
            available RAM on CPU; on CUDA, the free memory (``torch.cuda.mem_get_info``) plus what torch's caching
            allocator holds unused (``memory_reserved - memory_allocated``), so an engine built after another one was
            destroyed gets the same share. ``None`` picks 0.9 on CUDA and 0.25 on CPU; next to a trainer, use
            ``trainers.setup.training_memory_percent(model)`` (the GRPO trainer and the TRL plugin do), since gradients
            and optimizer state are allocated only after the engine.
        max_requests_per_batch: most requests in one step (>= 1). ``None``: no cap beyond the token budget.
        allow_block_sharing: prefix caching; full prompt blocks are hashed and shared between requests (the G samples of
            a GRPO prompt share them).
        sliding_window_cache: sliding-window layers (Gemma 2/3/4, Mistral, Qwen2 with windows) keep only the KV blocks
            their next queries read, giving the others back to the pool (``engine.kv.manager``). False keeps every
            position of every layer, as full attention does (vLLM's ``--disable-hybrid-kv-cache-manager``): a fallback,
            and the baseline the saving is measured against.
        scheduler_type: ``"fifo"`` (running requests first, then waiting ones in arrival order) or ``"prefill_first"``
            (waiting requests are admitted before decodes get their tokens).
        safety_margin: fraction [0, 1) of the cache's blocks kept free when admitting a new request, so running requests
            can keep decoding without preemption. ``None`` picks 0.15 for fifo and 0.0 for prefill_first.
        return_logprobs: record one logprob per generated token.
        logprobs_mode: ``"temperature"`` (log_softmax(logits / T), what a GRPO/PPO trainer computes for the same token),
            ``"raw"`` (log_softmax(logits)) or ``"sampled"`` (the distribution the token was drawn from).
            ``"temperature"`` and ``"raw"`` read the model's logits before any logits processor (repetition penalty,
            no-repeat n-grams, bad words, min_length/min_new_tokens, min_p), so they stay what a plain forward of the
            same weights gives, and a banned token keeps a finite logprob. ``"sampled"`` reads the processed
            distribution: the processors and a structured-output request's grammar mask (renormalised over the allowed
            tokens), then temperature, top-k, top-p and min-p for sampled requests (a greedy request: log_softmax of its
            processed logits, which is the raw logprob when it has no processor and no constraint). vLLM's names are
            read as these (``"raw_logprobs"`` is ``"raw"``, ``"processed_logprobs"`` is ``"sampled"``); each output
            says which mode gave its logprobs (``GenerationOutput.logprobs_mode``).
        seed: seed of the engine's generator, used by sampled requests that carry no seed of their own.
        preemption_mode: ``"recompute"`` (free the blocks, re-prefill later) or ``"offload"`` (copy the blocks to a CPU
            pool of ``cpu_offload_space`` GiB). A ``cpu_offload_space`` above 0 (or None) turns offload on by itself, as
            in transformers; ``"offload"`` with a space of 0 has no pool and recomputes.
        cpu_offload_space: GiB of CPU memory for offloaded blocks (>= 0), capped at
            ``cpu_offload_space_safety_threshold`` of the available RAM. None sizes the pool to that cap.
        cpu_offload_space_safety_threshold: fraction [0, 1] of the available RAM (psutil's ``available``, when the
            engine is built) that the CPU pool may take.
        max_queue_size: most waiting requests (>= 0; 0 means unbounded).
        per_request_processors: as in transformers, whether a request may set its own logits-processor values
            (do_sample, temperature, top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size, min_new_tokens,
            min_length, bad_words_ids) through ``add_request(s)``. False: every request uses the generation config's,
            and ``add_request(s)`` refuses another value with a ValueError naming the field (transformers fails such a
            request too). max_new_tokens, eos ids, seeds and stop strings stay per request either way. Default True,
            unlike transformers' False: RL rollouts vary them per request.
        drop_unsupported_processors: a ``GenerationConfig`` field that asks for a logits processor rollout does not
            implement (typical_p, suppress_tokens, sequence_bias, ...; see
            ``sampling_params.unsupported_processor_fields``): True drops it with one warning per field, False refuses
            the config with a ValueError naming it.
        default_compile_level: 0 (eager, the default) to 3, transformers' levels, for a path without a compile config
            of its own: 1 compiles with ``mode="default", dynamic=True``, 2 with ``mode="max-autotune-no-cudagraphs",
            dynamic=True``, 3 the same with ``dynamic=False``; at 0 the generation config's ``compile_config`` is used
            when the user set one. The step's forward is compiled (sampling stays eager), one function per path and
            config shared by every engine, and runs padded (``q_padding_interval_size``); ``warmup()`` compiles it
            before the first request (``EngineStats.num_compiles`` counts). With ``dynamic=False`` every padded shape
            compiles on first use, up to dynamo's ``recompile_limit`` (8) per path: level 3 suits few shapes.
        varlen_compile_config: a ``transformers.CompileConfig`` (or a dict of its fields) for the varlen path: every
            step that is not decode-only (prefill chunks, mixed, scoring). None: see ``default_compile_level``.
        decode_compile_config: the same for decode-only steps (one query token per request, sampled).
        use_cuda_graph: capture the padded forward of each step shape in a CUDA graph and replay it (with static input
            buffers; an LRU of 64 graphs per engine): a bool for both paths, a (varlen, decode) pair, or None, which is
            off on every device for now (the capture has not run on a GPU yet; see ``engine.spec.resolve_cuda_graphs``).
            True on a device without CUDA is a ValueError, raised before the engine allocates anything; so is a graphed
            path whose compile mode captures CUDA graphs itself ("reduce-overhead", "max-autotune").
        q_padding_interval_size: a compiled or CUDA-graphed path pads a step's query rows, kept logits rows and decode
            rows to a multiple of this many (capped at ``max_batch_tokens``; >= 0, 0 picks the device's preset: 64 on
            CUDA, as in transformers, 4 on CPU, measured). A padded row is token 0 at position 0, writes a padding block
            no request owns and its output is dropped.
        kv_padding_interval_size: the same for the keys each request reads, then rounded to whole blocks (>= 0; 0 picks
            1024 on CUDA and 32 on CPU, measured; transformers' 16384 sizes flash-attn's block-table reads, while the
            padded step gathers every padded key).
        max_blocks_per_request: width (blocks, >= 0) of the block table of the CUDA decode fast path: a step in which
            every request decodes one token goes through flash-attn's ``flash_attn_with_kvcache`` when each request's
            keys fit in this many blocks, else through the varlen kernel. 0 turns the fast path off; None sizes it for
            the longest request the cache can hold (see ``engine.spec.resolve_max_blocks_per_request``). Used only where
            the engine runs a paged kernel (flash-attn on CUDA, rollout's on CPU).
        cpu_attention: the attention kernel of an engine on CPU: ``"auto"`` (default) rollout's paged kernel
            (``cpu_attention``, which reads the cache in place through the block tables; compiled with the machine's
            C++ compiler the first time, about 20 s), falling back to SDPA over gathered keys with one warning when it
            cannot be built; ``"paged"`` the kernel or a RuntimeError naming why not; ``"sdpa"`` SDPA. No effect on
            CUDA (flash-attn or SDPA, see ``flash.choose_flash``).
        use_async_batching: schedule and prepare step k+1 while step k's forward and sampling run (``batch_queue``;
            placeholders for step k's tokens filled on the device: ``async_scheduler``); a row of a request that step
            k ended is computed and dropped. Greedy tokens, logprobs, seeded samples and weight versions are what the
            synchronous loop gives. None picks per device (``engine.spec.resolve_async_batching``). Under tensor
            parallelism True raises a ValueError before anything is allocated, None is off.
        disable_nccl_graph_mixing: under tensor parallelism on CUDA, turn off NCCL's safety net for graph-captured
            collectives beside other collectives (transformers' meaning; rollout never replays two such graphs at once).
            A tensor-parallel engine on CUDA sets ``NCCL_GRAPH_MIXING_SUPPORT=0`` unless set, which covers the
            communicators started after it (a config alone changes no variable); export it at launch to cover those
            the model's loading started.
        cpu_group_timeout: seconds (> 0) a collective of the tensor-parallel ranks' CPU (gloo) group may wait for the
            other ranks before it raises (transformers' meaning). None: no timeout. Idle or paused ranks exchange a
            message at least every 50 ms, so only a stuck or dead rank runs into it.
        progress_log_interval: seconds between debug logs of throughput (> 0).
        block_size: deprecated alias of ``page_size`` (transformers renamed it in 5.17); it sets ``page_size`` with a
            ``FutureWarning``. Both set to different values is a ``ValueError``.
        enable_lora: serve LoRA adapters unmerged, per token (``lora.LoraSlots``): a step may mix requests of several
            adapters and of the base model; adapters are loaded with ``Engine.load_lora`` / the manager's, and a request
            selects one by name (``SamplingParams.lora``). Off: no adapter can be loaded.
        max_loras: adapters loaded at once (>= 1; TRL's adapter sync keeps ``max_staleness + 2``).
        max_lora_rank: the largest rank an adapter may have (>= 1); every slot is this wide.
        check_weight_contents: True (default): whether the weights changed is decided from their contents when a
            pause ends, when a manager starts and when an engine is built: a checksum of every parameter and buffer
            (``weights.weights_contents``; its cost per check is in docs/engine.md), so a change is seen however it
            was written (``param.data.copy_``, ``param.data = t``, ``load_state_dict``, a fused optimizer step, a
            write through a view or through numpy). False compares only which tensors the model holds and their
            version counters (and the process's optimizer steps): writes that bump no counter, ``param.data.copy_``
            among them, are then missed and old-weight KV may be served under them. Turn it off only if you always
            call ``update_weights`` (``update_weights(None)`` after changing the weights yourself) for every change.
        fused_layers: ``"auto"`` (default): eager float32 CPU steps of a Llama-family model (Llama, Mistral, Qwen2/3,
            SmolLM2) run its decoder layers with rollout's fused kernels (``engine.worker.fused_layer``: the residual
            add fused with RMSNorm, SiLU-and-mul; built with the paged-attention kernel, so only where
            ``cpu_attention`` uses it), other models and steps transformers' forward, said once in the log; ``"off"``:
            transformers' forward always.
        batch_invariant: compute every token's logits and logprobs with rollout's batch-invariant CPU kernels
            (``rollout.batch_invariant()``, ``engine.worker.invariant``): a row's result depends on nothing else in
            the step (other requests, chunking, prefix-cache hits, forks, preemption), and equals, bitwise, what a
            plain transformers forward of the same model computes inside ``rollout.batch_invariant()``, so a trainer's
            ``log_softmax(logits / T)`` equals the engine's logprob of the token and the importance ratio is exactly 1
            at equal weights. float32 on CPU, eager (no compile, no CUDA graphs), no LoRA; fused layers and oneDNN
            are off in this mode. The cost is in docs/bench.md.
        regional_compile: eager CPU steps that run transformers' forward (models outside the fused family, or
            ``fused_layers="off"``) run the decoder layers' norms and MLPs through ``torch.compile``d calls, one per
            module class shared by every layer (``engine.worker.regions``: seconds to compile where a whole-model
            compile takes minutes), the attention eager; entered only in the engine's step thread, so any other
            forward of the model is transformers' own. The engine compiles them when it is built; steps never
            compile (a region whose graphs do not match, or with a hook set, runs its own call). Compiled artifacts
            are kept in ``$ROLLOUT_COMPILE_CACHE`` (default ``~/.cache/rollout/compile``) for the next process
            (``engine.worker.compile_cache``). CPU only; not with compile levels or configs, CUDA graphs, LoRA,
            batch_invariant or tensor parallelism (ValueError). Off by default: docs/engine.md has what it costs and
            gains.
    """

    page_size: int | None = None
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    sliding_window_cache: bool = True
    scheduler_type: Literal["fifo", "prefill_first"] = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    logprobs_mode: Literal["temperature", "raw", "sampled", "raw_logprobs", "processed_logprobs"] = "temperature"
    seed: int | None = None
    preemption_mode: Literal["recompute", "offload"] = "recompute"
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = True
    drop_unsupported_processors: bool = True
    default_compile_level: int = 0
    varlen_compile_config: CompileConfig | dict | None = None
    decode_compile_config: CompileConfig | dict | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    max_blocks_per_request: int | None = None
    cpu_attention: Literal["auto", "paged", "sdpa"] = "auto"
    use_async_batching: bool | None = None
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    progress_log_interval: float = 10.0
    block_size: int | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    check_weight_contents: bool = True
    fused_layers: Literal["auto", "off"] = "auto"
    batch_invariant: bool = False
    regional_compile: bool = False

    def __post_init__(self) -> None:
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, minimum=1)
        check_int("max_lora_rank", self.max_lora_rank, minimum=1)
        check_int("block_size", self.block_size, minimum=4, allow_none=True)
        check_int("page_size", self.page_size, minimum=4, allow_none=True)
        if self.block_size is not None:
            if self.page_size is not None and self.page_size != self.block_size:
                raise ValueError(
                    f"page_size and its deprecated alias block_size must agree, got page_size={self.page_size} "
                    f"and block_size={self.block_size}; set page_size only"
                )
            if self.page_size is None:  # dataclasses.replace passes both back, already equal: warn once
                warnings.warn(
                    "ContinuousBatchingConfig(block_size=...) is deprecated, as in transformers 5.17: use page_size",
                    FutureWarning,
                    stacklevel=3,
                )
            self.page_size = self.block_size
        check_int("num_blocks", self.num_blocks, minimum=1, allow_none=True)
        check_int("max_batch_tokens", self.max_batch_tokens, minimum=1, allow_none=True)
        check_int("max_requests_per_batch", self.max_requests_per_batch, minimum=1, allow_none=True)
        check_int("max_queue_size", self.max_queue_size, minimum=0)
        check_number("max_memory_percent", self.max_memory_percent, 0.0, 1.0, min_open=True, allow_none=True)
        check_choice("scheduler_type", self.scheduler_type, SCHEDULER_TYPES)
        self.logprobs_mode = LOGPROBS_MODE_ALIASES.get(self.logprobs_mode, self.logprobs_mode)  # type: ignore[assignment]
        check_choice("logprobs_mode", self.logprobs_mode, (*LOGPROBS_MODES, *LOGPROBS_MODE_ALIASES))
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_number("safety_margin", self.safety_margin, 0.0, 1.0, max_open=True, allow_none=True)
        check_number("cpu_offload_space", self.cpu_offload_space, minimum=0.0, allow_none=True)  # GiB
        check_number("cpu_offload_space_safety_threshold", self.cpu_offload_space_safety_threshold, 0.0, 1.0)
        check_number("progress_log_interval", self.progress_log_interval, minimum=0.0, min_open=True)  # seconds
        check_int("seed", self.seed, minimum=0, maximum=2**62 - 1, allow_none=True)
        for name in (
            "allow_block_sharing",
            "sliding_window_cache",
            "return_logprobs",
            "per_request_processors",
            "drop_unsupported_processors",
            "check_weight_contents",
            "batch_invariant",
            "regional_compile",
        ):
            check_bool(name, getattr(self, name))
        check_int("default_compile_level", self.default_compile_level, minimum=0, maximum=MAX_COMPILE_LEVEL)
        for name in ("varlen_compile_config", "decode_compile_config"):
            value = getattr(self, name)
            if value is None:
                continue
            from transformers.generation import CompileConfig

            if isinstance(value, dict):
                try:
                    value = CompileConfig(**value)
                except TypeError as exc:
                    raise ValueError(f"{name}: {exc}; the keys are CompileConfig's fields") from None
                setattr(self, name, value)
            if not isinstance(value, CompileConfig):
                raise ValueError(
                    f"{name} must be None, a transformers.CompileConfig or a dict of its fields, got {value!r}"
                )
        graphs = self.use_cuda_graph
        if not (
            graphs is None
            or isinstance(graphs, bool)
            or (isinstance(graphs, (tuple, list)) and len(graphs) == 2 and all(isinstance(g, bool) for g in graphs))
        ):
            raise ValueError(f"use_cuda_graph must be None, a bool or a (varlen, decode) pair of bools, got {graphs!r}")
        if isinstance(graphs, list):
            self.use_cuda_graph = tuple(graphs)
        check_int("q_padding_interval_size", self.q_padding_interval_size, minimum=0)
        check_int("kv_padding_interval_size", self.kv_padding_interval_size, minimum=0)
        check_int("max_blocks_per_request", self.max_blocks_per_request, minimum=0, allow_none=True)
        check_choice("cpu_attention", self.cpu_attention, CPU_ATTENTION_CHOICES)
        check_choice("fused_layers", self.fused_layers, FUSED_LAYERS_CHOICES)
        if self.use_async_batching is not None:
            check_bool("use_async_batching", self.use_async_batching)
        check_bool("disable_nccl_graph_mixing", self.disable_nccl_graph_mixing)
        check_number("cpu_group_timeout", self.cpu_group_timeout, minimum=0.0, min_open=True, allow_none=True)

    def resolved_page_size(self, device_type: str) -> int:
        """Tokens per block for a device type (``"cpu"`` or ``"cuda"``)."""
        if self.page_size is not None:
            return self.page_size
        return DEFAULT_BLOCK_SIZE_CUDA if device_type == "cuda" else DEFAULT_BLOCK_SIZE_CPU

    def resolved_max_batch_tokens(self, device_type: str) -> int:
        """Token budget of one step for a device type."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 2048 if device_type == "cuda" else 512

    def resolved_memory_percent(self, device_type: str) -> float:
        """Fraction of the usable memory the engine (KV cache and step workspace) may take on a device type."""
        if self.max_memory_percent is not None:
            return float(self.max_memory_percent)
        return DEFAULT_MEMORY_PERCENT_CUDA if device_type == "cuda" else DEFAULT_MEMORY_PERCENT_CPU

    def resolved_cpu_offload_gib(self, available_bytes: int) -> float:
        """GiB of the CPU offload pool: ``cpu_offload_space`` capped at the safety threshold.

        Args:
            available_bytes: the RAM available now (psutil's ``virtual_memory().available``).

        Returns:
            0.0 when preempted requests are recomputed (no pool); otherwise
            ``min(cpu_offload_space, threshold * available)`` in GiB, or the cap alone when
            ``cpu_offload_space`` is None.
        """
        cap = self.cpu_offload_space_safety_threshold * available_bytes / 1024**3
        if self.cpu_offload_space is None:
            return cap
        return min(float(self.cpu_offload_space), cap)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the configurable fields."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_transformers(cls, config: TransformersContinuousBatchingConfig) -> ContinuousBatchingConfig:
        """Convert a ``transformers.ContinuousBatchingConfig``, field by field.

        A field rollout has under the same name is copied when it differs from transformers' default; a field left at
        transformers' default keeps rollout's default, which may depend on the device (``page_size`` 256 is
        transformers' default, so it reads as unset: 32 on CPU, 256 on CUDA). Fields rollout does not have (flash
        auto-switch, deprecated fields...) are dropped; the ones set away from their default are named in one warning.
        ``block_size`` was folded into ``page_size`` by transformers itself.

        Raises:
            ValueError: a copied value rollout does not accept (the message names the field).
        """
        ours = {f.name for f in fields(cls)} - {"block_size"}
        values: dict[str, Any] = {}
        ignored: list[str] = []
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:  # a required field has no default: always copy it
                default = dataclasses.MISSING
            if f.name == "block_size" or _same(value, default):
                continue
            if f.name in ours:
                values[f.name] = value
            else:
                ignored.append(f"{f.name}={value!r}")
        if ignored:
            logger.warning(
                "transformers ContinuousBatchingConfig: rollout does not use %s; ignored (see docs/api.md, "
                "API compatibility section)",
                ", ".join(ignored),
            )
        return cls(**values)


def _same(value: Any, default: Any) -> bool:
    # Compile configs and other objects may not compare; anything that cannot be compared differs.
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001
        return False


def resolve_continuous_batching_config(
    continuous_batching_config: ContinuousBatchingConfig | TransformersContinuousBatchingConfig | None,
    generation_config: Any = None,
) -> ContinuousBatchingConfig:
    """The engine configuration an entry point runs with.

    Args:
        continuous_batching_config: rollout's config, a ``transformers.ContinuousBatchingConfig`` (converted with
            ``ContinuousBatchingConfig.from_transformers``), or None.
        generation_config: the call's (resolved) ``GenerationConfig``. When no ``continuous_batching_config`` is given
            and it carries one in its own ``continuous_batching_config`` attribute, that one is used, with the
            ``FutureWarning`` transformers gives for this deprecated form.

    Returns:
        A validated ``ContinuousBatchingConfig`` (the default one when nothing is given).

    Raises:
        TypeError: a value that is neither config class (the message names the argument).
        ValueError: a converted value rollout does not accept.
    """
    if continuous_batching_config is None:
        nested = getattr(generation_config, "continuous_batching_config", None)
        if nested is not None:
            warnings.warn(
                "a ContinuousBatchingConfig inside the GenerationConfig is deprecated (transformers 5.13); "
                "pass it as continuous_batching_config= instead",
                FutureWarning,
                stacklevel=3,
            )
            continuous_batching_config = nested
    if continuous_batching_config is None:
        return ContinuousBatchingConfig()
    if isinstance(continuous_batching_config, ContinuousBatchingConfig):
        return continuous_batching_config
    from transformers.generation import ContinuousBatchingConfig as TransformersContinuousBatchingConfig

    if isinstance(continuous_batching_config, TransformersContinuousBatchingConfig):
        return ContinuousBatchingConfig.from_transformers(continuous_batching_config)
    raise TypeError(
        "continuous_batching_config must be a rollout.ContinuousBatchingConfig, a "
        f"transformers.ContinuousBatchingConfig or None, got {type(continuous_batching_config).__name__}"
    )


def workload_tokens_hint(workload_hints: Any) -> list[int] | None:
    """The per-request token counts that ``workload_hints`` describe, for sizing the KV cache.

    Args:
        workload_hints: transformers' ``WorkloadHints`` (or any object, or mapping, with ``max_prompt_length``,
            ``max_generated_length`` and ``num_requests``: ints >= 0), or None.

    Returns:
        ``num_requests`` entries of ``max_prompt_length + max_generated_length`` tokens; None when
        no hint is given or it describes nothing (a zero count or length).

    Raises:
        ValueError: a missing or negative field (the message names it).
    """
    if workload_hints is None:
        return None
    values = {}
    for name in ("max_prompt_length", "max_generated_length", "num_requests"):
        if isinstance(workload_hints, dict):
            value = workload_hints.get(name, 0)
        else:
            value = getattr(workload_hints, name, None)
        check_int(f"workload_hints.{name}", value, minimum=0)
        values[name] = value
    length = values["max_prompt_length"] + values["max_generated_length"]
    if length == 0 or values["num_requests"] == 0:
        return None
    return [length] * values["num_requests"]
