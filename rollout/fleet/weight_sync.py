"""The fleet's weight plane: one broadcast group of the trainer (rank 0) and every replica, replica i at its own
``rank_offset`` (a replica takes as many ranks as ``/get_world_size`` says), so each packed bucket is broadcast once,
whatever the number of replicas (vLLM's ``NCCLInitInfo``; OpenRLHF's and verl's groups).

A weight send that fails drops the replicas that died, closes the group and, when the tensors can be read again (a
state dict or a list), sends them again over a new group of the survivors.

Each full weight update (``send_weights`` or ``update_weights_from_disk`` of every parameter) first probes the dropped
replicas (``Membership.probe_dropped``); those that answer join that update only: the group is rebuilt to include
them, and every member is told the version the update takes (``weight_version``, above each member's own), so that a
returning replica, whatever version it restarted at, ends on the survivors' version with their weights; then it
rejoins (``Membership.admit``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rollout.fleet.control import Control, FanOut
from rollout.fleet.http import Connections, RolloutServerError, address_towards, free_port, logger
from rollout.fleet.membership import Membership
from rollout.lora import LoraAdapter
from rollout.weights.transfer import NamedTensors, TensorMeta, TransferGroup, describe, send, update_info


def one_version(versions: Mapping[str, int]) -> int:
    """The one version every replica ended an update on.

    Raises:
        RuntimeError: the replicas ended on different versions (the message lists them).
    """
    if len(set(versions.values())) != 1:
        raise RuntimeError(f"the rollout servers ended on different weight versions: {dict(versions)}")
    return next(iter(versions.values()))


class WeightSync:
    """This side of the transfer group, and the weight updates of the pool.

    Args:
        fan_out: the pool's fan-out.
        http: the pool's connections (their ``timeout`` bounds the group's rendezvous, collectives and the broadcast
            thread; their ``control_timeout`` the version and world-size reads).
        membership: the pool's replicas (an update goes to the live and the returning ones).
        control: the pool's control calls (a returning replica is resumed only when the pool is not paused).
        bucket_bytes: the bucket bound of ``send_weights``.

    Attributes:
        group: this side of the transfer group, or None.
        last_send: the last weight send's ``seconds``, ``bytes``, ``weight_version`` and ``servers``.
        bucket_bytes: as given; read at each send.
    """

    def __init__(
        self, fan_out: FanOut, http: Connections, membership: Membership, control: Control, bucket_bytes: int
    ) -> None:
        self.fan_out = fan_out
        self.http = http
        self.membership = membership
        self.control = control
        self.bucket_bytes = bucket_bytes
        self.group: TransferGroup | None = None
        self.last_send: dict[str, Any] = {}
        self._group_urls: list[str] = []
        self._group_sent = False  # a send went over the open group (its members then agree on a version)

    # ------------------------------------------------------------------ the group
    def init_weight_transfer(
        self, master_address: str | None = None, master_port: int | None = None, world_size: int | None = None
    ) -> None:
        """Open one transfer group of this process (rank 0, serving the store) and every replica.

        Each replica joins at its own ``rank_offset`` and takes as many ranks as its ``/get_world_size``; the
        world is 1 + their sum. A replica that does not answer is dropped and the group is opened again over the
        others.

        Args:
            master_address: the address the replicas reach this process at (default: this machine's address on
                the route to the first replica; 127.0.0.1 for local ones).
            master_port: the store's port (default: a free one). It and gloo's or NCCL's own connections must be
                reachable from every replica (docs/scaling.md).
            world_size: the expected world (1 + the replicas' ranks); None: computed. A different number raises.

        Raises:
            RolloutServerError: a replica refused the group (400).
            RuntimeError: this side could not open the group, or the last replica failed, or ``world_size``
                differs from the replicas' ranks.
        """
        self.close_weight_transfer()
        while not self._open_group(master_address, master_port, world_size):
            logger.warning(
                "a rollout server left during the rendezvous; opening the group again over %s",
                self.membership.members(),
            )

    def _open_group(self, master_address: str | None, master_port: int | None, world_size: int | None) -> bool:
        """One rendezvous of this process and the live replicas; False when a replica was dropped meanwhile (that
        rendezvous cannot complete: its thread ends at its timeout). The members are the live replicas and the
        returning ones."""
        urls = self.membership.members()
        sizes = self.fan_out("GET", "/get_world_size", urls=urls, timeout=self.http.control_timeout)
        if set(sizes) != set(urls):
            return False
        world = 1 + sum(int(sizes[u]["world_size"]) for u in urls)
        if world_size is not None and world_size != world:
            raise RuntimeError(f"world_size: {world_size} given, but the trainer and the servers' ranks make {world}")
        address = master_address or address_towards(urls[0])
        port = master_port or free_port(address)
        bodies, rank = {}, 1
        for url in urls:
            init = {"master_address": address, "master_port": port, "rank_offset": rank, "world_size": world}
            bodies[url] = {"init_info": init}
            rank += int(sizes[url]["world_size"])
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["group"] = TransferGroup(address, port, 0, world, "cpu", self.http.timeout)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=join, name="rollout-transfer-init", daemon=True)
        thread.start()
        try:
            self.fan_out("POST", "/init_weight_transfer_engine", urls=urls, bodies=bodies)
        except RolloutServerError as e:
            if set(self.membership.members()) == set(urls):
                raise RolloutServerError(
                    e.status, f"a server did not join the transfer group at {address}:{port}: {e.message}", e.param
                ) from e
        except RuntimeError as e:
            raise RuntimeError(f"no server joined the transfer group at {address}:{port}: {e}") from e
        if set(self.membership.members()) != set(urls):
            return False
        thread.join(self.http.timeout)
        if "error" in result or "group" not in result:
            raise RuntimeError(f"the trainer's side of the transfer group did not open: {result.get('error')}")
        self.group = result["group"]
        self._group_urls = urls
        self._group_sent = False
        return True

    def close_weight_transfer(self) -> None:
        """Close this side of the transfer group (each server closes its own at its next init or failure)."""
        if self.group is not None:
            self.group.close()
            self.group = None
            self._group_urls = []

    # ------------------------------------------------------------------ updates
    def send_weights(
        self,
        named_tensors: NamedTensors,
        metas: Sequence[TensorMeta] | None,
        packed: bool,
        recompute: bool,
        lora_adapter: Mapping[str, Any] | None,
        full: bool,
    ) -> int:
        """Stream tensors into every replica's live weights as one new weight version, each bucket broadcast once.

        ``/start_weight_update`` on every replica, then ``/update_weights`` on every replica (each receives) while a
        thread broadcasts the buckets once to the whole group, then ``/finish_weight_update``. Opens the group
        first if none is open or the replicas changed.

        When a replica dies or times out, it is dropped and the group closed; when ``named_tensors`` can be read
        again (a mapping or a sequence, not an iterator), the send is repeated over a new group of the survivors,
        else the error is raised (the next send opens the new group).

        Args:
            named_tensors: a state dict or (name, tensor) pairs (an iterator is consumed once, lazily, when
                ``metas`` is given), named as the servers' ``model.named_parameters()``. CPU or CUDA tensors;
                a gloo group sends them from CPU.
            metas: the names, dtypes and shapes of what ``named_tensors`` yields (``weights.transfer.describe``);
                None reads them from ``named_tensors`` (materialised as a list of references, no copy).
            packed: buckets of ``bucket_bytes`` (True) or one broadcast per tensor.
            recompute: in-flight requests drop their KV when the new weights take effect and are re-prefilled
                under them (``/start_weight_update``'s ``recompute``); False keeps their KV.
            lora_adapter: ``/start_weight_update``'s ``lora_adapter`` (``lora_name``, ``r``, ``lora_alpha``...): the
                tensors are a LoRA adapter's, loaded as one on every replica (``send_lora_adapter``); such a send is
                never ``full``.
            full: the tensors are every parameter of the model (what the trainers send): dropped replicas that answer
                again join this send and rejoin the pool after it, on the others' version (``probe_dropped``); on a
                new group, replicas that report different versions all take one above the highest.
                Pass False for a partial update (some tensors only), which leaves them out. When one is joining, the
                servers refuse an update that misses a parameter (400 naming ``update_info.names``).

        Returns:
            The replicas' new weight version.

        Raises:
            RolloutServerError: a replica refused the announcement (400 naming the field) or the transfer failed on
                its side (500: it keeps its last complete weights, or reports partial ones).
            RuntimeError: this side's broadcast failed, the last replica failed, or the replicas ended on
                different versions. The group is closed after any failure.
        """
        rereadable = isinstance(named_tensors, Mapping | Sequence)
        pairs: Any = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if metas is None:
            pairs = list(pairs)  # read twice: described, then sent
            metas = describe(pairs)
            rereadable = True
        full = full and lora_adapter is None  # an adapter is no full update: it never admits a returning replica
        if full:
            self.membership.probe_dropped()
        while True:
            before = self.membership.members()
            try:
                return self._send_once(iter(pairs), metas, packed, recompute, lora_adapter, full)
            except Exception as e:
                self.close_weight_transfer()  # the group's state is unknown after a failure: the next send opens anew
                self.membership.drop_unhealthy()
                lost = [u for u in before if u not in self.membership.members()]
                if not lost or not rereadable:
                    raise
                logger.warning(
                    "the weight send failed (%s) and %s left the pool; sending again to %s",
                    e,
                    lost,
                    self.membership.members(),
                )

    def _send_once(
        self,
        iterator: Iterator[tuple[str, torch.Tensor]],
        metas: Sequence[TensorMeta],
        packed: bool,
        recompute: bool,
        lora_adapter: Mapping[str, Any] | None,
        full: bool,
    ) -> int:
        """One send over the group (opened first when the members changed); the replicas' new version."""
        if self.group is None or self._group_urls != self.membership.members():
            self.init_weight_transfer()
        assert self.group is not None
        group, urls = self.group, list(self._group_urls)
        # Only a full update admits a returning replica: an adapter or some tensors would leave it on other weights.
        joining = [url for url in urls if url in self.membership.joining] if full else []
        t0 = time.perf_counter()
        start: dict[str, Any] = {"is_checkpoint_format": True}  # vLLM's body, unless rollout's fields are needed
        if recompute:
            start["recompute"] = True
        if lora_adapter is not None:
            start["lora_adapter"] = dict(lora_adapter)
        # A returning replica, or (on a new group) replicas that were never on one version (a pool over servers
        # that served other pools): a full update brings all to one number.
        first = full and not self._group_sent
        target = self._catch_up_version(urls, only_if_needed=not joining) if joining or first else None
        if target is not None:
            start["weight_version"] = target
        self._all(urls, "/start_weight_update", start)
        result: dict[str, Any] = {}
        given_up = threading.Event()

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            # Once the send is given up, the caller's iterator is not read again from this thread: the caller may
            # read it itself (a lazy iterator may run the trainer's own collectives).
            while not given_up.is_set():
                item = next(iterator, None)
                if item is None:
                    return
                yield item

        def broadcast() -> None:
            try:
                result["bytes"] = send(group, metas, tensors(), self.bucket_bytes, packed)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                result["error"] = e

        thread = threading.Thread(target=broadcast, name="rollout-transfer-send", daemon=True)
        thread.start()
        info = {"update_info": update_info(metas, packed, self.bucket_bytes)}
        # When a replica refuses, every replica has answered (fan_out waits for all), so none is still receiving: the
        # broadcast cannot complete and is not waited for (its thread ends at the group's timeout; the caller closes
        # the group). Waiting for it made a refused announcement cost the whole timeout.
        try:
            self._all(urls, "/update_weights", info)
            thread.join(self.http.timeout)
        finally:
            given_up.set()
        if "error" in result or thread.is_alive():
            raise RuntimeError(f"broadcasting the weights failed: {result.get('error', 'timed out')}")
        answers = self._all(urls, "/finish_weight_update", None)
        # A replica still joining (not in this update's ``joining``: the update is not full) keeps its own version.
        serving = {
            url: int(a["weight_version"])
            for url, a in answers.items()
            if url not in self.membership.joining or url in joining
        }
        version = one_version(serving)
        self._group_sent = True
        self.membership.admit(joining, version, resume=not self.control.paused)
        seconds = time.perf_counter() - t0
        self.last_send = {"seconds": seconds, "bytes": result["bytes"], "weight_version": version, "servers": urls}
        logger.debug(
            "sent %.1f MB of weights to %d servers in %.2f s (version %d)", result["bytes"] / 1e6, len(urls), seconds,
            version,
        )  # fmt: skip
        return version

    def send_lora_adapter(self, adapter: LoraAdapter, replace: bool = True) -> int:
        """Load ``adapter`` from memory on every replica (servers started with ``--enable-lora``): its tensors go
        over the transfer group, each bucket broadcast once for all replicas, as one update that each replica loads
        as adapter ``adapter.name`` (a new weight version; its base weights untouched). What vLLM's
        ``/v1/load_lora_adapter`` does only from a folder each replica reads.

        Args:
            adapter: the adapter (``LoraAdapter.from_tensors``); its scaling is sent as peft's ``lora_alpha``
                (``scaling * rank``).
            replace: an adapter loaded under that name is replaced (vLLM's ``load_inplace``).

        Returns:
            The replicas' new weight version.

        Raises:
            RolloutServerError: a replica refused it (400 naming ``lora_adapter``, ``max_lora_rank``,
                ``max_loras`` or ``target_modules``).
            RuntimeError: as ``send_weights``.
        """
        pairs = [
            (f"{module}.lora_{which}.weight", tensor)
            for module, (a, b) in adapter.weights.items()
            for which, tensor in (("A", a), ("B", b))
        ]
        info = {
            "lora_name": adapter.name,
            "r": adapter.rank,
            "lora_alpha": adapter.scaling * adapter.rank,
            "load_inplace": replace,
        }
        return self.send_weights(pairs, metas=None, packed=True, recompute=False, lora_adapter=info, full=False)

    def update_weights_from_disk(self, model_path: str, full: bool = True) -> int:
        """``POST /update_weights_from_disk`` on every replica (each must read ``model_path``); the new version.

        Args:
            model_path: a folder of safetensors files every replica can read.
            full: the folder holds every parameter (a ``save_pretrained`` of the model): dropped replicas that
                answer again take it too, at the others' new version, and rejoin (``probe_dropped``).

        Raises:
            RolloutServerError: a replica refused the folder (400 naming ``model_path``).
            RuntimeError: the replicas ended on different versions.
        """
        joining = self.membership.probe_dropped() if full else []
        members = self.membership.members() if joining else list(self.membership.urls)
        body: dict[str, Any] = {"model_path": model_path}
        if joining:
            body["weight_version"] = self._catch_up_version(members)
        answers = self.fan_out("POST", "/update_weights_from_disk", urls=members, json=body)
        version = one_version({url: int(a["weight_version"]) for url, a in answers.items()})
        self.membership.admit([url for url in joining if url in answers], version, resume=not self.control.paused)
        return version

    # ------------------------------------------------------------------ helpers
    def _catch_up_version(self, urls: Sequence[str], only_if_needed: bool = False) -> int | None:
        """The version a full update must take so that every member (returning ones too) ends on one number: one
        above the highest any member reports (a number is never reused on a server). With ``only_if_needed``,
        None when the members already agree (the plain +1 of each then lands on one number).

        Raises:
            RuntimeError: a member did not answer.
        """
        answers = self.fan_out("GET", "/weight_transfer", urls=urls, timeout=self.http.control_timeout)
        if set(answers) != set(urls):
            raise RuntimeError(f"/weight_transfer: {sorted(set(urls) - set(answers))} did not answer")
        versions = {int(a["weight_version"]) for a in answers.values()}
        return None if only_if_needed and len(versions) == 1 else 1 + max(versions)

    def _all(self, urls: list[str], path: str, body: Any) -> dict[str, Any]:
        """POST to every replica of the group; any replica lost on the way fails the whole send.

        Raises:
            RuntimeError: a replica did not answer.
        """
        answers = self.fan_out("POST", path, urls=urls, json=body)
        if set(answers) != set(urls):
            lost = sorted(set(urls) - set(answers))
            raise RuntimeError(f"{path}: {lost} did not answer")
        return answers
