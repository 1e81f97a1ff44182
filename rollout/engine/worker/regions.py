"""Regional compilation of a model's decoder layers (``ContinuousBatchingConfig.regional_compile``, issue 45 item 3).

A whole-model compile traces every layer of the model for every step shape: 180-350 s on 2 cores (docs/engine.md),
and 130 s more in each new process, the on-disk caches warm. Here the regions are the repeated blocks of a decoder
layer around its attention: its norms and its MLP (and the attention's own per-head norms, Gemma 3's and Qwen 3's
``q_norm`` and ``k_norm``). Each class of region is compiled once (``dynamic=True``: one graph over every token
count) and that compiled call serves every module of the class in every layer: dynamo guards on their parameters as
inputs, not on which module it is (PyTorch's regional compilation recipe; Accelerate's ``compile_regions``). Inductor
fuses a norm's six to eight elementwise passes into one and the MLP's activation into its product; the linear layers
stay the step's (``rollout::onednn_linear`` on the packed weights). The layer's own forward, its attention module
and the engine's paged attention stay eager: the attention reads the layer's index (which cache layer, which block
tables), which would make every layer a graph of its own, and in transformers 5 runs inside the ``kernels`` package's
forward wrapper, whose context variable turns into one process-wide global while compiled code sets it (seen by every
thread). So no graph breaks inside a region, and nothing per layer in a graph.

The compiled calls are entered only by an engine's step, in the thread that runs it (``regional_step``). Each
region's ``_compiled_call_impl`` (what ``nn.Module.__call__`` runs when set, as ``module.compile()`` sets it) is a
``RegionDispatch`` while an engine with ``regional_compile`` is open on the model: in any other thread, and in the
step thread outside a step, it runs the module's own ``_call_impl``, so a trainer's forward of the same model (hooks
and all) is what it was (DESIGN.md section 3). A deep copy of the model gets plain modules (``__deepcopy__`` gives
None), a pickle of it too; the last engine to close puts ``None`` back.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rollout.engine.worker.fused_layer import forward_hooked
from rollout.engine.worker.onednn import OneDNNLinear

__all__ = ["RegionDispatch", "decoder_layers", "install", "regional_step", "regions_of", "uninstall", "warm"]

# Per thread: how many regional steps it is inside (the dispatchers read it).
_STEP = threading.local()
_LOCK = threading.Lock()
# Each model's compiled region calls by module class, kept while the model lives: the next engine on it finds their
# graphs (dynamo keeps them on the code object, which is the model's own).
_COMPILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[type, tuple]] = weakref.WeakKeyDictionary()
# Children that are no region: the attention itself, and modules a graph of their own would not speed up.
_NOT_REGIONS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Dropout, torch.nn.Identity)


def _region_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What a region's call runs: its ``_call_impl`` (forward and hooks); the function its graphs come from."""
    return module._call_impl(*args, **kwargs)


def _compiled_region_call() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A copy of ``_region_call`` with a code object of its own (one per model and region class, so each keeps its own
    dynamo cache and recompile limit: functions made from one def share their def's), as (compiling, run-only): the
    first compiles what its guards do not match; the second runs what the first compiled and, where nothing matches,
    the plain call, never compiling (``torch._dynamo.run``)."""
    # The step's float32 linear layers run under ``OneDNNLinear``, a TorchFunctionMode: traced into the graphs (as
    # ``rollout::onednn_linear``), but at run time every op call of a graph passes through the mode's
    # ``__torch_function__``, which dynamo would otherwise compile as a frame of its own and guard at each call.
    # Skipping its code as a frame leaves tracing through it as it was.
    torch._dynamo.eval_frame.skip_code(OneDNNLinear.__torch_function__.__code__)
    fn = types.FunctionType(_region_call.__code__.replace(), _region_call.__globals__, "rollout_region_call")
    return torch.compile(fn, dynamic=True), torch._dynamo.run(fn)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run more than its submodules' forwards: a forward hook, pre-hook or instance
    ``forward`` on it or on a submodule, or a global one (``fused_layer.forward_hooked``), or a backward hook. A graph
    compiled before a hook came does not run it (dynamo does not guard a hook dict that was empty), so such a call is
    the module's own."""
    modules = list(module.modules())
    if forward_hooked(modules) or torch.nn.modules.module._global_backward_hooks:
        return True
    return any(m._backward_hooks for m in modules)


def _none() -> None:
    return None


class RegionDispatch:
    """A region's ``_compiled_call_impl`` while engines compile its model's regions: inside a ``regional_step`` of this
    thread the compiled region call (run-only: a step never compiles; ``warm`` compiles), the module's own
    ``_call_impl`` anywhere else, and wherever a hook is set on it or below it (``_hooked``).

    Attributes:
        engines: the open engines that installed it (the last to close removes it).
    """

    __slots__ = ("_module", "_compiled", "_run", "engines", "__weakref__")

    def __init__(self, module: torch.nn.Module, calls: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
        self._module = weakref.ref(module)  # no cycle through the module's own attribute
        self._compiled, self._run = calls  # the model's (compiling, run-only) calls of this module's class
        self.engines = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        assert module is not None  # it is called through the module
        depth = getattr(_STEP, "depth", 0)
        if depth and not _hooked(module):
            call = self._compiled if getattr(_STEP, "compile", False) else self._run
            return call(module, *args, **kwargs)
        return module._call_impl(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model (a trainer's reference model) is transformers' own

    def __reduce__(self) -> tuple[Callable[[], None], tuple]:
        return (_none, ())


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder layers (``model.model.layers``, transformers' layout of decoder-only LMs), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0 else None


def regions_of(model: torch.nn.Module) -> list[torch.nn.Module] | str:
    """The model's regions: each decoder layer's children but its attention (``self_attn``), and the attention's
    children, leaving out linear layers, embeddings, dropouts and identities; or why the model has none.

    The layer's forward and the attention's run eagerly and call them (so their dispatchers are honoured).
    """
    layers = decoder_layers(model)
    if layers is None:
        return "the model has no decoder layers at model.model.layers"
    found: list[torch.nn.Module] = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, torch.nn.Module):
            return f"its layer {type(layer).__name__} has no self_attn module"
        children = [c for c in layer.children() if c is not attn] + list(attn.children())
        found += [c for c in children if not isinstance(c, _NOT_REGIONS)]
    for module in found:
        current = module._compiled_call_impl
        if current is not None and not isinstance(current, RegionDispatch):
            return f"its {type(module).__name__} is compiled already (module.compile())"
    if not found:
        return "its decoder layers have no norm or MLP module"
    return found


def install(model: torch.nn.Module) -> str | None:
    """Put a ``RegionDispatch`` on each of the model's regions (``regions_of``), or count this engine on the ones
    there.

    Returns:
        None when installed, else why not (a sentence for the log): no ``model.model.layers`` with a ``self_attn``
        each, or a region already compiled by someone else (``module.compile()``: left alone).
    """
    with _LOCK:
        found = regions_of(model)
        if isinstance(found, str):
            return found
        compiled = _COMPILED.setdefault(model, {})
        for module in found:
            if module._compiled_call_impl is None:
                call = compiled.get(type(module))
                if call is None:
                    call = compiled[type(module)] = _compiled_region_call()
                module._compiled_call_impl = RegionDispatch(module, call)
            module._compiled_call_impl.engines += 1
    return None


def uninstall(model: torch.nn.Module) -> None:
    """Count one engine off the dispatchers of the model's regions; the last one puts back ``None``."""
    layers = decoder_layers(model)
    if layers is None:
        return
    with _LOCK:
        for module in layers.modules():
            dispatch = module._compiled_call_impl
            if isinstance(dispatch, RegionDispatch):
                dispatch.engines -= 1
                if dispatch.engines <= 0:
                    module._compiled_call_impl = None


@contextlib.contextmanager
def regional_step(compile: bool = False) -> Iterator[None]:
    """Inside it, this thread's calls of regions with a ``RegionDispatch`` run their compiled calls: run-only (what
    ``warm`` compiled, else the plain call), or compiling what is missing with ``compile``."""
    previous = getattr(_STEP, "compile", False)
    _STEP.depth = getattr(_STEP, "depth", 0) + 1
    _STEP.compile = compile
    try:
        yield
    finally:
        _STEP.depth -= 1
        _STEP.compile = previous


def warm(model: torch.nn.Module, device: torch.device, rows: Sequence[int], run: Callable[..., Any]) -> None:
    """Compile the model's regions (the engine does, when it is built): the model's own forward on ``n`` dummy tokens
    for each ``n`` in ``rows``, inside ``regional_step(compile=True)``, with no engine metadata (its attention is the
    model's original: nothing of the engine's cache is read or written), each through ``run`` (the runner's compile
    counter). Steps only run what it compiled.

    Nothing compiles while the engine serves because of a reason beyond dynamo's: ``torch.compiler.is_compiling()``
    is True in every thread while any thread compiles, and the ``kernels`` package's context variable (transformers
    5's attention wrapper) then takes its process-wide form, which a forward running in another thread breaks.
    """
    with regional_step(compile=True):
        for n in rows:
            ids = torch.zeros(1, n, dtype=torch.long, device=device)
            run(lambda ids=ids: model(input_ids=ids, use_cache=False))
