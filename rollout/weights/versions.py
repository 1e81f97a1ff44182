"""Copying new weights into a model in place (the data path of ``update_weights``); noticing hand-made changes.

Two steps, so that a bad tensor is refused before anything is copied: ``plan_weight_copy`` pairs each given tensor
with the model's parameter or buffer of that name and checks it; ``copy_weights`` copies under ``torch.no_grad()``.
Tied weights keep both names, as in ``state_dict()``, so a full state dict of a tied model is accepted.

A model's ``WeightWatch`` (one per model object: ``watch_of``) holds the model's weight version, shared by every
engine and manager on it, and the weights as last recorded: a cheap fingerprint (``weights_fingerprint``: which
tensors, their version counters) and a content checksum (``weights_contents``). It makes a new version (the one
place a version is made) when ``update_weights`` copied new weights or when a check finds that the weights changed
without it, so no prefix-cache block of the old weights is served; it also holds the pause gates of the managers on
the model, so that a pause through one of them pauses them all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import torch
import xxhash
from torch.optim.optimizer import register_optimizer_step_post_hook

from rollout.checks import FieldError

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


class Gate(Protocol):
    """What a ``WeightWatch`` needs of a pause gate (``pausing.PauseGate``): a hold that keeps its loop still."""

    def hold(self) -> contextlib.AbstractContextManager[None]: ...


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
    """A cheap fingerprint that changes whenever a parameter is changed in place through autograd's view of it, or
    replaced.

    Every in-place write to a parameter (``optimizer.step()``, ``load_state_dict``, ``copy_``, ``add_`` under
    ``no_grad`` or ``inference_mode``) bumps its version counter ``_version``; assigning a new tensor
    (``param.data = ...``, ``model.to(...)``) changes its storage address. The fingerprint is the pair (storage
    address, version) of every parameter, in order: a few microseconds per hundred parameters, no tensor is read. The
    process's optimizer step count (``optimizer_steps``) is appended: a fused optimizer writes without bumping versions
    (so any optimizer step, of any model, counts as a change). It misses writes that bump no counter:
    ``param.data.copy_(...)`` (``.data`` is a tensor with a counter of its own), writes through numpy or another
    library; ``weights_contents`` sees those. Buffers are left out: some models rewrite theirs in their own forward
    (dynamic RoPE). A tensor-parallel shard (DTensor) reports no storage of its own (``data_ptr()`` is 0): its local
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


# Elements (of the int16 view) per chunk of the device checksum: bounds its int64 temporaries to 32 MiB.
_CHECKSUM_CHUNK = 1 << 22
# An odd multiplier that folds each chunk's sum into the running one (position-dependent across chunks).
_CHUNK_MIX = 0x2545F4914F6CDD1D
_WEIGHTS_SEED = 0x5EED


def _raw_elements(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous 1-D tensor as int16 (uint8 when its byte count is odd), the same storage."""
    as_bytes = flat.view(torch.uint8)
    return as_bytes.view(torch.int16) if as_bytes.numel() % 2 == 0 else as_bytes


def _device_checksum(flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A 64-bit checksum of a contiguous 1-D tensor's bytes, computed with torch ops on its own device.

    The bytes are read as int16 values x_i; the checksum is sum_i x_i * w_i mod 2^64, w_i random odd int64
    (``weights`` [_CHECKSUM_CHUNK], one chunk's; the chunks' sums are folded with an odd multiplier, so the position
    matters across chunks too). A change delta (int16 differences, each below 2^16 in size) goes unseen only if
    sum_i delta_i * w_i = 0 mod 2^64: for w uniform over odd numbers, and delta with lowest set bit k <= 15, that has
    probability at most 2^-(63-k) <= 2^-48, whatever the change (a sign flip, a permutation, noise).

    Returns:
        int64 0-d tensor on ``flat``'s device (read it with the others in one transfer).
    """
    x = _raw_elements(flat)
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, x.numel(), _CHECKSUM_CHUNK):
        chunk = x[start : start + _CHECKSUM_CHUNK]
        part = (chunk.to(torch.int64) * weights[: chunk.numel()]).sum()
        total = total * _CHUNK_MIX + part  # int64 arithmetic wraps: mod 2^64
    return total


def _host_checksum(flat: torch.Tensor) -> int:
    """xxh3-64 of a contiguous 1-D CPU tensor's bytes (read in place through numpy, no copy)."""
    return xxhash.xxh3_64_intdigest(flat.view(torch.uint8).numpy())


def weights_contents(model: torch.nn.Module, on_device: bool = False) -> tuple[object, ...]:
    """A checksum of the contents of every parameter and buffer of ``model``: what the forward reads.

    Per tensor (tied weights once, in ``named_parameters`` then ``named_buffers`` order): its dtype, its shape and a
    64-bit checksum of its bytes. On the CPU the checksum is xxh3-64 (``xxhash``, read in place, no copy: any change
    is missed with probability about 2^-64); on another device a checksum computed there with torch ops, no copy to
    the host (``_device_checksum``: at most 2^-48). A tensor-parallel shard is read through its local tensor (each rank
    checks its own shard); a tensor on the meta device (offloaded by accelerate) contributes its dtype and shape only.
    Buffers count (a ``load_state_dict`` writes them; the forward reads them): a model whose own forward rewrites a
    buffer (dynamic RoPE's ``inv_freq``) gets a new version at the first check after such a rewrite: a prefix-cache
    miss, never a wrong hit.
    Cost: one read of the weights (SmolLM2-135M on the 2-core CPU: docs/engine.md).

    Args:
        model: the model.
        on_device: use the torch checksum on CPU tensors too (tests check it there).

    Returns:
        A tuple to compare with ``==``: (dtype, shape) and checksum of each tensor.
    """
    tensors = [*model.parameters(), *model.buffers()]
    out: list[object] = []
    weights: dict[torch.device, torch.Tensor] = {}  # each device's chunk weights, made once per call
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for t in tensors:
            local = t.to_local() if _is_dtensor(t) else t
            out.append((str(local.dtype), tuple(local.shape)))
            if local.device.type == "meta" or local.numel() == 0:
                out.append(0)
                continue
            flat = local.detach().reshape(-1)
            flat = flat if flat.is_contiguous() else flat.contiguous()
            if flat.device.type == "cpu" and not on_device:
                out.append(_host_checksum(flat))
                continue
            if flat.device not in weights:
                generator = torch.Generator(device=flat.device).manual_seed(_WEIGHTS_SEED)
                w = torch.randint(-(2**62), 2**62, (_CHECKSUM_CHUNK,), generator=generator, device=flat.device)
                weights[flat.device] = w | 1
            pending.setdefault(flat.device, []).append((len(out), _device_checksum(flat, weights[flat.device])))
            out.append(0)  # filled below, after one transfer per device
    for items in pending.values():
        values = torch.stack([v for _, v in items]).tolist()
        for (i, _), value in zip(items, values):
            out[i] = value
    return tuple(out)


class WeightWatch:
    """One model's weight version and its weights as last recorded: shared by every engine and manager on the model.

    Get it with ``watch_of(model)``, never build a second one for a model: one version per model object is the
    promise (DESIGN.md, section 3): an update through any manager or engine on the model is every engine's. Engines
    adopt ``version`` before each step (``Engine.sync_weight_version``). Thread-safe (``lock``, re-entrant).

    Args:
        model: the model watched (held weakly: the watch lives as long as the model). Its cheap fingerprint is recorded
            now; its contents by the first ``record`` that asks for them (the engine's first check: ``Engine``).

    Attributes:
        version: the model's weight version: the number of weight changes recorded so far (LoRA loads included).
        base_version: the version at which the base weights were last changed (``version`` less the adapter loads
            since): what a token of a request without an adapter records (``Scheduler.token_version``).
        recompute_version: the latest version whose update asked in-flight requests to re-prefill (0: none); an engine
            that adopts it from an older version re-prefills its own.
        gates: the pause gates of the managers on the model (held weakly): ``hold_all`` holds every one of them.
        lock: guards everything above and the record.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self.lock = threading.RLock()
        self.version = 0
        self.base_version = 0
        self.recompute_version = 0
        self.gates: weakref.WeakSet[Gate] = weakref.WeakSet()
        self._fingerprint = weights_fingerprint(model)
        self._contents: tuple[object, ...] | None = None  # made by the first record with contents

    @property
    def model(self) -> torch.nn.Module:
        """The model watched.

        Raises:
            RuntimeError: it was garbage-collected (nothing holds an engine on it then).
        """
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this WeightWatch no longer exists")
        return model

    def changed(self) -> bool:
        """True when the cheap fingerprint moved since the last record (a hint: ``bump_if_changed`` decides); records
        nothing, reads no weight."""
        return weights_fingerprint(self.model) != self._fingerprint

    def record(self, contents: bool = True) -> bool:
        """Record the current weights (a change made through ``update_weights`` is recorded this way).

        Args:
            contents: decide from the content checksum (``weights_contents``): any write is seen, and a write that
                left the values as they were is no change. False: from the cheap fingerprint only (misses writes that
                bump no version counter); the content record is then left as it was.

        Returns:
            True when they had changed since the last record.
        """
        with self.lock:
            model = self.model
            fingerprint = weights_fingerprint(model)
            if contents:
                sums = weights_contents(model)
                # No content record yet (only cheap checks so far): the cheap fingerprint decides this once.
                changed = sums != self._contents if self._contents is not None else fingerprint != self._fingerprint
                self._contents = sums
            else:
                changed = fingerprint != self._fingerprint
            self._fingerprint = fingerprint
            return changed

    def publish(self, version: int) -> None:
        """Raise the model's version to ``version`` if it is behind (an engine was set to it: a tensor-parallel rank
        adopting its driver's, a rebuilt engine keeping its predecessor's)."""
        with self.lock:
            if version > self.version:  # a version made elsewhere (a driver's, a fleet's): of the base weights
                self.version = self.base_version = version

    def bump(
        self,
        engine: VersionedEngine | None,
        contents: bool = True,
        recompute: bool = False,
        version: int | None = None,
        adapter: bool = False,
    ) -> int:
        """Record the current weights and make a new version of the model (``update_weights``); ``engine`` adopts it
        now, every other engine on the model before its next step.

        With ``bump_if_changed``, the one place a weight version is made; a tensor-parallel rank other
        than the driver only adopts the driver's (``manager.loop.TensorParallelLoop``).

        Args:
            engine: the engine of the caller, or None.
            contents: record the content checksum too (see ``record``).
            recompute: in-flight requests of every engine on the model re-prefill under the new weights when their
                engine adopts the version (``recompute_version``).
            version: the new version, above the current one (a replica catching up with its fleet takes the
                fleet's number: SGLang's ``weight_version``); None: the current one + 1. A number is never
                reused, since blocks cached under it hold KV of other weights.
            adapter: the change is a LoRA adapter's load (the manager's ``load_lora``), not the base weights':
                ``base_version`` stays.

        Returns:
            The new version.

        Raises:
            ValueError: ``version`` is not above the current version (nothing is recorded then).
        """
        with self.lock:
            if version is not None and version <= self.version:
                raise ValueError(f"weight_version: {version} is not above the current weight version {self.version}")
            changed = self.record(contents)
            self.version = self.version + 1 if version is None else version
            if not adapter or changed:  # base weights changed by hand before an adapter load: a base version too
                self.base_version = self.version
            if recompute:
                self.recompute_version = self.version
            if engine is not None:
                engine.set_weight_version(self.version)
            return self.version

    def bump_if_changed(self, engine: VersionedEngine | None, contents: bool = True) -> bool:
        """With no step running on the model: record the weights and, if they changed, make a new version; ``engine``
        adopts the model's version (whoever made it).

        Args:
            engine: the engine of the caller; None (no engine: a destroyed manager, an engine being built) only
                records and versions the model.
            contents: decide from the contents (see ``record``).

        Returns:
            True when the weights had changed (without ``update_weights``) since the last record.
        """
        with self.lock:
            changed = self.record(contents)
            if changed:
                self.version += 1
                self.base_version = self.version
                logger.info("the model's weights changed without update_weights: weight version %d", self.version)
            if engine is not None and engine.weight_version != self.version:
                engine.set_weight_version(self.version)
            return changed

    @contextlib.contextmanager
    def hold_all(self, first: Gate) -> Iterator[None]:
        """Hold ``first`` and then every other pause gate of the model (``gates``): no manager on the model steps
        until the block ends. Gates take any number of holders, so two threads holding them in different orders cannot
        deadlock; each ``hold`` waits at most for its loop's current step."""
        with self.lock:
            others = [g for g in self.gates if g is not first]
        with contextlib.ExitStack() as stack:
            stack.enter_context(first.hold())
            for gate in others:
                stack.enter_context(gate.hold())
            yield


# The weight record of each live model object. A registry keyed weakly on the model, not an attribute of it, because
# the version and the pause gates must be the same object for every engine and manager on one model (one weight
# version per model object: DESIGN.md, section 3), whoever built them, and must not outlive the model nor be carried
# into ``copy.deepcopy(model)`` (a copy is other weights: a version of its own; its lock could not be copied anyway).
# Each value holds its model weakly, so an entry goes when its model does.
_WATCHES: weakref.WeakKeyDictionary[torch.nn.Module, WeightWatch] = weakref.WeakKeyDictionary()
_WATCHES_LOCK = threading.Lock()


def watch_of(model: torch.nn.Module) -> WeightWatch:
    """The model's ``WeightWatch``, made now if it has none (at version 0, its weights as they are now)."""
    with _WATCHES_LOCK:
        watch = _WATCHES.get(model)
        if watch is None:
            watch = _WATCHES[model] = WeightWatch(model)
        return watch
