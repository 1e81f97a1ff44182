"""rollout/ imports only point down: each module imports only modules listed before it in LAYERS.

The check parses every module with ``ast`` and looks at every import, at module level, inside
functions and under ``TYPE_CHECKING`` alike, so no cycle can hide in a lazy import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout"

# STYLE.md's arrows, low to high, with the modules they do not name placed where their imports put
# them: checks (the shared validation helpers), stop_strings (token spellings) and models
# (introspection) are leaves, intake sits between outputs and the manager, weights is a leaf of the
# manager, scoring and score_cli are entry points beside api.
LAYERS = [
    "checks",
    "config",
    "sampling_params",
    "stop_strings",
    "requests",
    "models",
    "weights",
    "block_manager",
    "kv_cache",
    "kv_cache_manager",
    "scheduler",
    "attention",
    "sampling",
    "model_runner",
    "engine",
    "outputs",
    "intake",
    "manager",
    "api",
    "scoring",
    "score_cli",
    "__init__",
]


def rollout_imports(path: Path) -> set[str]:
    """The rollout modules a file imports, anywhere in it (``from .x import``, ``import rollout.x``...)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:  # from . import x
                    found.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.split(".")[0] == "rollout":
                parts = node.module.split(".")
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(alias.name for alias in node.names)
            elif node.level > 1:
                raise AssertionError(f"{path.name}: import from outside the package: {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "rollout" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_module_is_placed_in_the_layers() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(LAYERS)


@pytest.mark.parametrize("module", LAYERS)
def test_module_imports_only_lower_layers(module: str) -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    imported = rollout_imports(PACKAGE / f"{module}.py")
    upward = sorted(m for m in imported if rank.get(m, len(LAYERS)) >= rank[module])
    assert not upward, f"rollout/{module}.py imports {upward}, which are not below it in LAYERS"


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
