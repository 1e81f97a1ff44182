"""LoRA training: the policy trained as a peft adapter over frozen base weights, and only the adapter synced.

``lora_policy`` checks ``lora_target_modules`` against the model (before any other work) and wraps the policy with
peft's ``get_peft_model``. peft replaces each targeted ``nn.Linear`` by its own layer in the module tree it is given,
so it is given a second tree of the same model (``shared_module_copy``): new module objects over the very same
parameter and buffer tensors (no weight is copied). The rollout engine keeps the untouched tree, whose targeted
layers are still ``nn.Linear`` and carry the engine's per-token adapter hooks (``rollout.lora``); the trainer's
forwards run peft's layers. Neither sees the other's modules, so a training forward never runs an engine hook and an
engine step never runs peft's live adapter, even when both run at once (``train_outside_pause``).

``LoraRollouts`` wraps the trainer's rollout backend (the local manager or ``trainers.remote.RemoteRollouts``): after
each optimizer step (``update_weights``) it loads the adapter's tensors, copied, as a new adapter named
``<prefix>-v<version>`` (the manager's ``load_lora``; over the transfer group for a server, on every replica), which
is a new weight version, and every later request names it. Until the first sync requests name no adapter: peft
starts lora_B at zero, so the base model is the initial policy exactly. The previous adapter is unloaded at once;
requests queued under it finish under it (the engine keeps its slot until they are done), and its adapter's uid keys
their KV, so no request reads KV of another adapter version (DESIGN.md's weight-version promise). The engine needs
``effective_prefetch + 2`` slots (``TrainerConfig.lora_engine_fields``; TRL's ``max_staleness + 2``).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Unpack

import torch
from transformers import PreTrainedModel

import rollout

from .backend import BatchOptions, NamedTensors, RequestOptions, RolloutBackend
from .config import ConfigError

ALL_LINEAR = "all-linear"
# Targets the engine cannot serve (the LM head sees only the kept logits rows; embeddings are not linear layers).
REFUSED_TARGETS = ("lm_head", "embed_tokens")


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The names of the ``nn.Linear`` modules of ``model`` a LoRA adapter may target (all but the LM head)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in REFUSED_TARGETS
    ]


def check_lora_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """The linear layers ``targets`` select, by peft's rule (a module whose name equals an entry or ends with ``.``
    and it; ``["all-linear"]``: every linear layer but the LM head).

    Raises:
        ConfigError: naming ``lora_target_modules``: an entry that is the LM head or the embeddings, or that matches
            no linear layer of the model (the message lists the layers' short names).
    """
    linear = linear_layer_names(model)
    if list(targets) == [ALL_LINEAR]:
        return linear
    short = sorted({name.rsplit(".", 1)[-1] for name in linear})
    chosen: set[str] = set()
    for target in targets:
        if target.rsplit(".", 1)[-1] in REFUSED_TARGETS:
            raise ConfigError(
                f"lora_target_modules: {target!r} is the LM head or the embeddings, which the rollout engine does "
                f"not adapt; choose among {short} or 'all-linear'"
            )
        hits = [name for name in linear if name == target or name.endswith("." + target)]
        if not hits:
            raise ConfigError(
                f"lora_target_modules: {target!r} matches no linear layer of the model; choose among {short} "
                "or 'all-linear'"
            )
        chosen.update(hits)
    return sorted(chosen)


def shared_module_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``'s modules (and config) over the same parameter and buffer tensors: no weight is
    copied, and an in-place change of a weight shows in both; replacing a module in one tree leaves the other as is.
    """
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo)


def lora_policy(config: Any, policy: PreTrainedModel) -> torch.nn.Module:
    """The module a LoRA run trains: peft's ``get_peft_model`` over a shared-tensor copy of ``policy``
    (``shared_module_copy``), adapter "default" of rank ``config.lora_r``, no dropout (the engine and the trainer
    must compute one function), no bias; the base weights frozen (also ``policy``'s: they are the same tensors).

    Raises:
        ConfigError: ``lora_target_modules`` selects a module the engine cannot adapt (``check_lora_targets``).
    """
    from peft import LoraConfig, get_peft_model

    targets = config.lora_target_modules
    check_lora_targets(policy, targets)
    lora_config = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        target_modules=ALL_LINEAR if list(targets) == [ALL_LINEAR] else list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(shared_module_copy(policy), lora_config)


def lora_plus_groups(named: Iterable[tuple[str, torch.nn.Parameter]], lr: float, ratio: float) -> list[dict[str, Any]]:
    """Optimizer parameter groups for LoRA+ (Hayou, Ghosh and Yu, "LoRA+: Efficient Low Rank Adaptation of Large
    Models", ICML 2024): every adapter's B matrix (peft's ``lora_B``) at ``ratio * lr``, every other trainable
    parameter at ``lr``. The paper's argument: with B starting at zero and A random, one learning rate for both is
    inefficient at width; it suggests ratios around 16.

    Args:
        named: the trained module's ``named_parameters()`` (frozen ones are left out).
        lr: the learning rate of A and of anything else trained.
        ratio: B's learning rate over A's (> 0).

    Returns:
        Groups (``params``, ``lr``): the others, then the B matrices, or one group of all when ``ratio`` is 1 (full
        fine-tuning has no B); an empty one is left out.
    """
    others, b = [], []
    for name, p in named:
        if p.requires_grad:
            (b if ".lora_B." in name and ratio != 1.0 else others).append(p)
    groups = [{"params": others, "lr": lr}, {"params": b, "lr": lr * ratio}]
    return [g for g in groups if g["params"]]


def full_weights_bytes(model: torch.nn.Module) -> int:
    """Bytes a full weight sync of ``model`` sends: every parameter once (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class LoraRollouts(RolloutBackend):
    """A rollout backend whose requests run under the trainer's latest LoRA adapter, synced alone.

    Args:
        backend: the local ``rollout.ContinuousBatchingManager`` (built with ``enable_lora``) or
            ``trainers.remote.RemoteRollouts``; either has ``load_lora(adapter) -> version`` and
            ``unload_lora(name)``.
        peft_model: the trained peft model (adapter "default").
        r, lora_alpha: the adapter's rank and alpha (peft's config).
        prefix: adapter names are ``<prefix>-v<version>``.

    Attributes:
        adapter: the name requests run under now (None before the first sync: the base model, which is what the
            untrained adapter computes).
        last_sync_bytes: bytes of the adapter tensors of the last sync (0 before one).
        full_bytes: bytes a full weight sync would send (the base model's parameters).
    """

    def __init__(
        self, backend: Any, peft_model: torch.nn.Module, r: int, lora_alpha: float, prefix: str = "policy"
    ) -> None:
        self.backend = backend
        self.peft_model = peft_model
        self.r = r
        self.lora_alpha = lora_alpha
        self.prefix = prefix
        self.adapter: str | None = None
        self.last_sync_bytes = 0
        # The base weights alone (peft's layers hold the adapter inside the base model's tree).
        self.full_bytes = sum(
            p.numel() * p.element_size() for n, p in peft_model.named_parameters() if ".lora_" not in n
        )

    # ------------------------------------------------------------------ life cycle
    @property
    def weight_version(self) -> int:
        return self.backend.weight_version

    def start(self) -> None:
        self.backend.start()

    def stop(self, *, hard_stop: bool = False) -> None:
        self.backend.stop(hard_stop=hard_stop)

    def destroy(self) -> None:
        self.backend.destroy()

    def pause(self) -> AbstractContextManager[None]:
        return self.backend.pause()

    def is_running(self) -> bool:
        """The wrapped backend's ``is_running``."""
        return self.backend.is_running()

    # ------------------------------------------------------------------ the adapter
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's LoRA tensors now, copied (the optimizer changes the live ones), named as
        ``rollout.LoraAdapter.from_tensors`` takes them."""
        return {k: v.detach().clone() for k, v in rollout.adapter_state_dict(self.peft_model).items()}

    def update_weights(self, named_tensors: NamedTensors | None = None) -> int:
        """Load the adapter's current tensors as a new adapter (a new weight version), unload the previous one, and
        name the new one in every later request.

        Args:
            named_tensors: must be None: the adapter is read from the peft model.

        Returns:
            The new weight version.

        Raises:
            ValueError: ``named_tensors`` given (refused, not ignored).
        """
        if named_tensors is not None:
            raise ValueError(
                "LoraRollouts.update_weights reads the adapter from the peft model: named_tensors must be None"
            )
        tensors = self.adapter_tensors()
        name = f"{self.prefix}-v{self.backend.weight_version + 1}"
        adapter = rollout.LoraAdapter.from_tensors(name, tensors, self.r, self.lora_alpha)
        with self.backend.pause():
            version = self.backend.load_lora(adapter)
            if self.adapter is not None:
                self.backend.unload_lora(self.adapter)
            self.adapter = name
        self.last_sync_bytes = adapter.num_bytes
        return version

    # ------------------------------------------------------------------ requests
    def add_request(
        self, input_ids: Sequence[int], request_id: str | None = None, **options: Unpack[RequestOptions]
    ) -> str | None:
        return self.backend.add_request(input_ids, request_id, **options, lora=self.adapter)

    def add_requests(self, inputs: Sequence[Sequence[int]], **options: Unpack[BatchOptions]) -> list[str]:
        return self.backend.add_requests(inputs, **options, lora=self.adapter)

    def get_result(self, request_id: str, timeout: float | None = None) -> rollout.GenerationOutput | None:
        return self.backend.get_result(request_id, timeout)


def adapter_sync_bytes(model_config: Any, r: int, target_modules: Sequence[str] = (ALL_LINEAR,)) -> tuple[int, int]:
    """(adapter bytes, full weight bytes) a sync of a LoRA run on a model of ``model_config`` sends, counted on the
    meta device (no weight is allocated or read): the adapter ``lora_policy`` builds, against every parameter.

    Args:
        model_config: a ``transformers`` config of a causal LM (``AutoConfig.from_pretrained``).
        r: the adapter's rank; its alpha does not change the bytes.
        target_modules: as ``lora_target_modules``.

    Raises:
        ConfigError: as ``check_lora_targets``.
    """
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    settings = SimpleNamespace(lora_r=r, lora_alpha=float(r), lora_target_modules=list(target_modules))
    peft_model = lora_policy(settings, model)
    adapter = rollout.LoraAdapter.from_tensors("sizing", rollout.adapter_state_dict(peft_model), r, float(r))
    return adapter.num_bytes, full_weights_bytes(model)
