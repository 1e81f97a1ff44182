"""Host-to-device staging: a step's small host arrays reach the device in one copy.

On CUDA the arrays travel through a pinned host buffer and a device buffer kept across steps (so a
replayed CUDA graph reads them at the same addresses), optionally double-buffered on a side stream for
async batching; on CPU the packed array itself is used. The sampler's per-row values (``sample/sampler.py``)
and the step's inputs (``worker/inputs.py``) both travel this way.
"""

from __future__ import annotations

import numpy as np
import torch


class _StagingSet:
    """One pinned host buffer and one device buffer of a ``HostStaging``, with the events that guard them."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None  # int64, pinned
        self.device_buffer: torch.Tensor | None = None  # int64, on the device
        self.copied: torch.cuda.Event | None = None  # the last copy from ``host`` into ``device_buffer``
        self.released: torch.cuda.Event | None = None  # every reader of the last upload was enqueued before it


class HostStaging:
    """Moves a step's small host arrays to the device in one copy, through buffers kept across steps.

    On CUDA the arrays are packed into one pinned host buffer and copied with one non-blocking copy into one
    device buffer; both are reused (grown when a step needs more), so a step's device tensors sit at the same
    addresses each time, as a replayed CUDA graph needs. A host buffer is refilled after the event of its previous
    copy. On CPU the packed array itself is returned, a new one each time.

    With one buffer set and no copy stream (the synchronous loop) the copy runs on the current stream, and the next
    upload overwrites the device buffer in stream order: do not keep the returned tensors past the step.

    Async batching (transformers' ``ContinuousBatchingAsyncIOs`` pattern): ``num_buffers=2`` alternates two buffer
    sets and ``copy_stream`` runs the copies on a side stream, overlapping step k's forward. An upload into a set
    first makes the side stream wait for that set's ``release`` event, and the current stream waits for the copy.
    The caller calls ``release(slot)`` once it has enqueued the last reader of an upload, or drops the upload.

    Args:
        device: where the tensors go.
        num_buffers: buffer sets used in turn (1 or 2).
        copy_stream: CUDA stream for the host-to-device copies; None copies on the current stream.

    Raises:
        ValueError: ``num_buffers`` is not 1 or 2, or a copy stream is given for a device that is not CUDA.
    """

    def __init__(
        self, device: torch.device, num_buffers: int = 1, copy_stream: torch.cuda.Stream | None = None
    ) -> None:
        if num_buffers not in (1, 2):
            raise ValueError(f"num_buffers must be 1 or 2, got {num_buffers}")
        if copy_stream is not None and device.type != "cuda":
            raise ValueError(f"copy_stream needs a CUDA device, got {device}")
        self.device = device
        self.copy_stream = copy_stream
        self.num_uploads = 0
        self.last_slot = 0  # the buffer set of the last upload
        self._sets = [_StagingSet() for _ in range(num_buffers)]

    def _buffers(self, total: int, slot: _StagingSet) -> tuple[np.ndarray | None, torch.Tensor | None]:
        if self.device.type != "cuda":
            return None, None
        if slot.host is None or slot.host.numel() < total:
            if slot.copied is not None:
                slot.copied.synchronize()  # the old host buffer may still be read by its copy
            if slot.released is not None:
                # The old device buffer may still be read by the current stream; freeing it is safe in that
                # stream's order, but it was written on the copy stream too.
                slot.released.synchronize()
            capacity = max(total, 2 * (slot.host.numel() if slot.host is not None else 256))
            slot.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            slot.device_buffer = torch.empty(capacity, dtype=torch.int64, device=self.device)
        elif slot.copied is not None and not slot.copied.query():
            slot.copied.synchronize()  # query() does not block: no sync when the copy has landed
        return slot.host.numpy(), slot.device_buffer

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Copy arrays to the device in one transfer.

        Args:
            arrays: int64 or float64 numpy arrays of any shape.

        Returns:
            One tensor per array, same dtype and shape, on the device; they live in buffer set
            ``last_slot``.

        Raises:
            TypeError: an array of another dtype.
        """
        for a in arrays:
            if a.dtype not in (np.int64, np.float64):
                raise TypeError(f"HostStaging.upload takes int64 or float64 arrays, got {a.dtype}")
        total = sum(a.size for a in arrays)
        self.last_slot = self.num_uploads % len(self._sets)
        self.num_uploads += 1
        slot = self._sets[self.last_slot]
        host, device_buffer = self._buffers(total, slot)
        if host is None:
            host = np.empty(total, dtype=np.int64)
        offset = 0
        for a in arrays:
            host[offset : offset + a.size] = a.reshape(-1).view(np.int64)  # float64 travels as its bits
            offset += a.size
        if device_buffer is None:
            packed = torch.from_numpy(host)
        else:
            assert slot.host is not None
            if slot.copied is None:
                slot.copied = torch.cuda.Event()
            current = torch.cuda.current_stream(self.device)
            if self.copy_stream is None:
                device_buffer[:total].copy_(slot.host[:total], non_blocking=True)
                slot.copied.record(current)
            else:
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                with torch.cuda.stream(self.copy_stream):
                    device_buffer[:total].copy_(slot.host[:total], non_blocking=True)
                slot.copied.record(self.copy_stream)
                current.wait_event(slot.copied)
            packed = device_buffer
        out = []
        offset = 0
        for a in arrays:
            t = packed[offset : offset + a.size]
            if a.dtype == np.float64:
                t = t.view(torch.float64)
            out.append(t.view(a.shape))
            offset += a.size
        return out

    def release(self, slot: int) -> None:
        """Record that every reader of buffer set ``slot``'s last upload is enqueued on the current stream.

        Only needed with a copy stream (elsewhere the current stream orders the copies after the readers);
        a no-op off CUDA.
        """
        if self.copy_stream is None or self.device.type != "cuda":
            return
        staged = self._sets[slot]
        if staged.released is None:
            staged.released = torch.cuda.Event()
        staged.released.record(torch.cuda.current_stream(self.device))
