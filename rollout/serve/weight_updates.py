"""New weights for the served model: from a folder on disk, or streamed by a trainer.

``/update_weights_from_disk`` copies a folder's safetensors files into the live weights. Weights streamed
by a trainer (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, vLLM's four calls) arrive over a ``rollout.weights.transfer.TransferGroup``;
``TransferSettings`` says whether they are staged first (atomic) or copied bucket by bucket (in place).
Both reach the model through ``manager.update_weights``, which makes a new weight version. An update opened with
``lora_adapter`` (rollout's field of ``/start_weight_update``) carries a LoRA adapter's tensors instead: they are
always staged, and loaded as an adapter when the update finishes (the service's ``install_lora``: a new weight
version; the base weights are untouched), the in-memory adapter load vLLM lacks.
``WeightUpdater`` belongs to the ``GenerationService`` (``service.py``), whose ``abort`` it calls after a failed
in-place transfer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rollout import ContinuousBatchingManager, FieldError, LoraAdapter
from rollout.lora import lora_module_name
from rollout.serve.errors import APIError, bad_request
from rollout.serve.protocol import InitInfo, LoraTransferInfo, UpdateInfo
from rollout.weights.transfer import DEFAULT_BUCKET_BYTES, TensorMeta, TransferGroup, parse_metas, receive
from rollout.weights.versions import copy_weights, plan_weight_copy

logger = logging.getLogger(__name__)

# What /health and generation answer (503) while the live weights mix two versions.
PARTIAL_WEIGHTS = (
    "the weights are partial: a weight transfer copied some tensors and did not finish; "
    "send a complete update (/start_weight_update, /update_weights, /finish_weight_update)"
)
# The ``update_info`` list that announces each attribute ``plan_weight_copy`` compares (its ``FieldError.field``).
UPDATE_INFO_FIELDS = {"shape": "update_info.shapes", "dtype": "update_info.dtype_names"}


@dataclass(frozen=True)
class TransferSettings:
    """How the server takes weights streamed by a trainer.

    Attributes:
        mode: ``atomic``: the received tensors are held until ``/finish_weight_update`` and copied then, under
            one pause, so a failed transfer leaves the weights as they were (memory: one more copy of the
            tensors sent); ``in_place``: each bucket is copied into the live weights as it arrives, under a
            pause held for the whole ``/update_weights`` call, which makes a new weight version (memory: one
            bucket; generation stops while it receives, and requests sent meanwhile wait, as under any pause),
            so a failed transfer leaves partial weights, which the server then reports (``/health`` 503,
            generation 503) until a complete update.
        timeout: seconds the rendezvous and each broadcast may wait for the trainer before failing.
    """

    mode: Literal["atomic", "in_place"] = "atomic"
    timeout: float = 120.0


@dataclass
class TransferState:
    """The server's side of the trainer's transfer group (read by ``GET /weight_transfer``).

    Attributes:
        group: the joined group, or None (never initialised, or closed after a failure).
        packed: ``init_info.packed``, the default of ``update_info.packed``.
        updating: between ``/start_weight_update`` and ``/finish_weight_update``.
        recompute: the open update re-prefills in-flight requests when it takes effect.
        weight_version: the version the open update takes (``/start_weight_update``'s), or None for the next one.
        receiving: an ``/update_weights`` call is receiving now.
        staged: atomic mode: the (name, tensor) pairs received since the update started.
        partial: in-place mode: why the live weights are a mix of two versions, or None.
        last_error: the last failed transfer's message, or None.
        lora: the open update's LoRA adapter (``/start_weight_update``'s ``lora_adapter``), or None.
        tensors_received, bytes_received, seconds: the last ``/update_weights`` call's progress.
    """

    group: TransferGroup | None = None
    packed: bool = False
    updating: bool = False
    recompute: bool = False
    weight_version: int | None = None
    receiving: bool = False
    staged: list[tuple[str, torch.Tensor]] | None = None
    partial: str | None = None
    last_error: str | None = None
    lora: LoraTransferInfo | None = None
    tensors_received: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class WeightUpdater:
    """The server's weight updates: from disk, and the server's side of the trainer's transfer group.

    Args:
        manager: the server's manager.
        settings: how streamed weights are taken (atomic or in place, the timeout).
        abort: cancels every in-flight request (the service's ``abort``): an in-place transfer that fails
            part way calls it before its pause ends, so no token is sampled from a mix of two versions.
        install_lora: loads a received adapter (the service's ``install_lora(adapter, replace)``), returns the
            new weight version.

    Attributes:
        settings: as given.
        state: the transfer group and the update in progress (``GET /weight_transfer``).
    """

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        settings: TransferSettings,
        abort: Callable[[], int],
        install_lora: Callable[[LoraAdapter, bool], Awaitable[int]],
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.state = TransferState()
        self._model_lock = threading.Lock()  # one weight copy at a time
        self._copies = 0  # copies into the live weights under way
        self._no_copy = asyncio.Event()  # set while none is
        self._no_copy.set()
        self._abort = abort
        self._install_lora = install_lora

    async def update_weights_from_disk(
        self, model_path: str, recompute: bool, weight_version: int | None = None
    ) -> int:
        """Copy the tensors of a folder's ``*.safetensors`` files into the live weights, in place.

        Args:
            model_path: the folder.
            recompute: in-flight requests are re-prefilled under the new weights.
            weight_version: the version the new weights take (above the current one; the folder must then hold
                every parameter), or None for the current one + 1.

        Returns:
            The new weight version.

        Raises:
            APIError: 400 (param ``model_path``) for a missing folder, no safetensors file, an unknown
                tensor name, a shape or dtype mismatch, or a parameter missing under ``weight_version``; 400
                (param ``weight_version``) for a version not above the current one. Nothing is copied then.
        """
        self._check_version(weight_version)
        folder = Path(model_path).expanduser()
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            raise APIError(400, f"model_path: {model_path!r} is not a folder holding *.safetensors files", "model_path")

        def run() -> int:
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            tensors: dict[str, Any] = {}
            for f in files:
                try:
                    tensors.update(load_file(str(f)))
                except (SafetensorError, OSError) as e:  # a corrupt or unreadable file: nothing copied yet
                    raise ValueError(f"{f.name} cannot be read as safetensors: {e}") from e
            if weight_version is not None and (missing := self._missing_parameters(tensors)):
                raise ValueError(f"{len(missing)} parameters are not in the folder ({missing[0]}...), but a "
                                 "weight_version update must hold every parameter")  # fmt: skip
            with self._model_lock:
                return self.manager.update_weights(tensors, recompute=recompute, version=weight_version)

        try:
            return await self._copying(run)
        except (KeyError, ValueError, TypeError) as e:
            message = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
            raise APIError(400, f"model_path: {message}", "model_path") from e

    async def until_no_copy(self) -> None:
        """Return once no copy into the live weights is under way.

        The service queues new requests only then: the manager records weights changed by hand when a request is
        added, and would record a half-copied model as a weight version of its own (an in-place transfer made two
        versions when a request came in the middle). The copies run under a pause, so the wait costs no step.
        """
        await self._no_copy.wait()

    async def _copying(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` (a copy into the live weights) in a thread; ``until_no_copy`` waits meanwhile."""
        self._copies += 1
        self._no_copy.clear()
        try:
            return await asyncio.to_thread(run)
        finally:
            self._copies -= 1
            if not self._copies:
                self._no_copy.set()

    def _check_version(self, weight_version: int | None) -> None:
        """Raises APIError 400 (param ``weight_version``) for a version not above the current one."""
        if weight_version is not None and weight_version <= self.manager.weight_version:
            raise bad_request(
                f"weight_version: {weight_version} is not above this server's weight version "
                f"{self.manager.weight_version} (a version number is never reused)",
                "weight_version",
            )

    def _missing_parameters(self, names: Iterable[str]) -> list[str]:
        """The model's parameters that ``names`` do not cover (a tied weight is covered by any of its names)."""
        targets = dict(self.manager.model.named_parameters(remove_duplicate=False))
        covered = {id(targets[name]) for name in names if name in targets}
        return [name for name, p in self.manager.model.named_parameters() if id(p) not in covered]

    def backend(self) -> str:
        """The transfer group's torch.distributed backend: ``nccl`` for a CUDA model, ``gloo`` otherwise."""
        return "nccl" if next(self.manager.model.parameters()).device.type == "cuda" else "gloo"

    def weights_dtype(self) -> str:
        """The dtype of the model's weights, as torch spells it (``"torch.float32"``)."""
        return str(next(self.manager.model.parameters()).dtype)

    def transfer_status(self) -> dict[str, Any]:
        """What ``GET /weight_transfer`` answers: the group, the update in progress, the last error."""
        t = self.state
        return {
            "initialized": t.group is not None,
            "mode": self.settings.mode,
            "updating": t.updating,
            "receiving": t.receiving,
            "weights": "partial" if t.partial is not None else "complete",
            "weight_version": self.manager.weight_version,
            "last_error": t.last_error,
            "tensors_received": t.tensors_received,
            "bytes_received": t.bytes_received,
            "seconds": t.seconds,
        }

    def close_group(self) -> None:
        """Leave the trainer's transfer group, if joined (after a failed transfer, and at shutdown)."""
        if self.state.group is not None:
            self.state.group.close()
            self.state.group = None

    async def init_weight_transfer(self, init: InitInfo) -> None:
        """Join the trainer's transfer group as rank ``rank_offset`` (this server has one worker).

        Blocks until every rank joined, at most ``TransferSettings.timeout`` seconds. A group joined before is
        closed first.

        Raises:
            APIError: 400 (``init_info.rank_offset``) for a rank outside the world; 409 while a transfer
                receives; 500 when the rendezvous failed or timed out (the message names the address).
        """
        if self.state.receiving:
            raise APIError(409, "a weight transfer is receiving now; wait for its /update_weights to answer")
        if init.rank_offset >= init.world_size:
            raise bad_request(
                f"init_info.rank_offset: {init.rank_offset} is not a rank of a world of {init.world_size} "
                "(the trainer is rank 0, this server's one worker is rank rank_offset)",
                "init_info.rank_offset",
            )
        self.close_group()
        device = next(self.manager.model.parameters()).device
        timeout = self.settings.timeout
        try:
            group = await asyncio.to_thread(
                TransferGroup, init.master_address, init.master_port, init.rank_offset, init.world_size, device, timeout
            )
        except RuntimeError as e:
            self.state.last_error = str(e)
            raise APIError(500, str(e)) from e
        self.state.group = group
        self.state.packed = bool(init.packed)
        self.state.updating = False
        self.state.staged = None
        self.state.weight_version = None
        logger.info("joined the weight-transfer group at %s:%d", init.master_address, init.master_port)

    def _need_group(self) -> TransferGroup:
        if self.state.group is None:
            raise bad_request(
                "no weight-transfer group: call /init_weight_transfer_engine first (a failed transfer closes it)",
                "init_info",
            )
        return self.state.group

    def start_weight_update(
        self, recompute: bool = False, lora: LoraTransferInfo | None = None, weight_version: int | None = None
    ) -> None:
        """Open an update: the tensors of the next ``/update_weights`` calls form one new weight version.

        Args:
            recompute: when the update takes effect (atomic: at ``finish``; in place: at each ``/update_weights``),
                in-flight requests drop their KV and are re-prefilled under the new weights.
            lora: the tensors are this LoRA adapter's, loaded as it at ``finish`` (staged whatever the mode).
            weight_version: the version the update takes, above the current one (a replica rejoining a fleet takes
                the fleet's); its ``/update_weights`` must then announce every parameter. None: the current + 1.

        Raises:
            APIError: 400 without a group, for ``lora_adapter`` on a server without ``--enable-lora``, for a
                ``weight_version`` not above the current one or given with ``lora_adapter``; 409 while a
                transfer receives.
        """
        self._need_group()
        if self.state.receiving:
            raise APIError(409, "a weight transfer is receiving now; wait for its /update_weights to answer")
        if lora is not None and not self.manager.cb_config.enable_lora:
            raise bad_request(
                "lora_adapter: this server serves no LoRA adapters; start it with --enable-lora", "lora_adapter"
            )
        if lora is not None and weight_version is not None:
            raise bad_request(
                "weight_version: an adapter update takes the next version; send weight_version only with base weights",
                "weight_version",
            )
        self._check_version(weight_version)
        self.state.updating = True
        self.state.recompute = recompute
        self.state.lora = lora
        self.state.weight_version = weight_version
        self.state.staged = []

    def _check_update(self, info: UpdateInfo) -> list[TensorMeta]:
        """The announced tensors, checked against the model's parameters before any byte is received."""
        try:
            metas = parse_metas(info.names, info.dtype_names, info.shapes)
        except FieldError as e:
            raise APIError(400, str(e), e.field) from e
        if self.state.updating and self.state.lora is not None:  # an adapter: peft's names; shapes checked at load
            for m in metas:
                if lora_module_name(m.name) is None:
                    raise bad_request(
                        f"update_info.names: {m.name!r} is not a LoRA tensor name ('<module>.lora_A.weight' or "
                        "'<module>.lora_B.weight'), and this update carries a LoRA adapter (lora_adapter)",
                        "update_info.names",
                    )
            return metas
        try:  # meta tensors: only names, shapes and dtypes are compared
            plan_weight_copy(
                self.manager.model, [(m.name, torch.empty(m.shape, dtype=m.dtype, device="meta")) for m in metas]
            )
        except KeyError as e:
            raise APIError(400, f"update_info.names: {e.args[0]}", "update_info.names") from e
        except FieldError as e:  # its field is the tensor's attribute that differs
            param = UPDATE_INFO_FIELDS[e.field]
            raise APIError(400, f"{param}: {e}", param) from e
        if self.state.weight_version is not None and (missing := self._missing_parameters(info.names)):
            raise bad_request(
                f"update_info.names: {len(missing)} parameters are not announced ({missing[0]}...), but an update "
                f"to weight_version {self.state.weight_version} must carry every parameter (a replica catching up)",
                "update_info.names",
            )
        return metas

    def _drop_open_update(self, refusal: APIError) -> None:
        """Close the open update after ``/update_weights`` refused its announcement: the update cannot be the one
        the trainer meant (a tensor of it was refused), and an update left open would report ``updating`` until the
        next ``/start_weight_update`` or init. Nothing was received for it in this call; tensors an earlier call
        staged are dropped (atomic mode), and copies an earlier call made in place are already a version of their own.
        """
        t = self.state
        if not t.updating:
            return
        t.updating, t.staged, t.lora, t.weight_version = False, None, None, None
        t.last_error = f"the open weight update was dropped: its announcement was refused ({refusal.message})"
        logger.warning("%s", t.last_error)

    async def update_weights(self, info: UpdateInfo) -> dict[str, Any]:
        """Receive the announced tensors from the trainer (rank 0), while it broadcasts them.

        Atomic mode stages them; in-place mode copies each bucket into the live weights under a pause. Without
        an open update (no ``/start_weight_update``), the call is a whole update: it finishes it too.

        Returns:
            ``tensors``, ``bytes``, ``seconds`` received, and ``weight_version`` when the call finished the update.

        Raises:
            APIError: 400 for a bad announcement (names, dtypes, shapes: nothing is received then, and an open update
                is dropped: ``/start_weight_update`` again) or no group;
                409 while another transfer receives; 500 when the transfer failed: the trainer died (seen at
                once) or stalled past the timeout. The group is closed then (init again); atomic mode keeps
                the last complete weights, in-place mode reports partial weights and aborts in-flight requests.
        """
        group = self._need_group()
        if self.state.receiving:
            raise APIError(409, "a weight transfer is receiving now; wait for its /update_weights to answer")
        try:
            metas = self._check_update(info)
        except APIError as e:
            self._drop_open_update(e)
            raise
        implicit = not self.state.updating
        if implicit:
            self.start_weight_update()
        packed = info.packed if info.packed is not None else self.state.packed
        bucket_bytes = info.packed_buffer_size_bytes or DEFAULT_BUCKET_BYTES
        t = self.state
        t.receiving, t.tensors_received, t.bytes_received = True, 0, 0
        in_place = self.settings.mode == "in_place" and t.lora is None  # an adapter is loaded whole, at finish
        t0 = time.perf_counter()

        def progress(done: int) -> None:
            t.tensors_received = done

        def stage(pairs: list[tuple[str, torch.Tensor]]) -> None:
            assert t.staged is not None
            t.staged.extend(pairs)

        copied: list[int] = []  # buckets this call copied into the live weights

        def copy(pairs: list[tuple[str, torch.Tensor]]) -> None:
            copied.append(len(pairs))
            copy_weights(plan_weight_copy(self.manager.model, pairs))

        def run() -> int:
            if not in_place:
                return receive(group, metas, stage, bucket_bytes, packed, progress)
            # A transfer that succeeds is invisible to clients: requests sent meanwhile wait for this pause (and the
            # client's) like any paused request; only one that fails after a copy leaves partial weights.
            with self._model_lock, self.manager.pause():
                try:
                    received = receive(group, metas, copy, bucket_bytes, packed, progress)
                except Exception:
                    if copied:
                        t.partial = PARTIAL_WEIGHTS
                    if t.partial is not None:
                        self._abort()  # before the pause ends: no token is sampled from a mix of two versions
                    raise
                # Recorded before the pause ends, or the loop would notice the change and bump on its own.
                self.manager.update_weights(None, recompute=t.recompute, version=t.weight_version)
                return received

        try:
            t.bytes_received = await (self._copying(run) if in_place else asyncio.to_thread(run))
        except Exception as e:
            self.close_group()
            t.updating, t.staged, t.lora, t.weight_version = False, None, None, None
            if in_place and t.partial is not None:
                keeps = "the server holds partial weights and refuses generation until a complete update"
            else:
                keeps = f"the server keeps its weights of version {self.manager.weight_version}"
            message = (
                f"the weight transfer failed after {t.tensors_received} of {len(metas)} tensors: {e}; {keeps}; "
                "call /init_weight_transfer_engine again"
            )
            t.last_error = message
            logger.error("%s", message)
            raise APIError(500, message) from e
        finally:
            t.receiving = False
            t.seconds = time.perf_counter() - t0
        answer: dict[str, Any] = {"tensors": len(metas), "bytes": t.bytes_received, "seconds": t.seconds}
        if implicit:
            answer["weight_version"] = await self.finish_weight_update()
        return answer

    async def finish_weight_update(self) -> int:
        """Close the update: atomic mode copies the staged tensors in one pause, a new weight version (in-place mode
        made one at each ``/update_weights``: one version per call, so send an update in one call).

        Returns:
            The new weight version (the one the next tokens report).

        Raises:
            APIError: 400 without an open update; 409 while a transfer receives.
        """
        t = self.state
        if t.receiving:
            raise APIError(409, "a weight transfer is receiving now; wait for its /update_weights to answer")
        if not t.updating:
            raise APIError(400, "no weight update is open: call /start_weight_update first")
        staged, recompute, lora, version = t.staged, t.recompute, t.lora, t.weight_version
        t.updating, t.staged, t.lora, t.weight_version = False, None, None, None
        if lora is not None:
            return await self._finish_lora(lora, staged or [])
        if self.settings.mode == "in_place":  # each /update_weights recorded its copy: a new version
            t.partial = None
            return self.manager.weight_version

        def run() -> int:
            with self._model_lock:
                return self.manager.update_weights(staged, recompute=recompute, version=version)

        return await self._copying(run)

    async def _finish_lora(self, lora: LoraTransferInfo, staged: list[tuple[str, torch.Tensor]]) -> int:
        """Load the received tensors as adapter ``lora.lora_name`` (the service's ``install_lora``).

        Raises:
            APIError: 400 naming ``lora_adapter`` for tensors that are not one rank-``r`` adapter (a module with
                lora_A or lora_B missing, shapes that do not match ``r``), or the field the service names.
        """
        try:
            adapter = LoraAdapter.from_tensors(
                lora.lora_name, dict(staged), lora.r, lora.lora_alpha, lora.use_rslora, source="weight transfer"
            )
        except ValueError as e:
            raise bad_request(f"lora_adapter: {e}", "lora_adapter") from e
        return await self._install_lora(adapter, lora.load_inplace)
