"""The console scripts of pyproject.toml are installed and answer ``--help``; the files under scripts/ are
thin wrappers that edit no ``sys.path``."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPTS = sorted(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def test_the_benchmark_and_plot_commands_are_declared():
    assert {"rollout-bench", "rollout-bench-scoring", "rollout-bench-manager", "rollout-plot"} <= set(CONSOLE_SCRIPTS)


@pytest.mark.parametrize("name", CONSOLE_SCRIPTS)
def test_console_script_answers_help(name: str, tmp_path: Path) -> None:
    path = shutil.which(name)
    assert path is not None, f"the console script {name} is not installed (pip install -e .)"
    proc = subprocess.run([path, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


def test_no_script_edits_sys_path():
    offenders = [p.name for p in sorted((REPO / "scripts").glob("*.py")) if "sys.path" in p.read_text()]
    assert not offenders, f"scripts that edit sys.path: {offenders}"
