"""The architecture, where it is enforced: rollout/ is laid out in rooms by role, and a room imports only the rooms
its row of ``ROOMS`` names (DESIGN.md, section 2).

Every import of every module counts, at module level, inside functions and under ``TYPE_CHECKING`` alike (``ast``),
so no cycle hides in a lazy import. An import is resolved to the module it reads (the longest dotted prefix that is a
module file or a package's ``__init__``), and that module to its room. Inside a room, imports form no cycle; between
rooms, each points down the table. A room imported "by its face" is imported through its package (``from
rollout.engine import Engine``), never through its sub-rooms or files; the worker reads the scheduler's step records
from their leaf module (``rollout.engine.sched.output``) only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GROUND = ("checks", "config", "sampling_params", "structured_outputs", "stop_strings", "requests", "lazy")

# room -> (what it owns, the rooms it may import). A room's own modules may import each other (without a cycle). An
# entry "room:face" allows the room's package __init__ only; "module:<dotted>" one module.
ROOMS: dict[str, tuple[str, set[str]]] = {
    "ground": (
        "config, sampling parameters, structured outputs, requests, checks (FieldError), stop strings, lazy faces",
        set(),
    ),
    "weights": ("loading and provisioning, model introspection, in-place copies and versions, transfer", {"ground"}),
    "lora": ("adapters and the per-token delta applied inside the step", {"ground"}),
    "engine.staging": ("host-to-device copies: a leaf of the engine", set()),
    "engine.kv": (
        "block pool, prefix hashing, group policies, KV manager, cache tensors, sizing, offload",
        {"ground", "weights"},
    ),
    "engine.sched": ("scheduler, async scheduler, the step's records", {"ground", "engine.kv"}),
    "engine.attention": (
        "paged attention backends (flash-attn, the CPU kernel, SDPA) and their registry",
        {"ground", "engine.kv"},
    ),
    "engine.sample": ("logits processors, sampling, logprobs, grammar bitmasks", {"ground", "engine.staging"}),
    "engine.worker": (
        "step inputs, the one forward (eager, compiled, graphed), oneDNN, tensor parallelism, the runner",
        {
            "ground",
            "lora",
            "weights",
            "engine.attention",
            "engine.sample",
            "engine.staging",
            "engine.kv",
            "module:rollout.engine.sched.output",
        },
    ),
    "engine": (
        "Engine, its construction, spec, stats and batch queue",
        {
            "ground",
            "weights",
            "lora",
            "engine.staging",
            "engine.kv",
            "engine.sched",
            "engine.attention",
            "engine.sample",
            "engine.worker",
        },
    ),
    "manager": (
        "the persistent manager: intake, loop, pausing, lifecycle, outputs, generate_batch/attach",
        {"ground", "engine:face", "weights", "lora"},
    ),
    "scoring": ("offline scoring and rollout-score", {"ground", "engine:face", "weights", "lora"}),
    "fleet": (
        "RolloutPool by plane, RolloutClient, rollout-fleet, Ray placement: an HTTP client",
        {"ground", "weights", "lora"},
    ),
    "agents": (
        "turns and turn backends, episodes, environments, tool parsing, chat deltas",
        {"ground", "manager:face"},
    ),
    "face": (
        "rollout/__init__.py: the public names",
        {
            "ground",
            "weights:face",
            "lora:face",
            "engine:face",
            "manager:face",
            "scoring:face",
            "fleet:face",
            "agents:face",
        },
    ),
    "serve": (
        "rollout-serve: protocol, jobs, service, responses, errors, routes",
        {"ground", "face", "manager:face", "weights", "lora", "agents:face"},
    ),
}
# Outside the package: the trainers use the face (and the fleet's and agents' faces); the benchmarks anything.
OUTSIDE: dict[str, set[str]] = {"trainers": {"face", "fleet:face", "agents:face"}}


def module_file(dotted: str) -> Path | None:
    """The file of a dotted module name below the repository root (a package's ``__init__.py``), or None."""
    path = ROOT.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def resolve(dotted: str) -> str:
    """The module a dotted name reads: its longest prefix that is a module (``rollout.engine.Engine`` ->
    ``rollout.engine``)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if module_file(".".join(parts[:n])) is not None:
            return ".".join(parts[:n])
    return parts[0]


def room_of(module: str) -> str | None:
    """The room of a rollout module (None outside rollout/)."""
    parts = module.split(".")
    if parts[0] != "rollout":
        return None
    if len(parts) == 1:
        return "face"
    if parts[1] in GROUND:
        return "ground"
    if parts[1] == "engine" and len(parts) > 2:
        sub = f"engine.{parts[2]}"
        if sub in ROOMS:
            return sub
    return parts[1]


def imports_of(path: Path, package: tuple[str, ...] | None = None) -> set[str]:
    """The modules a file imports, anywhere in it, resolved (``from .x import y`` against the file's package, by
    default its folder below the repository root; a name that is a module, ``from rollout.engine import kv``, as that
    module)."""
    if package is None:
        package = path.relative_to(ROOT).parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                found.add(resolve(f"{target}.{alias.name}"))
        elif isinstance(node, ast.Import):
            found.update(resolve(alias.name) for alias in node.names)
    return found


def allowed(room: str, target: str, rules: set[str]) -> bool:
    """Whether a module of ``room`` may import module ``target``."""
    target_room = room_of(target)
    if target_room is None or target_room == room:
        return True
    if target_room in rules or f"module:{target}" in rules:
        return True
    face = "rollout" if target_room == "face" else "rollout." + target_room
    return f"{target_room}:face" in rules and target == face


def package_modules() -> dict[str, Path]:
    """Every module of rollout/, by dotted name."""
    out = {}
    for path in sorted((ROOT / "rollout").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


MODULES = package_modules()


def test_every_module_is_in_a_room_of_the_table() -> None:
    rooms = {room_of(m) for m in MODULES}
    assert rooms <= set(ROOMS), sorted(rooms - set(ROOMS))
    assert set(ROOMS) <= rooms, sorted(set(ROOMS) - rooms)  # a room with no module left is a stale row


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_only_the_rooms_its_room_may_import(module: str) -> None:
    room = room_of(module)
    assert room is not None
    bad = sorted(t for t in imports_of(MODULES[module]) if not allowed(room, t, ROOMS[room][1]))
    shown = [f"{t} (room {room_of(t)})" for t in bad]
    assert not bad, f"{MODULES[module].relative_to(ROOT)} (room {room}) imports {shown}, which its room may not"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_the_modules_of_a_room_import_each_other_without_a_cycle(room: str) -> None:
    members = {m for m in MODULES if room_of(m) == room}
    graph = {m: {t for t in imports_of(MODULES[m]) if t in members and t != m} for m in members}
    done: set[str] = set()
    while len(done) < len(graph):
        ready = [m for m in graph if m not in done and graph[m] <= done]
        assert ready, f"room {room}: a cycle among {sorted(set(graph) - done)}"
        done.update(ready)


@pytest.mark.parametrize("folder", sorted(OUTSIDE))
def test_outside_packages_use_the_faces_only(folder: str) -> None:
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(t for t in imports_of(path) if not allowed(folder, t, OUTSIDE[folder]))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: {folder}/ uses rollout's faces only"


def test_rooms_import_down_the_table() -> None:
    """No two rooms may import each other (the table is ordered: a room's rules name only rooms above it)."""
    order = list(ROOMS)
    for i, (room, (_, rules)) in enumerate(ROOMS.items()):
        for rule in rules:
            target = rule.split(":")[0] if not rule.startswith("module:") else room_of(rule[len("module:") :])
            assert order.index(target) < i, f"room {room} may import {target}, which is not above it"


def test_the_checker_finds_a_forbidden_import(tmp_path: Path) -> None:
    """A manager module that reads the KV manager past the engine's face fails; the face itself passes."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from .outputs import OutputRouter\n"
        "def f():\n"
        "    from rollout.engine.kv.manager import KVCacheManager\n"
        "    from rollout.engine import Engine\n"
    )
    found = imports_of(source, ("rollout", "manager"))
    assert found == {"rollout.manager.outputs", "rollout.engine.kv.manager", "rollout.engine"}
    bad = sorted(t for t in found if not allowed("manager", t, ROOMS["manager"][1]))
    assert bad == ["rollout.engine.kv.manager"]
