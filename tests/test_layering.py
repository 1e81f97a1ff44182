"""rollout/ imports only point down: each module imports only modules listed before it in LAYERS.

The check parses every module with ``ast`` and looks at every import, at module level, inside
functions and under ``TYPE_CHECKING`` alike, so no cycle can hide in a lazy import. The subpackage
``rollout/benchmarks/`` is one entry of LAYERS, the top one (a consumer of everything below it that no
module of rollout/ imports); its own modules point down in BENCHMARK_LAYERS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout"

# STYLE.md's arrows, low to high, with the modules they do not name placed where their imports put them:
# checks (the shared validation helpers), stop_strings (token spellings) and models (introspection) are
# leaves, intake sits between outputs and the manager, weights, pausing (the pause gate) and lifecycle
# (the state and stop flags the loop reads) are leaves of the manager, loop (what the manager's thread
# runs) uses them with intake and outputs, persistence (the model-to-manager link) sits below the
# manager that registers itself there, scoring and score_cli are entry points beside api; the benchmarks
# (a subpackage) use all of it, the package's exports included. distributed (tensor parallelism: the
# ranks' CPU group and what they share) sits between the scheduler, whose step results it broadcasts,
# and the engine; tp_loop (the manager's loop on a tensor-parallel model) extends loop; onednn (the padded
# step's CPU linear layers) sits just below static_step, its one user; step_inputs (the step's one input
# builder) sits between them, below static_step's forward and model_runner, its users. async_scheduler (async batching's
# scheduler subclass) sits just above the scheduler it extends; engine_spec (config x model x device,
# resolved once) and engine_stats (the counters' record) sit just below the engine, their one user.
# weight_transfer (the trainer-to-server
# transfer group and its packed buckets) is a leaf beside weights; client (the HTTP client of rollout-serve and
# the trainer's side of the transfer) is an entry point beside api.
# loading (load_model, the default model's provisioning) is a leaf beside models.
# host_staging (host-to-device copies) and logits_processors sit just below sampling, which uses both.
# manager_requests (the manager's request methods, a base class of the manager) sits just below the manager.
# kv_group_policy (what full and sliding-window layer groups do differently) sits between the block pool it looks up
# and kv_cache, which sizes groups with it.
# cache_sizing (the cache's size from memory) and cpu_offload (the offload pool) sit just above kv_cache, whose
# shapes they use; flash (flash-attn's kernels and support rules) and cpu_attention (rollout's paged CPU kernel with
# flash-attn's API) are leaves just below attention, and
# attention_registry (the model's switch to the paged dispatcher) sits just above the attention it dispatches to.
# scheduler_output (a step's SchedulerOutput and RunnerOutput records) sits just below the scheduler that builds them;
# batch_queue (async batching's step function) and engine_requests (the
# engine's request intake, a base class of the engine) just below the engine.
LAYERS = [
    "checks",
    "config",
    "sampling_params",
    "stop_strings",
    "requests",
    "models",
    "loading",
    "weights",
    "weight_transfer",
    "block_manager",
    "kv_group_policy",
    "kv_cache",
    "cache_sizing",
    "cpu_offload",
    "kv_cache_manager",
    "scheduler_output",
    "scheduler",
    "async_scheduler",
    "distributed",
    "flash",
    "cpu_attention",
    "attention",
    "attention_registry",
    "host_staging",
    "logits_processors",
    "sampling",
    "onednn",
    "step_inputs",
    "static_step",
    "model_runner",
    "engine_spec",
    "engine_stats",
    "batch_queue",
    "engine_requests",
    "engine",
    "outputs",
    "intake",
    "pausing",
    "lifecycle",
    "loop",
    "tp_loop",
    "persistence",
    "manager_requests",
    "manager",
    "api",
    "scoring",
    "score_cli",
    "client",
    "__init__",
    "serve",
    "benchmarks",
]

# rollout/benchmarks/, low to high: the workloads and the report are leaves, the systems run the
# workloads' prompts, and the generation benchmark (rollout-bench) runs the scoring one as a workload;
# prompt_fork (scripts/bench_prompt_fork.py) and sliding_window (scripts/bench_sliding_window.py) are leaves,
# profile_step (scripts/profile_step.py) uses the workloads and the report;
# tensor_parallel (scripts/bench_tp.py) uses the workloads and the report; serving (rollout-bench-serve) uses the
# workloads and the report; weight_sync (scripts/bench_weight_sync.py) uses the report.
BENCHMARK_LAYERS = [
    "workloads",
    "report",
    "prompt_fork",
    "sliding_window",
    "profile_step",
    "vllm_peer",
    "systems",
    "vllm_cpu",
    "vllm_profile",
    "scoring",
    "manager",
    "generation",
    "serving",
    "tensor_parallel",
    "weight_sync",
    "__init__",
]


def _module_of(parts: tuple[str, ...]) -> tuple[str, ...]:
    """The rollout module that a dotted name below rollout/ lives in: the longest prefix that is a module
    file, or a package (its ``__init__``); a name no module holds is an attribute of rollout/__init__.py."""
    for n in range(len(parts), 0, -1):
        path = PACKAGE.joinpath(*parts[:n])
        if path.with_name(path.name + ".py").is_file():
            return parts[:n]
        if (path / "__init__.py").is_file():
            return (*parts[:n], "__init__")
    return ("__init__",)


def module_imports(path: Path, package: tuple[str, ...] = ("rollout",)) -> set[tuple[str, ...]]:
    """The rollout modules a file imports, anywhere in it, as paths below rollout/: ``("engine",)`` for
    ``from .engine import Engine``, ``("__init__",)`` for ``import rollout`` or ``from rollout import
    load_model``, ``("benchmarks", "workloads")`` for ``from .workloads import x`` in rollout/benchmarks/.

    Args:
        path: the file.
        package: the package the file belongs to, against which its relative imports resolve.
    """
    found: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level > len(package):
                raise AssertionError(f"{path.name}: import from outside the package: {ast.unparse(node)}")
            base = package[: len(package) - node.level + 1] if node.level else ()
            target = (*base, *(node.module.split(".") if node.module else ()))
            if target[0] == "rollout":
                found.update(_module_of((*target[1:], alias.name)) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = tuple(alias.name.split("."))
                if parts[0] == "rollout":
                    found.add(_module_of(parts[1:]) if len(parts) > 1 else ("__init__",))
    return found


def rollout_imports(path: Path, package: tuple[str, ...] = ("rollout",)) -> set[str]:
    """The top-level rollout modules (or subpackages) a file imports, anywhere in it (``from .x import``,
    ``import rollout.x``...)."""
    return {parts[0] for parts in module_imports(path, package)}


def _files(module: str) -> tuple[list[Path], tuple[str, ...]]:
    """The files of a LAYERS entry and the package their relative imports resolve against."""
    if (PACKAGE / module).is_dir():
        return sorted((PACKAGE / module).glob("*.py")), ("rollout", module)
    return [PACKAGE / f"{module}.py"], ("rollout",)


def test_every_module_is_placed_in_the_layers() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert modules == set(LAYERS)
    assert {p.stem for p in (PACKAGE / "benchmarks").glob("*.py")} == set(BENCHMARK_LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_module_imports_only_lower_layers(module: str) -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    files, package = _files(module)
    imported = set().union(*(rollout_imports(f, package) for f in files)) - ({module} if len(package) > 1 else set())
    upward = sorted(m for m in imported if rank.get(m, len(LAYERS)) >= rank[module])
    assert not upward, f"rollout/{module}.py imports {upward}, which are not below it in LAYERS"


@pytest.mark.parametrize("module", BENCHMARK_LAYERS)
def test_benchmark_module_imports_only_lower_benchmark_modules(module: str) -> None:
    rank = {name: i for i, name in enumerate(BENCHMARK_LAYERS)}
    imported = module_imports(PACKAGE / "benchmarks" / f"{module}.py", ("rollout", "benchmarks"))
    inside = {parts[1] for parts in imported if parts[0] == "benchmarks"}
    upward = sorted(m for m in inside if rank.get(m, len(BENCHMARK_LAYERS)) >= rank[module])
    assert not upward, f"rollout/benchmarks/{module}.py imports {upward}, which are not below it in BENCHMARK_LAYERS"


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from .engine import Engine\n"
        "import rollout.api\n"
        "def f():\n"
        "    from .manager import ContinuousBatchingManager\n"
        "    from rollout import scoring\n"
    )
    assert rollout_imports(source) == {"engine", "api", "manager", "scoring"}


def test_the_checker_resolves_a_subpackage_s_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import rollout\n"
        "from rollout import load_model\n"
        "from ..engine import Engine\n"
        "from .workloads import Workload\n"
        "from . import report\n"
        "from rollout.benchmarks.systems import SYSTEMS\n"
    )
    assert module_imports(source, ("rollout", "benchmarks")) == {
        ("__init__",),
        ("engine",),
        ("benchmarks", "workloads"),
        ("benchmarks", "report"),
        ("benchmarks", "systems"),
    }
    assert rollout_imports(source, ("rollout", "benchmarks")) == {"__init__", "engine", "benchmarks"}
