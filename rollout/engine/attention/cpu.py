"""rollout's paged attention kernel for CPU, with flash-attn's paged API, built from ``csrc/`` on first use.

On CPU the SDPA path of ``paged`` gathers every key and value a step reads into padded [B, Hkv, L, D] copies
(``index_select``) before ``scaled_dot_product_attention``: in a 32-request decode step of SmolLM2 on the 2-core
machine that copy took 24 ms of a 218 ms step, and vLLM's CPU build (whose ``cpu_attention_with_kv_cache`` reads
its paged cache in place) spends 2 ms there (docs/profile.md, issue 23). ``csrc/paged_attention_cpu.cpp`` is that
kind of kernel, written for rollout: each tile of query rows of one sequence reads its keys and values through
the block table, in place.

It takes flash-attn 2's paged inputs (``flash_attn_varlen_func`` with ``block_table``, ``flash_attn_with_kvcache``
with ``cache_seqlens``), so a CPU step is built and run as a flash-attn step of a CUDA machine is: the same input
builder (``worker.inputs``), the same metadata and the same call in ``paged._flash_attention``; only the
function differs. What it supports of that API: a causal mask aligned to the bottom right, a left window
(``window_size=(left, 0)``), softcap, grouped-query attention, float32, bfloat16 and float16 (computed in
float32), any head dim and page size. Rows after ``cu_seqlens_q[-1]`` (padding) get 0.

The kernel is compiled once per machine with the C++ compiler and ninja (``torch.utils.cpp_extension``; about 20 s
on 2 cores; cached in torch's extension directory, ``TORCH_EXTENSIONS_DIR``) for the CPU it runs on
(``-march=native``: the build's name, ``build_name()``, carries a digest of the CPU's flags, so a cache shared by
different CPUs builds one each, and a digest of the source, so each version of the kernel has a directory of its
own: two checkouts of different kernels, or a process loading the library while a changed source is rebuilt, would
otherwise share one directory and overwrite each other's library). A build is guarded by an OS file lock
(``filelock``), which the OS releases when its holder dies: torch's own guard is a lock file that a build killed
midway leaves behind, and every later ``load`` of that name then waits on it forever (this hung CI's first tests).
Under the OS lock no other rollout process is building, so a left-behind torch lock file is stale and removed; a
lock not won within ``BUILD_LOCK_TIMEOUT_S`` seconds means SDPA. ``ContinuousBatchingConfig.cpu_attention`` chooses:
``"auto"`` uses it when it builds and falls back to SDPA with one warning when it does not, ``"paged"`` requires it,
``"sdpa"`` never builds it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import filelock
import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# The extension's other operator: an unmerged LoRA adapter's product in one pass per row (``rollout_cpu::lora_add_``,
# which ``lora.LoraSlots`` calls on CPU when the engine has loaded this extension; why in the file's header).
LORA_SOURCE = Path(__file__).parent / "csrc" / "lora_cpu.cpp"
# And the Llama family's fused decoder-layer ops (``rollout_cpu::rms_norm``, ``fused_add_rms_norm_``,
# ``silu_and_mul``; ``engine.worker.fused_layer``).
FUSED_SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.cpp"
# And the batch-invariant kernels (``rollout_cpu::invariant_*``; ``engine.worker.invariant``).
INVARIANT_SOURCE = Path(__file__).parent / "csrc" / "invariant_cpu.cpp"
# And the GEMM on panel-packed weights (``rollout_cpu::packed_linear``, the engine's default float32 linear on
# AVX-512 machines: ``engine.worker.onednn.PackedWeights``; ``invariant_pack`` / ``invariant_mm_packed``, the
# batch-invariant mode's).
GEMM_SOURCE = Path(__file__).parent / "csrc" / "gemm_cpu.cpp"
# And the sampler's inverse-CDF draw (``rollout_cpu::inverse_cdf_sample``; ``engine.sample.sampler``).
SAMPLE_SOURCE = Path(__file__).parent / "csrc" / "sample_cpu.cpp"
SOURCES = (SOURCE, LORA_SOURCE, FUSED_SOURCE, INVARIANT_SOURCE, GEMM_SOURCE, SAMPLE_SOURCE)
# Included by the kernels: part of the build's digest, not compiled alone.
HEADERS = (Path(__file__).parent / "csrc" / "vec16.h", Path(__file__).parent / "csrc" / "fma16.h")
_BUILD_LOCK = threading.Lock()
# Seconds to wait for another process's build of the kernel (one build takes about 20 s on 2 cores).
BUILD_LOCK_TIMEOUT_S = 600.0
# The result of the process's one build and load (``load_kernel``): empty until then.
_LOADED: list[str | None] = []


def _cpu_digest() -> str:
    """A short digest of this CPU's model and instruction-set flags (the build targets them)."""
    flags = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name", "Features")):
                flags += line
    except OSError:  # not Linux: the processor string stands for the CPU
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_name() -> str:
    """The kernel's build name in torch's extension directory: this CPU's digest and the sources'."""
    source = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))).hexdigest()[:10]
    return f"rollout_cpu_attention_{_cpu_digest()}_{source}"


def load_kernel() -> str | None:
    """Build (once per machine) and load the kernel; None when loaded, else why it could not be.

    Thread-safe: the first call builds and loads, under a lock, and its result is kept for the process (the
    operator and its fake can be registered only once), so engines built at once in two threads wait for one build.
    """
    with _BUILD_LOCK:
        if not _LOADED:
            _LOADED.append(_build_and_load())
        return _LOADED[0]


def _build_and_load() -> str | None:
    """``load_kernel``'s one build. torch's C++ extension builder needs a C++ compiler and ninja; ninja's pip
    package puts its binary beside Python, which may not be on ``PATH`` (a virtual environment used without
    activating it), so its directory is added for the build."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # type: ignore[import-untyped]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            return "ninja is not installed (pip install ninja)"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = build_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
        with filelock.FileLock(str(build_dir) + ".rollout.lock", timeout=BUILD_LOCK_TIMEOUT_S):
            # torch's FileBaton lock file: we hold the OS lock, so a builder that left it is dead.
            (build_dir / "lock").unlink(missing_ok=True)
            logger.info("loading rollout's CPU paged-attention kernel (the first time on a machine it is compiled)")
            load(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
            )
    except filelock.Timeout:
        return f"another process held the kernel's build lock for over {BUILD_LOCK_TIMEOUT_S:.0f} s"
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "not available", with its reason
        return f"the kernel did not build: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"

    @torch.library.register_fake("rollout_cpu::paged_attention")
    def _fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, scale, window_left, softcap):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return None


def choose_cpu_attention(choice: str) -> bool:
    """Whether a CPU engine's steps run the paged kernel (True) or SDPA over gathered keys (False).

    Args:
        choice: ``ContinuousBatchingConfig.cpu_attention``: ``"auto"``, ``"paged"`` or ``"sdpa"``.

    Raises:
        RuntimeError: ``"paged"`` and the kernel cannot be built here (the reason named).
    """
    if choice == "sdpa":
        return False
    reason = load_kernel()
    if reason is None:
        return True
    if choice == "paged":
        raise RuntimeError(f"cpu_attention='paged': {reason}; use cpu_attention='auto' or 'sdpa' to run SDPA instead")
    _warn_once(reason)
    return False


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning("paged attention on CPU uses SDPA over gathered keys, not rollout's kernel: %s", reason)


def _window_left(causal: bool, window_size: tuple[int, int]) -> int:
    """The kernel's left window (-1: none), refusing what it does not compute (non-causal, a right window)."""
    if not causal or window_size[1] not in (0, -1):
        raise ValueError(f"the CPU kernel computes causal attention with no right window, got {causal=} {window_size=}")
    return window_size[0]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    block_table: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """flash-attn's paged ``flash_attn_varlen_func`` on CPU.

    Args:
        q: [T, H, D]; sequence b's queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``.
        k, v: the paged cache, [num_blocks, page, Hkv, D] (rows may be strided: a layer narrower than its cache
            slot), with a contiguous last dimension, in q's dtype (H a multiple of Hkv).
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1]; sequence b has ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys,
            its positions 0.. read through row b of ``block_table``.
        max_seqlen_q, max_seqlen_k: unused (flash-attn's launch sizes).
        softmax_scale: default D ** -0.5.
        causal, window_size: causal attention aligned to the bottom right, keys at most ``window_size[0]``
            positions back (-1: all).
        softcap: > 0 caps the scaled scores as softcap * tanh(score / softcap).
        block_table: int32 [B, W].
        invariant: run the batch-invariant kernel (``rollout_cpu::invariant_paged_attention``, float32: each query
            over its keys in ascending position, as ``rollout.batch_invariant()``'s attention) instead.

    Returns:
        [T, H, D] in q's dtype; rows from ``cu_seqlens_q[-1]`` on are 0.

    Raises:
        ValueError: a non-causal call or a right window. RuntimeError (from the kernel): a dtype, shape or
            length it does not take (a sequence with more keys than its table row holds, more queries than keys).
    """
    assert block_table is not None, "the CPU kernel reads a paged cache"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left = _window_left(causal, window_size)
    op = torch.ops.rollout_cpu.invariant_paged_attention if invariant else torch.ops.rollout_cpu.paged_attention
    return op(q, k, v, cu_seqlens_q, cu_seqlens_k, None, block_table, scale, left, softcap)


# The kernel writes 0 in the rows past cu_seqlens_q[-1] (flash-attn leaves them unwritten): the paged attention needs
# no guard after it (``paged._flash_attention``).
flash_attn_varlen_func.zeroes_rows_past_sequences = True  # type: ignore[attr-defined]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """flash-attn's paged ``flash_attn_with_kvcache`` on CPU, for one query token per sequence (a decode step).

    Args:
        q: [B, 1, H, D]; k_cache, v_cache, block_table and the rest as in ``flash_attn_varlen_func``.
        cache_seqlens: int32 [B]; sequence b's keys (this step's included, already in the cache).
        invariant: as in ``flash_attn_varlen_func``.

    Returns:
        [B, 1, H, D] in q's dtype.
    """
    assert q.shape[1] == 1, "the CPU kernel's kvcache form takes one query token per sequence"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left = _window_left(causal, window_size)
    op = torch.ops.rollout_cpu.invariant_paged_attention if invariant else torch.ops.rollout_cpu.paged_attention
    out = op(q[:, 0], k_cache, v_cache, None, None, cache_seqlens, block_table, scale, left, softcap)
    return out.unsqueeze(1)
