"""Markdown reports of run folders: one run (GRPO or PPO), and a side-by-side of two runs at equal wall time.

    python scripts/run_report.py RUN --out docs/ppo_run.md --figure docs/ppo_reward_curve.png
    python scripts/grpo_report.py RUN --out docs/grpo_run.md --figure docs/grpo_reward_curve.png   # the same
    python scripts/compare_runs.py --ppo PPO_RUN --grpo GRPO_RUN --out docs/grpo_vs_ppo.md

Everything in a report is read from the run folder the trainer wrote (``<algo>_config.json``,
metrics.jsonl, timing.jsonl, summary.json, eval_completions.jsonl; see ``trainers.runs``); the
commit and date of the report are those of the checkout it is written from.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

from .plotting import moving_average, plot, read_metrics

TITLES = {"grpo": "GRPO", "ppo": "PPO"}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if key in r and r[key] is not None and not math.isnan(float(r[key]))]
    return sum(values) / len(values) if values else math.nan


def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def git(*args: str) -> str:
    """Output of a git command in the current checkout ("unknown" when git fails)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_algo(run: Path) -> str:
    """ "grpo" or "ppo": the algorithm whose config the run folder holds.

    Raises:
        FileNotFoundError: the folder holds neither grpo_config.json nor ppo_config.json.
    """
    for algo in ("ppo", "grpo"):
        if (run / f"{algo}_config.json").is_file():
            return algo
    raise FileNotFoundError(f"{run} holds no grpo_config.json or ppo_config.json: not a run folder")


def _setup_line(algo: str, c: dict[str, Any]) -> str:
    rewards = ", ".join(f"`{n}` (weight {w})" for n, w in zip(c["reward_funcs"], c["reward_weights"] or [1.0] * 9))
    common = (
        f"Setup: `{c['model']}`, dataset `{c['dataset']}` ({c['dataset_size']} problems, seed {c['dataset_seed']}); "
    )
    if algo == "grpo":
        body = (
            f"{c['batch_size'] // c['num_generations']} prompts x G = {c['num_generations']} samples per step, "
            f"temperature {c['temperature']}, at most {c['max_new_tokens']} new tokens; AdamW lr "
            f"{c['learning_rate']}, loss `{c['loss_type']}`; "
        )
    else:
        kl = (
            "no KL penalty"
            if not c["kl_coef"]
            else f"KL penalty {c['kl_estimator']} x {c['kl_coef']}"
            + (f" adaptive to {c['kl_target']}" if c["kl_target"] else "")
        )
        body = (
            f"{c['batch_size']} prompts x 1 sample per step, temperature {c['temperature']}, at most "
            f"{c['max_new_tokens']} new tokens; value model `{c['value_model']}` (lr {c['value_learning_rate']}, "
            f"vf_coef {c['vf_coef']}, value clip {c['cliprange_value']}); policy AdamW lr {c['learning_rate']}, "
            f"clip {c['epsilon']}; GAE gamma {c['gamma']}, lambda {c['lam']}, whitening "
            f"{str(c['whiten_advantages']).lower()}; {kl}; {c['ppo_epochs']} epochs x {c['num_mini_batches']} "
            f"mini-batches per batch; entropy_coef {c['entropy_coef']}; "
        )
    if c.get("lora_r"):
        body += (
            f"a LoRA adapter (peft) of rank {c['lora_r']}, lora_alpha {c['lora_alpha']}, on "
            f"{', '.join(c['lora_target_modules'])}, trained in place of the full weights and the only tensors synced "
            "to the engine; "
        )
    return (
        common
        + body
        + f"rewards {rewards}; async_rollouts {str(c['async_rollouts']).lower()}, max_staleness {c['max_staleness']}; "
        f"{c['max_steps']} steps, seed {c['seed']}. Held-out evaluation: {c['eval_size']} problems that training "
        f"never samples (seed {c['eval_seed']}), greedy, at most {c['eval_max_new_tokens']} new tokens, right when "
        "the last number of the completion is the answer."
    )


def report(
    run: Path,
    figure: Path | None,
    command: str,
    script: str = "scripts/run_report.py",
    note: str | None = None,
    out: Path | None = None,
) -> str:
    """The markdown text of the report of ``run`` (a GRPO or PPO run folder); ``note``, when given, is a
    paragraph placed under the setup (conditions of the run the files do not record); ``out`` is the path the
    report's own command line names (default ``docs/<algo>_run.md``). A LoRA run (``lora_r`` set) also gets the
    bytes each sync sent against a full sync of the weights."""
    algo = run_algo(run)
    title = TITLES[algo]
    config = json.loads((run / f"{algo}_config.json").read_text())
    rows = read_metrics(run / "metrics.jsonl")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    samples = _jsonl(run / "eval_completions.jsonl")
    lora = config.get("lora_r")
    recipe = f"the default recipe with a rank-{lora} LoRA adapter" if lora else "the default recipe"
    lines = [
        f"# {title} on the default task: {recipe} on a CPU",
        "",
        f"Generated by `python {script}` at commit `{git('rev-parse', '--short', 'HEAD')}` on "
        f"{dt.date.today().isoformat()} from a run of commit `{summary.get('commit') or 'unrecorded'}`; the numbers "
        "below are read from the run's files, never typed.",
        "",
        "```bash",
        command,
        f"python {script} RUN --out {out or f'docs/{algo}_run.md'} --figure {figure or 'FIGURE.png'}",
        "```",
        "",
        _setup_line(algo, config),
        "",
    ]
    if note:
        lines += [note, ""]
    if summary:
        lines += [
            f"Wall time of the whole job (model load, evaluations, training, saving): "
            f"**{summary['wall_time_s'] / 60:.1f} min** on `{summary.get('device')}` with "
            f"{summary.get('torch_threads')} torch threads and {summary.get('world_size')} process(es).",
            "",
        ]
    synced = [r for r in train if r.get("lora_sync_bytes")]
    if synced:
        adapter, full = _mean(synced, "lora_sync_bytes"), _mean(synced, "full_sync_bytes")
        lines += [
            f"Weight sync after each step: the adapter only, **{adapter:,.0f} bytes** against {full:,.0f} for a full "
            f"sync of the weights (**{100 * adapter / full:.2f}%**), over {len(synced)} syncs.",
            "",
        ]
    lines += [
        "## Held-out accuracy",
        "",
        "| step | eval_accuracy | eval_completion_len (tokens) |",
        "| ---: | ---: | ---: |",
    ]
    lines += [f"| {r['step']} | {_f(r['eval_accuracy'])} | {_f(r['eval_completion_len'], 1)} |" for r in evals]
    if len(evals) >= 2:
        change = evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"]
        lines += ["", f"Change: **{'+' if change >= 0 else ''}{100 * change:.1f} points** of held-out accuracy."]
    if figure is not None:
        lines += ["", f"![reward, accuracy, lengths and throughput per step]({figure.name})"]
    lines += ["", "## Training, in blocks of steps", ""]
    parts = sorted(k for k in (train[0] if train else {}) if k.startswith("rewards/"))
    extra = ["explained_variance", "clip_fraction"] if algo == "ppo" else []
    head = ["steps", "reward_mean", *[p[8:] for p in parts], "completion tokens", *extra]
    head += ["step time (s)", "rollout tokens/s"]
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    block = max(1, math.ceil(len(train) / 3))
    for i in range(0, len(train), block):
        sel = train[i : i + block]
        cells = [f"{sel[0]['step']}-{sel[-1]['step']}", _f(_mean(sel, "reward_mean"))]
        cells += [_f(_mean(sel, p)) for p in parts]
        cells += [_f(_mean(sel, "completion_len_mean"), 1)]
        cells += [_f(_mean(sel, k)) for k in extra]
        cells += [_f(_mean(sel, "step_time_s"), 1), _f(_mean(sel, "rollout_tokens_per_s"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    if len(evals) >= 2 and samples:
        first = [s for s in samples if s["step"] == evals[0]["step"]]
        last = [s for s in samples if s["step"] == evals[-1]["step"]]
        fixed = sum(1 for a, b in zip(first, last) if not a["correct"] and b["correct"])
        broken = sum(1 for a, b in zip(first, last) if a["correct"] and not b["correct"])
        lines += [
            "",
            "## Held-out samples",
            "",
            f"Of {len(first)} held-out problems, {fixed} went from wrong to right and {broken} from right to wrong. "
            "The first three that changed to right, before and after:",
            "",
        ]
        shown = 0
        for a, b in zip(first, last):
            if shown == 3:
                break
            if not a["correct"] and b["correct"]:
                shown += 1
                lines += [
                    f"- {a['question']} (answer {a['answer']})",
                    f"  - step {a['step']}: `{a['completion'].strip()}`".replace("\n", " "),
                    f"  - step {b['step']}: `{b['completion'].strip()}`".replace("\n", " "),
                ]
    keys = ["reward_mean", *parts, "completion_len_mean"]
    if algo == "grpo":
        keys += ["frac_reward_zero_std", "is_ratio_max", "staleness_mean", "grad_norm"]
        if any("is_ratio_fresh_max" in r for r in train):  # the importance ratio's extremes in full
            at = keys.index("is_ratio_max")
            keys[at : at + 1] = ["is_ratio_min", "is_ratio_max", "is_ratio_fresh_min", "is_ratio_fresh_max"]
            keys.insert(keys.index("staleness_mean") + 1, "behaviour_kl")
    else:
        keys += ["explained_variance", "value_loss", "clip_fraction", "approx_kl", "entropy"]
        keys += ["kl"] if any("kl" in r for r in train) else []  # absent on a step that trained on no sample
        keys += ["logprob_diff_max", "staleness_mean", "grad_norm"]
    keys += ["step_time_s", "rollout_tokens_per_s"]
    lines += ["", "## Per step", "", "| step | " + " | ".join(k.replace("rewards/", "") for k in keys) + " |"]
    lines.append("| ---: | " + " | ".join("---:" for _ in keys) + " |")
    exact = ("is_ratio_min", "is_ratio_max", "is_ratio_fresh_min", "is_ratio_fresh_max", "behaviour_kl")

    def cell(r: dict[str, float], k: str) -> str:
        value = float(r.get(k, math.nan))
        if k in exact and "is_ratio_fresh_max" in r and not math.isnan(value):
            return f"{value:.9g}"  # enough digits to tell exactly 1 (or 0) from rounding
        return _f(value)

    for r in train:
        lines.append(f"| {r['step']} | " + " | ".join(cell(r, k) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    run: Path, out: Path | None, figure: Path | None, command: str, script: str, note: str | None = None
) -> str:
    """Draw ``figure`` (when given) and return the report's text, written to ``out`` when given."""
    if figure is not None:
        algo = run_algo(run)
        plot(read_metrics(run / "metrics.jsonl"), figure, title=f"{TITLES[algo]}, default recipe")
    text = report(run, figure, command, script, note, out)
    if out is not None:
        out.write_text(text)
    return text


COMMANDS = {
    algo: "accelerate launch --config_file configs/accelerate/one_process.yaml "
    f"scripts/train_{algo}.py --output_dir RUN"
    for algo in ("grpo", "ppo")
}


def report_main(argv: list[str] | None = None, script: str = "scripts/run_report.py") -> int:
    """Command line of ``scripts/run_report.py`` and ``scripts/grpo_report.py``: RUN [--out] [--figure] [--command].
    Returns the exit code (2 for a folder that holds no run)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run's output folder")
    parser.add_argument("--out", type=Path, help="markdown file (default: print)")
    parser.add_argument("--figure", type=Path, help="PNG to draw (trainers.plotting), beside --out")
    parser.add_argument("--command", help="the command that made the run, quoted in the report")
    parser.add_argument("--note", help="a paragraph under the setup: conditions the run's files do not record")
    args = parser.parse_args(argv)
    try:
        command = args.command or COMMANDS[run_algo(args.run)]
    except FileNotFoundError as e:
        print(f"error: {e}")
        return 2
    text = write_report(args.run, args.out, args.figure, command, script, args.note)
    print(f"wrote {args.out}" if args.out else text)
    return 0


# ---------------------------------------------------------------------- side by side
def rows_from_report(path: Path) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The per-step rows, the held-out accuracies and the wall time of a report this module wrote
    (for a run whose folder is gone: docs/grpo_run.md).

    Returns:
        (rows with the per-step table's columns as floats, {"eval": [(step, accuracy)], "wall_time_s"}).
    """
    text = path.read_text()
    table = text.split("## Per step", 1)[1].strip().splitlines()
    head = [h.strip() for h in table[0].strip("|").split("|")]
    rows = []
    for line in table[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append({h: float(c) for h, c in zip(head, cells) if c != "n/a"})
    evals = [(int(m[0]), float(m[1])) for m in re.findall(r"^\| (\d+) \| ([0-9.]+) \| [0-9.]+ \|$", text, re.M)]
    wall = re.search(r"\*\*([0-9.]+) min\*\*", text)
    return rows, {"eval": evals, "wall_time_s": float(wall[1]) * 60 if wall else math.nan}


def _run_figures(rows: list[dict[str, float]], completions_per_step: int) -> dict[str, Any]:
    train = [r for r in rows if "reward_mean" in r]
    cum, t = [], 0.0
    for r in train:
        t += float(r.get("step_time_s", math.nan))
        cum.append(t)
    tokens = sum(float(r["completion_len_mean"]) * completions_per_step for r in train)
    return {"train": train, "cum_time": cum, "tokens": tokens}


def compare(
    ppo_run: Path, grpo_run: Path | None, grpo_report: Path | None, figure: Path | None, note: str | None = None
) -> str:
    """Markdown side-by-side of a PPO run and a GRPO run (a run folder, or its report when the folder is gone).

    The wall time of each whole job (model load, both evaluations, training, saving), the held-out
    accuracy before and after, the completion tokens generated for training, and the mean step time;
    the figure puts both runs' training reward on one axis of cumulative training time (the sum of
    step times), so that equal wall time is a vertical line.
    """
    ppo_cfg = json.loads((ppo_run / "ppo_config.json").read_text())
    ppo_rows = read_metrics(ppo_run / "metrics.jsonl")
    ppo_sum = json.loads((ppo_run / "summary.json").read_text())
    ppo = _run_figures(ppo_rows, ppo_cfg["batch_size"] * ppo_sum.get("world_size", 1))
    ppo_evals = [(r["step"], r["eval_accuracy"]) for r in ppo_rows if "eval_accuracy" in r]
    if grpo_run is not None:
        grpo_cfg = json.loads((grpo_run / "grpo_config.json").read_text())
        grpo_rows = read_metrics(grpo_run / "metrics.jsonl")
        grpo_sum = json.loads((grpo_run / "summary.json").read_text())
        grpo_evals = [(r["step"], r["eval_accuracy"]) for r in grpo_rows if "eval_accuracy" in r]
        grpo_wall = grpo_sum["wall_time_s"]
        grpo_source = f"the run folder `{grpo_run}` (commit `{grpo_sum.get('commit')}`)"
        per_step = grpo_cfg["batch_size"] * grpo_sum.get("world_size", 1)
    else:
        assert grpo_report is not None
        grpo_rows, info = rows_from_report(grpo_report)
        grpo_evals, grpo_wall = info["eval"], info["wall_time_s"]
        grpo_source = f"the per-step table of `{grpo_report}` (its run folder is not kept; not re-run here)"
        per_step = 16  # the default recipe's batch_size, as that report's setup line says
    grpo = _run_figures(grpo_rows, per_step)
    table = [
        "| | GRPO | PPO |",
        "| --- | ---: | ---: |",
        f"| whole job wall time (min) | {grpo_wall / 60:.1f} | {ppo_sum['wall_time_s'] / 60:.1f} |",
        f"| training steps | {len(grpo['train'])} | {len(ppo['train'])} |",
        f"| completions per step | {per_step} | {ppo_cfg['batch_size'] * ppo_sum.get('world_size', 1)} |",
        f"| held-out accuracy before | {_f(grpo_evals[0][1])} | {_f(ppo_evals[0][1])} |",
        f"| held-out accuracy after | {_f(grpo_evals[-1][1])} | {_f(ppo_evals[-1][1])} |",
        f"| completion tokens generated for training | {grpo['tokens']:.0f} | {ppo['tokens']:.0f} |",
        f"| mean step time (s) | {_f(_mean(grpo['train'], 'step_time_s'), 1)} | "
        f"{_f(_mean(ppo['train'], 'step_time_s'), 1)} |",
        f"| training time, sum of step times (min) | {grpo['cum_time'][-1] / 60:.1f} | "
        f"{ppo['cum_time'][-1] / 60:.1f} |",
    ]
    # The reward each had reached by the shorter run's training time.
    horizon = min(grpo["cum_time"][-1], ppo["cum_time"][-1])

    def reward_until(fig: dict[str, Any], until: float, window: int = 5) -> float:
        sel = [r for r, t in zip(fig["train"], fig["cum_time"]) if t <= until + 1e-9]
        return _mean(sel[-window:], "reward_mean")

    table.append(
        f"| training reward, mean of the last 5 steps within {horizon / 60:.1f} min of training | "
        f"{_f(reward_until(grpo, horizon))} | {_f(reward_until(ppo, horizon))} |"
    )
    if figure is not None:
        _plot_compare(grpo, ppo, figure)
    lines = [
        "# GRPO and PPO side by side on the default task",
        "",
        f"Generated by `python scripts/compare_runs.py` at commit `{git('rev-parse', '--short', 'HEAD')}` on "
        f"{dt.date.today().isoformat()}. PPO: the run folder `{ppo_run.name}` (commit `{ppo_sum.get('commit')}`, "
        f"the default recipe `configs/ppo_default.yaml`); GRPO: {grpo_source}. Both evaluate the same 200 "
        "held-out problems greedily with the last-number rule, before and after training only.",
        "",
        *table,
    ]
    if note:
        lines += ["", note]
    if figure is not None:
        lines += ["", f"![training reward against training time]({figure.name})"]
    return "\n".join(lines) + "\n"


def _plot_compare(grpo: dict[str, Any], ppo: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, f, color in (("GRPO", grpo, "C0"), ("PPO", ppo, "C3")):
        minutes = [t / 60 for t in f["cum_time"]]
        reward = [float(r["reward_mean"]) for r in f["train"]]
        ax.plot(minutes, reward, "o", color=color, alpha=0.3, ms=4)
        ax.plot(minutes, moving_average(reward, 5), "-", color=color, lw=2, label=f"{name} reward_mean (5-step avg)")
    ax.set_xlabel("training time (min, sum of step times)")
    ax.set_ylabel("training reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def compare_value_models(runs: list[Path], note: str | None = None) -> str:
    """Markdown table of PPO runs that differ in their value model (``value_model``: head or critic).

    For each run: the value model, held-out accuracy before and after, training reward and explained
    variance in blocks of ten steps, the mean value loss, the whole job's wall time and CPU time
    (``process_cpu_time_s``: comparable across runs made under different loads, unlike wall time).

    Raises:
        FileNotFoundError: a folder is not a PPO run folder.
    """
    header = ["| | " + " | ".join(f"`{r.name}`" for r in runs) + " |", "| --- |" + " ---: |" * len(runs)]
    cols: list[dict[str, str]] = []
    for run in runs:
        if run_algo(run) != "ppo":
            raise FileNotFoundError(f"{run} is not a PPO run folder (no ppo_config.json)")
        cfg = json.loads((run / "ppo_config.json").read_text())
        summ = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        rows = read_metrics(run / "metrics.jsonl")
        train = [r for r in rows if "reward_mean" in r]
        evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        col = {
            "value model": f"`{cfg['value_model']}`",
            "commit": f"`{summ.get('commit', 'n/a')}`",
            "steps trained": str(len(train)),
            "held-out accuracy before": _f(evals[0][1]) if evals else "n/a",
            "held-out accuracy after": _f(evals[-1][1]) if len(evals) > 1 else "n/a",
        }
        for lo in range(0, len(train), 10):
            block = train[lo : lo + 10]
            span = f"{lo + 1}-{lo + len(block)}"
            col[f"training reward, steps {span}"] = _f(_mean(block, "reward_mean"))
            col[f"explained variance, steps {span}"] = _f(_mean(block, "explained_variance"), 2)
        col["value loss, mean"] = _f(_mean(train, "value_loss"))
        col["whole job wall time (min)"] = _f(summ["wall_time_s"] / 60, 1) if "wall_time_s" in summ else "n/a"
        cpu = summ.get("process_cpu_time_s")
        col["whole job CPU time (min)"] = _f(cpu / 60, 1) if cpu else "n/a"
        cols.append(col)
    keys = list(dict.fromkeys(k for c in cols for k in c))
    table = header + [f"| {k} | " + " | ".join(c.get(k, "n/a") for c in cols) + " |" for k in keys]
    lines = [
        "# PPO value models: a value head on the policy's trunk against a separate critic",
        "",
        f"Generated by `python scripts/compare_value_models.py` at commit `{git('rev-parse', '--short', 'HEAD')}` "
        f"on {dt.date.today().isoformat()} from the run folders named in the table; the numbers are read from "
        "their files, never typed.",
        "",
        *table,
        "",
    ]
    if note:
        lines += [note, ""]
    return "\n".join(lines)


def write_or_print(text: str, out: Path | None) -> None:
    """Write a report to ``out`` (and say so), or print it when ``out`` is None: the report scripts' output."""
    if out:
        out.write_text(text)
        print(f"wrote {out}")
    else:
        print(text)
