"""The step's one forward, compiled or CUDA-graphed: compiled forwards, compile counting, CUDA graphs, warmup.

Every step, eager, compiled or CUDA-graphed, runs ``step_forward`` on a batch from ``inputs``. The two paths
(``PATHS``) run copies of it with code objects of their own (``FORWARDS``), so each keeps its own dynamo cache; their
compiled versions are shared by every engine with the same ``CompileConfig`` (``compiled_forward``), so a new engine
finds the graphs compiled before it. ``CompileCounter`` counts compilations per thread while a forward runs.

CUDA graphs (``CUDAGraphs``): one per padded shape and kernel, captured on first use (or in warmup), kept in
an LRU sharing one memory pool, replayed on the step's own staged inputs (no copy) where it can.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx.experimental import _config as fx_config
from transformers.generation import CompileConfig

from rollout.engine.attention.paged import METADATA_KWARG, PagedAttentionMetadata
from rollout.engine.kv.cache import PagedKVCache
from rollout.engine.worker.compile_cache import CompileCache
from rollout.engine.worker.fused_layer import fused_forward, hooks_in_the_way
from rollout.engine.worker.inputs import PaddingRule, StepBatch
from rollout.engine.worker.onednn import OneDNNLinear, active_packs
from rollout.engine.worker.regions import regional_step

PATHS = ("varlen", "decode")
# Captured CUDA graphs kept per runner (both paths), least recently used evicted first. Their temporaries share one
# memory pool, so memory grows with the largest shape, not the count. 64 covers the decode shapes of a workload whose
# batch size and lengths vary over a few intervals each (beyond: ``EngineStats.num_cuda_graph_captures`` grows).
CUDA_GRAPH_CAPACITY = 64


def warmup_shapes(path: str, rule: PaddingRule) -> list[tuple[int, ...]]:
    """The padded shapes that ``warmup`` runs for a path: the smallest and the next size of every axis.

    Two shapes that differ in every axis that can vary: with ``dynamic=True`` the second confirms no size was
    specialised; with ``dynamic=None`` its compilation makes every varying axis symbolic. With ``dynamic=False``, and
    for CUDA graphs, every other shape compiles or captures on first use (``EngineStats.*_after_warmup``).

    Args:
        path: "varlen" or "decode".
        rule: the padding rule.

    Returns:
        One or two shapes, (T, Wd) or (T, R, Bd, Wd, G, Wp) (see ``StepBatch.shape``).
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


def step_forward(
    model: torch.nn.Module,
    cache: PagedKVCache,
    batch: StepBatch,
    block_size: int,
    skip_mask: torch.Tensor,
    logits_to_keep: bool,
    onednn: bool,
    fused: bool = False,
    invariant: bool = False,
    regional: bool = False,
) -> torch.Tensor:
    """The model's forward on a step's batch, then its kept logits rows in float32 [R, V].

    ``onednn``: run the float32 CPU linear layers inside ``onednn.OneDNNLinear`` (the runner's ``onednn.linear_plan``,
    a constant to dynamo); False keeps ``F.linear`` (MKL). ``fused``: the forward is ``fused_layer.fused_forward``
    (eager CPU steps of a Llama-family model), not ``model(...)``, unless a hook or an instance ``forward`` on a module
    it would skip is set (``fused_layer.hooks_in_the_way``). ``invariant``: the paged attention runs its
    batch-invariant kernel (the runner runs the step inside ``invariant.batch_invariant()`` too). ``regional``: the
    decoder layers' regions (norms, MLPs) run their compiled calls (``regions.regional_step``).
    """
    meta = PagedAttentionMetadata.from_batch(cache, block_size, batch, invariant)
    if fused and not hooks_in_the_way(model):
        # The fused forward runs its linear layers on the active packed weights itself (fused_layer._linear): the
        # mode, whose Python dispatch sees every op of the step, only where there are none.
        with OneDNNLinear() if onednn and active_packs() is None else contextlib.nullcontext():
            rows, ids, pos = batch.logits_rows, batch.input_ids, batch.positions
            return fused_forward(model, ids, pos, skip_mask, rows, **{METADATA_KWARG: meta}).float()
    kwargs = {
        "input_ids": batch.input_ids[None, :],
        "position_ids": batch.positions[None, :],
        "attention_mask": skip_mask,
        "use_cache": False,
        METADATA_KWARG: meta,
    }
    if logits_to_keep:
        kwargs["logits_to_keep"] = batch.logits_rows
    with (
        OneDNNLinear() if onednn else contextlib.nullcontext(),
        regional_step() if regional else contextlib.nullcontext(),
    ):
        logits = model(**kwargs).logits[0]
    if not logits_to_keep:
        logits = logits.index_select(0, batch.logits_rows)
    return logits.float()


def _forward_of(path: str) -> Callable[..., torch.Tensor]:
    """``step_forward`` with a code object of its own, named ``forward_<path>``.

    dynamo keeps its compiled graphs, their guards and its recompile limit per code object, and functions
    made from one def (a closure, a ``functools.partial``) share that def's: the two paths would share one
    cache, each path's graphs tried and guarded against the other's.
    """
    name = f"forward_{path}"
    code = step_forward.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, step_forward.__globals__, name)


FORWARDS: dict[str, Callable[..., torch.Tensor]] = {path: _forward_of(path) for path in PATHS}
_COMPILED: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
_COMPILED_LOCK = threading.Lock()


def compiled_forward(path: str, config: CompileConfig) -> Callable[..., torch.Tensor]:
    """The path's forward compiled with ``config``, one per (path, config) in the process.

    Sharing it lets every engine with the same config reuse what an earlier one compiled (dynamo's
    cache is per code object; its guards check shapes and types, not which engine runs).

    Raises:
        ValueError: ``config`` is refused by ``torch.compile`` (e.g. both ``mode`` and ``options``).
    """
    kwargs = config.to_dict()  # ``torch.compile``'s keyword arguments
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
    compiled = tuple((p, repr(sorted(c.to_dict().items()))) for p, c in configs)
    return (compiled, rule.q_interval, rule.kv_interval, rule.block_size, rule.max_batch_tokens, rule.subchunk_rows)


def warmed_before(model: torch.nn.Module, key: tuple | None) -> bool:
    """True when a warmup with this ``warm_key`` already ran on ``model`` in this process."""
    return key is not None and key in _WARMED.get(model, ())


def mark_warmed(model: torch.nn.Module, key: tuple | None) -> None:
    """Record that a warmup with this ``warm_key`` ran on ``model``."""
    if key is not None:
        _WARMED.setdefault(model, set()).add(key)


class CompileCounter:
    """Counts dynamo compilations made in this thread while ``run`` runs a function.

    One compile-start callback is registered with dynamo for the process; it adds one to the counter
    of the calling thread, if any. (dynamo runs its start callbacks when no other compilation is in
    flight; two threads compiling at once count once.)
    """

    _local = threading.local()
    _registered = False
    _lock = threading.Lock()

    def __init__(self, cache: CompileCache | None = None) -> None:
        self.count = 0
        self.cache = cache
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
        """``fn(*args)``, counting the compilations it triggers in this thread (saved to ``cache`` when there are)."""
        previous = getattr(CompileCounter._local, "counter", None)
        CompileCounter._local.counter = self
        count = self.count
        try:
            return fn(*args)
        finally:
            CompileCounter._local.counter = previous
            if self.cache is not None and self.count > count:
                self.cache.save()  # the new graphs, for the next process


@dataclass
class CapturedGraph:
    """One captured graph: the graph, its static inputs (replayed with whatever they hold) and its output."""

    graph: torch.cuda.CUDAGraph
    inputs: StepBatch
    output: torch.Tensor


class CUDAGraphs:
    """Captured CUDA graphs of a runner's padded forwards, one per key (path, shape, kernel), in an LRU.

    Capture (first use of a key): the forward runs once on a side stream (writing the keys and values the replay
    writes again; compiling a compiled path), is captured into a ``torch.cuda.CUDAGraph`` in the runner's memory pool
    (thread-local capture mode), then replayed. Its static inputs are the step's own staged tensors
    (``share_inputs``) or a clone; a step staged elsewhere is copied into them first. The output (the kept logits,
    float32 [R, V]) stays allocated while the graph is kept and is valid until the next replay; the replays of one
    runner never overlap (one stream), so their temporaries may share addresses.

    Args:
        device: the CUDA device of the model and cache.
        capacity: graphs kept; the least recently used is dropped beyond it (``CUDA_GRAPH_CAPACITY``).
        share_inputs: capture on the step's own tensors. Only when every upload and replay runs on one
            stream: with async batching's side-stream staging, the next step's upload could overwrite them
            while a replay of another buffer set's step still reads them.
    """

    def __init__(self, device: torch.device, capacity: int = CUDA_GRAPH_CAPACITY, share_inputs: bool = True) -> None:
        self.device = device
        self.capacity = capacity
        self.share_inputs = share_inputs
        self.pool: object | None = None  # created at the first capture
        self.graphs: OrderedDict[tuple, CapturedGraph] = OrderedDict()
        self.num_captures = 0
        self.num_evictions = 0

    def run(self, key: tuple, fn: Callable[[StepBatch], torch.Tensor], batch: StepBatch) -> torch.Tensor:
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
            if batch.input_ids.data_ptr() != entry.inputs.input_ids.data_ptr():  # staged elsewhere
                batch.copy_into(entry.inputs)
        entry.graph.replay()
        return entry.output

    def capture(
        self, fn: Callable[[StepBatch], torch.Tensor], batch: StepBatch
    ) -> CapturedGraph:  # pragma: no cover - needs CUDA
        """Capture ``fn`` on ``batch`` or a copy (see the class docstring); the caller replays it."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static = batch if self.share_inputs else batch.clone()
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
