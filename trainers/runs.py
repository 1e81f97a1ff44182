"""The run folder every trainer writes, and the lines that close a run.

A run folder holds ``<algo>_config.json`` (the config as run), ``metrics.jsonl`` (one row per step; row
0 is the evaluation before training), ``timing.jsonl`` (the wall-clock figures of the same steps,
which vary from run to run), ``summary.json``, ``eval_completions.jsonl``, ``completions.jsonl`` (a
few samples per step) and the saved model. The GRPO and PPO trainers share this module, so
``rollout-plot``, ``scripts/run_report.py`` and ``rollout-eval-grpo --model`` read either run.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list

import rollout

from .config import ConfigError

# Wall-clock metrics: they vary from run to run, so they go to timing.jsonl, not metrics.jsonl.
TIMING_KEYS = frozenset(
    {"step_time_s", "step_cpu_s", "wait_rollout_s", "prepare_s", "train_s", "rollout_tokens_per_s", "eval_time_s"}
)
RUN_FILES = ("metrics.jsonl", "model.safetensors")  # an output folder holding one of these holds a run


def resolve_output_dir(config: Any, num_processes: int, prefix: str = "grpo") -> Path:
    """The run's output folder, the same on every process.

    Args:
        config: any trainer config with ``output_dir`` and ``overwrite_output_dir``.
        num_processes: processes of the run (the main one picks a generated name and broadcasts it).
        prefix: the generated folder's name starts with it ("grpo", "ppo").

    Returns:
        ``config.output_dir`` when set, else ``$ROLLOUT_HOME/runs/<prefix>-<UTC date-time>``.

    Raises:
        ConfigError: the path is a file, or the folder holds an earlier run and
            ``overwrite_output_dir`` is False.
    """
    if config.output_dir is not None:
        path = Path(config.output_dir).expanduser()
    else:
        name = [time.strftime(f"{prefix}-%Y%m%d-%H%M%S", time.gmtime())]
        if num_processes > 1:
            broadcast_object_list(name, from_process=0)
        path = rollout.rollout_home() / "runs" / name[0]
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir {str(path)!r} is a file, not a folder; choose another --output_dir")
    if not config.overwrite_output_dir:
        found = [f for f in RUN_FILES if (path / f).exists()]
        if found:
            raise ConfigError(
                f"output_dir {str(path)!r} already holds a run ({', '.join(found)}); pass --overwrite_output_dir "
                "to replace it, or choose another --output_dir"
            )
    return path


def sample_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers (sampling seed of one request)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def source_commit() -> str | None:
    """The git commit of the checkout this package runs from (an editable install), or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class RunFolder:
    """Writes one run's files; only the main process writes, the others hold a no-op copy.

    Args:
        path: the output folder (created on ``start``).
        algo: "grpo" or "ppo": names the saved config, ``<algo>_config.json``.
        main: this process writes.
    """

    def __init__(self, path: Path, algo: str, main: bool) -> None:
        self.path = path
        self.algo = algo
        self.main = main
        # Read now: a checkout that moves on while the run trains must not be recorded as its code.
        self.commit = source_commit() if main else None

    def start(self, config: dict[str, Any]) -> None:
        """Create the folder, empty the metric files, drop an earlier run's samples, save the config."""
        if not self.main:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "timing.jsonl"):
            (self.path / name).write_text("")
        for name in ("completions.jsonl", "eval_completions.jsonl"):
            (self.path / name).unlink(missing_ok=True)
        (self.path / f"{self.algo}_config.json").write_text(json.dumps(config, indent=2))

    def record(self, row: dict[str, float]) -> None:
        """Append a step's row: learning figures to metrics.jsonl, ``TIMING_KEYS`` (and ``step``) to timing.jsonl."""
        if not self.main:
            return
        learning = {k: v for k, v in row.items() if k not in TIMING_KEYS}
        timing = {k: v for k, v in row.items() if k in TIMING_KEYS or k == "step"}
        with (self.path / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(learning) + "\n")
        with (self.path / "timing.jsonl").open("a") as f:
            f.write(json.dumps(timing) + "\n")

    def append(self, name: str, records: list[dict[str, Any]]) -> None:
        """Append JSON lines to ``name`` (completions.jsonl, eval_completions.jsonl)."""
        if not self.main or not records:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        with (self.path / name).open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def write_summary(
        self,
        rows: list[dict[str, float]],
        steps: int,
        wall_s: float,
        train_s: float,
        world_size: int,
        device: str,
        mixed_precision: str,
        **extra: Any,
    ) -> None:
        """summary.json: steps, wall and training time (s), held-out accuracy before and after, where it ran,
        the commit, and ``extra`` fields."""
        if not self.main:
            return
        evals = [r for r in rows if "eval_accuracy" in r]
        (self.path / "summary.json").write_text(
            json.dumps(
                {
                    "algo": self.algo,
                    "steps": steps,
                    "wall_time_s": wall_s,
                    "train_time_s": train_s,
                    "eval_accuracy_before": evals[0]["eval_accuracy"] if evals else None,
                    "eval_accuracy_after": evals[-1]["eval_accuracy"] if evals else None,
                    "world_size": world_size,
                    "device": device,
                    "torch_threads": torch.get_num_threads(),
                    # CPU seconds of this process, all threads: on a machine shared with other jobs the
                    # wall time says little, this says what the run itself cost.
                    "process_cpu_time_s": time.process_time(),
                    "mixed_precision": mixed_precision,  # what ran, the launcher's setting included
                    "commit": self.commit,
                    **extra,
                },
                indent=2,
            )
        )


def summary(rows: list[dict[str, float]], output_dir: Path, seconds: float, saved: bool, extra_files: str = "") -> str:
    """The closing lines of a run: steps, wall time (seconds, model load included), reward and held-out
    accuracy before and after, outputs."""
    steps = [r for r in rows if r["step"] > 0]
    evals = [r for r in rows if "eval_accuracy" in r]
    lines = [f"done: {len(steps)} steps in {seconds / 60:.1f} min"]
    if steps:
        # Two windows of up to 5 steps that never overlap: a 3-step run compares step 1 with step 3.
        width = max(1, min(5, len(steps) // 2))
        first, last = steps[:width], steps[-width:]
        r_first = sum(r["reward_mean"] for r in first) / len(first)
        r_last = sum(r["reward_mean"] for r in last) / len(last)
        lines.append(
            f"  reward_mean {r_first:.3f} (steps {first[0]['step']}-{first[-1]['step']}) -> "
            f"{r_last:.3f} (steps {last[0]['step']}-{last[-1]['step']})"
        )
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        lines.append(
            f"  held-out eval_accuracy {a['eval_accuracy']:.3f} (step {a['step']}) -> {b['eval_accuracy']:.3f} "
            f"(step {b['step']}); completions {a['eval_completion_len']:.1f} -> {b['eval_completion_len']:.1f} tokens"
        )
    files = "metrics.jsonl, timing.jsonl, summary.json" + (", eval_completions.jsonl" if evals else "")
    files += ", the model (save_pretrained)" if saved else ""
    files += extra_files
    lines.append(f"  outputs in {output_dir}: {files}")
    lines.append(f"  plot: rollout-plot {output_dir / 'metrics.jsonl'}")
    return "\n".join(lines)


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """Sample std of the non-NaN values of ``x`` (0 for fewer than two)."""
    x = x[~torch.isnan(x)]
    return x.std() if x.numel() > 1 else torch.tensor(0.0)


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """Tracker-friendly config: scalars as they are, everything else as a JSON string."""
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in config.items()}
