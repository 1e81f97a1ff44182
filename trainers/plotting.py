"""Plot a GRPO or PPO run's reward and rollout throughput per step from its metrics.jsonl.

    rollout-plot OUTPUT_DIR/metrics.jsonl [--out reward_curve.png] [--title TEXT]
    python scripts/plot_metrics.py OUTPUT_DIR/metrics.jsonl ...   # the same

Writes one PNG (matplotlib, Agg backend): the mean reward per step with its per-reward parts, moving
averages and the held-out eval_accuracy on top; completion lengths (training and evaluation) in the
middle; the rollout throughput (generated tokens/s, from timing.jsonl beside the metrics) below; for a PPO
run (rows with ``explained_variance``) a fourth panel of its diagnostics (explained variance, clip
fraction, approximate KL, value loss).
matplotlib is not a dependency of the package (``pip install matplotlib``, or the ``test`` extra); it is
imported when a figure is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (blank lines skipped), merged by step with the wall-clock
    figures of the timing.jsonl beside it when there is one.

    Raises:
        ValueError: the file holds no rows, or rows without a ``step`` (not a metrics file).
    """
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    if not all(isinstance(r, dict) and "step" in r for r in rows):
        raise ValueError(f"{path}: not a trainer's metrics.jsonl (rows without a 'step')")
    timing = path.with_name("timing.jsonl")
    if timing.exists():
        by_step = {r["step"]: r for r in (json.loads(x) for x in timing.read_text().splitlines() if x.strip())}
        rows = [{**by_step.get(r["step"], {}), **r} for r in rows]
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (NaNs skipped)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def plot(rows: list[dict], out: str | Path, title: str = "GRPO", window: int = 5) -> Path:
    """Write the figure to ``out`` and return its path.

    Top: the mean training reward per step, its parts (moving averages) and the held-out
    ``eval_accuracy`` (markers at the evaluated steps). Middle: training completion length and
    ``eval_completion_len``. Bottom: rollout tokens/s and step time, when the rows carry them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r["step"] for r in train]
    reward = [float(r["reward_mean"]) for r in train]
    ppo = bool(train) and "explained_variance" in train[0]
    if ppo:
        fig, (ax1, ax_len, ax2, ax_ppo) = plt.subplots(
            4, 1, figsize=(8, 11), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1, 1.2]}
        )
    else:
        fig, (ax1, ax_len, ax2) = plt.subplots(
            3, 1, figsize=(8, 8.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]}
        )
    ax1.plot(steps, reward, "o-", color="C0", alpha=0.45, label="reward_mean")
    ax1.plot(steps, moving_average(reward, window), "-", color="C0", lw=2.5, label=f"reward_mean ({window}-step avg)")
    parts = sorted(k for k in (train[0] if train else {}) if k.startswith("rewards/"))
    for i, key in enumerate(parts):
        values = [float(r.get(key, math.nan)) for r in train]
        ax1.plot(
            steps,
            moving_average(values, window),
            "--",
            color=f"C{i + 1}",
            lw=1.5,
            label=f"{key[8:]} ({window}-step avg)",
        )
    if evals:
        ax1.plot(
            [r["step"] for r in evals],
            [float(r["eval_accuracy"]) for r in evals],
            "D-",
            color="k",
            ms=8,
            lw=1.5,
            label="held-out eval_accuracy (greedy)",
        )
        for r in (evals[0], evals[-1]):
            ax1.annotate(
                f"{r['eval_accuracy']:.3f}",
                (r["step"], r["eval_accuracy"]),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=9,
            )
    ax1.set_ylabel("reward / accuracy")
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="best", fontsize=8)
    ax_len.plot(
        steps,
        [float(r.get("completion_len_mean", math.nan)) for r in train],
        ".-",
        color="C4",
        label="training completion_len_mean",
    )
    if evals:
        ax_len.plot(
            [r["step"] for r in evals],
            [float(r["eval_completion_len"]) for r in evals],
            "D-",
            color="k",
            label="eval_completion_len",
        )
    ax_len.set_ylabel("tokens")
    ax_len.grid(alpha=0.3)
    ax_len.legend(loc="best", fontsize=8)
    tput = [float(r.get("rollout_tokens_per_s", math.nan)) for r in train]
    ax2.plot(steps, tput, "s-", color="C3", label="rollout tokens/s")
    if train and "step_time_s" in train[0]:
        ax3 = ax2.twinx()
        ax3.plot(steps, [float(r["step_time_s"]) for r in train], ".:", color="C7", label="step time (s)")
        ax3.set_ylabel("step time (s)", color="C7")
    ax2.set_ylabel("generated tokens/s")
    ax2.set_xlabel("optimizer step" if not ppo else "")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left", fontsize=8)
    if ppo:
        for i, key in enumerate(("explained_variance", "clip_fraction", "approx_kl", "value_loss", "kl")):
            if key in train[0]:
                ax_ppo.plot(steps, [float(r.get(key, math.nan)) for r in train], ".-", color=f"C{i}", label=key)
        ax_ppo.axhline(0.0, color="k", lw=0.5)
        ax_ppo.set_ylabel("PPO diagnostics")
        ax_ppo.set_xlabel("PPO step (one rollout batch)")
        ax_ppo.grid(alpha=0.3)
        ax_ppo.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="a metrics.jsonl written by scripts/train_grpo.py")
    parser.add_argument("--out", help="PNG path (default: reward_curve.png next to the metrics)")
    parser.add_argument("--title", default="GRPO", help="figure title")
    parser.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    args = parser.parse_args(argv)
    out = args.out or str(Path(args.metrics).with_name("reward_curve.png"))
    try:
        rows = read_metrics(args.metrics)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        path = plot(rows, out, args.title, args.window)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        print("error: plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    print(path)
    return 0
