"""LoRA adapters served unmerged, per token: several adapters and the base model in one step (``LoraSlots``).

``LoraSlots`` serves adapters (``adapters.LoraAdapter``) unmerged: the base weights are never written (their packed
oneDNN copies stay valid, and a request of the base model in the same step sees the base weights). It holds
``max_loras`` slots; each targeted linear layer gets stacked buffers ``A_all`` [S * R, in] and ``B_all`` [S * R, out]
(S slots of rank R = ``max_lora_rank``, an adapter of rank r < R zero-padded, the scaling folded into B). A step gives
each query token a slot (-1: the base model); a forward hook on each targeted layer then adds

    delta = ((x @ A_all.T) * mask) @ B_all,    mask[t, s * R + j] = (slot[t] == s)

which is vLLM's punica idea (a token-to-adapter index over the adapters' stacked A and B, its "shrink" then "expand"
GEMMs) written as two dense GEMMs over every slot instead of a gather per token: static shapes on compiled and
CUDA-graphed steps, plain torch ops (CPU now, CUDA as written), exact zeros for base tokens. An eager step knows its
requests' slots on the host, so it reads only the rows of the slots it uses (from the first to the last), makes the
mask once for every layer, and none at all when every token runs under one adapter (an RL step under one policy); a
step where no token has an adapter runs no hook work at all. On CPU, float32, the product is one call of rollout's
kernel per layer (``rollout_cpu::lora_add_``, engine/attention/csrc/lora_cpu.cpp: row by row, no OpenMP region for a
decode step's few rows; each region cost 60-80 us in the manager's thread, scripts/omp_thread_cost.py): 1 and 4
adapters went from 0.60x of the base model's tokens/s to 0.90x and 0.86x (scripts/bench_lora.py, docs/lora_bench.md).
The engine's fused forward of the Llama family (engine/worker/fused_layer.py) calls no hook on such a step: it finds
each layer's hook by its type (``LoraHook``), asks it for the operands (``LoraHook.kernel_operands``: float32 views
``a`` [W, in] and ``b`` [W, out] of the step's rows, W = hi - lo, and the step's mask [T, W] or None; None where the
hook would do anything else), and adds the products of sibling layers on one input in one kernel call
(``rollout_cpu::lora_add_group_``: q/k/v, gate/up), bit for bit what the hooks' ``lora_add_`` would add.

The hooks sit on modules of the user's model, which a trainer's forward, an evaluation or another engine may run at
the same time in other threads; each ``LoraSlots`` therefore keeps the running step's token slots per thread
(``threading.local``), so a hook adds a delta only inside the step that set them, in the thread that runs it
(DESIGN.md, "Adapters obey the same promise"); ``kernel_operands`` reads the same plan, so the fused forward's
additions hold the promise too. ``threading.local`` rather than a ``contextvars.ContextVar`` (what
``engine.worker.onednn.PackedWeights`` uses) because compiled steps trace the hooks: dynamo guards on a thread-local
attribute but breaks the graph at ``ContextVar.get``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.checks import FieldError
from rollout.lora.adapters import LoraAdapter
from rollout.requests import Request

__all__ = ["LoadedAdapter", "LoraHook", "LoraSlots"]

# Modules whose inputs are not the step's query tokens (the LM head sees only the kept logits rows) or that are not
# linear layers: refused as targets, by name.
_REFUSED_TARGETS = ("lm_head", "embed_tokens")


@dataclass
class _Target:
    """The stacked buffers of one targeted linear layer and the hook that adds its LoRA output."""

    a_all: torch.Tensor  # [S * R, in]
    b_all: torch.Tensor  # [S * R, out]
    handle: Any = None  # of the module's ``LoraHook``
    # (lo, hi) -> (a_all[lo:hi], b_all[lo:hi]): the views an eager step of those rows reads.
    views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class _StepPlan:
    """What the hooks of one step compute: ``rows`` (lo, hi) of every target's ``A_all`` and ``B_all`` (the slots the
    step uses, from the first to the last), masked per token by ``mask`` [T, hi - lo], or by one each hook makes from
    ``slots`` [T] over every slot (a static step), or not at all (every token under one adapter)."""

    rows: tuple[int, int]
    slots: torch.Tensor | None
    mask: torch.Tensor | None
    kernel: bool = False  # run rollout's CPU kernel (``LoraSlots`` ``cpu_kernel``) rather than two torch GEMMs


@dataclass
class LoadedAdapter:
    """An adapter in a slot: ``uid`` is unique in the process's life of the ``LoraSlots`` (never reused), so KV and
    prefix-cache blocks computed under it are keyed to these tensors, not to the name or the slot.

    ``version`` is the model's weight version its load made (the manager's ``load_lora``; 0 for an engine used alone):
    a token sampled under this adapter records ``max(version, the base weights' version)``, the version at which the
    weights that produced it (base and adapter) were last set, whatever was loaded after it."""

    adapter: LoraAdapter
    slot: int
    uid: int
    version: int = 0

    def bind(self, request: Request) -> None:
        """``request`` runs under this adapter until it ends, whatever is loaded or unloaded under its name meanwhile
        (its ``lora_id``, ``lora_slot`` and ``lora_version`` are this adapter's)."""
        request.lora_id, request.lora_slot, request.lora_version = self.uid, self.slot, self.version


class LoraSlots:
    """The adapters one engine serves, in ``max_loras`` slots, applied per token by forward hooks on the targeted
    linear layers of ``model`` (see the module docstring).

    The hooks add nothing outside ``step``, and inside it only in the thread that runs the step: a training forward,
    ``model.generate`` or another engine's step on the same model, in any thread, sees its own weights alone; so does
    a ``step`` whose tokens all belong to the base model.

    Args:
        model: the engine's base model (not a peft wrapper): targets are its ``nn.Linear`` modules by name.
        max_loras: slots (>= 1): adapters loaded at once.
        max_lora_rank: R (>= 1): the largest rank an adapter may have.
        cpu_kernel: eager float32 steps on CPU add each layer's product with rollout's kernel
            (``rollout_cpu::lora_add_``, built with the engine's CPU attention kernel; the caller has loaded it): one
            pass per row, no OpenMP region for a decode step's few rows, which cost 60-80 us each in the manager's
            thread (``engine/attention/csrc/lora_cpu.cpp``). Off: two torch GEMMs per layer.

    Raises:
        ValueError: ``max_loras`` or ``max_lora_rank`` < 1.
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, cpu_kernel: bool = False) -> None:
        for arg, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.cpu_kernel = cpu_kernel
        self._modules = dict(model.named_modules())
        self._targets: dict[str, _Target] = {}
        self.loaded: dict[str, LoadedAdapter] = {}
        # Unloaded adapters whose slot unfinished requests may still read (``unload``), freed by ``reclaim``.
        self.retired: list[LoadedAdapter] = []
        self._next_uid = 1
        self._lock = threading.Lock()
        # The running step's ``_StepPlan``, in the attribute ``plan`` of the thread running the step (absent or None:
        # no LoRA work in this thread); read by the hooks.
        self._local = threading.local()
        self._slot_of_column: torch.Tensor | None = None

    # ------------------------------------------------------------------ adapters
    def check(self, adapter: LoraAdapter, in_use: set[int] = frozenset(), replace: bool = False) -> None:
        """Raise if ``adapter`` cannot be loaded now; changes nothing.

        Args:
            adapter: the adapter to load.
            in_use: the uids of adapters unfinished requests run under (their slots stay taken).
            replace: an adapter loaded under the same name is to be unloaded first (its slot counts as free unless
                requests still run under it).

        Raises:
            FieldError: naming the field: its name is loaded already and ``replace`` is off (``lora_name``), its rank
                is above ``max_lora_rank``, a target module is not an ``nn.Linear`` of the model or is the LM head or
                the embeddings (``target_modules``), a tensor's shape does not match its module (``weights``: the
                adapter was made for another base model) or holds a NaN or inf (``weights``), or every slot is taken
                (``max_loras``).
        """
        old = self.loaded.get(adapter.name)
        if old is not None and not replace:
            raise FieldError(
                "lora_name", f"lora_name {adapter.name!r} is loaded already; unload it first or use another name"
            )
        if adapter.rank > self.max_lora_rank:
            raise FieldError(
                "max_lora_rank",
                f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank={self.max_lora_rank}; "
                f"start the engine with max_lora_rank >= {adapter.rank}",
            )
        for module_name, (a, b) in sorted(adapter.weights.items()):  # the first misfit, whatever the load order
            module = self._modules.get(module_name)
            last = module_name.rsplit(".", 1)[-1]
            if type(module) is not torch.nn.Linear or last in _REFUSED_TARGETS:
                what = "the LM head or the embeddings" if last in _REFUSED_TARGETS else "not an nn.Linear of the model"
                raise FieldError(
                    "target_modules",
                    f"adapter {adapter.name!r}: target_modules has {module_name!r}, {what}; LoRA is served on the "
                    "decoder layers' linear layers only",
                )
            if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
                raise FieldError(
                    "weights",
                    f"adapter {adapter.name!r}: {module_name!r} is [{module.out_features}, {module.in_features}] but "
                    f"lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}",
                )
            # A slot's rows are read by every step whose slots span it (masked): a NaN there would reach them all.
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                raise FieldError(
                    "weights", f"adapter {adapter.name!r}: {module_name!r} has non-finite values (NaN or inf)"
                )
        retired = [x for x in self.retired if x.uid in in_use]
        taken = len(self.loaded) + len(retired)
        if old is not None and old.uid not in in_use:
            taken -= 1  # the replaced adapter's slot is freed at once
        if taken >= self.max_loras:
            still = f" and {len(retired)} unloaded one(s) still in use" if retired else ""
            raise FieldError(
                "max_loras",
                f"max_loras={self.max_loras} adapters are loaded ({', '.join(sorted(self.loaded))}{still}); unload "
                "one first or start the engine with a larger max_loras",
            )

    def load(
        self, adapter: LoraAdapter, in_use: set[int] = frozenset(), replace: bool = False, version: int = 0
    ) -> LoadedAdapter:
        """Copy ``adapter`` into a free slot, all or nothing: checked first (``check``, same arguments), then the slots
        of unloaded adapters no request runs under are freed (``reclaim``) and, with ``replace``, an adapter of the same
        name is unloaded (requests already running under it keep it). Call with no step running.

        Args:
            version: the weight version this load makes (``LoadedAdapter.version``).

        Returns:
            Its slot, its new uid and ``version``.

        Raises:
            FieldError: as ``check``; nothing changes then.
        """
        with self._lock:
            self.check(adapter, in_use, replace)
            if adapter.name in self.loaded:
                self.retired.append(self.loaded.pop(adapter.name))
            self.retired = [x for x in self.retired if x.uid in in_use]
            taken = {x.slot for x in (*self.loaded.values(), *self.retired)}
            slot = min(set(range(self.max_loras)) - taken)
            R = self.max_lora_rank
            rows = slice(slot * R, slot * R + adapter.rank)
            for name, target in self._targets.items():  # zero the slot where this adapter has no A/B
                if name not in adapter.weights:
                    target.a_all[slot * R : (slot + 1) * R].zero_()
                    target.b_all[slot * R : (slot + 1) * R].zero_()
            for name, (a, b) in adapter.weights.items():
                target = self._target(name)
                target.a_all[slot * R : (slot + 1) * R].zero_()
                target.b_all[slot * R : (slot + 1) * R].zero_()
                target.a_all[rows].copy_(a)
                target.b_all[rows].copy_(b.t() * adapter.scaling)
            loaded = LoadedAdapter(adapter, slot, self._next_uid, version)
            self._next_uid += 1
            self.loaded[adapter.name] = loaded
            return loaded

    def unload(self, name: str) -> LoadedAdapter:
        """Forget adapter ``name``: no new request can select it. Its slot stays taken while requests accepted under it
        are unfinished (each finishes under the adapter it was accepted with, as TRL's adapter sync needs), until
        ``reclaim``; the buffers are overwritten by the next load into the slot.

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        with self._lock:
            if name not in self.loaded:
                raise KeyError(f"lora_name {name!r} is not loaded (loaded: {sorted(self.loaded)})")
            gone = self.loaded.pop(name)
            self.retired.append(gone)
            return gone

    def reclaim(self, in_use: set[int]) -> None:
        """Free the slots of unloaded adapters whose uid is not in ``in_use`` (the uids of unfinished requests)."""
        with self._lock:
            self.retired = [x for x in self.retired if x.uid in in_use]

    def get(self, name: str) -> LoadedAdapter:
        """The loaded adapter called ``name``.

        Raises:
            FieldError: none is (field ``lora``; the message names the loaded adapters).
        """
        found = self.loaded.get(name)
        if found is None:
            raise FieldError("lora", f"lora {name!r} is not a loaded adapter (loaded: {sorted(self.loaded)})")
        return found

    def holds(self, uid: int) -> bool:
        """True while the adapter of ``uid`` has a slot (loaded, or unloaded with requests still under it)."""
        return any(x.uid == uid for x in (*self.loaded.values(), *self.retired))

    def _target(self, name: str) -> _Target:
        """The buffers of layer ``name``, made (zeros) and hooked at its first adapter."""
        target = self._targets.get(name)
        if target is None:
            module = self._modules[name]
            w = module.weight
            rows = self.max_loras * self.max_lora_rank
            target = _Target(
                torch.zeros(rows, module.in_features, dtype=w.dtype, device=w.device),
                torch.zeros(rows, module.out_features, dtype=w.dtype, device=w.device),
            )
            target.handle = module.register_forward_hook(LoraHook(self._local, target, self))
            self._targets[name] = target
        return target

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(
        self, slots: torch.Tensor | None, used: Sequence[int] = (), uniform: bool = False, static: bool = False
    ) -> Iterator[None]:
        """Within it, in this thread only, the hooks add each token's adapter.

        Args:
            slots: int64 [T], the step's query rows' slots (-1: the base model), on the model's device; None (or no
                ``used``) leaves the forward to the base weights alone.
            used: the distinct slots >= 0 of the step's real rows, ascending (host ints): an eager step reads only
                the buffers' rows from the first one's to the last one's.
            uniform: every real row runs under ``used[0]``: no per-row mask (an RL step under one policy).
            static: the step is compiled or CUDA-graphed: every slot's rows, and the mask made inside the forward, so
                that the traced or captured shapes do not depend on which adapters the step has.
        """
        if slots is None or not used or not self._targets:
            yield
            return
        if self._slot_of_column is None or self._slot_of_column.device != slots.device:
            column = torch.arange(self.max_loras, device=slots.device).repeat_interleave(self.max_lora_rank)
            self._slot_of_column = column
        R = self.max_lora_rank
        if static:
            plan = _StepPlan((0, self.max_loras * R), slots, None)
        elif uniform:
            plan = _StepPlan((used[0] * R, (used[0] + 1) * R), None, None, self.cpu_kernel)
        else:  # one mask for every hooked layer of the step
            lo, hi = used[0] * R, (used[-1] + 1) * R
            dtype = next(iter(self._targets.values())).a_all.dtype
            mask = (slots[:, None] == self._slot_of_column[None, lo:hi]).to(dtype)
            plan = _StepPlan((lo, hi), None, mask, self.cpu_kernel)
        self._local.plan = plan
        try:
            yield
        finally:
            self._local.plan = None

    def close(self) -> None:
        """Remove every hook (the engine closes): the model is left as it was."""
        for target in self._targets.values():
            if target.handle is not None:
                target.handle.remove()
        self._targets.clear()
        self.loaded.clear()
        self.retired.clear()


class LoraHook:
    """The forward hook ``LoraSlots`` sets on one targeted layer: in the thread running a step of its ``slots``, it
    adds the step's LoRA product to the layer's output (the module docstring); anywhere else it returns at once.

    A forward that computes the layer's output itself (``engine.worker.fused_layer``) finds the hook among the
    module's forward hooks by its type and may add the product in the hook's place: where ``kernel_operands`` gives
    operands, ``rollout_cpu::lora_add_(out, x, *operands)`` (or one ``lora_add_group_`` call for sibling layers) is
    exactly what the call would do, and the hook must not be called as well.
    """

    def __init__(self, local: threading.local, target: _Target, slots: LoraSlots) -> None:
        self._local = local  # the slots' ``_local``: its attribute ``plan`` is set in the thread running a step
        self.target = target
        self.slots = slots

    def __copy__(self) -> LoraHook:
        return self

    def __deepcopy__(self, memo: dict) -> LoraHook:
        """The hook itself, as for a function: a copy of the hooked model (a trainer's, ``copy.deepcopy``) shares it,
        and it adds nothing there outside the engine's step thread."""
        return self

    def _views(self, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a_all[lo:hi], b_all[lo:hi])``: views of the buffers (which loads update in place), made once per range."""
        views = self.target.views.get(rows)
        if views is None:
            lo, hi = rows
            views = self.target.views[rows] = (self.target.a_all[lo:hi], self.target.b_all[lo:hi])
        return views

    def idle(self) -> bool:
        """No step of its slots runs in this thread: a call would add nothing (a fused forward may skip it)."""
        return getattr(self._local, "plan", None) is None

    def kernel_operands(
        self, x: torch.Tensor, output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """What this hook would add to ``output`` with rollout's kernel here and now, else None.

        Args:
            x: the layer's input, [..., in] (the fused forward's [T, in]).
            output: its output, [..., out].

        Returns:
            ``(a, b, mask)`` where this thread runs an eager step of ``slots`` whose plan takes the kernel
            (``cpu_kernel``), and ``x`` and ``output`` are float32 with contiguous rows (``output`` contiguous):
            ``a`` [W, in] and ``b`` [W, out], contiguous float32 views of the step's rows (W = (hi - lo) of the
            step's slots), ``mask`` the step's float32 [T, W] (None: every token under one adapter). None: the hook
            adds nothing here (no step of its slots in this thread), or adds by torch's GEMMs (no kernel, a static
            step, another dtype or layout).
        """
        plan = getattr(self._local, "plan", None)  # set only in the thread running this engine's step
        if plan is None or not plan.kernel or plan.slots is not None:
            return None
        if not (
            x.dtype == torch.float32
            and output.dtype == torch.float32
            and x.stride(-1) == 1
            and output.is_contiguous()
            and self.target.a_all.dtype == torch.float32
        ):
            return None
        a, b = self._views(plan.rows)
        return a, b, plan.mask

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        plan = getattr(self._local, "plan", None)
        if plan is None:
            return None
        target = self.target
        x = args[0]  # [1, T, in] (the module's call) or [T, in] (the fused forward's replay)
        n = output.shape[-1]
        if plan.slots is not None:  # a static step: every slot, the mask made inside the traced or captured graph
            columns = self.slots._slot_of_column
            assert columns is not None
            mask = (plan.slots[:, None] == columns[None, :]).to(x.dtype)
            shrunk = (x @ target.a_all.t()) * mask
            return torch.addmm(output.reshape(-1, n), shrunk.reshape(-1, mask.shape[1]), target.b_all).view_as(output)
        operands = self.kernel_operands(x, output)
        if operands is not None:
            torch.ops.rollout_cpu.lora_add_(output.view(-1, n), x.reshape(-1, x.shape[-1]), *operands)
            return None
        a, b = self._views(plan.rows)
        shrunk = torch.mm(x.reshape(-1, x.shape[-1]), a.t())  # [T, hi - lo]
        if plan.mask is not None:
            shrunk.mul_(plan.mask)
        if output.is_contiguous():  # added in place, a GEMM with BLAS's beta = 1: no product tensor, no copy
            output.view(-1, n).addmm_(shrunk, b)
            return None
        return torch.addmm(output.reshape(-1, n), shrunk, b).view_as(output)
