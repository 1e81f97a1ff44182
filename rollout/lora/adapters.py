"""LoRA adapters as data: ``LoraAdapter`` and where one comes from.

An adapter is peft's: for each target linear layer ``y = W x + b``, two matrices A [r, in] and B [out, r] and a scaling
s (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA); the adapted layer computes ``W x + b + s * B A x``. An
adapter comes from a peft folder (``adapter_config.json`` and ``adapter_model.safetensors``,
``LoraAdapter.from_peft_dir``) or from tensors in memory (``LoraAdapter.from_tensors``: peft's state-dict names, or the
module names alone); ``adapter_state_dict`` reads a live peft model's. Serving them is ``slots.LoraSlots``'s.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

__all__ = ["LoraAdapter", "adapter_state_dict", "lora_module_name"]

# peft's names: "<prefix>.<module>.lora_A.weight" (and ".lora_A.<adapter>.weight" in a live PeftModel's state dict).
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


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
