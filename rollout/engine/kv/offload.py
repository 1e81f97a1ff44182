"""The CPU offload pool: host memory holding the KV blocks of requests preempted by offload."""

from __future__ import annotations

import torch

from rollout.engine.kv.cache import GIB, CacheLayout, CacheShape, PagedKVCache, block_slots


def _page_lock(buffer: torch.Tensor) -> None:
    """Page-lock (pin) a CPU tensor's whole storage in place, exactly its bytes (``cudaHostRegister``).

    Raises:
        RuntimeError: CUDA refused (the error code is in the message).
    """
    nbytes = buffer.untyped_storage().nbytes()
    # Flag 1 is cudaHostRegisterPortable: pinned for every CUDA context of the process.
    err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes}-byte CPU offload pool failed with CUDA error {err}")


def _page_unlock(buffer: torch.Tensor) -> None:
    """Undo ``_page_lock`` (``cudaHostUnregister``); errors are ignored (the memory is freed next anyway)."""
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ids: (index in ``ids``, first id, length) each."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


class CPUOffloadPool:
    """CPU memory that holds the KV blocks of requests preempted by offload.

    One buffer of exactly ``num_blocks`` pool blocks, viewed as ``blocks`` [num_blocks, num_slots, 2, block_size,
    *row_shape] (2: key then value; slots and row shape of the cache's ``CacheLayout``). A pool block holds one cache
    block of every slot, contiguous, so a request's blocks move in one copy per run of consecutive pool ids (the free
    list hands ids out ascending). ``key[slot]`` and ``value[slot]`` are views [num_blocks, block_size, *row_shape].
    The KV cache manager allocates and frees pool blocks; the model runner copies into and out of them.

    Pinned (for a CUDA cache), the buffer is allocated pageable and page-locked in place (``cudaHostRegister``), so
    exactly ``size_bytes`` are pinned (torch's pinned allocator rounds up to a power of two).

    Copies (CUDA cache): ``store`` enqueues the device-to-host copies on the current stream and records an event per
    device, which ``read_blocks`` waits for; ``load`` makes the current stream wait for those events, enqueues the
    host-to-device copies and records its own (``close`` waits for all before unpinning). A freed pool block is only
    written again by a later ``store``, ordered after the ``load`` that read it on the one stream.

    Args:
        shape: the cache's shape.
        space_gib: GiB of CPU memory to use (> 0); the pool holds ``floor(space / bytes per block)`` blocks.
        block_size: tokens per block (the cache's).
        pin: page-lock the buffer (for a CUDA cache).
        layout: the cache's layout (``PagedKVCache.layout``); None: the one of ``shape`` on one device.

    Raises:
        RuntimeError: pinning failed.
    """

    def __init__(
        self,
        shape: CacheShape,
        space_gib: float,
        block_size: int,
        pin: bool = False,
        layout: CacheLayout | None = None,
    ) -> None:
        self.block_size = block_size
        self.layout = layout or CacheLayout.build(shape, [torch.device("cpu")] * shape.num_layers)
        bytes_per_block = self.layout.pool_block_bytes(shape, block_size)
        self.num_blocks = max(0, int(space_gib * GIB // bytes_per_block))
        num_slots = self.layout.num_slots
        self.row_shape = self.layout.row_shape
        block_shape = (num_slots, 2, block_size, *self.row_shape)
        numel = self.num_blocks * bytes_per_block // shape.element_size
        with torch.inference_mode(False):  # as for the cache: written in place from any thread
            # Uninitialised: a pool block is only read back after a store filled it; untouched pages
            # of an unpinned pool cost no RAM.
            self.buffer = torch.empty(numel, dtype=shape.dtype)
            self.blocks = self.buffer.view(self.num_blocks, *block_shape)
            self.key = [self.blocks[:, slot, 0] for slot in range(num_slots)]
            self.value = [self.blocks[:, slot, 1] for slot in range(num_slots)]
        self.pinned = False
        if pin and numel > 0:
            _page_lock(self.buffer)
            self.pinned = True
        # Descending, so that ``pop`` hands out ascending ids: a fresh request's blocks are one run.
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.copy_events: dict[torch.device, torch.cuda.Event] = {}  # the last copies' end, per CUDA device

    @property
    def size_bytes(self) -> int:
        """Bytes of the pool's buffer (all pinned when ``pinned``): ``num_blocks`` x bytes per block."""
        return self.buffer.untyped_storage().nbytes()

    def close(self) -> None:
        """Wait for pending copies and unpin the buffer. Idempotent; the pool is unusable for CUDA copies after."""
        if self.pinned:
            self.synchronize()
            self.pinned = False
            _page_unlock(self.buffer)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
            pass

    def can_hold(self, num_blocks: int) -> bool:
        """True when ``num_blocks`` pool blocks are free."""
        return num_blocks <= len(self.free_blocks)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` pool blocks (bookkeeping only; ``store`` fills them).

        Raises:
            RuntimeError: fewer free blocks than asked (check ``can_hold`` first).
        """
        if not self.can_hold(num_blocks):
            raise RuntimeError(f"offload pool has {len(self.free_blocks)} free blocks, asked for {num_blocks}")
        return [self.free_blocks.pop() for _ in range(num_blocks)]

    def free(self, pool_ids: list[int]) -> None:
        """Return pool blocks to the free list."""
        self.free_blocks.extend(pool_ids)

    def store(self, cache: PagedKVCache, block_ids: list[int], pool_ids: list[int]) -> None:
        """Copy cache blocks ``block_ids`` into pool blocks ``pool_ids`` (same length), every slot.

        On CUDA the copies are only enqueued (see the class docstring); an event per device marks their end. A
        cache sharded over devices (``CacheLayout.slot_devices``) is copied one device's slots at a time.
        """
        n = len(block_ids)
        if n == 0:
            return
        bs = self.block_size
        runs = _runs(pool_ids)
        for device, slots in cache.layout.slots_by_device():
            src = block_slots(block_ids, bs, device)

            def blocks_of(t: torch.Tensor, src: torch.Tensor = src) -> torch.Tensor:
                return t[src].view(n, bs, *self.row_shape)

            # [n, len(slots), 2, bs, *row_shape] on the device: the pool blocks' layout for these slots.
            staged = torch.stack(
                [torch.stack((blocks_of(cache.slot_key[i]), blocks_of(cache.slot_value[i])), dim=1) for i in slots],
                dim=1,
            )
            whole = len(slots) == self.layout.num_slots
            for index, first, length in runs:
                if whole:  # one contiguous copy per run
                    self.blocks[first : first + length].copy_(staged[index : index + length], non_blocking=True)
                else:
                    for j, slot in enumerate(slots):
                        self.blocks[first : first + length, slot].copy_(
                            staged[index : index + length, j], non_blocking=True
                        )
            self._record(device)

    def _record(self, device: torch.device) -> None:
        """Mark the end of the copies just enqueued on ``device``'s current stream (CUDA only)."""
        if device.type == "cuda":
            event = self.copy_events.get(device)
            if event is None:
                event = self.copy_events[device] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))

    def load(self, cache: PagedKVCache, pool_ids: list[int], block_ids: list[int]) -> None:
        """Copy pool blocks ``pool_ids`` back into cache blocks ``block_ids`` (the pool blocks stay taken)."""
        n = len(pool_ids)
        if n == 0:
            return
        runs = _runs(pool_ids)
        rows = n * self.block_size
        for device, slots in cache.layout.slots_by_device():
            if device.type == "cuda":
                stream = torch.cuda.current_stream(device)
                for event in self.copy_events.values():
                    stream.wait_event(event)
            whole = len(slots) == self.layout.num_slots
            parts = [
                (self.blocks[first : first + length] if whole else self.blocks[first : first + length, slots]).to(
                    device, non_blocking=True
                )
                for _, first, length in runs
            ]
            moved = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n, len(slots), 2, bs, *row_shape]
            dst = block_slots(block_ids, self.block_size, device)
            for j, slot in enumerate(slots):
                cache.slot_key[slot][dst] = moved[:, j, 0].reshape(rows, *self.row_shape)
                cache.slot_value[slot][dst] = moved[:, j, 1].reshape(rows, *self.row_shape)
            self._record(device)

    def synchronize(self) -> None:
        """Block the host until every copy into or out of the pool enqueued so far is done."""
        for event in self.copy_events.values():
            event.synchronize()

    def read_blocks(self, pool_ids: list[int]) -> torch.Tensor:
        """A host copy of pool blocks, after the pending stores have landed.

        Returns:
            [len(pool_ids), num_slots, 2, block_size, *row_shape] in the cache's dtype (see the class docstring).
        """
        self.synchronize()
        return self.blocks[torch.tensor(pool_ids, dtype=torch.int64)].clone()
