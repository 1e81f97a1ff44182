"""rollout/ imports only point down: each module imports only modules listed before it in LAYERS.

The check parses every module with ``ast`` and looks at every import, at module level, inside
functions and under ``TYPE_CHECKING`` alike, so no cycle can hide in a lazy import. Each subpackage
(``rollout/serve/``, ``rollout/benchmarks/``) is one entry of LAYERS, near the top (a consumer of the package that
no module of rollout/ imports); its own modules point down in their own order (SUBPACKAGE_LAYERS). The step's
records are imported from their leaf module, ``scheduler_output``, never through ``scheduler``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout"

# STYLE.md's arrows, low to high, with the modules they do not name placed where their imports put them:
# checks (the shared validation helpers), stop_strings (token spellings) and models (introspection) are leaves, and so
# are loading (load_model, the default model's provisioning), weights (in-place copies and the weight fingerprint;
# onednn reads its optimizer-step count) and weight_transfer (the trainer-to-server transfer group and its packed
# buckets). kv_group_policy (what full and sliding-window layer groups do differently) sits between the block pool it
# looks up and kv_cache, which sizes groups with it. cache_sizing (the cache's size from memory) and cpu_offload (the
# offload pool) sit just above kv_cache, whose shapes they use. scheduler_output (a step's SchedulerOutput and
# RunnerOutput records) sits just below the scheduler that builds them; async_scheduler (async batching's scheduler
# subclass) just above the scheduler it extends. distributed (tensor parallelism: the ranks' CPU group and what they
# share) sits above the step records it broadcasts and below engine_spec, which resolves it. flash (flash-attn's
# kernels and support rules) and cpu_attention (rollout's paged CPU kernel with flash-attn's API) are leaves just
# below attention, and attention_registry (the model's switch to the paged dispatcher) sits just above the attention
# it dispatches to. host_staging (host-to-device copies) and logits_processors sit just below sampling, which uses
# both (step_inputs uses host_staging too). onednn (the step's CPU linear layers, eager and padded) sits below
# static_step and model_runner, its users, and lora (LoRA adapters served per token by hooks on linear layers) beside
# it, below model_runner and engine, which own it; step_inputs (the step's one input builder) between them, below
# static_step's forward and model_runner, its users. engine_spec (config x model x device, resolved once) and
# engine_stats (the counters' record) sit below the engine; batch_queue (async batching's step function) and
# engine_requests (the engine's request intake, a part it owns, which checks requests against the spec) just below the
# engine. intake sits between outputs and the manager; pausing (the pause gate) and lifecycle (the state and stop
# flags the loop reads) are leaves of the manager; loop (what the manager's thread runs) uses them with intake and
# outputs, and tp_loop (the manager's loop on a tensor-parallel model) extends loop; persistence (the model-to-manager
# link) sits below the manager that registers itself there, manager_requests (the manager's request API, a part it
# owns) just below the manager. scoring and score_cli are entry points beside api, and so is client (the HTTP client
# of rollout-serve and the trainer's side of the transfer), over pool (N servers, a router, one group; its
# launch_on_ray places them with ray_replicas, Ray actors that run rollout-serve in child processes); fleet
# (rollout-fleet: local replicas and the router) is an entry point of its own. environments (TRL's environment shape,
# tools, tool-call parsing) and chat_delta (an episode's ids by the chat template, its tools' listing) are leaves placed
# here; episodes (multi-turn trajectories) runs them over the manager and the pool. The subpackages sit on top: serve
# (rollout-serve, over the package's exports and a few modules) and the benchmarks, which use all of it.
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
    "lora",
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
    "ray_replicas",
    "pool",
    "client",
    "fleet",
    "environments",
    "chat_delta",
    "episodes",
    "__init__",
    "serve",
    "benchmarks",
]

# rollout/benchmarks/, low to high: the workloads, the report and vllm_peer (what runs in vLLM's own process) are
# leaves; arguments (the flags of the four bench commands and their entry points, which import their benchmark only
# once the flags are parsed) reads the workloads' names; prompt_fork (scripts/bench_prompt_fork.py) and sliding_window
# (scripts/bench_sliding_window.py) are leaves too;
# profile_step (scripts/profile_step.py) uses the workloads and the report; the systems run the workloads' prompts,
# vllm_cpu runs vLLM's CPU build as one of them, and vllm_profile profiles it beside rollout's step; scoring
# (rollout-bench-scoring) and manager (rollout-bench-manager) use the workloads; the generation benchmark
# (rollout-bench) runs the systems and the scoring one as a workload; serving (rollout-bench-serve) and
# tensor_parallel (scripts/bench_tp.py) use the workloads and the report; weight_sync (scripts/bench_weight_sync.py)
# uses the report; fleet (scripts/bench_fleet.py) starts replicas as serving does, with the workloads and the report;
# cli (the four bench commands' entry points) parses with arguments, then imports the benchmark it runs.
BENCHMARK_LAYERS = [
    "workloads",
    "arguments",
    "roofline",
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
    "fleet",
    "tensor_parallel",
    "weight_sync",
    "lora",
    "cli",
    "__init__",
]

# rollout/serve/, low to high: errors (OpenAI's error body) is a leaf; protocol (the pydantic request bodies) names
# errors' type of a boolean sent for a number; chat (the chat template and tool calls) raises errors; jobs (a request
# body to a checked job) uses chat and protocol; responses (outputs to OpenAI's shapes) reads jobs; metrics (Prometheus
# text) reads the manager only; pause (the pause and resume holder, vLLM's rules) is a leaf; submission (a job's
# requests and their ends) raises errors; weight_updates (new weights from disk or a trainer's transfer group) uses
# errors and protocol; service (the one part that talks to the manager) uses jobs, responses, pause, submission and
# weight_updates; weight_routes (the weight-transfer routes) use the service; app (the routes) uses the service and
# weight_routes; kv_memory (the KV cache asked for against the memory there is) reads the package's exports; cli
# (rollout-serve) builds the app; __main__ runs cli, and __init__ exports the app, the service and cli.
SERVE_LAYERS = [
    "errors",
    "protocol",
    "chat",
    "jobs",
    "responses",
    "metrics",
    "pause",
    "submission",
    "weight_updates",
    "service",
    "weight_routes",
    "app",
    "kv_memory",
    "cli",
    "__main__",
    "__init__",
]

# Each subpackage of rollout/ and the order of its own modules.
SUBPACKAGE_LAYERS = {"serve": SERVE_LAYERS, "benchmarks": BENCHMARK_LAYERS}


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
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert {p.stem for p in PACKAGE.glob("*.py")} | subpackages == set(LAYERS)
    assert subpackages == set(SUBPACKAGE_LAYERS)
    for subpackage, layers in SUBPACKAGE_LAYERS.items():
        assert {p.stem for p in (PACKAGE / subpackage).glob("*.py")} == set(layers), subpackage


@pytest.mark.parametrize("module", LAYERS)
def test_module_imports_only_lower_layers(module: str) -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    files, package = _files(module)
    imported = set().union(*(rollout_imports(f, package) for f in files)) - ({module} if len(package) > 1 else set())
    upward = sorted(m for m in imported if rank.get(m, len(LAYERS)) >= rank[module])
    assert not upward, f"rollout/{module}.py imports {upward}, which are not below it in LAYERS"


@pytest.mark.parametrize(
    ("subpackage", "module"), [(sub, module) for sub, layers in SUBPACKAGE_LAYERS.items() for module in layers]
)
def test_subpackage_module_imports_only_lower_modules_of_its_subpackage(subpackage: str, module: str) -> None:
    layers = SUBPACKAGE_LAYERS[subpackage]
    rank = {name: i for i, name in enumerate(layers)}
    imported = module_imports(PACKAGE / subpackage / f"{module}.py", ("rollout", subpackage))
    inside = {parts[1] for parts in imported if parts[0] == subpackage}
    upward = sorted(m for m in inside if rank.get(m, len(layers)) >= rank[module])
    assert not upward, f"rollout/{subpackage}/{module}.py imports {upward}, which are not below it in its layers"


def _step_records() -> set[str]:
    """The names scheduler_output exports (its ``__all__``), read without importing it."""
    tree = ast.parse((PACKAGE / "scheduler_output.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("scheduler_output.py has no __all__")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_step_records_are_imported_from_their_leaf_module(path: Path) -> None:
    records = _step_records()
    package = ("rollout", *path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            target = (*base, *(node.module.split(".") if node.module else ()))
            through = {alias.name for alias in node.names} & records
            assert not (target == ("rollout", "scheduler") and through), (
                f"{path.relative_to(PACKAGE)} imports {sorted(through)} through scheduler: use scheduler_output"
            )


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
