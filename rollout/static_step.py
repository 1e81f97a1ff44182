"""The step's input builder and forward, with its padding: compiled forwards, compile counting, CUDA graphs.

Every step, eager, compiled or CUDA-graphed, is built by ``build_padded_batch`` and runs ``forward_varlen``
or ``forward_decode`` over the same paged attention (``attention.paged_attention``); padding is only a
choice of sizes (``PaddingRule``). An eager step keeps the exact sizes (``PaddingRule.exact_rule``). A
compiled forward is reused only while its inputs keep the shapes it was traced for (and a CUDA graph
replays exactly one set of shapes), so a step whose path is compiled or graphed runs on padded inputs:

- the flattened query rows are padded to a multiple of ``q_padding_interval_size`` (capped at the token
  budget); a padded row is token 0 at position 0, writes the padding slot (the cache's extra last block,
  which the block manager never hands out) and its logits are dropped;
- the logits rows and the decode rows of a varlen step are padded to a multiple of the same interval
  (the decode path keeps one logits row per query row);
- the chunks of the requests that compute more than one token are cut into sub-chunks of
  ``SUBCHUNK_ROWS`` rows (the prefill groups, padded to an even count);
- the keys every group reads are padded to a multiple of ``kv_padding_interval_size``, then to whole
  blocks of its request's block table (padded with the padding block).

Slots and block tables are built for every KV layer group of the cache (``kv_cache.CacheLayout``): each
layer reads its own group's (``PagedAttentionMetadata.group_of``), so sliding-window groups and layers of
other shapes run padded too. A sliding group's ``NULL_BLOCK`` entries (blocks that left the window) read
the padding block, which the layer's window mask never lets a query attend to.

Every padded size is at least 2: dynamo specialises sizes 0 and 1, which would compile graphs of their
own. A step's padded sizes are its ``shape`` (the key of compiled shapes and captured graphs):
``(T, Wd)`` on the decode path (decode-only steps) and ``(T, R, Bd, Wd, G, Wp)`` on the varlen path
(every other step): query rows, logits rows, decode rows, block-table width of the decode rows,
prefill groups, block-table width of the prefill groups.

The two paths run two module-level functions, ``forward_varlen`` and ``forward_decode``, with the same
body but distinct code objects, so each keeps its own dynamo cache; their compiled versions are shared
by every engine with the same ``CompileConfig`` (``compiled_forward``), so a new engine (each
``generate_batch`` call builds one) finds the graphs compiled before it. Compilations are counted per
thread while a runner's forward runs (``CompileCounter``), through dynamo's compile-start callback.

CUDA graphs (``CUDAGraphs``): one graph per padded shape, captured on first use (or in warmup) with
static input buffers of exactly that shape, kept in an LRU of ``CUDA_GRAPH_CAPACITY`` graphs that share
one memory pool; a hit copies the step's inputs into the buffers and replays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.fx.experimental import _config as fx_config
from transformers.generation import CompileConfig

from .attention import METADATA_KWARG, PagedAttentionMetadata
from .kv_cache import PagedKVCache
from .onednn import MKL, OneDNNLinear
from .sampling import HostStaging
from .scheduler import ScheduledRequest

logger = logging.getLogger(__name__)

PATHS = ("varlen", "decode")
# Smallest padded size of every axis: dynamo specialises 0 and 1 (a graph of their own each).
MIN_PADDED_SIZE = 2
# Captured CUDA graphs kept per runner (both paths together), least recently used evicted first. Each
# graph holds its own static inputs (a few small int64 vectors and the decode block table) and its
# output logits; their temporaries share one memory pool, so memory grows with the largest shape, not
# with the count. 64 covers the decode shapes of a workload whose batch size and lengths vary over a
# few intervals each; a workload beyond it captures again (``EngineStats.num_cuda_graph_captures``).
CUDA_GRAPH_CAPACITY = 64


def pad_to_interval(n: int, interval: int, cap: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``interval`` (at least ``MIN_PADDED_SIZE``), at most ``cap``.

    Args:
        n: the real size (>= 0).
        interval: the padding interval (>= 1).
        cap: the largest padded size allowed (the token budget, the longest request), or None. A cap
            below ``n`` is ignored: a size is never padded down.

    Returns:
        The padded size.
    """
    padded = -(-max(n, MIN_PADDED_SIZE) // interval) * interval
    if cap is not None and padded > cap:
        padded = max(cap, n, MIN_PADDED_SIZE)
    return padded


# Rows of one prefill group: a request's chunk is cut into sub-chunks of this many rows, each reading
# its request's keys up to its last row. Smaller sub-chunks pad fewer rows at the end of a chunk but
# re-read the request's keys once more each (the gather is G x Lp). Measured with 32, 64 and 128 on
# SmolLM2 prefill steps of 512 tokens (gsm8k prompts of 60-150 tokens, 1 thread, the loaded 2-core CPU):
# the uncompiled padded step was 4-8% slower than the eager one with each, within the machine's noise;
# 64 re-reads the keys half as often as 32.
SUBCHUNK_ROWS = 64


@dataclass(frozen=True)
class PaddingRule:
    """How a runner pads its static-shape steps.

    Attributes:
        q_interval: query rows, logits rows and decode rows are padded to a multiple of this.
        kv_interval: the keys each group reads are padded to a multiple of this (then to whole blocks).
        max_batch_tokens: the token budget: the most query rows a padded step has (unless the real
            step has more, which the scheduler never schedules).
        max_keys: the most keys one request can have (the cache's tokens); caps the padded keys.
        block_size: tokens per block.
        pad_block: the padding block's id (the cache's last block, never handed to a request).
        subchunk_rows: rows of a prefill group (``SUBCHUNK_ROWS``).
        exact: every size is the real one (an eager step: nothing to compile, so nothing to pad); the
            intervals and caps are then unused, and ``pad_block`` (block 0 by ``exact_rule``) is read only
            under a mask and never written.
    """

    q_interval: int
    kv_interval: int
    max_batch_tokens: int
    max_keys: int
    block_size: int
    pad_block: int
    subchunk_rows: int = SUBCHUNK_ROWS
    exact: bool = False

    @classmethod
    def exact_rule(cls, block_size: int) -> PaddingRule:
        """The sizes of an eager step: exact, block 0 standing in for the padding block of a table row's tail."""
        return cls(1, 1, 1 << 62, 1 << 62, block_size, pad_block=0, exact=True)

    @property
    def pad_slot(self) -> int:
        """The slot padded rows write and padded reads read: the padding block's first slot."""
        return self.pad_block * self.block_size

    def num_rows(self, n: int) -> int:
        """Padded query rows (or logits rows, or decode rows) for ``n`` real ones."""
        return n if self.exact else pad_to_interval(n, self.q_interval, self.max_batch_tokens)

    def num_groups(self, n: int) -> int:
        """Padded prefill groups for ``n`` real ones (an even count)."""
        return n if self.exact else pad_to_interval(n, MIN_PADDED_SIZE)

    def table_width(self, longest: int) -> int:
        """Blocks in each group's padded table when its longest request reads ``longest`` keys."""
        if self.exact:
            return max(1, -(-longest // self.block_size))
        keys = pad_to_interval(longest, self.kv_interval, self.max_keys)
        return max(MIN_PADDED_SIZE, -(-keys // self.block_size))


@dataclass
class PaddedBatch:
    """The device inputs of one step; every shape is a size its ``PaddingRule`` chose (exact or padded).

    Attributes:
        input_ids: int64 [T]; padded rows hold token 0.
        positions: int64 [T]; each row's position in its request (0 for padded rows).
        slot_mapping: int64 [N, T]; per KV layer group, the slot each row writes (padded rows: the
            padding slot).
        logits_rows: int64 [R]; the rows whose logits are kept (sampled rows, then scored rows, then
            padding: row 0 again).
        decode_rows: int64 [Bd], the decode rows (fillers: T), or None on the decode path (every row).
        decode_tables: int64 [N, Bd, Wd]; per layer group, each decode row's block table, padded with the
            padding block.
        decode_pos: int64 [Bd]; each decode row's position (0 for fillers and padded rows).
        prefill_rows: int64 [G, Qs]; the rows of each prefill group (fillers: T); None on the decode path.
        prefill_tables: int64 [N, G, Wp]; per layer group, each prefill group's request's block table,
            padded with the padding block.
        prefill_pos: int64 [G, Qs]; each row's position in its request (0 for fillers).
        flash: the flash-attn inputs of an eager step on CUDA (``PagedAttentionMetadata.flash``), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_rows: torch.Tensor
    decode_rows: torch.Tensor | None
    decode_tables: torch.Tensor
    decode_pos: torch.Tensor
    prefill_rows: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    prefill_pos: torch.Tensor | None = None
    flash: dict | None = None

    @property
    def path(self) -> str:
        """``"decode"`` when every row is a decode row, else ``"varlen"``."""
        return "decode" if self.decode_rows is None else "varlen"

    @property
    def shape(self) -> tuple[int, ...]:
        """The padded sizes: (T, Wd) on the decode path, (T, R, Bd, Wd, G, Wp) on the varlen path."""
        T, Wd = self.input_ids.shape[0], self.decode_tables.shape[-1]
        if self.decode_rows is None:
            return (T, Wd)
        assert self.prefill_tables is not None
        G, Wp = self.prefill_tables.shape[-2:]
        return (T, self.logits_rows.shape[0], self.decode_rows.shape[0], Wd, G, Wp)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the batch by field name (the None ones left out)."""
        found = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: t for name, t in found.items() if isinstance(t, torch.Tensor)}

    def clone(self) -> PaddedBatch:
        """A copy with tensors of its own (the static inputs of a CUDA graph)."""
        return dataclasses.replace(self, **{name: t.clone() for name, t in self.tensors().items()})

    def copy_into(self, other: PaddedBatch) -> None:
        """Copy every tensor into ``other``'s tensors of the same shape (a graph's static inputs)."""
        targets = other.tensors()
        for name, t in self.tensors().items():
            targets[name].copy_(t, non_blocking=True)


def synthetic_batch(
    path: str, shape: Sequence[int], rule: PaddingRule, device: torch.device, num_groups: int = 1
) -> PaddedBatch:
    """A batch of the given padded shape that reads and writes the padding block only (warmup).

    Its forward compiles (or captures) what a real step of that shape runs, and changes nothing but
    the padding block: every row writes the padding slot, every group reads the padding block.

    Args:
        path: "varlen" or "decode".
        shape: (T, Wd) for decode, (T, R, Bd, Wd, G, Wp) for varlen (padded sizes, each >= 2).
        rule: the runner's padding rule.
        device: where the tensors go.
        num_groups: the cache's KV layer groups.
    """
    N = num_groups

    def full(size: int | tuple[int, ...], value: int) -> torch.Tensor:
        return torch.full(size if isinstance(size, tuple) else (size,), value, dtype=torch.int64, device=device)

    slot, block, qs = rule.pad_slot, rule.pad_block, rule.subchunk_rows
    if path == "decode":
        T, Wd = shape
        rows = torch.arange(T, device=device)
        return PaddedBatch(full(T, 0), full(T, 0), full((N, T), slot), rows, None, full((N, T, Wd), block), full(T, 0))
    T, R, Bd, Wd, G, Wp = shape
    return PaddedBatch(
        full(T, 0),
        full(T, 0),
        full((N, T), slot),
        full(R, 0),
        full(Bd, T),
        full((N, Bd, Wd), block),
        full(Bd, 0),
        full((G, qs), T),
        full((N, G, Wp), block),
        full((G, qs), 0),
    )


def warmup_shapes(path: str, rule: PaddingRule) -> list[tuple[int, ...]]:
    """The padded shapes that ``warmup`` runs for a path: the smallest and the next size of every axis.

    Two shapes that differ in every axis that can vary: a path compiled with ``dynamic=True`` traces
    symbolic sizes at once and the second shape confirms no size was specialised; with
    ``dynamic=None`` (automatic) the second compilation makes every varying axis symbolic. Then any
    later shape reuses the graph. With ``dynamic=False``, and for CUDA graphs, every new shape needs a
    graph of its own: these two are compiled or captured now, the others on first use (counted in
    ``EngineStats.num_compiles_after_warmup`` / ``num_cuda_graph_captures_after_warmup``).

    Args:
        path: "varlen" or "decode".
        rule: the padding rule.

    Returns:
        One or two shapes, (T, Wd) or (T, R, Bd, Wd, G, Wp) (see ``PaddedBatch.shape``).
    """
    # The next size up, where the caps allow one (a size past a cap is never padded to).
    t1 = rule.num_rows(1)
    t2 = rule.num_rows(min(t1 + 1, rule.max_batch_tokens))
    w1 = rule.table_width(1)
    w2 = rule.table_width(min(w1 * rule.block_size + 1, rule.max_keys))
    if path == "decode":
        shapes = [(t1, w1), (t2, w2)]
    else:
        g1 = rule.num_groups(1)
        g2 = rule.num_groups(g1 + 1)
        # Decode rows and logits rows at most the query rows, as in a real step.
        shapes = [(t1, t1, t1, w1, g1, w1), (t2, t2, t1, w2, g2, w2)]
    return list(dict.fromkeys(shapes))


def build_padded_batch(
    scheduled: Sequence[ScheduledRequest],
    logits_rows: Sequence[int],
    decode_path: bool,
    rule: PaddingRule,
    staging: HostStaging,
    extra: Sequence[np.ndarray] = (),
    num_groups: int = 1,
) -> tuple[PaddedBatch, list[torch.Tensor]]:
    """The device inputs of a step, sized by ``rule`` (numpy on the host, one staged upload).

    Args:
        scheduled: the step's requests, in batch order. A query token past a request's known tokens (a
            placeholder of async batching, ``Request.num_output_placeholders``) is staged as token 0; the
            runner writes the real token into ``input_ids`` on the device before the forward.
        logits_rows: the flattened rows whose logits are kept (sampled rows, then scored rows).
        decode_path: every request computes one token (a decode-only step).
        rule: the padding rule.
        staging: the runner's input staging buffer.
        extra: more int64 or float64 host arrays to upload in the same copy (the score targets, the
            placeholders' rows, flash-attn's inputs).
        num_groups: the cache's KV layer groups (N): slots and tables are built from each request's
            ``block_tables[g]``.

    Returns:
        The batch, its shapes padded per ``rule``, and the ``extra`` arrays on the device.
    """
    bs, pad_slot, pad_block, qs = rule.block_size, rule.pad_slot, rule.pad_block, rule.subchunk_rows
    N = num_groups
    num_rows = sum(e.num_scheduled_tokens for e in scheduled)
    T = rule.num_rows(num_rows)
    ids = np.zeros(T, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    slots = np.full((N, T), pad_slot, dtype=np.int64)
    decodes: list[tuple[int, int, np.ndarray]] = []  # (row, position, tables [N, blocks])
    groups: list[tuple[int, int, int, np.ndarray]] = []  # (first row, rows, first position, tables)
    start = 0
    for entry in scheduled:
        req, n = entry.request, entry.num_scheduled_tokens
        c = entry.num_computed_tokens
        known = req.token_ids[c : c + n]  # a placeholder past them stays 0: written on the device
        ids[start : start + len(known)] = known
        p = np.arange(c, c + n, dtype=np.int64)
        pos[start : start + n] = p
        tables = np.full((N, max(len(t) for t in req.block_tables)), pad_block, dtype=np.int64)
        for g, table in enumerate(req.block_tables):
            tables[g, : len(table)] = table
        tables[tables < 0] = pad_block  # NULL_BLOCK (left a sliding window): the padding block
        slots[:, start : start + n] = tables[:, p // bs] * bs + p % bs
        if n == 1:
            decodes.append((start, c, tables))
        else:
            groups.extend((start + j, min(qs, n - j), c + j, tables) for j in range(0, n, qs))
        start += n

    def tables_of(entries: Sequence[tuple[int, np.ndarray]], num: int, width: int) -> np.ndarray:
        """[N, num, width] block tables: each entry's blocks holding keys 0..last, then the padding block."""
        out = np.full((N, num, width), pad_block, dtype=np.int64)
        for i, (last, tables) in enumerate(entries):
            used = last // bs + 1  # its table may hold a block more than its keys so far
            out[:, i, :used] = tables[:, :used]
        return out

    R = T if decode_path else rule.num_rows(len(logits_rows))
    rows = np.zeros(R, dtype=np.int64)
    rows[: len(logits_rows)] = logits_rows
    Bd = T if decode_path else rule.num_rows(len(decodes))
    Wd = rule.table_width(max((c + 1 for _, c, _ in decodes), default=1))
    d_tables = tables_of([(c, tables) for _, c, tables in decodes], Bd, Wd)
    d_pos = np.zeros(Bd, dtype=np.int64)
    d_pos[: len(decodes)] = [c for _, c, _ in decodes]
    arrays = [ids, pos, slots, rows, d_tables, d_pos]
    if not decode_path:
        d_rows = np.full(Bd, T, dtype=np.int64)
        d_rows[: len(decodes)] = [row for row, _, _ in decodes]
        G = rule.num_groups(len(groups))
        Wp = rule.table_width(max((p0 + m for _, m, p0, _ in groups), default=1))
        g_rows = np.full((G, qs), T, dtype=np.int64)
        g_pos = np.zeros((G, qs), dtype=np.int64)
        for i, (row, m, p0, _) in enumerate(groups):
            g_rows[i, :m] = np.arange(row, row + m)
            g_pos[i, :m] = np.arange(p0, p0 + m)
        g_tables = tables_of([(p0 + m - 1, tables) for _, m, p0, tables in groups], G, Wp)
        arrays += [d_rows, g_rows, g_tables, g_pos]
    num = len(arrays)
    t = staging.upload(*arrays, *extra)
    if decode_path:
        return PaddedBatch(t[0], t[1], t[2], t[3], None, t[4], t[5]), t[num:]
    batch = PaddedBatch(t[0], t[1], t[2], t[3], t[6], t[4], t[5], t[7], t[8], t[9])
    return batch, t[num:]


def _padded_forward(
    model: torch.nn.Module,
    cache: PagedKVCache,
    batch: PaddedBatch,
    block_size: int,
    skip_mask: torch.Tensor,
    logits_to_keep: bool,
    linear_policy: str,
) -> torch.Tensor:
    """The model's forward on a padded batch, then its kept logits rows in float32 [R, V].

    ``linear_policy``: the kernel of the float32 CPU linear layers (``rollout/onednn.py``: ``"mkl"``, ``"onednn"``
    or ``"auto"``, measured per shape; the runner's, a constant to dynamo).
    """
    meta = PagedAttentionMetadata.from_tables(
        cache,
        block_size,
        batch.slot_mapping,
        batch.decode_rows,
        batch.decode_tables,
        batch.decode_pos,
        batch.prefill_rows,
        batch.prefill_tables,
        batch.prefill_pos,
        batch.flash,
    )
    kwargs = {
        "input_ids": batch.input_ids[None, :],
        "position_ids": batch.positions[None, :],
        "attention_mask": skip_mask,
        "use_cache": False,
        METADATA_KWARG: meta,
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = batch.logits_rows
    with contextlib.nullcontext() if linear_policy == MKL else OneDNNLinear(linear_policy):
        logits = model(**kwargs).logits[0]
    if not logits_to_keep:
        logits = logits.index_select(0, batch.logits_rows)
    return logits.float()


# Two defs with one body, on purpose: dynamo keeps its compiled graphs, their guards and its recompile limit
# per code object, and functions made from one def (a closure, a functools.partial) share that def's code
# object, so the two paths would share one cache, each path's graphs tried and guarded against the other's.
def forward_varlen(
    model: torch.nn.Module,
    cache: PagedKVCache,
    batch: PaddedBatch,
    block_size: int,
    skip_mask: torch.Tensor,
    logits_to_keep: bool,
    linear_policy: str,
) -> torch.Tensor:
    """The varlen path's forward (``_padded_forward``); its own code object, so its own dynamo cache."""
    return _padded_forward(model, cache, batch, block_size, skip_mask, logits_to_keep, linear_policy)


def forward_decode(
    model: torch.nn.Module,
    cache: PagedKVCache,
    batch: PaddedBatch,
    block_size: int,
    skip_mask: torch.Tensor,
    logits_to_keep: bool,
    linear_policy: str,
) -> torch.Tensor:
    """The decode path's forward (``_padded_forward``); its own code object, so its own dynamo cache."""
    return _padded_forward(model, cache, batch, block_size, skip_mask, logits_to_keep, linear_policy)


FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"varlen": forward_varlen, "decode": forward_decode}
_COMPILED: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
_COMPILED_LOCK = threading.Lock()


def compile_kwargs(config: CompileConfig) -> dict:
    """``torch.compile``'s keyword arguments from a ``CompileConfig`` (its own ``to_dict``)."""
    return dict(config.to_dict())


def compiled_forward(path: str, config: CompileConfig) -> Callable[..., torch.Tensor]:
    """The path's forward compiled with ``config``, one per (path, config) in the process.

    Sharing it lets every engine with the same config reuse what an earlier one compiled (dynamo's
    cache is per code object; its guards check shapes and types, not which engine runs).

    Raises:
        ValueError: ``config`` is refused by ``torch.compile`` (e.g. both ``mode`` and ``options``).
    """
    kwargs = compile_kwargs(config)
    key = (path, repr(sorted(kwargs.items(), key=lambda kv: kv[0])))
    with _COMPILED_LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            try:
                compiled = torch.compile(FORWARDS[path], **kwargs)
            except RuntimeError as exc:  # torch.compile's own check of mode against options
                raise ValueError(f"{path}_compile_config: {exc}") from None

            def fn(*args: object, compiled: Callable[..., torch.Tensor] = compiled) -> torch.Tensor:
                # No duck sizing: sizes equal in the traced example (query rows and decode rows, say)
                # would share one symbol and a guard that they stay equal, so the first step where
                # they differ would compile again. Only compilations read this setting, and a
                # compilation in another thread meanwhile just gets the more general shapes too.
                with fx_config.patch(use_duck_shape=False):
                    return compiled(*args)

            _COMPILED[key] = fn
    return fn


# Per model object: the warmups already run in this process whose compiled graphs any later engine
# reuses as they are (see ``warm_key``).
_WARMED: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple]] = weakref.WeakKeyDictionary()


def warm_key(
    compile_configs: dict[str, CompileConfig | None], cuda_graphs: dict[str, bool], rule: PaddingRule
) -> tuple | None:
    """What a warmup compiled, when another engine on the same model could skip it; else None.

    Only compiled paths with ``dynamic=True`` and no CUDA graphs qualify: their graphs take every size
    as a symbol (the cache's slots included), so an engine with the same configs and padding intervals
    reuses them whatever its cache size. (With ``dynamic=None`` the cache size was static in the first
    warmup, and CUDA graphs belong to one engine.)
    """
    if any(cuda_graphs.values()):
        return None
    configs = [(p, c) for p, c in compile_configs.items() if c is not None]
    if not configs or any(c.dynamic is not True for _, c in configs):
        return None
    compiled = tuple((p, repr(sorted(compile_kwargs(c).items()))) for p, c in configs)
    return (compiled, rule.q_interval, rule.kv_interval, rule.block_size, rule.max_batch_tokens, rule.subchunk_rows)


def warmed_before(model: torch.nn.Module, key: tuple | None) -> bool:
    """True when a warmup with this ``warm_key`` already ran on ``model`` in this process."""
    return key is not None and key in _WARMED.get(model, ())


def mark_warmed(model: torch.nn.Module, key: tuple | None) -> None:
    """Record that a warmup with this ``warm_key`` ran on ``model``."""
    if key is not None:
        _WARMED.setdefault(model, set()).add(key)


class CompileCounter:
    """Counts dynamo compilations made in this thread while ``counting()`` is active.

    One compile-start callback is registered with dynamo for the process; it adds one to the counter
    of the calling thread, if any. (dynamo runs its start callbacks when no other compilation is in
    flight; two threads compiling at once count once.)
    """

    _local = threading.local()
    _registered = False
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.count = 0
        with CompileCounter._lock:
            if not CompileCounter._registered:
                from torch._dynamo.callback import CallbackTrigger, callback_handler

                def on_start(args: object) -> None:
                    if getattr(args, "callback_trigger", None) is CallbackTrigger.DYNAMO:
                        counter = getattr(CompileCounter._local, "counter", None)
                        if counter is not None:
                            counter.count += 1

                callback_handler.register_start_callback(on_start)
                CompileCounter._registered = True

    def run(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """``fn(*args)``, counting the compilations it triggers in this thread."""
        previous = getattr(CompileCounter._local, "counter", None)
        CompileCounter._local.counter = self
        try:
            return fn(*args)
        finally:
            CompileCounter._local.counter = previous


@dataclass
class CapturedGraph:
    """One captured graph: the graph, its static inputs (replayed with whatever they hold) and its output."""

    graph: torch.cuda.CUDAGraph
    inputs: PaddedBatch
    output: torch.Tensor


class CUDAGraphs:
    """Captured CUDA graphs of a runner's padded forwards, one per (path, shape), in an LRU.

    Capture (first use of a shape): the forward runs once on a side stream with static inputs cloned
    from the step's (it writes the same keys and values the replay writes again; it also compiles, when
    the path is compiled), then is captured into a ``torch.cuda.CUDAGraph`` in the runner's memory pool
    (thread-local capture mode, so another thread's CUDA work cannot invalidate it), then replayed.
    A hit copies the step's inputs into the graph's static buffers and replays. The output (the kept
    logits, float32 [R, V]) lives in the pool: it is valid until the next replay, so the step samples
    from it before the next step starts. The graphs share one pool: each graph's output stays
    allocated while the graph is kept, so no other capture reuses its memory, and the replays of one
    runner never overlap (one stream, one step at a time), so their temporaries may share addresses.

    Args:
        device: the CUDA device of the model and cache.
        capacity: graphs kept; the least recently used is dropped beyond it (``CUDA_GRAPH_CAPACITY``).
    """

    def __init__(self, device: torch.device, capacity: int = CUDA_GRAPH_CAPACITY) -> None:
        self.device = device
        self.capacity = capacity
        self.pool: object | None = None  # created at the first capture
        self.graphs: OrderedDict[tuple, CapturedGraph] = OrderedDict()
        self.num_captures = 0
        self.num_evictions = 0

    def run(self, key: tuple, fn: Callable[[PaddedBatch], torch.Tensor], batch: PaddedBatch) -> torch.Tensor:
        """Replay the graph of ``key`` on ``batch`` (capturing it first if needed); returns its output."""
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.capture(fn, batch)
            self.num_captures += 1
            self.graphs[key] = entry
            while len(self.graphs) > self.capacity:
                self.graphs.popitem(last=False)
                self.num_evictions += 1
        else:
            self.graphs.move_to_end(key)
            batch.copy_into(entry.inputs)
        entry.graph.replay()
        return entry.output

    def capture(
        self, fn: Callable[[PaddedBatch], torch.Tensor], batch: PaddedBatch
    ) -> CapturedGraph:  # pragma: no cover - needs CUDA
        """Capture ``fn`` on a static copy of ``batch`` (see the class docstring); the caller replays it."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = batch.clone()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn(static)  # warm: allocator, cuBLAS workspaces, compilation
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = fn(static)
        return CapturedGraph(graph, static, output)
