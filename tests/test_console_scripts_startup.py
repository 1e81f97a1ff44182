"""Every console script of pyproject.toml answers a bad flag at once: argparse's usage and exit status 2 before torch
(and, but for the trainers, transformers) is imported (their import took about 5 s of every mistyped command).

Each script's entry point runs from this checkout (``python -c``, PYTHONPATH the repository) with argparse's exit
wrapped: when it answers an argument error while a blocked package is in ``sys.modules``, the script exits with status
3 and names the package instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# The trainers parse with transformers' HfArgumentParser (STYLE.md: the parser made for dataclass configs), which
# imports transformers but not torch.
NEEDS_TRANSFORMERS = {"rollout-train-grpo", "rollout-train-ppo", "rollout-eval-grpo"}

# Flags a script requires, given so that the bad flag is the error it answers.
REQUIRED = {
    "rollout-fleet": ["--model", "m"],
    "rollout-plot": ["metrics.jsonl"],
    "rollout-score": [
        "--dataset",
        "d.jsonl",
        "--prompt-column",
        "p",
        "--completion-column",
        "c",
        "--output",
        "o.jsonl",
    ],
}

# Run an entry point ("module:function") as its console script does, then check what it imported on its way out.
GUARD = """
import importlib, sys
blocked = sys.argv[1].split(",")
module, _, function = sys.argv[2].partition(":")
sys.argv = sys.argv[3:]
try:
    status = getattr(importlib.import_module(module), function)()
except SystemExit as e:
    status = e.code
loaded = [name for name in blocked if name in sys.modules]
if loaded:
    print(f"imported on the way to the answer: {', '.join(loaded)}", file=sys.stderr)
    status = 3
sys.exit(status)
"""


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_bad_flag_is_answered_with_the_usage_before_torch_is_imported(name: str, tmp_path: Path) -> None:
    blocked = "torch" if name in NEEDS_TRANSFORMERS else "torch,transformers"
    proc = subprocess.run(
        [sys.executable, "-c", GUARD, blocked, SCRIPTS[name], name, *REQUIRED.get(name, []), "--no-such-flag"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    if name in NEEDS_TRANSFORMERS:  # the trainers' parser names unknown keys, flags or config-file keys alike
        assert last == "error: bad config: unknown argument(s) --no-such-flag", proc.stderr[-3000:]
    else:
        assert proc.stderr.startswith("usage: ") and last.endswith("unrecognized arguments: --no-such-flag"), last
