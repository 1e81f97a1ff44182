"""Plot a GRPO run's reward and rollout throughput per step from its metrics.jsonl.

    python scripts/plot_metrics.py OUTPUT_DIR/metrics.jsonl [--out reward_curve.png] [--title TEXT]

Writes one PNG (matplotlib, Agg backend): the mean reward per step with its per-reward parts and a
moving average on top, the rollout throughput (generated tokens/s) below.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (blank lines skipped).

    Raises:
        ValueError: the file holds no rows.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no metrics rows")
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (NaNs skipped)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def plot(rows: list[dict], out: str | Path, title: str = "GRPO", window: int = 5) -> Path:
    """Write the figure to ``out`` and return its path."""
    steps = [r["step"] for r in rows]
    reward = [float(r["reward_mean"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax1.plot(steps, reward, "o-", color="C0", alpha=0.45, label="reward_mean")
    ax1.plot(steps, moving_average(reward, window), "-", color="C0", lw=2.5, label=f"reward_mean ({window}-step avg)")
    parts = sorted(k for k in rows[0] if k.startswith("rewards/"))
    for i, key in enumerate(parts):
        values = [float(r.get(key, math.nan)) for r in rows]
        ax1.plot(
            steps,
            moving_average(values, window),
            "--",
            color=f"C{i + 1}",
            lw=1.5,
            label=f"{key[8:]} ({window}-step avg)",
        )
    ax1.set_ylabel("reward")
    ax1.set_title(title)
    ax1.grid(alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)
    tput = [float(r.get("rollout_tokens_per_s", math.nan)) for r in rows]
    ax2.plot(steps, tput, "s-", color="C3", label="rollout tokens/s")
    if "step_time_s" in rows[0]:
        ax3 = ax2.twinx()
        ax3.plot(steps, [float(r["step_time_s"]) for r in rows], ".:", color="C7", label="step time (s)")
        ax3.set_ylabel("step time (s)", color="C7")
    ax2.set_ylabel("generated tokens/s")
    ax2.set_xlabel("optimizer step")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left", fontsize=8)
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
    print(plot(rows, out, args.title, args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
