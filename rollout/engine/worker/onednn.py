"""The engine's float32 CPU linear layers: weights packed once per engine (rollout's GEMM or oneDNN), else MKL.

``torch.nn.functional.linear`` in float32 on a CPU runs MKL's sgemm, which, like oneDNN's inner product on a plain
weight (``torch.ops.mkldnn._linear_pointwise``), reorders the weight into a blocked layout inside every call: every
weight of the model is read and written again at each step. Packed weights (``PackedWeights``, issue 23): where the
copies fit in memory, each engine packs its float32 linear weights once and runs every such layer on them, sibling
projections stacked into one GEMM, as vLLM's CPU backend does. Two kernels run packed weights (``packed_kernel``):

- rollout's GEMM (``rollout_cpu::packed_linear``, engine/attention/csrc/gemm_cpu.cpp) on weights packed in 32-column
  panels, on AVX-512 machines (issue 45): the broadcast micro-kernel the batch-invariant mode runs, so each output
  element is one FMA chain over K whatever the step's rows; each stacked sibling's output is written into a tensor of
  its own. A pass of SmolLM2-135M's 211 linear layers took 20.2 ms against 29.8 for packed oneDNN at 2 rows, 48.4
  against 56.4 at 32 rows and 700.7 against 706.0 at 512 rows (``scripts/bench_cpu_linear.py`` at ``e341d09``, this
  project's 2-core Zen 4 EPYC): oneDNN's fixed cost per call is what a decode step's small GEMMs pay;
- oneDNN's inner product on its blocked layout (``mkldnn._reorder_linear_weight``) elsewhere, or under
  ``ROLLOUT_ONEDNN_LINEAR=1``: 118.7 ms on MKL, 87.2 on oneDNN with plain weights and 70.6 packed at 32 rows at
  ``450a0c9`` (packed won at 2 and 512 rows too, also with oneDNN held to AVX2, ``ONEDNN_MAX_CPU_ISA=AVX2``).

Where the weights are not packed (``ROLLOUT_PACK_WEIGHTS=0``, or the copies would not fit), the engine keeps MKL,
what ``F.linear``, training and ``model.generate`` run. oneDNN on plain weights is not a safe default: on the
project's Zen 4 EPYC (AVX-512) it was 1.1-2.7x faster than MKL at 32 and 512 rows, but on an AVX2-only EPYC (issue
22) it was slower on every projection at 1-8 rows (its per-call overhead) and on k/v at 32 rows, faster only on the
lm_head. (Until issue 31 the engine timed both kernels per weight shape and row bucket and kept the faster; packing
left that only to this fallback.)

How each forward gets there: the fused decoder layers (``fused_layer``) call the active packed weights directly.
Otherwise ``OneDNNLinear`` is a ``TorchFunctionMode`` (which dynamo traces) around the engine's forwards, eager and
compiled. In eager steps it runs the packed copies directly; in a compiled step it maps each float32 CPU ``F.linear``
to the custom op ``rollout::onednn_linear``, which finds the packed copies at run time. Custom ops rather than
inductor's own oneDNN lowering: inductor lowers ``mkldnn._linear_pointwise`` only for weights frozen into the graph
(``torch._inductor.config.freezing``), so an in-place weight update would go unseen; the op is opaque to inductor and
reads the live parameter at every call. Only the engine's own forwards run inside the mode: training and
``model.generate`` keep MKL.

``ROLLOUT_ONEDNN_LINEAR`` in the environment, read when an engine is built (``linear_plan``, ``packed_kernel``): unset
or ``auto``: packed weights where packing is on and fits (rollout's GEMM on AVX-512, else oneDNN), else MKL;
``1``/``true``/``on``/``yes``: oneDNN for every layer (packed where it can be, else on the plain weights);
``0``/``false``/``off``/``no``: MKL for every layer (the mode is not entered, nothing is packed). Either packed kernel's
results equal ``F.linear``'s up to float32 rounding (another summation order), not bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rollout.weights.versions import optimizer_steps

# Read once: dynamo does not trace ``torch.backends`` (a call inside a compiled step breaks its graph).
MKLDNN_AVAILABLE = torch.backends.mkldnn.is_available()

ENV_VAR = "ROLLOUT_ONEDNN_LINEAR"
# The values of ROLLOUT_ONEDNN_LINEAR (case-insensitive) for each policy.
OFF_VALUES = ("0", "false", "off", "no")
ON_VALUES = ("1", "true", "on", "yes")
AUTO_VALUES = ("", "auto")

# The policies: packed weights where they fit else MKL, oneDNN everywhere, MKL everywhere.
AUTO, ONEDNN, MKL = "auto", "onednn", "mkl"
# The kernels that run packed weights: rollout's GEMM (``rollout_cpu::packed_linear``) or oneDNN's inner product.
ROLLOUT = "rollout"


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
        ``"auto"`` (unset, empty or ``auto``: packed weights where they fit, else MKL), ``"onednn"`` (``1``, ``true``,
        ``on``, ``yes``) or ``"mkl"`` (``0``, ``false``, ``off``, ``no``, or oneDNN missing from this torch build).

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


@torch.library.custom_op("rollout::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed copy of ``weight`` where this thread's forward has packed weights
    active (``PackedWeights.active``, whose kernel runs it), else through oneDNN's inner product on ``weight``.

    Args:
        x: float32 [..., K] on the CPU.
        weight: float32 [N, K], a plain (unpacked) tensor: the model's live parameter.
        bias: float32 [N] or None.

    Returns:
        float32 [..., N], a new tensor.
    """
    packs = _ACTIVE_PACKS.get()
    return packs.linear(x, weight, bias) if packs is not None else _onednn(x, weight, bias)


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


def packed_kernel(extension: bool = True) -> str:
    """The kernel an engine built now runs its packed weights on: ``"rollout"`` (rollout's GEMM on column panels,
    ``rollout_cpu::packed_linear``) where ``ROLLOUT_ONEDNN_LINEAR`` is ``auto``, the CPU has AVX-512 (what torch's
    vector code reports: ``torch.backends.cpu.get_cpu_capability()``), ``extension`` (the engine runs rollout's CPU
    extension: False under ``cpu_attention="sdpa"``, which is not built then) and the extension loads; else
    ``"onednn"``. The GEMM is written for AVX-512's 16-lane registers (without them its loops are scalar).

    Measured on this project's 2-core Zen 4 EPYC (``scripts/bench_cpu_linear.py``, docs/engine.md): faster than
    oneDNN on packed weights up to 128 rows (the decode steps), equal at 512.

    Raises:
        ValueError: a value of ``ROLLOUT_ONEDNN_LINEAR`` that it does not take.
    """
    if not extension or linear_kernel_policy() != AUTO or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return ONEDNN
    from rollout.engine.attention.cpu import load_kernel

    return ROLLOUT if load_kernel() is None else ONEDNN


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, sizes: Sequence[int], bias: torch.Tensor | None
) -> list[torch.Tensor]:
    """rollout's GEMM: ``x`` [..., K] on the column panels of one weight or of stacked siblings (``sizes``, their
    output features) -> one new contiguous [..., size] tensor per member."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    outs = torch.ops.rollout_cpu.packed_linear(rows, packed, list(sizes), bias)
    return [out.view(*lead, out.shape[-1]) for out in outs]


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
    """Packed copies of an engine's float32 CPU linear weights (oneDNN's blocked layout or rollout's column panels),
    made on a weight's first use.

    ``F.linear`` on a plain weight makes MKL or oneDNN reorder the weight into their blocked layout at every call,
    which reads and writes every weight again each step; vLLM's CPU backend runs its linear layers on weights
    reordered once (``_C::onednn_mm``, docs/profile.md). Here a weight's copy is made the first time a step uses it
    and remade when the weight is not the one packed: another tensor,
    storage or version counter (an in-place update: ``update_weights``, an optimizer step; the same test as the
    manager's weight fingerprint), and all are dropped by ``clear`` (a new weight version) and before the first
    forward after any optimizer step in the process (``weights.versions.optimizer_steps``: a fused optimizer writes
    without bumping versions). The copies cost the linear weights' memory once more, so the runner packs only where
    they fit (``packing_fits``).

    Sibling projections (``groups``, from ``sibling_groups``) are packed stacked, as one weight: the first member's
    call computes every member's output in one GEMM and the others' calls on the same input tensor take their part
    (a call on another input, or out of order, runs on the member's own copy).

    The copies are oneDNN's blocked layout (run by ``mkldnn._linear_pointwise``) or, with ``kernel="rollout"``,
    rollout's column panels (``rollout_cpu::invariant_pack``, run by ``rollout_cpu::packed_linear``, which writes each
    sibling's output into a tensor of its own: no split and no copy); ``packed_kernel`` chooses.

    Thread-safe (the fused outputs are kept per thread); the runner makes the copies active around its forwards
    (``active``), where ``OneDNNLinear`` and the compiled step's linear ops find them.

    Args:
        groups: sibling linear layers to fuse, each in call order.
        rows_hint: the rows oneDNN chooses its blocked layout for (any row count runs on it; unused by rollout's
            kernel, whose panels serve every row count alike).
        kernel: ``"onednn"`` or ``"rollout"`` (which needs rollout's CPU extension loaded).

    Raises:
        ValueError: another ``kernel``.
    """

    def __init__(
        self, groups: Sequence[Sequence[torch.nn.Linear]] = (), rows_hint: int = PACK_ROWS_HINT, kernel: str = ONEDNN
    ) -> None:
        if kernel not in (ONEDNN, ROLLOUT):
            raise ValueError(f"kernel must be {ONEDNN!r} or {ROLLOUT!r}; got {kernel!r}")
        self.kernel = kernel
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
                bias = None
                if len(tensors) > 1 and biases[0] is not None:
                    bias = torch.cat([b.detach() for b in biases])
                if self.kernel == ROLLOUT:
                    # Each member padded to whole panels, so that no panel straddles two members' outputs.
                    panels = [torch.ops.rollout_cpu.invariant_pack(t.detach()) for t in tensors]
                    packed = panels[0] if len(panels) == 1 else torch.cat(panels)
                else:
                    weight = tensors[0].detach() if len(tensors) == 1 else torch.cat([t.detach() for t in tensors])
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
                        # Each part a contiguous tensor of its own: the model views its projections' outputs into
                        # heads, and a compiled step may reuse an op's output buffer once it is dead, which must not
                        # be a sibling's memory (a one-row part is contiguous as a view, so oneDNN's is copied too).
                        parts: list[torch.Tensor | None] = list(self._run(x, entry.packed, siblings.sizes, entry.bias))
                        self._local.fused = (siblings, x, parts)
                        first, parts[0] = parts[0], None
                        return first
        packed = self.packed(weight) if weight.dim() == 2 else None
        if packed is None:
            return _onednn(x, weight, bias)
        bias = bias.contiguous() if bias is not None else None
        return self._run(x, packed, (weight.shape[0],), bias)[0]

    def _run(
        self, x: torch.Tensor, packed: torch.Tensor, sizes: Sequence[int], bias: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """``x`` [..., K] on one packed copy (one weight, or stacked siblings of ``sizes`` output features) with this
        engine's kernel: one [..., size] output per member, each a tensor of its own (oneDNN's stacked output is split
        and its parts copied)."""
        if self.kernel == ROLLOUT:
            return _packed_linear(x, packed, sizes, bias)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if len(sizes) == 1:
            return [y]
        return [t.clone(memory_format=torch.contiguous_format) for t in y.split(list(sizes), dim=-1)]

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


def active_packs() -> PackedWeights | None:
    """The packed weights made active in this thread (``PackedWeights.active``), None outside such a forward."""
    return _ACTIVE_PACKS.get()


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


@onednn_linear.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op's output under tracing: [..., N] like ``x``."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear_plan(model: torch.nn.Module, device: torch.device) -> tuple[bool, bool]:
    """How an engine built now runs its steps' float32 linear layers, from ``ROLLOUT_ONEDNN_LINEAR`` and
    ``ROLLOUT_PACK_WEIGHTS`` (see the module docstring).

    Args:
        model: the engine's model.
        device: the engine's device (off the CPU nothing is mapped: CUDA keeps cuBLAS).

    Returns:
        (whether its forwards run inside ``OneDNNLinear``, whether it packs its weights: ``PackedWeights``). MKL
        (neither) off the CPU, under ``0``, under ``auto`` where the weights are not packed, and under ``auto`` on a
        tensor-parallel model (sharded layers keep their own linear, and whether a rank's copies fit would be each
        rank's own choice: logits rounded differently per rank).

    Raises:
        ValueError: a value of either variable that it does not take.
    """
    policy = linear_kernel_policy() if device.type == "cpu" else MKL
    if policy == AUTO and any(is_dtensor(p) for p in model.parameters()):
        policy = MKL
    pack = policy != MKL and packing_wanted() and packing_fits(model, psutil.virtual_memory().available)
    return policy == ONEDNN or pack, pack


def takes_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` may run on the engine's kernels (packed weights or oneDNN): float32 tensors on
    the CPU, neither a tensor-parallel ``DTensor``, nothing that needs a gradient, and CPU autocast off (under it
    ``F.linear`` computes in autocast's dtype; the kernels would stay float32). ``OneDNNLinear`` and the fused
    forward's linear layers (``fused_layer._linear``) ask it."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not (is_dtensor(x) or is_dtensor(weight))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not torch.is_autocast_enabled("cpu")
    )


class OneDNNLinear(TorchFunctionMode):
    """Inside it, ``F.linear`` on float32 CPU tensors without autograd runs on the packed copies made active in this
    thread (``PackedWeights.active``, with their kernel), else on oneDNN with the plain weight.

    In eager code a packed layer runs directly; otherwise, and in any compiled code, through the custom op
    ``rollout::onednn_linear`` (which finds the copies at run time). Anything else (other functions, other devices or
    dtypes, a tensor that needs a gradient, a tensor-parallel ``DTensor``, any call while CPU autocast is on) runs as
    it would without the mode.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if takes_linear(x, weight):
                if torch.compiler.is_compiling():
                    return onednn_linear(x, weight, bias)  # the op finds the packed copies when the graph runs
                packs = _ACTIVE_PACKS.get()
                if packs is not None:
                    return packs.linear(x, weight, bias)  # eager: no custom-op dispatch per layer
                return onednn_linear(x, weight, bias)
        return func(*args, **kwargs)
