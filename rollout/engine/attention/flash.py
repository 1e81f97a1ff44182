"""flash-attn on CUDA: its paged kernels when installed, and whether they can serve a cache.

``choose_flash`` decides once per engine whether its steps run flash-attn's kernels (``paged``'s
CUDA path) or SDPA, by rules read in flash-attn's own source (below).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)
# Reasons already logged by ``choose_flash``: one line per reason per process, not per engine.
_LOGGED_FLASH_REASONS: set[str] = set()

# The kernels and flash-attn's version, None when it cannot be imported.
try:  # pragma: no cover - exercised on CUDA machines only
    from flash_attn import __version__ as flash_attn_version
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_varlen_func = None
    flash_attn_with_kvcache = None
    flash_attn_version = None

# What flash-attn's paged varlen kernel needs, read from flash-attn 2.8.3 (csrc/flash_attn/flash_api.cpp,
# mha_varlen_fwd, and flash_attn/flash_attn_interface.py):
# - flash_attn_varlen_func takes block_table since 2.5.7 and softcap since 2.6.0 (flash_attn_with_kvcache,
#   the decode fast path's kernel, has both by then too);
FLASH_ATTN_MIN_VERSION = (2, 6, 0)
# - "FlashAttention only supports Ampere GPUs or newer": compute capability major >= 8;
FLASH_MIN_COMPUTE_CAPABILITY = 8
# - q, k and v in fp16 or bf16, all of one dtype;
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# - a head dim of at most 256 and a multiple of 8 (the Python wrapper pads other head dims, which for a
#   paged cache would copy the whole cache at every call, so rollout treats them as unsupported);
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
# - "Paged KV cache block size must be divisible by 256";
FLASH_PAGE_MULTIPLE = 256
# - cu_seqlens, cache_seqlens and block_table in int32, every tensor on the device of q (the worker's input builder
#   makes them so).


def flash_attn_available() -> bool:
    """True when flash-attn's kernels can be imported (its varlen and with_kvcache kernels import together)."""
    return flash_attn_varlen_func is not None


def _version_tuple(version: str) -> tuple[int, ...]:
    """(2, 8, 3) for "2.8.3", "2.8.3.post1" or "2.8.3+cu12torch2.6"."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def flash_unsupported_reason(
    version: str | None,
    capabilities: Sequence[tuple[int, int] | None],
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
) -> str | None:
    """Why flash-attn's paged varlen kernel cannot serve a cache, or None when it can (the rules above).

    No device is queried, so tests can drive the rules with made-up GPUs.

    Args:
        version: flash-attn's ``__version__``, or None when it cannot be imported.
        capabilities: the CUDA compute capability (major, minor) of each device holding cache layers;
            None for a device that is not a CUDA GPU.
        dtype: the cache's dtype (the kernel reads q, k and v in it).
        head_dim: the attention head dim.
        page_size: tokens per cache block.

    Returns:
        A sentence naming the first unmet requirement, or None.
    """
    if version is None:
        return "flash-attn is not installed"
    if _version_tuple(version) < FLASH_ATTN_MIN_VERSION:
        need = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
        return f"flash-attn {version} is older than {need} (paged varlen attention with softcap)"
    for capability in capabilities:
        if capability is None:
            return "part of the cache is not on a CUDA GPU (the flash path is checked for NVIDIA GPUs only)"
        if capability[0] < FLASH_MIN_COMPUTE_CAPABILITY:
            return (
                f"a GPU has compute capability {capability[0]}.{capability[1]}; flash-attn 2 needs "
                f"{FLASH_MIN_COMPUTE_CAPABILITY}.0 (Ampere) or newer"
            )
    if dtype not in FLASH_DTYPES:
        return f"the KV cache is {dtype}; flash-attn reads only float16 and bfloat16"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % FLASH_HEAD_DIM_MULTIPLE:
        return (
            f"head_dim is {head_dim}; flash-attn needs a multiple of {FLASH_HEAD_DIM_MULTIPLE} "
            f"of at most {FLASH_MAX_HEAD_DIM}"
        )
    if page_size % FLASH_PAGE_MULTIPLE:
        return f"page_size is {page_size}; flash-attn's paged kernel needs a multiple of {FLASH_PAGE_MULTIPLE}"
    return None


def flash_support(devices: Sequence[torch.device], dtype: torch.dtype, head_dim: int, page_size: int) -> str | None:
    """``flash_unsupported_reason`` for a cache on these devices, with this machine's flash-attn and GPUs.

    Args:
        devices: the devices holding cache layers (one per layer, repeats allowed).
        dtype, head_dim, page_size: as in ``flash_unsupported_reason``.

    Returns:
        Why the flash path cannot be used, or None when it can.
    """
    capabilities: list[tuple[int, int] | None] = []
    for device in dict.fromkeys(devices):
        if device.type != "cuda" or torch.version.hip is not None:
            # ROCm reports its own architecture numbers here, and its flash-attn backend has other rules.
            capabilities.append(None)
        else:
            capabilities.append(torch.cuda.get_device_capability(device))
    version = flash_attn_version if flash_attn_varlen_func is not None else None
    return flash_unsupported_reason(version, capabilities, dtype, head_dim, page_size)


def choose_flash(devices: Sequence[torch.device], dtype: torch.dtype, head_dim: int, page_size: int) -> bool:
    """Whether an engine's steps run flash-attn's paged kernel (``flash_support``), else SDPA.

    Only a cache entirely on CUDA GPUs is considered; when flash-attn is installed but cannot serve
    this cache (GPU too old, fp32 cache, head dim, page size) the reason is logged as a warning, and
    a CUDA machine without flash-attn gets an info line (each reason once per process).
    """
    if any(d.type != "cuda" for d in devices):
        return False
    reason = flash_support(devices, dtype, head_dim, page_size)
    if reason is None:
        return True
    if reason not in _LOGGED_FLASH_REASONS:  # once per process: generate_batch builds an engine per call
        _LOGGED_FLASH_REASONS.add(reason)
        log = logger.info if not flash_attn_available() else logger.warning
        log("paged attention uses SDPA, not flash-attn: %s", reason)
    return False
