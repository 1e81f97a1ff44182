"""The engine's float32 CPU linear layers: MKL or oneDNN, chosen per weight shape and row count by measuring both.

``torch.nn.functional.linear`` in float32 on a CPU runs MKL's sgemm; oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``) computes the same on the same unpacked weight. Which one is faster
depends on the CPU, the shape and the number of rows, so the engine does not assume either:
``LinearKernels`` times both, interleaved, the first time a (weight shape, row bucket) reaches a step, and keeps
oneDNN only when it is clearly faster (``prefer_onednn``: MKL's time at least ``MARGIN`` times oneDNN's, each
the fastest of a few calls: ``measure_linear`` says why not the median).
The table is per process (``KERNELS``), so each shape is measured once for every engine and step after it.

Why not always oneDNN (docs/profile.md): on the project's Zen 4 EPYC (AVX-512) oneDNN runs AVX-512 kernels while
MKL keeps AVX2 code on an AMD CPU, and oneDNN was 1.1-2.7x faster at 32 and 512 rows; on an AVX2-only EPYC (issue
22; ``ONEDNN_MAX_CPU_ISA=AVX2`` reproduces it) oneDNN is slower on every projection at 1-8 rows (its per-call
overhead) and on k/v at 32 rows, faster only on the lm_head. Load matters too (``measure_linear``): a process
keeps the choice measured under its load.

How each forward gets there: ``OneDNNLinear`` is a ``TorchFunctionMode`` (which dynamo traces) around the
engine's forwards, eager and compiled. In eager steps it calls the chosen kernel directly; in a compiled step it
maps each float32 CPU ``F.linear`` to the custom op ``rollout::cpu_linear``, which looks the choice up at run time
(a row bucket need not be constant to dynamo). Custom ops rather than inductor's own oneDNN lowering: inductor
lowers ``mkldnn._linear_pointwise`` only for weights frozen into the graph (``torch._inductor.config.freezing``),
so an in-place weight update would go unseen; the ops are opaque to inductor and read the live parameter at
every call. Only the engine's own forwards run inside the mode: training and ``model.generate`` keep MKL.

Packed weights (``PackedWeights``, issue 23): where the copies fit in memory, each engine reorders its float32
linear weights once into oneDNN's blocked layout, as vLLM's CPU backend does, and runs every such layer on them
whatever the policy below says (except ``mkl``): on this project's machine a pass of SmolLM2-135M's 211 linear
layers took 118.7 ms on MKL, 87.2 on oneDNN with plain weights and 70.6 packed at 32 rows, and packed won at 2 and
512 rows too (``scripts/bench_cpu_linear.py`` at ``450a0c9``; also with oneDNN held to AVX2,
``ONEDNN_MAX_CPU_ISA=AVX2``, in a trial). The per-shape measurement
below is then unused; it remains the choice where the weights are not packed. ``ROLLOUT_PACK_WEIGHTS=0`` turns
packing off.

``ROLLOUT_ONEDNN_LINEAR`` in the environment, read when an engine is built (``linear_kernel_policy``): unset
or ``auto``: measure and choose; ``1``/``true``/``on``/``yes``: oneDNN for every shape (``rollout::onednn_linear``);
``0``/``false``/``off``/``no``: MKL for every shape (the mode is not entered). oneDNN's results equal
``F.linear``'s up to float32 rounding (another summation order), not bit for bit; a shape measured near the
margin may go either way in another process, so two processes can differ by that rounding.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .weights import optimizer_steps

# Read once: dynamo does not trace ``torch.backends`` (a call inside a compiled step breaks its graph).
MKLDNN_AVAILABLE = torch.backends.mkldnn.is_available()

ENV_VAR = "ROLLOUT_ONEDNN_LINEAR"
# The values of ROLLOUT_ONEDNN_LINEAR (case-insensitive) for each policy.
OFF_VALUES = ("0", "false", "off", "no")
ON_VALUES = ("1", "true", "on", "yes")
AUTO_VALUES = ("", "auto")

# The policies: measure per shape, oneDNN everywhere, MKL everywhere.
AUTO, ONEDNN, MKL = "auto", "onednn", "mkl"

# Row buckets (upper bounds, inclusive): 1-2, 3-8, 9-32, 33-128 and more rows. Decode steps of a few requests,
# decode steps of a full batch and prefill chunks fall in different buckets, and the measured ratio changes
# between them (oneDNN lost at 1-8 rows and won at 512 on the same projection, issue 22).
ROW_BUCKET_BOUNDS = (2, 8, 32, 128)
# oneDNN is kept only when MKL's time is at least this many times oneDNN's: MKL is what ``F.linear`` and
# ``model.generate`` run (bit-equal logits), so a near tie, within the noise of a shared 2-core machine, keeps it.
MARGIN = 1.15
# Interleaved rounds per measurement: at least ``MIN_ROUNDS``, and no more once ``BUDGET_S`` has passed: a
# shape whose calls are slow (the lm_head at many rows, or any shape on a busy machine where every call waits
# for a descheduled thread) stops early, since the lm_head's calls are most of what the table costs.
ROUNDS = 7
MIN_ROUNDS = 2
BUDGET_S = 0.05
# Rows of the measuring input at most (a prefix of the step's rows, in the same bucket): a 4,096-row scoring
# chunk through a 49,152-wide lm_head would take seconds to time.
MAX_MEASURED_ROWS = 256


def _switch_value(var: str, on_label: str = "", off_label: str = "") -> str:
    """The environment variable ``var``, lower-cased: one of ``AUTO_VALUES``, ``ON_VALUES`` or ``OFF_VALUES``.

    Raises:
        ValueError: any other value; the message names ``var`` and the values (labelled) it takes.
    """
    value = os.environ.get(var, "").strip().lower()
    if value not in (*OFF_VALUES, *ON_VALUES, *AUTO_VALUES):
        raise ValueError(
            f"{var} must be one of auto, {', '.join(ON_VALUES)}{on_label} or {', '.join(OFF_VALUES)}{off_label}; "
            f"got {os.environ[var]!r}"
        )
    return value


def linear_kernel_policy() -> str:
    """The linear kernel policy of an engine built now, from ``ROLLOUT_ONEDNN_LINEAR``.

    Returns:
        ``"auto"`` (unset, empty or ``auto``: measure per shape), ``"onednn"`` (``1``, ``true``, ``on``, ``yes``)
        or ``"mkl"`` (``0``, ``false``, ``off``, ``no``, or oneDNN missing from this torch build).

    Raises:
        ValueError: any other value (the message names the variable and the values it takes).
    """
    value = _switch_value(ENV_VAR, " (oneDNN)", " (MKL)")
    if not MKLDNN_AVAILABLE or value in OFF_VALUES:
        return MKL
    return ONEDNN if value in ON_VALUES else AUTO


try:  # a tensor-parallel shard keeps its own linear (the op takes plain tensors)
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed
    DTensor = None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a tensor-parallel ``DTensor`` shard (False where torch has no distributed)."""
    return DTensor is not None and isinstance(t, DTensor)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN reads the bias as dense memory: a strided or expanded view would be read wrongly.
    bias = bias.contiguous() if bias is not None else None
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _mkl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The aten op, not F.linear: inside ``OneDNNLinear`` F.linear would be mapped again.
    return torch.ops.aten.linear.default(x, weight, bias)


@torch.library.custom_op("rollout::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN's inner product.

    Args:
        x: float32 [..., K] on the CPU.
        weight: float32 [N, K], a plain (unpacked) tensor: the model's live parameter.
        bias: float32 [N] or None.

    Returns:
        float32 [..., N], a new tensor.
    """
    packs = _ACTIVE_PACKS.get()
    return packs.linear(x, weight, bias) if packs is not None else _onednn(x, weight, bias)


def row_bucket(rows: int) -> int:
    """The bucket of a linear call with ``rows`` rows: 0 for 1-2, 1 for 3-8, 2 for 9-32, 3 for 33-128, 4 above."""
    return bisect.bisect_left(ROW_BUCKET_BOUNDS, rows)


def prefer_onednn(mkl_s: float, onednn_s: float, margin: float = MARGIN) -> bool:
    """Whether oneDNN wins by the margin: ``mkl_s >= margin * onednn_s`` (any unit, the same for both)."""
    return mkl_s >= margin * onednn_s


def time_interleaved(
    kernels: Sequence[Callable[[], object]],
    rounds: int,
    timer: Callable[[], float] = time.perf_counter,
    min_rounds: int | None = None,
    budget_s: float = math.inf,
) -> list[list[float]]:
    """Time each kernel over interleaved rounds.

    Each kernel runs once untimed first (oneDNN builds its primitive on a shape's first call). Round r runs
    the kernels in order when r is even and in reverse when odd, so that a slow spell of a shared machine
    falls on both.

    Args:
        kernels: callables, each one call of a kernel.
        rounds: timed calls per kernel at most (>= 1).
        timer: seconds, monotonic (``time.perf_counter``; a fake clock in tests).
        min_rounds: rounds always run (default ``rounds``); after them, rounds stop once ``budget_s``
            seconds have passed since the first timed call.
        budget_s: see ``min_rounds``.

    Returns:
        Per kernel, in the order given, the seconds of its timed calls in round order.
    """
    for kernel in kernels:
        kernel()
    samples: list[list[float]] = [[] for _ in kernels]
    start = timer()
    for r in range(rounds):
        if r >= (rounds if min_rounds is None else min_rounds) and timer() - start > budget_s:
            break
        order = range(len(kernels)) if r % 2 == 0 else reversed(range(len(kernels)))
        for i in order:
            t0 = timer()
            kernels[i]()
            samples[i].append(timer() - t0)
    return samples


def measure_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[float, float]:
    """The fastest of ``ROUNDS`` interleaved calls of MKL and of oneDNN on this linear (``time_interleaved``).

    The minimum, not the median: with two OpenMP threads on two shared cores, a call whose second thread is
    descheduled waits whole scheduler slices (measured on this project's machine at load 4: a 2-row
    576x576 projection took 24-42 ms on MKL and 10-28 ms on oneDNN in every one of 15 calls, against
    0.03-0.04 ms idle). A stall only adds time, so the fastest call is the nearest to the kernel's own cost,
    which stays true after the load is gone; the median would make a process-long choice from the load of
    the moment, in favour of the kernel that synchronises its threads less often. (Under a load that
    stalls every call, the minimum too measures the stalls.)

    Args:
        x: float32 [..., K]; at most ``MAX_MEASURED_ROWS`` of its rows are used (the same row bucket).
        weight: float32 [N, K].
        bias: float32 [N] or None.

    Returns:
        (MKL seconds, oneDNN seconds) per call.
    """
    x = x.reshape(-1, x.shape[-1])[:MAX_MEASURED_ROWS]
    mkl, onednn = time_interleaved(
        [lambda: _mkl(x, weight, bias), lambda: _onednn(x, weight, bias)],
        ROUNDS,
        min_rounds=MIN_ROUNDS,
        budget_s=BUDGET_S,
    )
    return min(mkl), min(onednn)


@dataclass(frozen=True)
class KernelChoice:
    """One measured entry of ``LinearKernels``.

    Attributes:
        in_features, out_features: the weight's K and N.
        bias: whether the layer has a bias.
        bucket: the row bucket (``row_bucket``); ``rows``: the rows measured (the first call's, capped).
        threads: ``torch.get_num_threads()`` when measured.
        mkl_s, onednn_s: seconds per call (``measure_linear``).
        onednn: the choice (``prefer_onednn``).
        measure_s: wall seconds the measurement took (what the choice cost the step that made it).
    """

    in_features: int
    out_features: int
    bias: bool
    bucket: int
    rows: int
    threads: int
    mkl_s: float
    onednn_s: float
    onednn: bool
    measure_s: float


class LinearKernels:
    """The process's choice of MKL or oneDNN per linear shape, measured the first time each shape is seen.

    The key is (K, N, bias or not, row bucket, torch threads): a row bucket's first call is timed on both
    kernels (``measure``), and every later call in that bucket, of any engine or layer of that shape, reuses
    the choice. Thread-safe (an async step runs on a worker thread).

    Args:
        measure: (x, weight, bias) -> (MKL seconds, oneDNN seconds); ``measure_linear``, or a table in tests.
        margin: see ``prefer_onednn``.
    """

    def __init__(
        self,
        measure: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[float, float]] = measure_linear,
        margin: float = MARGIN,
    ) -> None:
        self.measure = measure
        self.margin = margin
        self._table: dict[tuple[int, int, bool, int, int], KernelChoice] = {}
        self._lock = threading.Lock()

    def use_onednn(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this call runs oneDNN (measuring its shape and bucket first when they are new)."""
        k, n = weight.shape[1], weight.shape[0]
        rows = x.numel() // k if k else 0
        key = (k, n, bias is not None, row_bucket(rows), torch.get_num_threads())
        choice = self._table.get(key)
        if choice is None:
            with self._lock:
                choice = self._table.get(key)
                if choice is None:
                    t0 = time.perf_counter()
                    mkl_s, onednn_s = self.measure(x, weight, bias)
                    choice = KernelChoice(
                        k,
                        n,
                        bias is not None,
                        key[3],
                        min(rows, MAX_MEASURED_ROWS),
                        key[4],
                        mkl_s,
                        onednn_s,
                        prefer_onednn(mkl_s, onednn_s, self.margin),
                        time.perf_counter() - t0,
                    )
                    self._table[key] = choice
        return choice.onednn

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` on the chosen kernel (shapes as ``onednn_linear``)."""
        return (_onednn if self.use_onednn(x, weight, bias) else _mkl)(x, weight, bias)

    def table(self) -> list[dict[str, Any]]:
        """The measured entries as dicts (for a benchmark's JSON), in the order they were measured."""
        return [vars(c).copy() for c in list(self._table.values())]

    def clear(self) -> None:
        """Forget every measurement (the next call of each shape measures again)."""
        with self._lock:
            self._table.clear()


# The process's table, shared by every engine and both step kinds.
KERNELS = LinearKernels()

PACK_ENV_VAR = "ROLLOUT_PACK_WEIGHTS"
# The row count oneDNN's blocked weight layout is chosen for: a decode step of a full batch (the layout serves any
# row count; measured on this project's machine, a 32-row layout beat unpacked oneDNN and MKL at 2, 32 and 512 rows).
PACK_ROWS_HINT = 32


def _version_of(weight: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write), None for an inference tensor (it has none)."""
    try:
        return weight._version
    except RuntimeError:
        return None


@dataclass(frozen=True)
class _Pack:
    key: tuple[tuple[int, int, int], ...]  # (id, data_ptr, version) of each tensor packed
    packed: torch.Tensor
    bias: torch.Tensor | None = None


# Sibling projections that read the same input, run as one GEMM on their stacked weights (vLLM's qkv_proj and
# gate_up_proj): the attention's query, key and value projections, the gated MLP's gate and up projections.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class _Siblings:
    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    sizes: tuple[int, ...]  # each member's output features


def sibling_groups(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, ...]]:
    """The model's ``FUSED_SIBLINGS`` groups: children of one module with those names, all ``nn.Linear`` on float32
    weights with one input width, all with or all without a bias."""
    groups = []
    for module in model.modules():
        for names in FUSED_SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if (
                all(type(m) is torch.nn.Linear for m in members)
                and len({m.in_features for m in members}) == 1
                and len({m.bias is None for m in members}) == 1
                and all(m.weight.dtype == torch.float32 and not is_dtensor(m.weight) for m in members)
            ):
                groups.append(tuple(members))
    return groups


class PackedWeights:
    """oneDNN's blocked (prepacked) copies of an engine's float32 CPU linear weights, made on a weight's first use.

    ``F.linear`` on a plain weight makes MKL or oneDNN reorder the weight into their blocked layout at every call,
    which reads and writes every weight again each step; vLLM's CPU backend runs its linear layers on weights
    reordered once (``_C::onednn_mm``, docs/profile.md). Here a weight's copy is made the first time a step uses it
    (``torch.ops.mkldnn._reorder_linear_weight``) and remade when the weight is not the one packed: another tensor,
    storage or version counter (an in-place update: ``update_weights``, an optimizer step; the same test as the
    manager's weight fingerprint), and all are dropped by ``clear`` (a new weight version) and before the first
    forward after any optimizer step in the process (``weights.optimizer_steps``: a fused optimizer writes without
    bumping versions). The copies cost the linear weights' memory once more, so the runner packs only where they fit
    (``packing_fits``).

    Sibling projections (``groups``, from ``sibling_groups``) are packed stacked, as one weight: the first member's
    call computes every member's output in one GEMM and the others' calls on the same input tensor take their part
    (a call on another input, or out of order, runs on the member's own copy).

    Thread-safe (the fused outputs are kept per thread); the runner makes the copies active around its forwards
    (``active``), where ``OneDNNLinear`` and the compiled step's linear ops find them.

    Args:
        groups: sibling linear layers to fuse, each in call order.
        rows_hint: the rows oneDNN chooses its blocked layout for (any row count runs on it).
    """

    def __init__(self, groups: Sequence[Sequence[torch.nn.Linear]] = (), rows_hint: int = PACK_ROWS_HINT) -> None:
        self.rows_hint = rows_hint
        self._packs: dict[int, _Pack] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._optimizer_steps = optimizer_steps()
        # id(weight) -> (its group, its place in it)
        self._siblings: dict[int, tuple[_Siblings, int]] = {}
        for group in groups:
            siblings = _Siblings(
                tuple(m.weight for m in group), tuple(m.bias for m in group), tuple(m.out_features for m in group)
            )
            for i, m in enumerate(group):
                self._siblings[id(m.weight)] = (siblings, i)

    def _pack(
        self, key_id: int, tensors: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
    ) -> _Pack | None:
        """The copy of ``tensors`` stacked (one tensor: itself), made now if any of them or their biases is new or
        changed; None where one has no version counter (an inference tensor, whose changes could not be seen)."""
        key = []
        for t in (*tensors, *(b for b in biases if b is not None)):
            version = _version_of(t)
            if version is None:
                return None
            key.append((id(t), t.data_ptr(), version))
        entry = self._packs.get(key_id)
        if entry is None or entry.key != tuple(key):
            with self._lock:
                weight = tensors[0].detach() if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])
                bias = None
                if len(tensors) > 1 and biases[0] is not None:
                    bias = torch.cat([b.detach() for b in biases])
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.rows_hint)
                entry = _Pack(tuple(key), packed, bias)
                self._packs[key_id] = entry
        return entry

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` alone (float32 [N, K]), made now if it is new or changed; None where it
        cannot be packed (an inference tensor)."""
        entry = self._pack(id(weight), [weight], [None])
        return entry.packed if entry is not None else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` on the packed copy of ``weight`` or of its siblings (shapes as
        ``onednn_linear``)."""
        found = self._siblings.get(id(weight))
        if found is not None:
            siblings, i = found
            if siblings.weights[i] is weight and siblings.biases[i] is bias:
                kept = getattr(self._local, "fused", None)
                if kept is not None and kept[0] is siblings and kept[1] is x and kept[2][i] is not None:
                    out = kept[2][i]
                    kept[2][i] = None  # each part is served once
                    return out
                if i == 0:
                    entry = self._pack(id(siblings), siblings.weights, siblings.biases)
                    if entry is not None:
                        y = torch.ops.mkldnn._linear_pointwise(x, entry.packed, entry.bias, "none", [], "")
                        # Each part a contiguous tensor of its own: the model views its projections' outputs into
                        # heads, and a compiled step may reuse an op's output buffer once it is dead, which must not
                        # be a sibling's memory (a one-row part is contiguous as a view, so it is copied too).
                        parts: list[torch.Tensor | None] = [
                            t.clone(memory_format=torch.contiguous_format) for t in y.split(siblings.sizes, dim=-1)
                        ]
                        self._local.fused = (siblings, x, parts)
                        first, parts[0] = parts[0], None
                        return first
        packed = self.packed(weight) if weight.dim() == 2 else None
        if packed is None:
            return _onednn(x, weight, bias)
        bias = bias.contiguous() if bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def clear(self) -> None:
        """Drop every copy (each is made again on its weight's next use)."""
        with self._lock:
            self._packs.clear()
        self._local = threading.local()

    def __len__(self) -> int:
        """The copies held: one per weight packed alone, one per sibling group."""
        return len(self._packs)

    @contextlib.contextmanager
    def active(self) -> Any:
        """Within it, this thread's float32 linear layers under ``OneDNNLinear`` run on these copies (all dropped
        first if an optimizer step was taken since the last forward: a fused optimizer bumps no version counter)."""
        steps = optimizer_steps()
        if steps != self._optimizer_steps:
            self.clear()
            self._optimizer_steps = steps
        token = _ACTIVE_PACKS.set(self)
        try:
            yield self
        finally:
            _ACTIVE_PACKS.reset(token)
            self._local.fused = None  # no output outlives the forward


# The packed weights of the forward running in this thread (``PackedWeights.active``), read when a linear layer
# runs, so that a compiled step's opaque linear ops find them as eager code does.
_ACTIVE_PACKS: contextvars.ContextVar[PackedWeights | None] = contextvars.ContextVar("rollout_packs", default=None)


def packing_wanted() -> bool:
    """Whether ``ROLLOUT_PACK_WEIGHTS`` allows packing: unset, empty, ``auto`` or an on value (``1``, ``true``...).

    Raises:
        ValueError: any other value than those and the off values (``0``, ``false``, ``off``, ``no``).
    """
    return _switch_value(PACK_ENV_VAR) not in OFF_VALUES


def packing_fits(model: torch.nn.Module, available_bytes: int) -> bool:
    """Whether packed copies of the model's float32 matrices (at most all its 2-D float32 parameters: bytes counted)
    take at most half of ``available_bytes`` (the memory the OS has free, ``psutil.virtual_memory().available``)."""
    matrices = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2 and p.dtype == torch.float32)
    return 2 * matrices <= available_bytes


@torch.library.custom_op("rollout::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the kernel ``KERNELS`` chose for this shape and row bucket.

    The compiled step's form of the choice: opaque to dynamo and inductor, so the row bucket is looked up
    (and measured, on a first call) when the graph runs. Shapes and dtypes as ``onednn_linear``.
    """
    packs = _ACTIVE_PACKS.get()
    return packs.linear(x, weight, bias) if packs is not None else KERNELS.linear(x, weight, bias)


@onednn_linear.register_fake
@cpu_linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The output of either op under tracing: [..., N] like ``x``."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``OneDNNLinear`` maps linear layers on this device and dtype: float32 on a CPU with oneDNN (bfloat16
    and float16 ``F.linear`` on CPU already run oneDNN; CUDA keeps cuBLAS)."""
    return device.type == "cpu" and dtype == torch.float32 and MKLDNN_AVAILABLE


class OneDNNLinear(TorchFunctionMode):
    """Inside it, ``F.linear`` on float32 CPU tensors without autograd runs the kernel the policy names.

    Args:
        policy: ``"auto"`` (default): ``KERNELS``'s choice per shape and row bucket (directly in eager code,
            through ``rollout::cpu_linear`` under dynamo); ``"onednn"``: ``rollout::onednn_linear`` always.

    Anything else (other functions, other devices or dtypes, a tensor that needs a gradient, a
    tensor-parallel ``DTensor``, any call while CPU autocast is on) runs as it would without the mode.

    Raises:
        ValueError: another policy (``"mkl"`` means not entering the mode).
    """

    def __init__(self, policy: str = AUTO) -> None:
        super().__init__()
        if policy not in (AUTO, ONEDNN):
            raise ValueError(f"OneDNNLinear policy must be {AUTO!r} or {ONEDNN!r}, got {policy!r}")
        self.policy = policy

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (
                x.device.type == "cpu"
                and x.dtype == torch.float32
                and weight.dtype == torch.float32
                and not (is_dtensor(x) or is_dtensor(weight))
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
                # Under autocast F.linear computes in autocast's dtype; the custom op would stay float32.
                and not torch.is_autocast_enabled("cpu")
            ):
                if self.policy == ONEDNN:
                    return onednn_linear(x, weight, bias)
                if torch.compiler.is_compiling():
                    return cpu_linear(x, weight, bias)
                # Eager: no custom-op dispatch per layer; an MKL choice is the plain F.linear.
                packs = _ACTIVE_PACKS.get()
                if packs is not None:
                    return packs.linear(x, weight, bias)
                if KERNELS.use_onednn(x, weight, bias):
                    return _onednn(x, weight, bias)
        return func(*args, **kwargs)
