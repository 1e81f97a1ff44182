"""Run GRPO variants of one config and write their held-out accuracy as a markdown table.

    python scripts/grpo_ablation.py --runs-dir /tmp/ablation --out docs/grpo_ablation.md
    python scripts/grpo_ablation.py --runs-dir /tmp/ablation --out docs/grpo_ablation.md --only lr_5e-6 --reuse
    python scripts/grpo_ablation.py --sweep lora --runs-dir /tmp/lora_sweep --out docs/lora_sweep.md

``--sweep`` picks the set of variants: ``recipe`` (how the default recipe was chosen, issue 8) or ``lora`` (the LoRA
recipe against full fine-tuning, issue 43: learning rate, alpha, rank and targets of the adapter).

Each variant is the default config (``configs/grpo_default.yaml``) plus the overrides listed in
``VARIANTS``; it runs in its own process (``python -m trainers.cli``, one CPU process), one after
another, into ``RUNS_DIR/<name>``. With ``--reuse`` a variant whose run folder already holds a complete
metrics.jsonl is not run again, so the table can be rebuilt from earlier runs. The table reports the
held-out evaluation the trainer itself logs (``eval_accuracy`` at step 0 and after the last step,
``trainers.evaluate.is_correct``) next to the training reward, so a reward that rises while accuracy
falls is visible.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainers.cli import DEFAULT_CONFIG
from trainers.report import write_or_print

# The recipe that collapsed (issue 8): format reward at weight 0.5, lr 2e-5, asynchronous with staleness 1.
OLD = {
    "reward_funcs": ["correctness", "format"],
    "reward_weights": [1.0, 0.5],
    "learning_rate": 2e-5,
    "async_rollouts": True,
    "max_staleness": 1,
    "temperature": 0.7,
    "num_generations": 4,
    "batch_size": 16,
    "max_new_tokens": 64,
    "max_steps": 30,
}
# name -> (overrides of the default config, what the variant tests)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "old": (OLD, "the earlier default (it collapsed in the issue's run)"),
    "old_sync": ({**OLD, "max_staleness": 0}, "synchronous rollouts"),
    "old_no_format": ({**OLD, "reward_weights": [1.0, 0.0]}, "format reward at weight 0"),
    "old_grpo_loss": ({**OLD, "loss_type": "grpo"}, "per-sequence loss normalisation"),
    "old_lr_5e-6": ({**OLD, "learning_rate": 5e-6}, "a 4x lower learning rate"),
    "recipe": (
        {
            **OLD,
            "reward_funcs": ["correctness", "format_if_correct"],
            "reward_weights": [1.0, 0.5],
            "learning_rate": 1e-5,
        },
        "the new default: format only on a correct answer, lr 1e-5",
    ),
    "format_if_correct": (
        {**OLD, "reward_funcs": ["correctness", "format_if_correct"], "reward_weights": [1.0, 0.5]},
        "format rewarded only on a correct answer",
    ),
    "correct_only_lr_1e-5": (
        {**OLD, "reward_funcs": ["correctness", "format"], "reward_weights": [1.0, 0.0], "learning_rate": 1e-5},
        "format at weight 0 and lr 1e-5",
    ),
}


# The LoRA sweep (issue 43): the default recipe (configs/grpo_default.yaml) trained as a peft adapter. "LoRA Without
# Regret" (Thinking Machines, 2025) finds LoRA matching full fine-tuning in RL down to rank 1 at about 10x full
# fine-tuning's learning rate, more for short runs; the shipped r=8 run at lr 1e-4 (10x) reached 0.620 against 0.830.
LORA = {"lora_r": 8, "lora_alpha": 16.0}
LORA_VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "full": ({}, "full fine-tuning: the default recipe (lr 1e-5), the reference"),
    "lora_lr_1e-4": ({**LORA, "learning_rate": 1e-4}, "r=8, alpha 16, lr 1e-4 (10x full): the earlier LoRA recipe"),
    "lora_lr_1.5e-4": ({**LORA, "learning_rate": 1.5e-4}, "r=8, alpha 16, lr 1.5e-4 (15x full)"),
    "lora_lr_2e-4": ({**LORA, "learning_rate": 2e-4}, "r=8, alpha 16, lr 2e-4 (20x full; 10x at alpha 32, as TM)"),
    "lora_lr_2e-4_40_steps": (
        {**LORA, "learning_rate": 2e-4, "max_steps": 40},
        "r=8, alpha 16, lr 2e-4, 40 steps (a LoRA step is cheaper: the full run's wall time)",
    ),
    "lora_lr_3e-4_linear": (
        {**LORA, "learning_rate": 3e-4, "lr_scheduler_type": "linear"},
        "r=8, alpha 16, lr 3e-4 decayed linearly to 0 (fast while B is small, gentle later)",
    ),
    "lora_lr_3e-4": ({**LORA, "learning_rate": 3e-4}, "r=8, alpha 16, lr 3e-4 (30x full)"),
    "lora_lr_1e-3": ({**LORA, "learning_rate": 1e-3}, "r=8, alpha 16, lr 1e-3 (100x full)"),
    "lora_lr_3e-3": ({**LORA, "learning_rate": 3e-3}, "r=8, alpha 16, lr 3e-3 (300x full)"),
    "lora_alpha_32_lr_1e-4": (
        {**LORA, "lora_alpha": 32.0, "learning_rate": 1e-4},
        "r=8, alpha 32, lr 1e-4: twice the scale at half the lr (does alpha stand in for lr?)",
    ),
    "lora_attn_lr_2e-4": (
        {**LORA, "learning_rate": 2e-4, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "r=8, alpha 16, lr 2e-4, attention projections only (no MLP)",
    ),
    "lora_r32_lr_2e-4": (
        {**LORA, "lora_r": 32, "lora_alpha": 64.0, "learning_rate": 2e-4},
        "r=32, alpha 64 (the same alpha / r), lr 2e-4: more capacity at the same scale",
    ),
    "lora_r1_lr_2e-4": (
        {**LORA, "lora_r": 1, "learning_rate": 2e-4},
        "r=1, alpha 16, lr 2e-4 (TM: with alpha/r scaling the best lr hardly depends on the rank)",
    ),
    "lora_plus_4_lr_1e-4": (
        {**LORA, "learning_rate": 1e-4, "lora_plus_ratio": 4.0},
        "LoRA+ (Hayou et al. 2024): A at lr 1e-4, B at 4e-4 (B=0 at the start: its lr sets the early pace)",
    ),
    "lora_plus_16_lr_5e-5": (
        {**LORA, "learning_rate": 5e-5, "lora_plus_ratio": 16.0},
        "LoRA+ at the paper's ratio 16: A at lr 5e-5, B at 8e-4",
    ),
    "lora_plus_8_lr_7e-5": (
        {**LORA, "learning_rate": 7e-5, "lora_plus_ratio": 8.0},
        "LoRA+ at ratio 8: A at lr 7e-5, B at 5.6e-4 (between ratio 4, short and behind, and 16, ahead but long)",
    ),
}
SWEEPS = {"recipe": VARIANTS, "lora": LORA_VARIANTS}


def _command(overrides: dict[str, Any], out: Path, config: Path, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "trainers.cli", "--config", str(config), "--output_dir", str(out)]
    cmd += ["--overwrite_output_dir", "true", "--save_model", "false", "--cpu_threads", str(threads)]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]  # JSON is YAML
    return cmd


def run_all(
    jobs: list[tuple[str, dict[str, Any]]],
    runs_dir: Path,
    config: Path,
    reuse: bool,
    parallel: int,
    threads: int | None = None,
) -> None:
    """Run each (folder name, overrides) job not already complete, ``parallel`` at a time.

    Each job gets ``threads`` torch threads, by default cores / parallel; on two cores two single-threaded
    runs finish sooner than the same two runs one after the other with two threads each.
    """
    threads = threads or max(1, len(os.sched_getaffinity(0)) // parallel)
    todo = [(n, o) for n, o in jobs if not (reuse and _complete(runs_dir / n / "metrics.jsonl", o))]
    running: list[tuple[str, subprocess.Popen, float]] = []
    while todo or running:
        while todo and len(running) < parallel:
            name, overrides = todo.pop(0)
            out = runs_dir / name
            out.mkdir(parents=True, exist_ok=True)
            print(f"== {name}: {' '.join(_command(overrides, out, config, threads)[3:])}", flush=True)
            log = (out.parent / f"{name}.log").open("w")
            proc = subprocess.Popen(_command(overrides, out, config, threads), stdout=log, stderr=subprocess.STDOUT)
            running.append((name, proc, time.perf_counter()))
        time.sleep(2)
        for item in list(running):
            name, proc, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {runs_dir / (name + '.log')}")
            (runs_dir / name / "wall_time_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
            print(f"== {name} done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


def _complete(metrics: Path, overrides: dict[str, Any]) -> bool:
    if not metrics.exists() or not (metrics.parent / "grpo_config.json").exists():
        return False
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config = json.loads((metrics.parent / "grpo_config.json").read_text())
    return bool(rows) and "eval_accuracy" in rows[-1] and all(config.get(k) == v for k, v in overrides.items())


def summarize(run_dir: Path) -> dict[str, Any]:
    """The figures of one run folder: eval before/after, last-5-step means of the training metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["step"] > 0]
    last = steps[-5:]

    def mean(key: str, sel: list[dict[str, Any]]) -> float:
        values = [r[key] for r in sel if key in r and r[key] is not None and not math.isnan(r[key])]
        return sum(values) / len(values) if values else math.nan

    wall = run_dir / "wall_time_s.txt"
    meta = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {
        "commit": meta.get("commit") or "unrecorded",
        "eval_before": rows[0].get("eval_accuracy", math.nan) if rows[0]["step"] == 0 else math.nan,
        "eval_after": steps[-1].get("eval_accuracy", math.nan),
        "eval_len_after": steps[-1].get("eval_completion_len", math.nan),
        "reward_first5": mean("reward_mean", steps[:5]),
        "reward_last5": mean("reward_mean", last),
        "correct_last5": mean("rewards/correctness", last),
        # Whichever format reward the variant used (format or format_if_correct).
        "format_last5": _nanfirst(mean("rewards/format", last), mean("rewards/format_if_correct", last)),
        "len_last5": mean("completion_len_mean", last),
        "is_ratio_max": max(r.get("is_ratio_max", 0.0) for r in steps),
        "steps": len(steps),
        "minutes": float(wall.read_text()) / 60 if wall.exists() else math.nan,
    }


def _nanfirst(*values: float) -> float:
    return next((v for v in values if not math.isnan(v)), math.nan)


def _after(run: dict[str, Any], name_seed: bool) -> str:
    return _fmt(run["eval_after"]) + (f" (s{run['seed']})" if name_seed else "")


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def table(
    results: dict[str, list[dict[str, Any]]], seeds: list[int], variants: dict[str, tuple[dict[str, Any], str]]
) -> str:
    """One row per variant: held-out accuracy per seed and its mean change, training metrics averaged over seeds.

    A variant with fewer runs than ``seeds`` (``--table-only``) names the seeds it has: ``0.885 (s0)``.
    """
    head = (
        f"| variant | what it changes | eval acc before | eval acc after (seeds {', '.join(map(str, seeds))}) | "
        "mean change | eval len after | reward steps 1-5 | reward last 5 | correctness last 5 | format last 5 | "
        "train len last 5 | is_ratio_max | minutes |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for name, runs in results.items():
        m = {k: _mean([r[k] for r in runs]) for k in runs[0] if k not in ("commit", "seed")}
        change = m["eval_after"] - m["eval_before"]
        lines.append(
            f"| {name} | {variants[name][1]} | {_fmt(m['eval_before'])} | "
            f"{' / '.join(_after(r, len(runs) < len(seeds)) for r in runs)} | "
            f"{'+' if change >= 0 else ''}{_fmt(change)} | "
            f"{_fmt(m['eval_len_after'], 1)} | {_fmt(m['reward_first5'])} | {_fmt(m['reward_last5'])} | "
            f"{_fmt(m['correct_last5'])} | {_fmt(m['format_last5'])} | {_fmt(m['len_last5'], 1)} | "
            f"{_fmt(max(r['is_ratio_max'] for r in runs), 2)} | {_fmt(m['minutes'], 1)} |"
        )
    return head + "\n".join(lines) + "\n"


def overrides_table(names: list[str], variants: dict[str, tuple[dict[str, Any], str]]) -> str:
    lines = ["| variant | overrides of the default config |", "| --- | --- |"]
    for name in names:
        lines.append(f"| {name} | {', '.join(f'`{k}={json.dumps(v)}`' for k, v in variants[name][0].items())} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, required=True, help="one run folder per variant and seed goes here")
    parser.add_argument("--out", type=Path, help="markdown file for the tables (default: print them)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base config (default: %(default)s)")
    parser.add_argument(
        "--sweep", choices=list(SWEEPS), default="recipe", help="the set of variants (default: %(default)s)"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[n for v in SWEEPS.values() for n in v], help="these variants only"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds (default: 0)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (each gets cores / parallel threads)")
    parser.add_argument("--threads", type=int, help="torch threads per run (default: cores / --parallel)")
    parser.add_argument("--reuse", action="store_true", help="keep the runs already complete in --runs-dir")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: the table from the complete runs in --runs-dir (a variant lists the seeds it has)",
    )
    parser.add_argument("--note", default="", help="a paragraph written under the header (markdown)")
    args = parser.parse_args(argv)
    variants = SWEEPS[args.sweep]
    names = args.only or list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        parser.error(f"--only: {', '.join(unknown)} not in --sweep {args.sweep} ({', '.join(variants)})")
    jobs = [(f"{n}_s{seed}", {**variants[n][0], "seed": seed}) for n in names for seed in args.seeds]
    if not args.table_only:
        run_all(jobs, args.runs_dir, args.config, args.reuse, args.parallel, args.threads)
    results = {
        n: [
            {**summarize(args.runs_dir / f"{n}_s{seed}"), "seed": seed}
            for seed in args.seeds
            if _complete(args.runs_dir / f"{n}_s{seed}" / "metrics.jsonl", {**variants[n][0], "seed": seed})
        ]
        for n in names
    }
    missing = [n for n, runs in results.items() if not runs]
    if missing:
        print(f"error: no complete run of {', '.join(missing)} in {args.runs_dir}", file=sys.stderr)
        return 1
    commits = sorted({r["commit"] for runs in results.values() for r in runs})
    title = "GRPO ablation: held-out accuracy of recipe variants"
    if args.sweep == "lora":
        title = "GRPO with a LoRA adapter: held-out accuracy against full fine-tuning"
    text = (
        f"# {title}\n\n"
        f"Generated by `python scripts/grpo_ablation.py --sweep {args.sweep} "
        f"--seeds {' '.join(map(str, args.seeds))}` at commit "
        f"{_commit()} on {dt.date.today().isoformat()} from the run folders in `{args.runs_dir}` (runs made by "
        f"commits {', '.join(commits)}; {len(os.sched_getaffinity(0))} CPUs; minutes are wall times on a machine "
        "shared with other jobs, so only the accuracy columns compare across rows).\n\n"
        + (args.note.strip() + "\n\n" if args.note.strip() else "")
        + table(results, args.seeds, variants)
        + "\n"
        + overrides_table(names, variants)
    )
    write_or_print(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
