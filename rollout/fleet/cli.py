"""``rollout-fleet``: N local ``rollout-serve`` replicas behind vLLM's router, started and stopped together.

    rollout-fleet --model M --replicas N --port P [--threads-per-replica T] [--gpus] [-- extra rollout-serve flags]

The router listens on ``P`` (``vllm-router --policy consistent_hash``: a session header keeps one session on one
replica); replica i on ``P + 1 + i``, each with ``--enable-control`` so that a trainer's ``RolloutPool`` can pause
it and stream weights to it. On CPU each replica gets ``--threads-per-replica`` torch threads (``OMP_NUM_THREADS``);
with ``--gpus`` replica i runs on GPU i (``CUDA_VISIBLE_DEVICES``). CPU replicas split one server's memory share
(``--max-memory-percent`` 0.25 / N) unless the flags after ``--`` size the KV cache. Each process is named on stderr
with its PID and URL as it starts (a replica that hangs can be found). Once every replica is healthy and the router
routes to all of them, the server URLs, the router URL and the PIDs are printed on stdout, one ``key=value`` line each
(``server_urls``, ``router_url``, ``server_pids``, ``router_pid``), and the launcher waits; SIGINT or SIGTERM stops the
router, then the replicas (SIGTERM, the servers' own graceful shutdown), and it exits 0. A replica or the router that
exits on its own stops the rest (exit status 1).

The router logs at ``--router-log-level`` (default ``warning``): vllm-router 0.1.17 logs three lines per request at
INFO (``CONSISTENT_HASH_DEBUG: ...``) and ignores its own ``--log-level``, so the level reaches it as ``RUST_LOG``
(unless the environment sets one), and its startup ``DEBUG:`` prints are dropped below ``debug``.

Several machines: run ``rollout-serve`` on each and ``vllm-router --worker-urls ...`` on one (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

import httpx

from rollout.config import DEFAULT_MEMORY_PERCENT_CPU

# Seconds each process gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 60.0
# vllm-router's levels (its --log-level's choices), each also a RUST_LOG directive.
ROUTER_LOG_LEVELS = ("debug", "info", "warning", "error")
# What vllm-router 0.1.17 prints with println at startup, whatever the level: dropped below --router-log-level debug.
ROUTER_DEBUG_PREFIX = "DEBUG: "


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder, or an alias (as rollout-serve's)")
    parser.add_argument("--replicas", type=int, default=2, help="number of rollout-serve replicas (>= 1)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port; replica i gets PORT + 1 + i")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of the router and the replicas")
    parser.add_argument("--threads-per-replica", type=int, default=1, help="torch threads of each CPU replica")
    parser.add_argument("--gpus", action="store_true", help="replica i on GPU i (CUDA_VISIBLE_DEVICES=i)")
    parser.add_argument("--policy", default="consistent_hash", help="the router's policy (vllm-router --policy)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the replicas get to be healthy")
    parser.add_argument(
        "--router-log-level",
        choices=ROUTER_LOG_LEVELS,
        default="warning",
        help="the router's log level (default warning; info shows its per-request routing lines)",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags passed to every rollout-serve")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The rollout-serve flags after ``--``; exits with a line naming the bad flag before anything starts."""
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if args.threads_per_replica < 1:
        parser.error(f"--threads-per-replica must be >= 1, got {args.threads_per_replica}")
    if not 1 <= args.port <= 65535 - args.replicas - 1:
        parser.error(f"--port must leave room for {args.replicas} replica ports above it, got {args.port}")
    if shutil.which("vllm-router") is None:
        parser.error("vllm-router is not installed: pip install 'rollout[fleet]' (or vllm-router==0.1.17)")
    extra = list(args.serve_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    for owned in ("--model", "--port", "--host", "--enable-control"):
        if owned in extra:
            parser.error(f"{owned} is set by rollout-fleet for every replica; remove it after --")
    return extra


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL after ``STOP_TIMEOUT_S``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port(host: str) -> int:
    """A free TCP port: the router's Prometheus exporter, whose fixed default (29000) a second router would clash on."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False


def _started(what: str, proc: subprocess.Popen, url: str) -> None:
    """Name a process that just started on stderr: its PID (to find it, or to stop it by hand) and its URL."""
    print(f"rollout-fleet: {what}: pid {proc.pid}, {url}", file=sys.stderr, flush=True)


def _wait(procs: Sequence[subprocess.Popen], ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: {' '.join(map(str, proc.args))} exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready within {timeout:g} s")
        time.sleep(0.5)


def router_env(level: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The router's environment: ``RUST_LOG`` at ``level`` (vllm-router reads it, not its ``--log-level``), unless
    ``environ`` (default ``os.environ``) sets one: a user's filter directive wins."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("RUST_LOG", "warn" if level == "warning" else level)
    return env


def _forward_router_output(stream: IO[str], keep_debug: bool) -> None:
    """Copy the router's output to stderr line by line, less its startup ``DEBUG:`` prints unless ``keep_debug``
    (runs in a thread until the router closes its stdout)."""
    for line in stream:
        if keep_debug or not line.startswith(ROUTER_DEBUG_PREFIX):
            sys.stderr.write(line)
            sys.stderr.flush()


def cpu_memory_share(replicas: int, serve_args: Sequence[str]) -> list[str]:
    """``--max-memory-percent`` for each of ``replicas`` CPU replicas on one machine: one server's default share
    (``DEFAULT_MEMORY_PERCENT_CPU`` of the available RAM) split between them, since they start together and each
    would otherwise size its KV cache from the same free memory (4 replicas of SmolLM2-135M took 6.4 GB each on a
    24 GiB machine and one was killed for memory in the middle of a weight sync). Nothing when ``serve_args`` sizes
    the cache itself (``--max-memory-percent`` or ``--num-blocks``)."""
    if any(a.split("=")[0] in ("--max-memory-percent", "--num-blocks") for a in serve_args):
        return []
    return ["--max-memory-percent", f"{DEFAULT_MEMORY_PERCENT_CPU / replicas:.6g}"]


def main(argv: Sequence[str] | None = None) -> int:
    """Start the fleet, print its URLs, wait for SIGINT/SIGTERM, stop it. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    extra = _check(args, parser)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    urls = [f"http://{args.host}:{args.port + 1 + i}" for i in range(args.replicas)]
    replicas: list[subprocess.Popen] = []
    router: subprocess.Popen | None = None
    try:
        for i in range(args.replicas):
            env = dict(os.environ)
            if args.gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            else:
                env["OMP_NUM_THREADS"] = str(args.threads_per_replica)
            placement = ["--device", "cuda"] if args.gpus else cpu_memory_share(args.replicas, extra)
            cmd = [sys.executable, "-m", "rollout.serve", "--model", args.model, "--host", args.host, "--port",
                   str(args.port + 1 + i), "--enable-control", *placement, *extra]  # fmt: skip
            # A new session: a terminal's Ctrl-C reaches the launcher only, which stops the replicas in order.
            # Their output goes to stderr: stdout carries only the key=value lines, for a script to read.
            replicas.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stderr))
            _started(f"replica {i}", replicas[-1], urls[i])
        _wait(replicas, lambda: stopping or all(_healthy(u) for u in urls), args.ready_timeout, "a replica")
        if not stopping:
            router_url = f"http://{args.host}:{args.port}"
            router = subprocess.Popen(
                ["vllm-router", "--host", args.host, "--port", str(args.port), "--worker-urls", *urls,
                 "--policy", args.policy, "--log-level", args.router_log_level, "--prometheus-host", args.host,
                 "--prometheus-port", str(_free_port(args.host))],
                env=router_env(args.router_log_level),
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            keep_debug = args.router_log_level == "debug"
            threading.Thread(
                target=_forward_router_output, args=(router.stdout, keep_debug), name="router-output", daemon=True
            ).start()
            _started("router", router, router_url)
            _wait([router, *replicas], lambda: stopping or _healthy(router_url), 120.0, "the router")
            print(f"server_urls={','.join(urls)}", flush=True)
            print(f"router_url={router_url}", flush=True)
            print(f"server_pids={','.join(str(p.pid) for p in replicas)}", flush=True)
            print(f"router_pid={router.pid}", flush=True)
        while not stopping:
            for proc in [*replicas, *([router] if router else [])]:
                if proc.poll() is not None:
                    print(f"rollout-fleet: {' '.join(map(str, proc.args))} exited; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as e:
        print(f"rollout-fleet: {e}", file=sys.stderr)
        return 1
    finally:
        _stop([router] if router else [])
        _stop(replicas)


if __name__ == "__main__":
    sys.exit(main())
