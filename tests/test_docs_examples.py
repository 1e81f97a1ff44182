"""Every ```python block of README.md and docs/*.md runs as written (issue 43: the first example of docs/episodes.md
failed with ``NameError: name 'model' is not defined``).

Each block runs alone in a fresh interpreter, in a temporary folder with this checkout on ``PYTHONPATH``, and passes
when it exits 0 within its timeout. Most load the real default model (SmolLM2-135M-Instruct, from its converted copy
in the rollout cache), so they are ``slow``. A block that cannot run here (a running server, a GPU, several
processes) carries the marker ``<!-- not run: REASON -->`` on the line before its fence: it is skipped with that
reason, and ``NOT_RUN`` below counts the markers, so a new one is a visible change of this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
NOT_RUN_MARKER = re.compile(r"^<!-- not run: (.+?) -->$")
# The blocks marked not run, by file: each needs something a test machine has not (see each marker's reason).
NOT_RUN = {"docs/scaling.md": 2, "docs/serving.md": 1, "docs/episodes.md": 1}
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One ```python block: its file (relative to the checkout), first line, code and the reason it is not run."""

    path: str
    line: int
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, each with the reason of a ``<!-- not run: ... -->`` marker on the
    line before its fence (blank lines between them are allowed)."""
    text = path.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = [line for line in text[: match.start()].splitlines() if line.strip()]
        marker = NOT_RUN_MARKER.match(before[-1].strip()) if before else None
        line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
        name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
        blocks.append(Block(name, line, match.group(1), marker.group(1) if marker else None))
    return blocks


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


def test_the_blocks_not_run_are_the_marked_ones_and_each_says_why() -> None:
    counted: dict[str, int] = {}
    for block in BLOCKS:
        if block.not_run is not None:
            counted[block.path] = counted.get(block.path, 0) + 1
            assert len(block.not_run) > 10, f"{block.name}: say what the block needs"
    assert counted == NOT_RUN
    assert sum(b.not_run is None for b in BLOCKS) >= 8  # the extraction finds the runnable blocks too


def test_a_marker_skips_only_the_block_after_it(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- not run: needs a rollout-serve on :8000 -->\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = 2\n```\n"
    )
    blocks = [(b.code, b.not_run, b.line) for b in python_blocks(page)]
    assert blocks == [("x = 1\n", "needs a rollout-serve on :8000", 4), ("y = 2\n", None, 10)]


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_documented_example_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"{block.name} is marked not run: {block.not_run}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} ran past {TIMEOUT_S} s")
    assert result.returncode == 0, f"{block.name} failed:\n{result.stderr[-4000:]}"
