"""Copying new weights into a model in place (the data path of ``update_weights``); noticing hand-made changes.

Two steps, so that a bad tensor is refused before anything is copied: ``plan_weight_copy`` pairs each given tensor
with the model's parameter or buffer of that name and checks it; ``copy_weights`` copies under ``torch.no_grad()``.
Tied weights keep both names, as in ``state_dict()``, so a full state dict of a tied model is accepted.

A ``WeightWatch`` keeps the last ``weights_fingerprint`` and bumps the engine's weight version (the one place a
version is made) when the parameters moved without ``update_weights`` (an optimizer step on the shared model) or
``update_weights`` copied new ones, so no prefix-cache block of the old weights is served.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .checks import FieldError

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

logger = logging.getLogger(__name__)

# Optimizer steps taken in this process by any torch optimizer, counted by a global post-step hook: a fused
# optimizer (``AdamW(fused=True)``, transformers' ``adamw_torch_fused``) writes the parameters in place without
# bumping their version counters, so the version alone would miss its updates. Process-wide on purpose: it is a
# fact about the process's tensors that every engine and manager reads, never writes.
_OPTIMIZER_STEPS = [0]


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """How many ``torch.optim`` optimizer steps this process has taken (any optimizer, any model)."""
    return _OPTIMIZER_STEPS[0]


class VersionedEngine(Protocol):
    """What a ``WeightWatch`` needs of an engine: the weight version that each generated token records."""

    @property
    def weight_version(self) -> int: ...

    def set_weight_version(self, version: int) -> None: ...


def plan_weight_copy(
    model: torch.nn.Module, named_tensors: NamedTensors | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each new tensor with its destination in the model, checking names, shapes and dtypes.

    Args:
        model: the model to update.
        named_tensors: a state dict or (name, tensor) pairs, names as in ``model.named_parameters()``
            (buffers too); None for nothing.

    Returns:
        (destination parameter or buffer, new tensor) pairs, in the given order.

    Raises:
        TypeError: a value is not a tensor.
        KeyError: the model has no parameter or buffer of that name.
        FieldError: a shape or dtype differs from the destination's (``field``: ``"shape"`` or ``"dtype"``, the
            attribute of the named tensor that differs; a ``ValueError``).
    """
    pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else (named_tensors or []))
    # remove_duplicate=False: tied weights keep both names, as in state_dict().
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    plan = []
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if name not in targets:
            raise KeyError(f"update_weights: the model has no parameter or buffer named {name!r}")
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise FieldError(
                "shape", f"update_weights: {name} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        if tensor.dtype != target.dtype:
            raise FieldError("dtype", f"update_weights: {name} has dtype {target.dtype}, got {tensor.dtype}")
        plan.append((target, tensor))
    return plan


@torch.no_grad()
def copy_weights(plan: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each new tensor into its destination in place (across devices if needed).

    A destination sharded by tensor parallelism (a DTensor of a ``tp_plan`` model) takes a full tensor
    too: each rank keeps its own shard of it (``distribute_tensor`` with ``src_data_rank=None`` slices
    locally, without communication, so every rank must pass the same full tensor). A DTensor source
    is copied as it is.
    """
    for target, tensor in plan:
        if _is_dtensor(target) and not _is_dtensor(tensor):
            from torch.distributed.tensor import distribute_tensor

            tensor = distribute_tensor(
                tensor.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            )
        target.copy_(tensor)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (the weights of a model loaded with a ``tp_plan``)."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def weights_fingerprint(model: torch.nn.Module) -> tuple[int, ...]:
    """A cheap fingerprint that changes whenever a parameter is changed in place or replaced.

    Every in-place write to a tensor (``optimizer.step()``, ``load_state_dict``, ``copy_``, ``add_``
    under ``no_grad`` or ``inference_mode``) bumps its version counter ``_version``; assigning a new
    tensor (``param.data = ...``, ``model.to(...)``) changes its storage address. The fingerprint is
    the pair (storage address, version) of every parameter, in order: a few microseconds per hundred
    parameters, no tensor is read. The process's optimizer step count (``optimizer_steps``) is appended: a fused
    optimizer writes without bumping versions (so any optimizer step, of any model, counts as a change). Buffers
    are left out: some models rewrite theirs in their own forward (dynamic RoPE), and no training step changes
    them. A tensor-parallel shard (DTensor) reports no storage of its own (``data_ptr()`` is 0): its local
    tensor's address is taken, with the DTensor's version, which in-place ops on the DTensor bump.

    Returns:
        A tuple of ints to compare with ``==``.
    """
    out: list[int] = []
    with torch.no_grad():  # to_local() of a parameter would otherwise record an autograd node
        for param in model.parameters():
            storage = param.to_local() if _is_dtensor(param) else param
            out.append(storage.data_ptr())
            out.append(param._version)
    out.append(optimizer_steps())  # a fused optimizer's step bumps no version
    return tuple(out)


class WeightWatch:
    """The parameters of a model as last recorded, to notice changes made without ``update_weights``.

    The caller serializes the calls (the manager holds its lock).

    Args:
        model: the model watched; its current parameters are recorded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._fingerprint = weights_fingerprint(model)

    def changed(self) -> bool:
        """True when the parameters changed since they were last recorded; records nothing."""
        return weights_fingerprint(self.model) != self._fingerprint

    def record(self) -> bool:
        """Record the current parameters (a change made through ``update_weights`` is recorded this way).

        Returns:
            True when they had changed since the last record.
        """
        fingerprint = weights_fingerprint(self.model)
        if fingerprint == self._fingerprint:
            return False
        self._fingerprint = fingerprint
        return True

    def bump(self, engine: VersionedEngine, version: int | None = None) -> int:
        """Record the current parameters and give ``engine`` a new weight version (``update_weights``).

        With ``bump_if_changed``, the one place a weight version is made; a tensor-parallel rank other
        than the driver only adopts the driver's (``tp_loop``).

        Args:
            engine: the engine whose version moves.
            version: the new version, above the current one (a replica catching up with its fleet takes the
                fleet's number: SGLang's ``weight_version``); None: the current one + 1. A number is never
                reused, since blocks cached under it hold KV of other weights.

        Returns:
            The new version.

        Raises:
            ValueError: ``version`` is not above the current version (nothing is recorded then).
        """
        if version is not None and version <= engine.weight_version:
            raise ValueError(
                f"weight_version: {version} is not above the current weight version {engine.weight_version}"
            )
        self.record()
        engine.set_weight_version(engine.weight_version + 1 if version is None else version)
        return engine.weight_version

    def bump_if_changed(self, engine: VersionedEngine | None) -> bool:
        """With no step running: record the parameters and, if they changed, bump ``engine``'s weight version.

        Args:
            engine: the engine whose version moves; None (a destroyed manager) only records.

        Returns:
            True when the weights had changed (without ``update_weights``) since the last record.
        """
        if not self.record():
            return False
        if engine is not None:
            version = self.bump(engine)
            logger.info("the model's parameters changed without update_weights: weight version %d", version)
        return True
