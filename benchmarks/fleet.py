"""Fleet benchmark (``scripts/bench_fleet.py``): rollout-serve replicas behind vLLM's router, measured three ways.

1. **Throughput through the router.** The GRPO workload (``gsm8k-grpo``: 8 GSM8K prompts in the chat template, G=8
   samples each, temperature 1, 128 new tokens, EOS ends a sample) sent as a trainer sends it: every prompt at once,
   one request of ``n=G`` per prompt with the prompt's session key (``X-Session-ID``, ``consistent_hash``), through
   ``RolloutPool(router_url=...)``. Three layouts on the same machine, each behind its own ``vllm-router``: 1 replica
   of 1 torch thread, 2 replicas of 1 thread each, 1 replica of 2 threads. Each layout runs once per round, the order
   rotating from round to round (a shared machine's load changes between rounds); tokens/s = completion tokens over
   the wall seconds of the batch. The same seeds go to every layout: ``same_tokens`` says whether they generated
   the same tokens (a different thread count may round differently).
2. **Weight sync time** from this process (the trainer, holding the model's fp32 weights) to 1, 2 and 3 replicas:
   ``RolloutPool.send_weights`` over one broadcast group of 1 + N ranks (gloo), the whole call as a trainer sees it;
   median and spread over ``--sync-repeats`` timed sends after a warm-up send (the group is opened before).
3. **The router's added latency per request**: one short request (a GSM8K prompt, 1 greedy token) sent alternately
   straight to a replica and through the router in front of it, one at a time; the medians and p90s of both and
   the median of the paired differences.

Replicas are ``python -m rollout.serve --enable-control`` subprocesses on 127.0.0.1 (all started at the beginning:
an idle replica waits without stepping), routers ``vllm-router --policy consistent_hash``. The JSON holds every
sample; the markdown holds the tables and the commit. Measure on an idle machine.

    python scripts/bench_fleet.py --json docs/fleet_bench.json --markdown docs/fleet_bench.md
    python scripts/bench_fleet.py --num-prompts 2 --num-samples 2 --max-new-tokens 4 --rounds 1 \\
        --sync-repeats 1 --latency-requests 5 --json /tmp/fleet.json --markdown /tmp/fleet.md     # a quick check
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

import rollout
from benchmarks.report import SOURCE_ROOT, machine_info, write_json
from benchmarks.serving import SERVER_START_TIMEOUT_S, free_port, percentile
from benchmarks.workloads import SAMPLE_QUESTIONS, WORKLOADS, Workload, build_prompts, load_questions, select_questions
from rollout.fleet.cli import cpu_memory_share
from trainers.prompts import eos_token_ids

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# Each layout: its name, the number of replicas and the torch threads of each.
LAYOUTS = (("1 replica x 1 thread", 1, 1), ("2 replicas x 1 thread", 2, 1), ("1 replica x 2 threads", 1, 2))
SYNC_REPLICAS = (1, 2, 3)
# Seconds a router gets to see every worker.
ROUTER_START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def replica_subprocesses(
    model: str, flags: Sequence[str], threads: Sequence[int], timeout: float = SERVER_START_TIMEOUT_S
) -> Iterator[list[str]]:
    """One ``python -m rollout.serve`` on 127.0.0.1 per entry of ``threads`` (its torch threads), all started at once;
    yields their URLs once every ``/health`` answers 200, stops them all (SIGTERM, then SIGKILL) on exit.

    Raises:
        RuntimeError: a replica exited, or not all were healthy within ``timeout`` seconds.
    """
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for n in threads:
            port = free_port()
            cmd = [sys.executable, "-m", "rollout.serve", "--model", model, "--port", str(port), "--log-level",
                   "warning", *flags]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS=str(n), PYTHONPATH=str(SOURCE_ROOT))
            procs.append((f"http://127.0.0.1:{port}", subprocess.Popen(cmd, cwd=SOURCE_ROOT, env=env)))
        deadline = time.monotonic() + timeout
        for url, proc in procs:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"rollout-serve at {url} exited with status {proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout-serve at {url} was not healthy within {timeout:g} s")
                time.sleep(0.5)
        yield [url for url, _ in procs]
    finally:
        for _, proc in procs:
            proc.terminate()
        for _, proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def router_subprocess(
    worker_urls: Sequence[str],
    policy: str = "consistent_hash",
    extra_args: Sequence[str] = (),
    timeout: float = ROUTER_START_TIMEOUT_S,
) -> Iterator[str]:
    """``vllm-router --policy POLICY`` over ``worker_urls`` on 127.0.0.1; yields its URL once it lists every
    worker, stops it on exit.

    Args:
        worker_urls: the replicas' base URLs.
        policy: the router's policy.
        extra_args: more vllm-router flags (the fleet tests turn its retries off).
        timeout: seconds the router gets to list every worker.

    Raises:
        RuntimeError: vllm-router is not installed (``pip install 'rollout[fleet]'``), exited, or did not list the
            workers in time.
    """
    binary = shutil.which("vllm-router")
    if binary is None:
        raise RuntimeError("vllm-router is not installed: pip install 'rollout[fleet]'")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
         "--log-level", "warning", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         *extra_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with status {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if len(httpx.get(f"{url}/list_workers", timeout=2).json()["urls"]) == len(worker_urls):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not list {list(worker_urls)} within {timeout:g} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def session_key(prompt: Sequence[int]) -> str:
    """A prompt's session key: a hash of its token ids (what the trainers send)."""
    return hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()[:16]


def generate_batch(
    pool: rollout.RolloutPool, prompts: Sequence[list[int]], body: dict[str, Any], seed: int
) -> tuple[float, list[list[int]]]:
    """Every prompt at once (one request of ``n`` each, its session key), as a trainer sends a batch.

    Returns:
        The wall seconds of the batch and every choice's completion token ids (prompt, then choice order).
    """

    def one(i: int) -> list[list[int]]:
        out = pool.generate(prompts[i], session=session_key(prompts[i]), seed=seed + i, **body)
        return [choice["token_ids"] for choice in sorted(out["choices"], key=lambda c: c["index"])]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as executor:
        results = list(executor.map(one, range(len(prompts))))
    return time.perf_counter() - t0, [seq for choices in results for seq in choices]


def measure_throughput(
    workers: dict[str, list[str]],
    routers: dict[str, str],
    prompts: Sequence[list[int]],
    body: dict[str, Any],
    rounds: int,
    seed: int,
) -> dict[str, Any]:
    """Each layout's tokens/s through its router, in rounds (see the module docstring).

    Args:
        workers: each layout's replica URLs.
        routers: each layout's router URL (same keys, in the order the first round runs them).
        prompts: the workload's prompts.
        body: the generation fields of every request.
        rounds: runs of each layout.
        seed: the seed of prompt 0 (prompt i gets ``seed + i``).
    """
    names = list(routers)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    pools = {name: rollout.RolloutPool(workers[name], router_url=routers[name], timeout=3600) for name in names}
    try:
        for name in names:  # warm-up: first requests of each replica (connections, first steps)
            generate_batch(pools[name], prompts[:2], dict(body, max_tokens=2), seed)
        for round_ in range(rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                wall, sequences = generate_batch(pools[name], prompts, body, seed)
                count = sum(len(s) for s in sequences)
                runs[name].append({"wall_s": wall, "tokens": count, "tokens_per_s": count / wall})
                tokens.setdefault(name, sequences)
                logger.info("round %d, %s: %.1f tokens/s", round_, name, count / wall)
    finally:
        for pool in pools.values():
            pool.close()
    reference = tokens[names[0]]
    out = {}
    for name in names:
        rates = [r["tokens_per_s"] for r in runs[name]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[name], runs[names[0]])]
        out[name] = {
            "runs": runs[name],
            "tokens_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "ratio_vs_first": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "same_tokens": tokens[name] == reference,
        }
    return out


def measure_sync(
    urls: Sequence[str], params: list[tuple[str, torch.Tensor]], repeats: int, bucket_mb: int
) -> dict[str, Any]:
    """``send_weights`` time to the first 1, 2 and 3 replicas of ``urls`` (one group each, opened before)."""
    out: dict[str, Any] = {}
    for n in SYNC_REPLICAS:
        if n > len(urls):
            break
        with rollout.RolloutPool(list(urls[:n]), bucket_bytes=bucket_mb << 20) as pool:
            pool.init_weight_transfer()
            t0 = time.perf_counter()
            pool.send_weights(params)
            first = time.perf_counter() - t0
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                pool.send_weights(params)
                times.append(time.perf_counter() - t0)
            pool.close_weight_transfer()
        out[str(n)] = {
            "world_size": 1 + n,
            "times_s": times,
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "first_s": first,
        }
        logger.info("sync to %d replicas: %.3f s (median)", n, out[str(n)]["median_s"])
    return out


def measure_router_latency(replica: str, router: str, prompt: list[int], requests: int) -> dict[str, Any]:
    """One request at a time, alternately straight to ``replica`` and through ``router`` (see the module docstring)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    direct, routed = [], []
    with httpx.Client(timeout=120) as http:
        for url in (replica, router):  # warm-up
            http.post(f"{url}/v1/completions", json=body).raise_for_status()
        for i in range(requests):
            order = [(replica, direct), (router, routed)]
            for url, times in order if i % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                http.post(f"{url}/v1/completions", json=body, headers={"X-Session-ID": "latency"}).raise_for_status()
                times.append(time.perf_counter() - t0)
    added = [r - d for d, r in zip(direct, routed)]
    return {
        "requests": requests,
        "direct_s": direct,
        "router_s": routed,
        "direct_median_s": statistics.median(direct),
        "direct_p90_s": percentile(direct, 90),
        "router_median_s": statistics.median(routed),
        "router_p90_s": percentile(routed, 90),
        "added_median_s": statistics.median(added),
        "added_p90_s": percentile(added, 90),
    }


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Start the replicas and routers, measure, write the JSON and the markdown; returns the report."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    torch.set_num_threads(args.trainer_threads)
    model, tokenizer = rollout.load_model(args.model, dtype=torch.float32)
    eos = eos_token_ids(model, tokenizer)
    eos = [eos] if isinstance(eos, int) else list(eos)
    workload: Workload = dataclasses.replace(
        WORKLOADS["gsm8k-grpo"], num_prompts=args.num_prompts, num_samples=args.num_samples
    )
    if args.max_new_tokens is not None:
        workload = dataclasses.replace(workload, max_new_tokens=args.max_new_tokens)
    selected, _ = select_questions(load_questions(args.gsm8k or SAMPLE_QUESTIONS), workload.start, workload.num_prompts)
    prompts = build_prompts(tokenizer, selected, workload)
    body = {
        "n": workload.num_samples,
        "max_tokens": workload.max_new_tokens,
        "temperature": workload.temperature,
        "top_p": 1.0,
        "ignore_eos": True,  # EOS ends a sample through stop_token_ids: the model's own list, as in rollout-bench-serve
        "stop_token_ids": eos,
    }
    threads = [1] * max(SYNC_REPLICAS) + [2]
    sizing = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else cpu_memory_share(len(threads), [])
    flags = ["--enable-control", *sizing]
    command = "python scripts/bench_fleet.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report: dict[str, Any] = {
        "model": args.model,
        "machine": machine_info("cpu"),
        "command": command,
        "workload": dataclasses.asdict(workload),
        "layouts": {name: {"replicas": n, "threads_per_replica": t} for name, n, t in LAYOUTS},
    }
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    report["weights"] = {"tensors": len(params), "bytes": sum(p.numel() * p.element_size() for _, p in params)}
    with contextlib.ExitStack() as stack:
        *one_thread, two_threads = stack.enter_context(replica_subprocesses(args.model, flags, threads))
        workers = {LAYOUTS[0][0]: one_thread[:1], LAYOUTS[1][0]: one_thread[:2], LAYOUTS[2][0]: [two_threads]}
        routers = {name: stack.enter_context(router_subprocess(urls)) for name, urls in workers.items()}
        report["throughput"] = measure_throughput(workers, routers, prompts, body, args.rounds, args.seed)
        write_json(report, args.json_path)
        report["router_latency"] = measure_router_latency(
            one_thread[0], routers[LAYOUTS[0][0]], prompts[0], args.latency_requests
        )
        write_json(report, args.json_path)
        report["weight_sync"] = measure_sync(one_thread, params, args.sync_repeats, args.bucket_mb)
        report["weight_sync_bucket_mb"] = args.bucket_mb
    write_json(report, args.json_path)
    table = markdown(report)
    print(table)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")
    print(f"wrote {args.json_path}" + (f" and {args.markdown}" if args.markdown else ""))
    return report


def markdown(report: dict[str, Any]) -> str:
    """The three tables, with the commit, the machine and the command."""
    m, w = report["machine"], report["workload"]
    lines = [
        f"Commit {m['git_commit']}; {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}; {report['model']}, "
        f"fp32. Command: `{report['command']}`.",
        "",
        f"GRPO workload through vllm-router (consistent_hash): {w['num_prompts']} prompts x G={w['num_samples']}, "
        f"temperature {w['temperature']:g}, up to {w['max_new_tokens']} new tokens, all prompts at once; "
        f"{len(next(iter(report['throughput'].values()))['runs'])} round(s).",
        "",
        "| layout | tokens/s, median | min-max | ratio to the first layout (median) | same tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in report["throughput"].items():
        t, r = row["tokens_per_s"], row["ratio_vs_first"]
        lines.append(
            f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {r['median']:.2f} | {row['same_tokens']} |"
        )
    weights = report["weights"]
    lines += [
        "",
        f"Weight sync from this process (fp32, {weights['tensors']} tensors, {weights['bytes'] / 1e6:.0f} MB, "
        f"{report['weight_sync_bucket_mb']} MiB buckets, gloo over 127.0.0.1), one broadcast group of 1 + N:",
        "",
        "| replicas | world size | median s | min-max s | first send s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n, row in report["weight_sync"].items():
        lines.append(
            f"| {n} | {row['world_size']} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} | "
            f"{row['first_s']:.3f} |"
        )
    lat = report["router_latency"]
    lines += [
        "",
        f"Router latency: {lat['requests']} requests of 1 greedy token, one at a time, alternately direct and routed:",
        "",
        "| path | median ms | p90 ms |",
        "| --- | --- | --- |",
        f"| straight to the replica | {lat['direct_median_s'] * 1e3:.1f} | {lat['direct_p90_s'] * 1e3:.1f} |",
        f"| through vllm-router | {lat['router_median_s'] * 1e3:.1f} | {lat['router_p90_s'] * 1e3:.1f} |",
        f"| added by the router (paired) | {lat['added_median_s'] * 1e3:.1f} | {lat['added_p90_s'] * 1e3:.1f} |",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model folder or alias every replica loads")
    p.add_argument("--gsm8k", default=None, help="a JSONL of questions (default: the shipped sample)")
    p.add_argument("--num-prompts", type=int, default=WORKLOADS["gsm8k-grpo"].num_prompts)
    p.add_argument("--num-samples", type=int, default=WORKLOADS["gsm8k-grpo"].num_samples, help="G per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's 128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="each replica's --num-blocks (default: the replicas split one server's memory share, as rollout-fleet's)",
    )
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=16, help="the trainers' default weight_sync_bucket_mb")
    p.add_argument("--latency-requests", type=int, default=50)
    p.add_argument("--trainer-threads", type=int, default=1, help="torch threads of this process")
    p.add_argument("--json", type=Path, default=Path("bench_results/fleet_bench.json"), dest="json_path")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    for name in ("num_prompts", "num_samples", "rounds", "sync_repeats", "latency_requests", "bucket_mb"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fleet benchmark (see the module docstring); 0 when it ran."""
    run(parse_args(argv), argv)
    return 0
