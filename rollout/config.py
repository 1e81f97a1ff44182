"""Engine configuration: one validated dataclass.

Every field is checked in ``__post_init__`` (with the shared helpers of ``checks``) so
that a bad value fails with a ``ValueError`` naming the field and its allowed values
before any memory is allocated or any request is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from .checks import check_bool, check_choice, check_int, check_number

SCHEDULER_TYPES = ("fifo", "prefill_first")
LOGPROBS_MODES = ("temperature", "raw", "sampled")
PREEMPTION_MODES = ("recompute", "offload")

# Block size that measured fastest on a 2-core CPU with SmolLM2-135M (see
# scripts/bench.py); on CUDA 256 matches transformers' continuous batching default.
DEFAULT_BLOCK_SIZE_CPU = 32
DEFAULT_BLOCK_SIZE_CUDA = 256
DEFAULT_MEMORY_PERCENT_CPU = 0.25
DEFAULT_MEMORY_PERCENT_CUDA = 0.9


@dataclass
class ContinuousBatchingConfig:
    """Configuration of the continuous-batching engine.

    Field names follow ``transformers.ContinuousBatchingConfig`` where the two
    overlap, so users of ``model.generate_batch`` find what they know.

    Attributes:
        block_size: tokens per KV-cache block (>= 4). ``None`` picks 256 on CUDA
            and 32 on CPU.
        num_blocks: blocks in the paged KV cache (>= 1). ``None`` sizes the cache to
            ``max_memory_percent`` of free memory (psutil on CPU,
            ``torch.cuda.mem_get_info`` on CUDA).
        max_batch_tokens: token budget of one engine step: query tokens (prefill
            chunks plus one per decoding request) computed in one forward (>= 1).
            ``None`` picks 2048 on CUDA and 512 on CPU.
        max_memory_percent: fraction (0, 1] of free memory the KV cache may use when
            ``num_blocks`` is ``None``. ``None`` picks 0.9 on CUDA and 0.25 on CPU.
        max_requests_per_batch: most requests in one step (>= 1). ``None``: no cap
            beyond the token budget.
        allow_block_sharing: prefix caching; full prompt blocks are hashed and
            shared between requests (the G samples of a GRPO prompt share them).
        scheduler_type: ``"fifo"`` (running requests first, then waiting ones in
            arrival order) or ``"prefill_first"`` (waiting requests are admitted
            before decodes get their tokens).
        safety_margin: fraction [0, 1) of the cache's blocks kept free when
            admitting a new request, so running requests can keep decoding without
            preemption. ``None`` picks 0.15 for fifo and 0.0 for prefill_first.
        return_logprobs: record one logprob per generated token.
        logprobs_mode: ``"temperature"`` (log_softmax(logits / T), what a GRPO/PPO
            trainer computes for the same token), ``"raw"`` (log_softmax(logits)) or
            ``"sampled"`` (the distribution the token was drawn from). ``"temperature"`` and
            ``"raw"`` read the model's logits before any logits processor (repetition penalty,
            no-repeat n-grams, bad words, min_length/min_new_tokens, min_p), so they stay what a
            plain forward of the same weights gives, and a banned token keeps a finite logprob.
            ``"sampled"`` reads the processed distribution: the processors, then temperature,
            top-k, top-p and min-p for sampled requests (a greedy request: log_softmax of its
            processed logits, which is the raw logprob when it has no processor).
        seed: seed of the engine's generator, used by sampled requests that carry
            no seed of their own.
        preemption_mode: ``"recompute"`` (free the blocks, re-prefill later) or
            ``"offload"`` (copy the blocks to a CPU pool of ``cpu_offload_space`` GiB).
        cpu_offload_space: GiB of CPU memory for offloaded blocks (>= 0).
        max_queue_size: most waiting requests (>= 0; 0 means unbounded).
        per_request_processors: as in transformers, whether a request may set its own
            logits-processor values (do_sample, temperature, top_k, top_p, min_p,
            repetition_penalty, no_repeat_ngram_size, min_new_tokens, min_length,
            bad_words_ids) through ``add_request(s)``. False: every request uses the
            generation config's, and ``add_request(s)`` refuses another value with a
            ValueError naming the field (transformers fails such a request too).
            max_new_tokens, eos ids, seeds and stop strings stay per request either way.
            Default True, unlike transformers' False: RL rollouts vary them per request.
        drop_unsupported_processors: a ``GenerationConfig`` field that asks for a logits
            processor rollout does not implement (typical_p, suppress_tokens, sequence_bias,
            ...; see ``sampling_params.unsupported_processor_fields``): True drops it with one
            warning per field, False refuses the config with a ValueError naming it.
        progress_log_interval: seconds between debug logs of throughput (> 0).
    """

    block_size: int | None = None
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = True
    scheduler_type: Literal["fifo", "prefill_first"] = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    logprobs_mode: Literal["temperature", "raw", "sampled"] = "temperature"
    seed: int | None = None
    preemption_mode: Literal["recompute", "offload"] = "recompute"
    cpu_offload_space: float = 0.0
    max_queue_size: int = 0
    per_request_processors: bool = True
    drop_unsupported_processors: bool = True
    progress_log_interval: float = 10.0

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, minimum=4, allow_none=True)
        check_int("num_blocks", self.num_blocks, minimum=1, allow_none=True)
        check_int("max_batch_tokens", self.max_batch_tokens, minimum=1, allow_none=True)
        check_int("max_requests_per_batch", self.max_requests_per_batch, minimum=1, allow_none=True)
        check_int("max_queue_size", self.max_queue_size, minimum=0)
        check_number("max_memory_percent", self.max_memory_percent, 0.0, 1.0, min_open=True, allow_none=True)
        check_choice("scheduler_type", self.scheduler_type, SCHEDULER_TYPES)
        check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_number("safety_margin", self.safety_margin, 0.0, 1.0, max_open=True, allow_none=True)
        check_number("cpu_offload_space", self.cpu_offload_space, minimum=0.0)  # GiB
        check_number("progress_log_interval", self.progress_log_interval, minimum=0.0, min_open=True)  # seconds
        check_int("seed", self.seed, minimum=0, maximum=2**62 - 1, allow_none=True)
        for name in ("allow_block_sharing", "return_logprobs", "per_request_processors", "drop_unsupported_processors"):
            check_bool(name, getattr(self, name))

    def resolved_block_size(self, device_type: str) -> int:
        """Block size in tokens for a device type (``"cpu"`` or ``"cuda"``)."""
        if self.block_size is not None:
            return self.block_size
        return DEFAULT_BLOCK_SIZE_CUDA if device_type == "cuda" else DEFAULT_BLOCK_SIZE_CPU

    def resolved_max_batch_tokens(self, device_type: str) -> int:
        """Token budget of one step for a device type."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 2048 if device_type == "cuda" else 512

    def resolved_memory_percent(self, device_type: str) -> float:
        """Fraction of free memory the KV cache may take for a device type."""
        if self.max_memory_percent is not None:
            return float(self.max_memory_percent)
        return DEFAULT_MEMORY_PERCENT_CUDA if device_type == "cuda" else DEFAULT_MEMORY_PERCENT_CPU

    def resolved_safety_margin(self) -> float:
        """Safety margin: the explicit value, else 0.15 for fifo and 0.0 for prefill_first."""
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return 0.15 if self.scheduler_type == "fifo" else 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the configurable fields."""
        return [f.name for f in fields(cls)]
