"""The step's one input builder: a batch of device inputs per step, its sizes exact or padded.

Every step, eager, compiled or CUDA-graphed, is built by ``prepare_inputs`` (over ``build_step_batch``, which also
builds the warmup's batches of no request: ``synthetic_batch``) and runs the one forward of ``forward``; padding
is only a choice of sizes (``PaddingRule``). An eager step keeps the exact sizes. A compiled forward is reused only
while its input shapes stay those it was traced for (a CUDA graph replays one set of shapes), so a compiled or
graphed step runs on padded inputs:

- query rows are padded to a multiple of ``q_interval`` (capped at the token budget); a padded row is token 0
  at position 0, writes the padding slot (the cache's extra last block, never handed out) and is dropped;
- the logits rows and the decode rows of a varlen step are padded to a multiple of the same interval;
- a request's chunk of more than one token is cut into prefill groups of ``SUBCHUNK_ROWS`` rows (an even
  number of groups);
- the keys every group reads are padded to a multiple of ``kv_interval``, then to whole blocks of its
  request's table (padded with the padding block).

Slots and tables are built per KV layer group (``kv.cache.CacheLayout``; each layer reads its group's,
``PagedAttentionMetadata.group_of``). A sliding group's ``NULL_BLOCK`` entries read the padding block, which
the window mask never lets a query attend to.

Every padded size is at least 2 (dynamo specialises 0 and 1). A step's padded sizes are its ``shape``, the key
of compiled shapes and captured graphs: ``(T, Wd)`` on the decode path (decode-only steps), ``(T, R, Bd, Wd, G,
Wp)`` on the varlen path: query rows, logits rows, decode rows, their table width, prefill groups, their width.

flash-attn's ``flash_attn_varlen_func`` (CUDA) takes inputs sized by the same rule, on a padded step by the shape
alone (no axis of their own): B sequences (the requests, then fillers of no query and no key), B = T on the
decode path and Bd + G on the varlen path, tables max(Wd, Wp) wide, ``max_seqlen_q`` = T and ``max_seqlen_k`` =
that width in keys (the launch grid, fixed per shape as a CUDA graph needs). An eager step's are exact.

One staged upload (``HostStaging``) carries the batch (flash-attn's inputs included) first, so a step of a given
shape finds its tensors at the same addresses (a graph captured on them replays with no copy), then the score
targets and async batching's placeholders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout.engine.sched.output import ScheduledRequest
from rollout.engine.staging import HostStaging
from rollout.requests import Request

# Smallest padded size of every axis: dynamo specialises 0 and 1 (a graph of their own each).
MIN_PADDED_SIZE = 2
# Rows of one prefill group; each re-reads its request's keys (the gather is G x Lp). 32, 64 and 128 measured
# alike on SmolLM2 prefill steps of 512 tokens (gsm8k, 1 thread, the loaded 2-core CPU: padded 4-8% slower
# than eager, within noise); 64 re-reads the keys half as often as 32.
SUBCHUNK_ROWS = 64


def pad_to_interval(n: int, interval: int, cap: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``interval`` (at least ``MIN_PADDED_SIZE``), at most ``cap``.

    Args:
        n: the real size (>= 0).
        interval: the padding interval (>= 1).
        cap: the largest padded size allowed (the token budget, the longest request), or None. A cap
            below ``n`` is ignored: a size is never padded down.
    """
    padded = -(-max(n, MIN_PADDED_SIZE) // interval) * interval
    if cap is not None and padded > cap:
        padded = max(cap, n, MIN_PADDED_SIZE)
    return padded


@dataclass(frozen=True)
class PaddingRule:
    """How a runner sizes a step's inputs.

    Attributes:
        q_interval: query rows, logits rows and decode rows are padded to a multiple of this.
        kv_interval: the keys each group reads are padded to a multiple of this (then to whole blocks).
        max_batch_tokens: the token budget: the most query rows a padded step has (unless the real step has more).
        max_keys: the most keys one request can have (the cache's tokens); caps the padded keys.
        block_size: tokens per block.
        pad_block: the padding block's id (the cache's last block, never handed to a request).
        subchunk_rows: rows of a prefill group (``SUBCHUNK_ROWS``).
        exact: every size is the real one (an eager step); the intervals and caps are then unused, and
            ``pad_block`` (block 0 by ``exact_rule``) is read only under a mask and never written.
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
class StepBatch:
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
        varlen_cu_seqlens: int64 [2, B + 1]; ``flash_attn_varlen_func``'s ``cu_seqlens_q`` (row 0) and
            ``cu_seqlens_k`` (row 1): the query rows and the keys (this step's included) of the requests,
            cumulated, then filler sequences of none (the last entry repeated). None unless the step runs
            that kernel (eager, compiled or graphed; sizes in the module docstring).
        varlen_tables: int64 [N, B, W]; per layer group, each sequence's block table: a request's blocks
            holding its keys, then the padding block (fillers: the padding block only). None unless that kernel.
        varlen_max_seqlens: that kernel's (``max_seqlen_q``, ``max_seqlen_k``): (T, W * block_size) on a padded
            step, fixed by its shape; the longest request's query rows and keys on an eager one.
        flash_decode: every row decodes through ``flash_attn_with_kvcache`` (eager, compiled or graphed).
        lora_slots: int64 [T]; each row's ``lora.LoraSlots`` slot (-1: the base model, padded rows); None without LoRA.
        lora_used, lora_uniform: the real rows' distinct slots >= 0, ascending; whether all run under the first
            (host values: a step whose rows are all the base model's runs no LoRA work).
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
    varlen_cu_seqlens: torch.Tensor | None = None
    varlen_tables: torch.Tensor | None = None
    varlen_max_seqlens: tuple[int, int] | None = None
    flash_decode: bool = False
    lora_slots: torch.Tensor | None = None
    lora_used: tuple[int, ...] = ()
    lora_uniform: bool = False

    @property
    def path(self) -> str:
        """``"decode"`` when every row is a decode row, else ``"varlen"``."""
        return "decode" if self.decode_rows is None else "varlen"

    @property
    def kernel(self) -> str:
        """The attention kernel: ``"flash_decode"``, ``"flash_varlen"`` or ``"sdpa"`` (a graph key with ``shape``)."""
        if self.flash_decode:
            return "flash_decode"
        return "sdpa" if self.varlen_tables is None else "flash_varlen"

    @property
    def shape(self) -> tuple[int, ...]:
        """The padded sizes: (T, Wd) on the decode path, (T, R, Bd, Wd, G, Wp) on the varlen path."""
        T, Wd = self.input_ids.shape[0], self.decode_tables.shape[-1]
        if self.decode_rows is None:
            return (T, Wd)
        assert self.prefill_tables is not None
        G, Wp = self.prefill_tables.shape[-2:]
        return (T, self.logits_rows.shape[0], self.decode_rows.shape[0], Wd, G, Wp)

    @property
    def flash(self) -> dict | None:
        """flash-attn's inputs (``PagedAttentionMetadata.flash``), None for SDPA, computed inside the forward (so a
        compiled or graphed step computes them too, the int32 casts included):

        - the decode kernel: ``cache_seqlens`` int32 [B] = ``decode_pos`` + 1 (a padded row reads the padding
          slot), ``block_tables`` int32 [N, B, Wd];
        - the varlen kernel: ``cu_seqlens_q``, ``cu_seqlens_k`` int32 [B + 1], ``max_seqlen_q``, ``max_seqlen_k``
          (ints), ``block_tables`` int32 [N, B, W].
        """
        if self.flash_decode:
            return {"cache_seqlens": (self.decode_pos + 1).int(), "block_tables": self.decode_tables.int()}
        if self.varlen_tables is None:
            return None
        assert self.varlen_cu_seqlens is not None and self.varlen_max_seqlens is not None
        cu = self.varlen_cu_seqlens.int()
        max_q, max_k = self.varlen_max_seqlens
        return {
            "cu_seqlens_q": cu[0],
            "cu_seqlens_k": cu[1],
            "max_seqlen_q": max_q,
            "max_seqlen_k": max_k,
            "block_tables": self.varlen_tables.int(),
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the batch by field name (the None ones left out)."""
        found = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: t for name, t in found.items() if isinstance(t, torch.Tensor)}

    def clone(self) -> StepBatch:
        """A copy with tensors of its own (the static inputs of a CUDA graph)."""
        return dataclasses.replace(self, **{name: t.clone() for name, t in self.tensors().items()})

    def copy_into(self, other: StepBatch) -> None:
        """Copy every tensor into ``other``'s tensors of the same shape (a graph's static inputs)."""
        targets = other.tensors()
        for name, t in self.tensors().items():
            targets[name].copy_(t, non_blocking=True)


def varlen_sizes(shape: Sequence[int]) -> tuple[int, int]:
    """(B, W) of a padded step's flash varlen inputs from its ``StepBatch.shape``: B sequences, tables W blocks wide."""
    if len(shape) == 2:  # the decode path: (T, Wd)
        return shape[0], shape[1]
    _, _, Bd, Wd, G, Wp = shape
    return Bd + G, max(Wd, Wp)


def build_step_batch(
    scheduled: Sequence[ScheduledRequest],
    logits_rows: Sequence[int],
    decode_path: bool,
    rule: PaddingRule,
    staging: HostStaging,
    extra: Sequence[np.ndarray] = (),
    num_groups: int = 1,
    flash_varlen: bool = False,
    shape: Sequence[int] | None = None,
    lora: bool = False,
) -> tuple[StepBatch, list[torch.Tensor]]:
    """The device inputs of a step, sized by ``rule`` (numpy on the host, one staged upload).

    Args:
        scheduled: the step's requests, in batch order. A placeholder (async batching) is staged as token 0;
            the runner writes the real token into ``input_ids`` on the device before the forward.
        logits_rows: the flattened rows whose logits are kept (sampled rows, then scored rows).
        decode_path: every request computes one token (a decode-only step).
        rule: the padding rule.
        staging: the runner's input staging buffer.
        extra: more int64 or float64 host arrays to upload in the same copy, after the batch (the score
            targets, the placeholders' rows).
        num_groups: the cache's KV layer groups (N), of each request's ``block_tables``.
        flash_varlen: also build ``flash_attn_varlen_func``'s inputs (``StepBatch.varlen_cu_seqlens``, ...).
        shape: padded sizes to build (``StepBatch.shape``) instead of the rule's for ``scheduled``: a warmup batch of
            no request (``synthetic_batch``) at a shape its steps will have.
        lora: also build ``StepBatch.lora_slots`` (each row's ``Request.lora_slot``).

    Returns:
        The batch, its shapes padded per ``rule``, and the ``extra`` arrays on the device.
    """
    bs, pad_slot, pad_block, qs = rule.block_size, rule.pad_slot, rule.pad_block, rule.subchunk_rows
    N = num_groups
    T = shape[0] if shape is not None else rule.num_rows(sum(e.num_scheduled_tokens for e in scheduled))
    ids = np.zeros(T, dtype=np.int64)
    pos = np.zeros(T, dtype=np.int64)
    slots = np.full((N, T), pad_slot, dtype=np.int64)
    lora_slots = np.full(T, -1, dtype=np.int64)
    decodes: list[tuple[int, int, np.ndarray]] = []  # (row, position, tables [N, blocks])
    groups: list[tuple[int, int, int, np.ndarray]] = []  # (first row, rows, first position, tables)
    seqs: list[tuple[int, np.ndarray]] = []  # (last key, tables) of each request
    start = 0
    for entry in scheduled:
        req, n = entry.request, entry.num_scheduled_tokens
        c = entry.num_computed_tokens
        known = req.token_ids[c : c + n]  # a placeholder past them stays 0: written on the device
        ids[start : start + len(known)] = known
        p = np.arange(c, c + n, dtype=np.int64)
        pos[start : start + n] = p
        lora_slots[start : start + n] = req.lora_slot
        tables = np.full((N, max(len(t) for t in req.block_tables)), pad_block, dtype=np.int64)
        for g, table in enumerate(req.block_tables):
            tables[g, : len(table)] = table
        tables[tables < 0] = pad_block  # NULL_BLOCK (left a sliding window): the padding block
        slots[:, start : start + n] = tables[:, p // bs] * bs + p % bs
        seqs.append((c + n - 1, tables))
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

    if shape is not None:  # the sizes given (T, Wd) or (T, R, Bd, Wd, G, Wp)
        R, Bd, Wd, G, Wp = (T, T, shape[1], 0, 0) if decode_path else shape[1:]
    else:  # the rule's for these requests
        R = T if decode_path else rule.num_rows(len(logits_rows))
        Bd = T if decode_path else rule.num_rows(len(decodes))
        Wd = rule.table_width(max((c + 1 for _, c, _ in decodes), default=1))
        G = rule.num_groups(len(groups))
        Wp = rule.table_width(max((p0 + m for _, m, p0, _ in groups), default=1))
    rows = np.zeros(R, dtype=np.int64)
    rows[: len(logits_rows)] = logits_rows
    d_pos = np.zeros(Bd, dtype=np.int64)
    d_pos[: len(decodes)] = [c for _, c, _ in decodes]
    # Staged in this order (``StepBatch`` fields): a step of a given shape finds its tensors at the same addresses.
    arrays = {
        "input_ids": ids,
        "positions": pos,
        "slot_mapping": slots,
        "logits_rows": rows,
        "decode_tables": tables_of([(c, tables) for _, c, tables in decodes], Bd, Wd),
        "decode_pos": d_pos,
    }
    if not decode_path:
        d_rows = np.full(Bd, T, dtype=np.int64)
        d_rows[: len(decodes)] = [row for row, _, _ in decodes]
        g_rows = np.full((G, qs), T, dtype=np.int64)
        g_pos = np.zeros((G, qs), dtype=np.int64)
        for i, (row, m, p0, _) in enumerate(groups):
            g_rows[i, :m] = np.arange(row, row + m)
            g_pos[i, :m] = np.arange(p0, p0 + m)
        arrays["decode_rows"] = d_rows
        arrays["prefill_rows"] = g_rows
        arrays["prefill_tables"] = tables_of([(p0 + m - 1, tables) for _, m, p0, tables in groups], G, Wp)
        arrays["prefill_pos"] = g_pos
    max_seqlens = None
    if flash_varlen:  # cu_seqlens [2, B + 1] (query rows, then keys; fillers repeat the last entry), tables
        lens = np.array([[e.num_scheduled_tokens for e in scheduled], [last + 1 for last, _ in seqs]], dtype=np.int64)
        if rule.exact:  # the requests, their longest table and lengths: nothing to pad
            B, W = len(scheduled), rule.table_width(int(lens[1].max()))
            max_seqlens = (int(lens[0].max()), int(lens[1].max()))
        else:
            B, W = varlen_sizes((T, Wd) if decode_path else (T, R, Bd, Wd, G, Wp))
            # Bounds fixed by the shape, not the step's maxima: the kernel's launch grid follows max_seqlen_q (a
            # CUDA graph replays the grid it captured), and ints that varied per step would make dynamo recompile.
            max_seqlens = (T, W * bs)
        cu = np.zeros((2, B + 1), dtype=np.int64)
        cu[:, 1:] = np.cumsum(np.pad(lens, ((0, 0), (0, B - len(scheduled)))), axis=1)
        arrays["varlen_cu_seqlens"] = cu
        arrays["varlen_tables"] = tables_of(seqs, B, W)
    if lora:
        arrays["lora_slots"] = lora_slots
    # One copy: the batch, then ``extra``.
    staged = staging.upload(*arrays.values(), *extra)
    tensors = dict(zip(arrays, staged))
    batch = StepBatch(**{"decode_rows": None, **tensors}, varlen_max_seqlens=max_seqlens)
    if lora:  # the real rows' slots, read on the host (an eager step's LoRA work follows them)
        used = np.unique(lora_slots[:start][lora_slots[:start] >= 0])
        batch.lora_used = tuple(used.tolist())
        batch.lora_uniform = len(used) == 1 and bool((lora_slots[:start] == used[0]).all())
    return batch, staged[len(arrays) :]


def synthetic_batch(
    path: str,
    shape: Sequence[int],
    rule: PaddingRule,
    staging: HostStaging,
    num_groups: int = 1,
    kernel: str = "sdpa",
    lora: bool = False,
) -> StepBatch:
    """A batch of the given padded shape that reads and writes the padding block only (warmup): the one builder's
    (``build_step_batch``) batch of no request at that shape.

    Its forward compiles (or captures) what a real step of that shape runs and changes nothing but the
    padding block. It is staged as a real step is, so a graph captured on it replays later steps with no copy.

    Args:
        path: "varlen" or "decode".
        shape: (T, Wd) for decode, (T, R, Bd, Wd, G, Wp) for varlen (padded sizes, each >= 2).
        rule: the runner's padding rule.
        staging: the runner's input staging buffer.
        num_groups: the cache's KV layer groups.
        kernel: the attention kernel its steps run (``prepare_inputs``): "flash_varlen" stages flash-attn's
            varlen inputs of the shape's sizes, every sequence a filler (every row's output is then zeroed).
        lora: stage ``lora_slots`` too (every row the base model's).
    """
    flash_varlen = kernel == "flash_varlen"
    batch, _ = build_step_batch([], [], path == "decode", rule, staging, (), num_groups, flash_varlen, shape, lora)
    batch.flash_decode = kernel == "flash_decode"
    return batch


@dataclass
class LogitsPlan:
    """Which rows of a step's logits are for what.

    The first ``num_sample_rows`` rows are the last query token of each sampled request, in batch order. The
    rest are scored positions: row ``num_sample_rows + j`` predicts ``score_targets[j]``; ``score_segments``
    says, in order, how many of those rows belong to which request.
    """

    num_sample_rows: int = 0
    score_targets: list[int] = field(default_factory=list)
    score_segments: list[tuple[Request, int]] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)  # the request of each sample row, in order
    # On the device (staged with the inputs): int64 [S] score_targets, float32 [S] their temperatures; or None.
    score_target_ids: torch.Tensor | None = None
    score_temperatures: torch.Tensor | None = None


def fits_decode_kernel(scheduled: Sequence[ScheduledRequest], max_blocks: int, block_size: int) -> bool:
    """Whether a step fits ``flash_attn_with_kvcache``: every request computes one token and its keys (this one
    included) fit in ``max_blocks`` blocks (0: none does); transformers' scheduler applies the same rule."""
    limit = max_blocks * block_size  # keys a table row can address
    return bool(scheduled) and all(e.num_scheduled_tokens == 1 and e.num_computed_tokens < limit for e in scheduled)


def prepare_inputs(
    scheduled: Sequence[ScheduledRequest],
    decode_path: bool,
    rule: PaddingRule,
    staging: HostStaging,
    num_groups: int,
    kernel: str = "sdpa",
    sample_rows: dict[str, int] | None = None,
    lora: bool = False,
) -> tuple[StepBatch, list[int], LogitsPlan, torch.Tensor | None]:
    """The inputs of a step, in one staged upload: its batch, the real logits rows and their plan.

    Args:
        scheduled: the step's requests, in batch order.
        decode_path: every request computes one token and samples it (``ModelRunner.path_of``).
        rule: the sizes (exact on an eager path, padded on a compiled or graphed one).
        staging: the runner's input staging buffer.
        num_groups: the cache's KV layer groups.
        kernel: "sdpa"; "flash_decode" (``fits_decode_kernel``: an eager step or a padded decode-path one);
            "flash_varlen" (any other CUDA step with flash-attn, its inputs sized by ``rule``).
        sample_rows: async batching: the row of each request (by id) among the sampled tokens of the step
            prepared before; a request's query token past its known ``token_ids`` (at most one, its last) is a
            placeholder for that step's token. None when every token is known.
        lora: stage each row's LoRA slot (``StepBatch.lora_slots``).

    Returns:
        The batch; the logits rows it keeps first (sampled rows, then scored rows); their plan, with the
        score targets and temperatures on the device; and the placeholders (``PreparedStep.placeholders``:
        a padded batch keeps the real rows first, at the same indices), or None.
    """
    plan = LogitsPlan()
    logits_rows: list[int] = []
    score_rows: list[int] = []
    placeholders: list[list[int]] = [[], []]  # the input rows holding one, the sampled token replacing each
    start = 0
    for entry in scheduled:
        req, n, c = entry.request, entry.num_scheduled_tokens, entry.num_computed_tokens
        if entry.sample:  # a sampled request keeps its last row
            logits_rows.append(start + n - 1)
            plan.sampled.append(req)
        if req.score_from is not None:
            # A scoring request keeps its rows that predict a prompt token not yet scored, positions [lo, hi):
            # position p's logits predict token p + 1; positions scored before a preemption are not redone.
            lo = max(c, req.score_from - 1 + len(req.prompt_logprobs))
            hi = min(c + n, req.num_tokens - 1)
            if hi > lo:
                score_rows.extend(range(start + lo - c, start + hi - c))
                plan.score_targets.extend(req.token_ids[lo + 1 : hi + 1])
                plan.score_segments.append((req, hi - lo))
        if sample_rows is not None and c + n > req.num_tokens:
            placeholders[0].append(start + n - 1)
            placeholders[1].append(sample_rows[req.request_id])
        start += n
    temps = [req.score_temperature for req, count in plan.score_segments for _ in range(count)]
    extra = [np.asarray(plan.score_targets, dtype=np.int64), np.asarray(temps, dtype=np.float64)]
    if placeholders[0]:
        extra.append(np.asarray(placeholders, dtype=np.int64))
    rows = logits_rows + score_rows
    flash_varlen = kernel == "flash_varlen"
    batch, staged = build_step_batch(
        scheduled, rows, decode_path, rule, staging, extra, num_groups, flash_varlen, lora=lora
    )
    batch.flash_decode = kernel == "flash_decode"
    if plan.score_segments:
        plan.score_target_ids, plan.score_temperatures = staged[0], staged[1].float()
    plan.num_sample_rows = len(logits_rows)
    return batch, rows, plan, staged[2] if placeholders[0] else None
