"""Batch invariance: the engine's logprobs bitwise equal to the trainer's own forward, in any batch.

RL's importance ratio is ``exp(logp_trainer - logp_rollout)``. The engine and the trainer run the same transformers
modules on the same weights, but a token's logits still differ in the last bits: a decode step runs 1-row GEMMs where
the trainer runs T-row ones, MKL and oneDNN choose their blocking (and with it the order of the sum over K) by the row
count, the engine's paged attention sums over keys in another order than the trainer's SDPA, and ATen computes the
tail of a vectorized elementwise loop with scalar libm calls that round differently from the vector ones.

``batch_invariant()`` is a context manager under which every operation whose result could depend on the other rows
runs one of rollout's kernels instead (``attention/csrc/invariant_cpu.cpp``, where the rules are written out):

- ``aten.mm``, ``aten.addmm`` and ``aten.linear`` of a linear layer (``x @ W^T``): each element one chain of FMAs over
  K in ascending order (threads split rows and columns, never K), on W packed in column panels (``InvariantPacks``);
- ``aten.mean.dim``, ``aten._log_softmax`` and ``aten.logsumexp`` over the last dimension: each row alone, in one
  order (RMSNorm's mean, the logprobs; ``log_softmax`` is ``x - logsumexp`` computed once, so a trainer that takes
  the selected logit minus ``logsumexp``, as TRL does, gets the same float);
- ``aten.silu``, ``aten.gelu``, ``aten.cos``, ``aten.sin``: the same formula for every element wherever it lies;
- SDPA (transformers' ``sdpa`` attention, the trainer's): ``aten.scaled_dot_product_attention`` as it arrives whole
  without autograd, and ATen's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``) it runs
  with autograd: each query over its visible keys in ascending position (``invariant_attention_dense``, which also
  gives the logsumexp the flash backward reads); the engine's paged attention runs the same per-query code over its
  cache (``invariant_paged_attention``), after the step wrote its keys and values.

Everything else (adds, multiplies, divisions, ``rsqrt``, copies, embedding lookups) is exact elementwise IEEE
arithmetic, the same for a row wherever it lies. The engine runs its steps under the context when
``ContinuousBatchingConfig(batch_invariant=True)``; a trainer runs its forward under it. Then a token's
``log_softmax(logits / T)`` is the same float on both sides (tests/test_batch_invariant.py compares with ``==``).

The mode is thread-local (a ``TorchDispatchMode`` on the entering thread's stack, below autograd, so a backward run
inside it, and a checkpointed layer's recomputation, take the same operations): another thread's forward, the
engine's included, is untouched. Only the forward is made invariant; the backward runs ATen's kernels for the
products it forms (another layout than a linear layer's) and ATen's flash-attention backward.

The anchors: Thinking Machines' ``batch_invariant_ops`` (overrides of ``aten::mm``, ``addmm``, ``_log_softmax``,
``mean.dim`` with fixed-tile kernels, no split-K), vLLM's batch-invariant mode with TorchTitan and SGLang's
deterministic mode (attention with a fixed split size, the KV cache written before it is read); those run on GPUs.
Here the kernels are rollout's C++ CPU kernels, float32 only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.engine.attention.cpu import load_kernel
from rollout.engine.worker.onednn import _version_of
from rollout.weights.versions import optimizer_steps

aten = torch.ops.aten
_UNARY = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "cos": 3, "sin": 4}


class InvariantPacks:
    """The linear weights packed for ``invariant_mm_packed`` (column panels), each made on first use and remade when
    the weight is not the one packed: another storage, shape or strides, or another version counter (an in-place
    update: an optimizer step, ``update_weights``), as the engine's oneDNN copies (``onednn.PackedWeights``). All are
    dropped by ``clear`` (the engine calls it at a new weight version) and when an optimizer step was taken since the
    last ``batch_invariant()`` entered with them (a fused optimizer bumps no version counter). A tensor without a
    version counter (an inference tensor) is packed at every call.

    An engine keeps one (its steps reuse the copies: packing the LM head costs tens of milliseconds); only
    ``aten.linear`` reads it, which reaches the mode with the parameter itself under ``torch.inference_mode`` (the
    engine's steps). A ``batch_invariant()`` entered without one packs each weight at each call. Thread-safe.
    """

    def __init__(self) -> None:
        # (data_ptr, shape, strides) -> (version, the tensor packed, its copy). The tensor is held so that its memory
        # cannot be reused by another tensor while its copy is kept (a freed temporary's address would otherwise
        # find a stale copy).
        self._packs: dict[tuple, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._optimizer_steps = optimizer_steps()

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """float32 [ceil(N / 32), K, 32]: ``weight`` [N, K] packed (a copy kept for its next use)."""
        version = _version_of(weight)
        if version is None:  # an inference tensor: no version counter, so no copy could be trusted later
            return torch.ops.rollout_cpu.invariant_pack(weight)
        key = (weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))
        entry = self._packs.get(key)
        if entry is None or entry[0] != version:
            with self._lock:
                entry = (version, weight, torch.ops.rollout_cpu.invariant_pack(weight))
                self._packs[key] = entry
        return entry[2]

    def clear(self) -> None:
        """Drop every copy (each is remade on its next use)."""
        with self._lock:
            self._packs.clear()

    def check_optimizer_steps(self) -> None:
        steps = optimizer_steps()
        if steps != self._optimizer_steps:
            self.clear()
            self._optimizer_steps = steps


# The packed weights of the batch_invariant() this thread (or task) is in.
_PACKS: contextvars.ContextVar[InvariantPacks | None] = contextvars.ContextVar("rollout_invariant_packs", default=None)


def _cpu_float(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _routable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors (float32 on the CPU); a floating-point operation they cannot take runs
    with ATen's kernels, said once per dtype and device (its rows are then not batch-invariant)."""
    if _cpu_float(*tensors):
        return True
    for t in tensors:
        if t.is_floating_point() and (t.device.type != "cpu" or t.dtype != torch.float32):
            _warn_not_routed(str(t.dtype), t.device.type)
    return False


@functools.cache
def _warn_not_routed(dtype: str, device: str) -> None:
    warnings.warn(
        f"batch_invariant(): a {dtype} operation on {device} ran with ATen's kernels (rollout's invariant kernels are "
        "float32 on the CPU): its rows are not batch-invariant",
        stacklevel=4,
    )


def _matmul_wt(x: torch.Tensor, weight: torch.Tensor, cached: bool) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T by the invariant kernel, on a packed copy of ``weight``: the context's kept copy
    when ``cached`` and the context has an ``InvariantPacks``, else one made for this call."""
    packs = _PACKS.get() if cached else None
    packed = packs.packed(weight) if packs is not None else torch.ops.rollout_cpu.invariant_pack(weight)
    return torch.ops.rollout_cpu.invariant_mm_packed(x, packed, weight.shape[0])


def _mm(a: torch.Tensor, b: torch.Tensor) -> Any:
    """``a @ b`` when it is a linear layer's ``x @ W^T`` (b = W.t(), W's rows contiguous); other layouts (autograd's
    products) keep ATen's kernel. Never from a kept copy: ``b`` is a view made below autograd, whose version counter
    does not follow the parameter's (an optimizer step inside one context would go unseen)."""
    if not _routable(a, b) or a.stride(-1) != 1 or b.stride(0) != 1:
        return NotImplemented
    return _matmul_wt(a, b.t(), cached=False)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> Any:
    if beta != 1 or alpha != 1:
        return NotImplemented
    out = _mm(a, b)
    return out if out is NotImplemented else out + bias


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    """``F.linear``, which reaches the mode whole under ``torch.inference_mode`` (the engine's steps); with autograd
    it arrives as ``mm`` / ``addmm`` of the same rows."""
    if not _routable(x, weight) or weight.dim() != 2 or weight.stride(-1) != 1 or x.dim() == 0:
        return NotImplemented
    out = _matmul_wt(x.reshape(-1, x.shape[-1]), weight, cached=True)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _last_dim(x: torch.Tensor, dim: Any) -> bool:
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return x.dim() > 0 and len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _mean(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    if not _routable(x) or dtype not in (None, torch.float32) or not _last_dim(x, dim) or x.shape[-1] == 0:
        return NotImplemented
    out = torch.ops.rollout_cpu.invariant_mean(_rows(x)).view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> Any:
    if not _routable(x) or half_to_float or not _last_dim(x, dim) or x.shape[-1] == 0:
        return NotImplemented
    return torch.ops.rollout_cpu.invariant_log_softmax(_rows(x)).view(x.shape)


def _logsumexp(x: torch.Tensor, dim: Any, keepdim: bool = False) -> Any:
    """``torch.logsumexp`` over the last dimension (TRL's ``selective_log_softmax``: the selected logit minus it, the
    same float as ``log_softmax``'s element)."""
    if not _routable(x) or not _last_dim(x, dim) or x.shape[-1] == 0:
        return NotImplemented
    out = torch.ops.rollout_cpu.invariant_logsumexp(_rows(x)).view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def _log_softmax_int(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> Any:
    """``torch.log_softmax`` as it reaches the mode under ``torch.inference_mode`` (the engine's sampler)."""
    if dtype not in (None, torch.float32):
        return NotImplemented
    return _log_softmax(x, dim, False)


def _unary(op: str) -> Callable[..., Any]:
    def run(x: torch.Tensor) -> Any:
        if not _routable(x):
            return NotImplemented
        return torch.ops.rollout_cpu.invariant_unary(x, _UNARY[op])

    return run


def _gelu(x: torch.Tensor, *, approximate: str = "none") -> Any:
    return _unary("gelu_tanh" if approximate == "tanh" else "gelu")(x)


def _allowed_keys(
    attn_mask: torch.Tensor | None, is_causal: bool, batch: int, heads: int, t: int, s: int
) -> torch.Tensor:
    """bool [B, T, S]: which keys each query sees, from SDPA's ``attn_mask`` (bool, or float of 0 and -inf/min)
    and ``is_causal`` (aligned to the top left, as SDPA's).

    Raises:
        ValueError: a mask that differs between heads or adds a bias (neither is what transformers' masks are).
    """
    allowed = torch.ones(batch, t, s, dtype=torch.bool)
    if attn_mask is not None:
        mask = attn_mask
        if mask.dtype != torch.bool:
            finite_bias = (mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)
            if bool(finite_bias.any()):
                raise ValueError("batch_invariant(): an attention mask with a bias (not 0 / -inf) is not supported")
            mask = mask == 0
        mask = mask.expand(batch, heads, t, s) if mask.dim() == 4 else mask.expand(batch, 1, t, s)
        if mask.shape[1] > 1 and not bool((mask == mask[:, :1]).all()):
            raise ValueError("batch_invariant(): an attention mask that differs between heads is not supported")
        allowed = allowed & mask[:, 0]
    if is_causal:
        allowed = allowed & torch.ones(t, s, dtype=torch.bool).tril()
    return allowed


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> Any:
    """(out [B, H, T, D], logsumexp [B, H, T]) of rollout's invariant attention, or NotImplemented."""
    if not _routable(query, key, value) or query.dim() != 4:
        return NotImplemented
    if dropout_p:
        raise ValueError(f"batch_invariant(): attention dropout must be 0 (the forward is evaluated), got {dropout_p}")
    b, h, t, d = query.shape
    allowed = _allowed_keys(attn_mask, is_causal, b, h, t, key.shape[2])
    scale = scale if scale is not None else d**-0.5
    return torch.ops.rollout_cpu.invariant_attention_dense(query, key, value, allowed, scale, 0.0)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``F.scaled_dot_product_attention`` as it reaches the mode whole (no autograd: ``torch.inference_mode``)."""
    out = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return out if out is NotImplemented else out[0]


def _flash_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    """ATen's CPU flash attention (what SDPA runs with autograd): rollout's output and logsumexp in its place, so
    autograd's backward (ATen's flash backward, which reads both) and a checkpointed recomputation work unchanged."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)


_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.linear.default: _linear,
    aten.mean.dim: _mean,
    aten._log_softmax.default: _log_softmax,
    aten.log_softmax.int: _log_softmax_int,
    aten.logsumexp.default: _logsumexp,
    aten.silu.default: _unary("silu"),
    aten.gelu.default: _gelu,
    aten.cos.default: _unary("cos"),
    aten.sin.default: _unary("sin"),
    aten.scaled_dot_product_attention.default: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu,
}


class _InvariantOps(TorchDispatchMode):
    """The aten operations of ``_HANDLERS`` through rollout's invariant kernels (where their inputs qualify)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(packs: InvariantPacks | None = None) -> Iterator[None]:
    """Run the calling thread's float32 CPU forwards with rollout's batch-invariant kernels (see the module).

    Under it, a plain transformers forward of a model (any batch size, padded with an attention mask, its default
    ``sdpa`` attention) computes each row's logits and ``log_softmax`` as an engine built with
    ``ContinuousBatchingConfig(batch_invariant=True)`` computes them: bitwise equal, whatever the rest of either batch.
    Re-entrant; other threads are untouched.

    Example::

        with rollout.batch_invariant():
            logits = model(input_ids=ids, attention_mask=mask).logits
            logprobs = torch.log_softmax(logits / T, dim=-1)  # inside too: the log-softmax is one of the ops

    Args:
        packs: where the packed copies of the linear weights are kept (an engine passes its own, reused across its
            steps, cleared at each new weight version); None: the enclosing context's, else none (each linear
            layer's weight packed at each call, so a weight changed inside the context is always read anew).

    Raises:
        RuntimeError: rollout's C++ CPU extension cannot be built here (the reason named).
    """
    reason = load_kernel()
    if reason is not None:
        raise RuntimeError(f"batch_invariant() needs rollout's CPU kernels: {reason}")
    packs = packs if packs is not None else _PACKS.get()
    if packs is not None:
        packs.check_optimizer_steps()
    token = _PACKS.set(packs)
    try:
        with _InvariantOps():
            yield
    finally:
        _PACKS.reset(token)
