"""LoRA adapters served unmerged, per token: several adapters and the base model in one step.

An adapter (``LoraAdapter``) is peft's: for each target linear layer ``y = W x + b``, two matrices A [r, in] and B
[out, r] and a scaling s (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA); the adapted layer computes
``W x + b + s * B A x``. An adapter comes from a peft folder (``adapter_config.json`` and ``adapter_model.safetensors``,
``LoraAdapter.from_peft_dir``) or from tensors in memory (``LoraAdapter.from_tensors``: peft's state-dict names, or the
module names alone).

``LoraSlots`` serves them unmerged: the base weights are never written (their packed oneDNN copies stay valid, and a
request of the base model in the same step sees the base weights). It holds ``max_loras`` slots; each targeted linear
layer gets stacked buffers ``A_all`` [S * R, in] and ``B_all`` [S * R, out] (S slots of rank R = ``max_lora_rank``,
an adapter of rank r < R zero-padded, the scaling folded into B). A step gives each query token a slot (-1: the base
model); a forward hook on each targeted layer then adds

    delta = ((x @ A_all.T) * mask) @ B_all,    mask[t, s * R + j] = (slot[t] == s)

which is vLLM's punica idea (a token-to-adapter index over the adapters' stacked A and B, its "shrink" then "expand"
GEMMs) written as two dense GEMMs over every slot instead of a gather per token: static shapes (the same code runs
eager, compiled and CUDA-graphed), plain torch ops (CPU now, CUDA as written), exact zeros for base tokens. Its cost
grows with S * R, small next to the layer itself for the few adapters RL keeps (TRL's ``max_staleness + 2``); a step
where no token has an adapter runs no hook work at all (``LoraSlots.step`` with no adapter token).

The hooks sit on modules of the user's model, which a trainer's forward, an evaluation or another engine may run at
the same time in other threads; each ``LoraSlots`` therefore keeps the running step's token slots per thread
(``threading.local``), so a hook adds a delta only inside the step that set them, in the thread that runs it
(DESIGN.md, "Adapters obey the same promise"). ``threading.local`` rather than a ``contextvars.ContextVar`` (what
``onednn.PackedWeights`` uses) because compiled steps trace the hooks: dynamo guards on a thread-local attribute but
breaks the graph at ``ContextVar.get``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.checks import FieldError

__all__ = ["LoraAdapter", "LoraSlots", "adapter_state_dict", "lora_module_name"]

# peft's names: "<prefix>.<module>.lora_A.weight" (and ".lora_A.<adapter>.weight" in a live PeftModel's state dict).
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# Modules whose inputs are not the step's query tokens (the LM head sees only the kept logits rows) or that are not
# linear layers: refused as targets, by name.
_REFUSED_TARGETS = ("lm_head", "embed_tokens")


def lora_module_name(key: str) -> tuple[str, str] | None:
    """(module name in the base model, "A" or "B") of a peft LoRA tensor name, None for any other name.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (a saved adapter) and
    ``...q_proj.lora_A.default.weight`` (a live ``PeftModel``'s state dict) both give
    (``model.layers.0.self_attn.q_proj``, ``"A"``).
    """
    m = _PEFT_KEY.match(key)
    return (m["module"], m["which"]) if m else None


@dataclass
class LoraAdapter:
    """One LoRA adapter, on the CPU or any device, not yet in a slot.

    Attributes:
        name: the name requests select it by (``SamplingParams.lora``; the served ``model``).
        rank: r, the adapter's rank (every layer's).
        scaling: s, the factor of B A (``lora_alpha / r``; rsLoRA: ``lora_alpha / sqrt(r)``).
        weights: module name in the base model (``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r]).
        source: where it came from (a folder path, or ``"memory"``), for messages.
    """

    name: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    source: str = "memory"

    @property
    def num_bytes(self) -> int:
        """Bytes of its A and B tensors."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    @property
    def target_modules(self) -> list[str]:
        """The module names it adapts, sorted."""
        return sorted(self.weights)

    def clone(self) -> LoraAdapter:
        """The same adapter over copies of its tensors (what an engine keeps to load again later)."""
        weights = {m: (a.detach().clone(), b.detach().clone()) for m, (a, b) in self.weights.items()}
        return LoraAdapter(self.name, self.rank, self.scaling, weights, self.source)

    @classmethod
    def from_tensors(
        cls,
        name: str,
        tensors: Mapping[str, torch.Tensor],
        r: int,
        lora_alpha: float,
        use_rslora: bool = False,
        source: str = "memory",
    ) -> LoraAdapter:
        """An adapter from named tensors: peft's names (``...q_proj.lora_A.weight``, as ``get_peft_model_state_dict``
        or ``adapter_model.safetensors`` give them); other names are refused. The tensors are copied: changing the
        caller's afterwards (an optimizer step on a live adapter) does not change this adapter.

        Raises:
            ValueError: ``name`` empty, ``r`` < 1, ``lora_alpha`` not finite, a name that is not a LoRA tensor, a
                module with A or B missing, or shapes that do not match rank ``r``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name must be a non-empty string, got {name!r}")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"r (the adapter's rank) must be an int >= 1, got {r!r}")
        if not isinstance(lora_alpha, (int, float)) or not math.isfinite(lora_alpha):
            raise ValueError(f"lora_alpha must be a finite number, got {lora_alpha!r}")
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            found = lora_module_name(key)
            if found is None:
                raise ValueError(
                    f"adapter {name!r}: tensor {key!r} is not a LoRA tensor (expected '<module>.lora_A.weight' or "
                    "'<module>.lora_B.weight'); bias, modules_to_save and DoRA magnitudes are not served"
                )
            # A copy: the caller's tensors (a trainer's live parameters) may change after the load, and an adapter's
            # tensors must stay those its weight version names.
            parts.setdefault(found[0], {})[found[1]] = t.detach().clone()
        weights = {}
        for module, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"adapter {name!r}: module {module!r} has lora_{'B' if 'A' in ab else 'A'} missing")
            a, b = ab["A"], ab["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
                raise ValueError(
                    f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                    f"not [r, in] and [out, r] with r={r}"
                )
            weights[module] = (a, b)
        if not weights:
            raise ValueError(f"adapter {name!r} has no LoRA tensors")
        scaling = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        return cls(name, r, scaling, weights, source)

    @classmethod
    def from_peft_dir(cls, name: str, path: str | os.PathLike) -> LoraAdapter:
        """An adapter saved by peft's ``save_pretrained``: ``adapter_config.json`` and ``adapter_model.safetensors``.

        Raises:
            FileNotFoundError: ``path`` is not a folder holding both files (the message names ``lora_path``).
            ValueError: a config the engine cannot serve: ``peft_type`` not LORA, ``bias`` other than "none",
                ``modules_to_save``, ``use_dora``, per-layer ``rank_pattern`` / ``alpha_pattern``, or
                ``fan_in_fan_out``; or tensors as ``from_tensors`` refuses them.
        """
        from safetensors.torch import load_file

        folder = os.fspath(path)
        config_path = os.path.join(folder, "adapter_config.json")
        weights_path = os.path.join(folder, "adapter_model.safetensors")
        for needed in (config_path, weights_path):
            if not os.path.isfile(needed):
                raise FileNotFoundError(
                    f"lora_path {folder!r} is not a peft adapter folder: {os.path.basename(needed)} is missing"
                )
        with open(config_path) as f:
            config = json.load(f)
        refusals = {
            "peft_type": config.get("peft_type", "LORA") not in ("LORA", None),
            "bias": config.get("bias", "none") != "none",
            "modules_to_save": bool(config.get("modules_to_save")),
            "use_dora": bool(config.get("use_dora")),
            "rank_pattern": bool(config.get("rank_pattern")),
            "alpha_pattern": bool(config.get("alpha_pattern")),
            "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        }
        bad = [k for k, refused in refusals.items() if refused]
        if bad:
            shown = ", ".join(f"{k}={config.get(k)!r}" for k in bad)
            raise ValueError(f"adapter {name!r} at {folder!r}: {shown} cannot be served (plain LoRA only)")
        r = config.get("r", 8)
        alpha = config.get("lora_alpha", r)
        return cls.from_tensors(name, load_file(weights_path), r, alpha, bool(config.get("use_rslora")), folder)


def adapter_state_dict(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA tensors of a live peft model's adapter, under the names ``LoraAdapter.from_tensors`` takes (peft's
    ``get_peft_model_state_dict`` names them the same way; this reads them without importing peft).

    Args:
        model: a ``peft.PeftModel`` (or any module with peft's ``lora_A`` / ``lora_B`` module dicts).
        adapter_name: the peft adapter to read.

    Returns:
        name -> detached tensor (the live parameter's memory: copy before the next optimizer step if it must stay).
    """
    out = {}
    for name, p in model.named_parameters():
        found = lora_module_name(name)
        if found is not None and f".lora_{found[1]}.{adapter_name}." in name + ".":
            out[name.replace(f".{adapter_name}.weight", ".weight")] = p.detach()
    return out


@dataclass
class _Target:
    """The stacked buffers of one targeted linear layer and the hook that adds its LoRA output."""

    a_all: torch.Tensor  # [S * R, in]
    b_all: torch.Tensor  # [S * R, out]
    handle: Any = None


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

    Raises:
        ValueError: ``max_loras`` or ``max_lora_rank`` < 1.
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int) -> None:
        for arg, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._modules = dict(model.named_modules())
        self._targets: dict[str, _Target] = {}
        self.loaded: dict[str, LoadedAdapter] = {}
        # Unloaded adapters whose slot unfinished requests may still read (``unload``), freed by ``reclaim``.
        self.retired: list[LoadedAdapter] = []
        self._next_uid = 1
        self._lock = threading.Lock()
        # The running step's slot of each query token, int64 [T], in the attribute ``slots`` of the thread running the
        # step (absent or None: no LoRA work in this thread); read by the hooks.
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
                adapter was made for another base model), or every slot is taken (``max_loras``).
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
            target.handle = module.register_forward_hook(self._hook(target))
            self._targets[name] = target
        return target

    def _hook(self, target: _Target) -> Any:
        local = self._local

        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            slots = getattr(local, "slots", None)  # set only in the thread running this engine's step
            if slots is None:
                return None
            x = args[0]
            columns = self._slot_of_column
            assert columns is not None
            mask = (slots[:, None] == columns[None, :]).to(x.dtype)  # [T, S * R]
            shrunk = (x @ target.a_all.t()) * mask  # x: [1, T, in] -> [1, T, S * R]
            return output + shrunk @ target.b_all

        return hook

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, slots: torch.Tensor | None, any_adapter: bool) -> Iterator[None]:
        """Within it, in this thread only, the hooks add each token's adapter: ``slots`` int64 [T] (the step's query
        rows; -1 the base model), on the model's device. ``any_adapter`` False (or ``slots`` None) leaves the forward
        to the base weights alone."""
        if slots is None or not any_adapter or not self._targets:
            yield
            return
        if self._slot_of_column is None or self._slot_of_column.device != slots.device:
            column = torch.arange(self.max_loras, device=slots.device).repeat_interleave(self.max_lora_rank)
            self._slot_of_column = column
        self._local.slots = slots
        try:
            yield
        finally:
            self._local.slots = None

    def close(self) -> None:
        """Remove every hook (the engine closes): the model is left as it was."""
        for target in self._targets.values():
            if target.handle is not None:
                target.handle.remove()
        self._targets.clear()
        self.loaded.clear()
        self.retired.clear()
