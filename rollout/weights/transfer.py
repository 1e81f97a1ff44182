"""Streaming weights from a trainer process to rollout servers: a process group of its own, packed buckets.

The layout is vLLM's weight-transfer engine (``vllm/distributed/weight_transfer``: ``NCCLInitInfo``,
``NCCLUpdateInfo``, ``packed_tensor.py``), rebuilt on plain ``torch.distributed`` so that it runs on a CPU:

* **The group.** The trainer is rank 0 and hosts a ``TCPStore`` on ``master_address:master_port``; each server joins
  as ``rank_offset + its worker rank`` of ``world_size``. The group is a ``ProcessGroupGloo`` (CPU) or
  ``ProcessGroupNCCL`` (CUDA) built on that store, never the default group, so existing groups (tensor parallelism,
  DDP) are untouched and no ``init_process_group`` is needed.
* **The announcement.** Before the bytes, the receiver learns every tensor's name, dtype and shape (``update_info``:
  ``names``, ``dtype_names``, ``shapes``, ``packed``), to allocate its buffers and check the names first.
* **Packed buckets.** With ``packed``, consecutive tensors are concatenated as bytes into buckets, one broadcast each,
  cut by vLLM's rule (a bucket closes once its size exceeds ``bucket_bytes``); without it, one broadcast per tensor.
* **Bounded failure.** Every collective has the group's timeout: a dead sender is seen at once, a stalled one after
  ``timeout`` seconds, never a hang (TRL issues 6796, 7131 describe the hangs of NCCL groups without one).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollout.checks import FieldError

logger = logging.getLogger(__name__)

# vLLM's default packed buffer (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``): 1 GiB.
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 120.0
# The store keys of a transfer group live under this prefix, apart from any other user of the port.
STORE_PREFIX = "rollout-weight-transfer"

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver learns of one tensor before its bytes arrive.

    Attributes:
        name: the parameter's name, as in ``model.named_parameters()``.
        dtype: its dtype.
        shape: its shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor, contiguous."""
        return math.prod(self.shape) * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling of ``update_info.dtype_names`` (vLLM's)."""
    return str(dtype).removeprefix("torch.")


def describe(named_tensors: NamedTensors) -> list[TensorMeta]:
    """The metadata of (name, tensor) pairs or a state dict, in order."""
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in pairs]


def update_info(metas: Sequence[TensorMeta], packed: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """The ``update_info`` body of ``/update_weights`` for these tensors (vLLM's ``NCCLUpdateInfo`` fields).

    ``packed_buffer_size_bytes`` is rollout's addition: both sides must cut the same buckets, so the
    sender says the size it packs with (vLLM fixes it to 1 GiB on both sides).
    """
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "packed": packed,
        "packed_buffer_size_bytes": bucket_bytes,
    }


def parse_metas(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """Metadata from ``update_info``'s three parallel lists.

    Raises:
        FieldError: lists of different lengths, an unknown dtype name or a negative dimension; ``field`` is
            the field's name (``update_info.dtype_names``), which the message starts with.
    """
    for field, values in (("dtype_names", dtype_names), ("shapes", shapes)):
        if len(values) != len(names):
            raise FieldError(
                f"update_info.{field}", f"update_info.{field}: {len(values)} entries for {len(names)} names"
            )
    metas = []
    for name, dname, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, str(dname).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise FieldError(
                "update_info.dtype_names", f"update_info.dtype_names: {dname!r} (for {name}) is not a torch dtype"
            )
        if any(int(d) < 0 for d in shape):
            raise FieldError(
                "update_info.shapes", f"update_info.shapes: {list(shape)} (for {name}) has a negative dimension"
            )
        metas.append(TensorMeta(name, dtype, tuple(int(d) for d in shape)))
    return metas


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Cut the tensors into buckets, in order, by vLLM's packing rule.

    A bucket takes tensors until its size exceeds ``bucket_bytes`` (the tensor that crosses the bound
    stays in it), so each bucket holds at least one tensor and at most ``bucket_bytes`` plus one tensor.

    Args:
        metas: the tensors, in sending order.
        bucket_bytes: the bound, > 0.

    Returns:
        The indices into ``metas`` of each bucket's tensors.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, meta in enumerate(metas):
        current.append(i)
        size += meta.nbytes
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _local_address(peer: str, port: int) -> str:
    """The address of this machine's interface that reaches ``peer`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class TransferGroup:
    """A process group for weight transfer only, on a ``TCPStore`` of its own (not the default group).

    Args:
        master_address: the host of rank 0 (the trainer), which serves the store.
        master_port: the store's TCP port.
        rank: this process's rank; 0 is the sender.
        world_size: the trainer plus every receiving worker.
        device: ``cpu`` (a gloo group) or a CUDA device (an NCCL group); tensors must live there.
        timeout: seconds that the rendezvous and every collective may take before they raise.

    The constructor blocks until every rank has joined (at most ``timeout``). Gloo binds to the interface
    that reaches ``master_address``, or to ``GLOO_SOCKET_IFNAME`` when set.

    Raises:
        RuntimeError: the rendezvous failed or timed out (torch's ``DistStoreError`` is one); the message
            names the address.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device | str = "cpu",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout = timeout
        self._works: list[Any] = []  # the collectives started and not known to be completed
        self._lock = threading.Lock()
        delta = datetime.timedelta(seconds=timeout)
        try:
            # Rank 0 serves the store; wait_for_workers=False: the group's own rendezvous below waits for them.
            self._store = dist.TCPStore(
                master_address, master_port, world_size, is_master=rank == 0, timeout=delta, wait_for_workers=False
            )
            store = dist.PrefixStore(STORE_PREFIX, self._store)
            if self.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = delta
                self.group: Any = dist.ProcessGroupNCCL(store, rank, world_size, options)
            else:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = delta
                iface = os.environ.get("GLOO_SOCKET_IFNAME")
                bind = {"interface": iface} if iface else {"hostname": _local_address(master_address, master_port)}
                options._devices = [dist.ProcessGroupGloo.create_device(**bind)]
                self.group = dist.ProcessGroupGloo(store, rank, world_size, options)
        except Exception as e:
            raise RuntimeError(
                f"weight transfer: rank {rank} of {world_size} could not join the group at "
                f"{master_address}:{master_port} within {timeout:g} s: {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast of ``tensor`` from rank 0 (filled in place on the others); returns its work.

        Raises:
            RuntimeError: the group was closed.
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        # Under the lock: a close between starting a collective and recording it would miss it (and block).
        with self._lock:
            if self.group is None:
                raise RuntimeError("weight transfer: the group is closed")
            work = self.group.broadcast([tensor], opts)
            self._works = [w for w in self._works if not w.is_completed()] + [work]
        return work

    def close(self) -> None:
        """Drop the group and the store (rank 0 stops serving it); returns at once.

        A collective still in flight (a peer refused the update or died) holds the group's destructor, and
        ``abort``, until the collective's timeout: then the last references are dropped in a thread of their own, so
        a refused update does not cost the caller the whole timeout (the store keeps its port until then). That
        thread is not a daemon: a group destroyed while the interpreter shuts down aborts the process, so an exit
        waits for it instead (at most the timeout). With nothing in flight they are dropped here.
        """
        with self._lock:
            held = [self.group, self._store]
            in_flight = any(not w.is_completed() for w in self._works)
            self.group = None
            self._store = None
            self._works = []
        if in_flight:
            threading.Thread(target=held.clear, name="rollout-transfer-close").start()
        else:
            held.clear()


def _flat_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on ``device`` (a view when it already is contiguous there)."""
    return tensor.detach().to(device).contiguous().view(-1).view(torch.uint8)


def _typed(piece: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """A bucket's uint8 slice seen as the announced tensor (a copy only when its offset is misaligned for the dtype,
    as after an odd number of bfloat16 values before a float32 tensor)."""
    if piece.storage_offset() % meta.dtype.itemsize:
        piece = piece.clone()
    return piece.view(meta.dtype).view(meta.shape)


def send(
    group: TransferGroup,
    metas: Sequence[TensorMeta],
    tensors: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    packed: bool = True,
) -> int:
    """Broadcast tensors from rank 0 in the buckets the receivers expect.

    The next bucket is packed while the previous one is on the wire (gloo and NCCL run the work in
    their own threads); at most two buckets are alive at once.

    Args:
        group: the transfer group, this process rank 0.
        metas: what was announced, in order; ``tensors`` must yield exactly these.
        tensors: (name, tensor) pairs, consumed lazily, bucket by bucket.
        bucket_bytes: the bucket bound announced (``packed_buffer_size_bytes``).
        packed: one broadcast per bucket (True) or per tensor.

    Returns:
        Bytes sent.

    Raises:
        ValueError: a tensor differs from its announcement (name, dtype or shape), or too few came.
        RuntimeError: the group failed (a receiver died, or the timeout passed).
    """
    buckets = plan_buckets(metas, bucket_bytes) if packed else [[i] for i in range(len(metas))]
    in_flight: list[tuple[Any, torch.Tensor]] = []
    sent = 0
    for bucket in buckets:
        parts = []
        for i in bucket:
            item = next(tensors, None)
            if item is None:
                raise ValueError(f"send: {len(metas)} tensors were announced, the iterator ended at {i}")
            name, tensor = item
            meta = metas[i]
            if name != meta.name or tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
                raise ValueError(
                    f"send: tensor {i} is {name} {dtype_name(tensor.dtype)} {tuple(tensor.shape)}, announced as "
                    f"{meta.name} {dtype_name(meta.dtype)} {meta.shape}"
                )
            parts.append(_flat_bytes(tensor, group.device))
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        if len(in_flight) == 2:
            work, _ = in_flight.pop(0)
            work.wait()
        in_flight.append((group.broadcast(buffer), buffer))
        sent += buffer.numel()
    for work, _ in in_flight:
        work.wait()
    return sent


def receive(
    group: TransferGroup,
    metas: Sequence[TensorMeta],
    on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    packed: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Receive the announced tensors, bucket by bucket, and hand each bucket to ``on_bucket``.

    Args:
        group: the transfer group, this process a rank > 0.
        metas: the announced tensors, in order.
        on_bucket: called with the bucket's (name, tensor) pairs, views of a fresh uint8 buffer (the caller
            may keep them: no buffer is reused).
        bucket_bytes: the sender's bucket bound.
        packed: as the sender sends.
        on_progress: called with the number of tensors received so far, after each bucket.

    Returns:
        Bytes received.

    Raises:
        RuntimeError: the group failed: the sender died (at once) or sent nothing for ``group.timeout`` s.
    """
    buckets = plan_buckets(metas, bucket_bytes) if packed else [[i] for i in range(len(metas))]
    received = done = 0
    for bucket in buckets:
        sizes = [metas[i].nbytes for i in bucket]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
        group.broadcast(buffer).wait()
        pieces = buffer.split(sizes)
        on_bucket([(metas[i].name, _typed(piece, metas[i])) for i, piece in zip(bucket, pieces)])
        received += buffer.numel()
        done += len(bucket)
        if on_progress is not None:
            on_progress(done)
    return received
