"""The model's switch to paged attention, a dispatcher registered with ``transformers.AttentionInterface``.

The engine switches the user's own model object to ``dispatcher_name(original)`` ("rollout_paged|sdpa" for an SDPA
model). A forward carrying a step's metadata (the ``rollout_batch`` kwarg) runs ``paged.paged_attention``; any
other calls the original implementation with the mask its own mask function builds, so a training forward is what it
was before. Several engines may share one model: the first switches it, only the last restores it.
"""

from __future__ import annotations

import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rollout.engine.attention.paged import METADATA_KWARG, paged_attention

PAGED_PREFIX = "rollout_paged|"
# transformers' own paged implementations: "paged|eager" and "paged|sdpa" are how its continuous-batching
# guide keeps generation off flash attention (transformers 5.24 loads "paged|sdpa" as "sdpa" with a
# deprecation warning, keeps "paged|eager", and a later ``set_attn_implementation`` may set either).
TRANSFORMERS_PAGED_PREFIX = "paged|"


class _ConfigAsOriginal:
    """A model config whose attention implementation names the original rather than the paged dispatcher.

    transformers' flash wrapper (``integrations/flash_attention.py``) picks its kernel from
    ``module.config._attn_implementation``; under the dispatcher's name it would look for a kernel called
    "rollout_paged|..." and fail. Every other attribute is the config's; a write raises.
    """

    __slots__ = ("_config", "_attn_implementation", "_attn_implementation_internal")

    def __init__(self, config: PretrainedConfig, original: str) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_attn_implementation", original)
        object.__setattr__(self, "_attn_implementation_internal", original)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the attention function's view of the config is read-only (setting {name!r})")


class _ModuleAsOriginal:
    """An attention module whose ``config`` is a ``_ConfigAsOriginal``; every other attribute is the module's."""

    __slots__ = ("_module", "config")

    def __init__(self, module: torch.nn.Module, original: str) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", _ConfigAsOriginal(module.config, original))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)


# Originals whose functions never read the implementation's name from the config: they get the module
# itself (the common path stays exactly what it was).
_PLAIN_ORIGINALS = frozenset({"eager", "sdpa"})


def _original_function(module: torch.nn.Module, original: str) -> Callable[..., Any]:
    if original == "eager":
        # Each model module defines its own eager function (Gemma 2's soft-caps, for one).
        modeling = sys.modules[type(module).__module__]
        fn = getattr(modeling, "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[original]


def _make_dispatch(original: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    plain = original in _PLAIN_ORIGINALS

    def rollout_paged_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        meta = kwargs.pop(METADATA_KWARG, None)
        if meta is None:
            fn = _original_function(module, original)
            seen = module if plain or not hasattr(module, "config") else _ModuleAsOriginal(module, original)
            return fn(seen, query, key, value, attention_mask, **kwargs)
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("attention sinks (s_aux) are not supported by rollout's paged attention")
        out = paged_attention(
            module,
            query,
            key,
            value,
            meta,
            scaling=kwargs.get("scaling"),
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
        )
        return out, None

    rollout_paged_attention.__qualname__ = f"rollout_paged_attention[{original}]"
    return rollout_paged_attention


# Every dispatcher registered in this process: its name -> (the original it falls back to, its function).
_DISPATCHERS: dict[str, tuple[str, Callable[..., Any]]] = {}
_REGISTER_LOCK = threading.Lock()


def dispatcher_name(original: str) -> str:
    """The name under which the paged dispatcher falling back to ``original`` is registered.

    ``"rollout_paged|" + original`` with "flash" (any case) written "fa" and "/" written "--":
    transformers 5 treats a name containing "flash" as a flash-kernel request (``is_flash_attention_requested``,
    then an import of a kernel of that name, which fails) and a name ``org/repo`` as a Hub kernel to
    download and register under that very name, replacing the dispatcher. "flash_attention_2" ->
    "rollout_paged|fa_attention_2", "kernels-community/flash-attn2" -> "rollout_paged|kernels-community--fa-attn2".
    """
    return PAGED_PREFIX + re.sub("flash", "fa", original, flags=re.IGNORECASE).replace("/", "--")


def register_paged_attention(original: str) -> str:
    """Register the paged function that falls back to ``original`` and return its name.

    Registration is idempotent; the registered function holds no state, so models and managers can
    share it. A registration that something else replaced under the same name is put back.

    Args:
        original: the model's attention implementation ("sdpa", "eager", "flash_attention_2", a Hub
            kernel such as "kernels-community/flash-attn2", ...).

    Returns:
        ``dispatcher_name(original)``.

    Raises:
        ValueError: ``original`` is itself a paged implementation, has no mask function, or its
            dispatcher name is already taken by another original.
    """
    if original.startswith(PAGED_PREFIX) or original.startswith(TRANSFORMERS_PAGED_PREFIX):
        raise ValueError(f"original attention must not be a paged implementation, got {original!r}")
    name = dispatcher_name(original)
    with _REGISTER_LOCK:
        entry = _DISPATCHERS.get(name)
        if entry is not None and entry[0] != original:
            raise ValueError(
                f"attention implementations {entry[0]!r} and {original!r} both map to the dispatcher name {name!r}"
            )
        if entry is None:
            entry = _DISPATCHERS[name] = (original, _make_dispatch(original))
        if ALL_ATTENTION_FUNCTIONS._global_mapping.get(name) is not entry[1]:
            AttentionInterface.register(name, entry[1])
        if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            mask_key = original if original in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "eager"
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask_key])
    return name


def original_implementation(model: torch.nn.Module) -> str:
    """The kernel the model's forwards without engine metadata fall back to: the implementation it had
    before the engine switched it or, for transformers' ``"paged|sdpa"`` and ``"paged|eager"``, the kernel
    named underneath (rollout's dispatcher replaces their paging)."""
    impl = model.config._attn_implementation or "eager"
    entry = _DISPATCHERS.get(impl)
    if entry is not None:
        return entry[0]
    return impl.removeprefix(PAGED_PREFIX).removeprefix(TRANSFORMERS_PAGED_PREFIX)


def _implementation_configs(model: torch.nn.Module) -> list[tuple[PretrainedConfig, Any]]:
    """The model's config, its sub-configs at any depth and its sub-models' configs (what transformers'
    ``set_attn_implementation`` walks), each with its attention implementation now."""
    found: dict[int, PretrainedConfig] = {}
    pending = [model.config]
    pending += [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, PretrainedConfig):
                pending.append(sub)
    return [(c, getattr(c, "_attn_implementation_internal", None)) for c in found.values()]


@dataclass
class _User:
    """A model on the paged dispatcher: its users, its original implementation, what to put back."""

    count: int
    original: str
    saved: list[tuple[PretrainedConfig, Any]]


# Models switched to the paged dispatcher. Several engines share one model (a persistent manager, a
# generate_batch or score call, a second manager): the first switches it, only the last restores it.
_USERS: weakref.WeakKeyDictionary[torch.nn.Module, _User] = weakref.WeakKeyDictionary()
_USERS_LOCK = threading.Lock()


def enable_paged_attention(model: torch.nn.Module) -> str:
    """Switch a model to the paged dispatcher for one more user; returns the original implementation's name.

    Reference-counted per model object: each call must be paired with one ``restore_attention``. The
    first user records every config's implementation, and the last one puts those values back as
    they were (no check and no kernel import runs again: the model already had them).

    Raises:
        ValueError: transformers refuses the dispatcher (``set_attn_implementation``), or see
            ``register_paged_attention``.
    """
    with _USERS_LOCK:
        entry = _USERS.get(model)
        if entry is not None and model.config._attn_implementation == dispatcher_name(entry.original):
            entry.count += 1
            return entry.original
        # First user, or the caller replaced the implementation since: start counting afresh.
        original = original_implementation(model)
        name = register_paged_attention(original)
        saved = _implementation_configs(model)
        if model.config._attn_implementation != name:
            model.set_attn_implementation(name)
        _USERS[model] = _User(1 if entry is None else entry.count + 1, original, saved)
        return original


def restore_attention(model: torch.nn.Module, original: str) -> None:
    """Release one user of the paged dispatcher; the last one puts the original implementation back.

    Args:
        model: the model.
        original: the implementation ``enable_paged_attention`` returned (used when the model was
            never counted, e.g. switched by hand).
    """
    with _USERS_LOCK:
        entry = _USERS.get(model)
        if entry is None:
            if model.config._attn_implementation != original:
                model.set_attn_implementation(original)
            return
        entry.count -= 1
        if entry.count > 0:
            return
        del _USERS[model]
        for config, value in entry.saved:
            config._attn_implementation_internal = value
