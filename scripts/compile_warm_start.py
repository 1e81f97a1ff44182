"""What compilation costs a process: the first run on a machine (an empty inductor cache) and a second process that
finds the caches the first one left (issue 45 item 1).

    python scripts/compile_warm_start.py                     # default model, compile level 1, two processes
    python scripts/compile_warm_start.py --json docs/compile_warm_start.json --markdown docs/compile_warm_start.md

Each run is a fresh Python process that loads the model, builds an engine at ``--compile-level`` and times
``Engine.warmup()`` (every padded step shape compiled before the first request), then generates one greedy request so
that the compiled steps are known to run. Runs 1 and 2 share one new ``TORCHINDUCTOR_CACHE_DIR`` (run 1 fills it: the
cold start; run 2 reads it: the warm start); ``--runs 3`` adds a run on a second empty directory (a cold start again).
Run on an otherwise idle machine: the compile is CPU-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from rollout import ContinuousBatchingConfig, SamplingParams, load_model
from rollout.engine import Engine
model, tokenizer = load_model(sys.argv[1])
t_load = time.perf_counter()
engine = Engine(model, ContinuousBatchingConfig(default_compile_level=int(sys.argv[2])))
warmup_s = engine.warmup(progress_bar=False)
t_warm = time.perf_counter()
engine.add_request(tokenizer("The capital of France is")["input_ids"], SamplingParams(max_new_tokens=8), request_id="r")
while engine.has_unfinished():
    engine.step()
engine.close()
t_end = time.perf_counter()
print(json.dumps({"load_s": t_load - t0, "warmup_s": warmup_s, "build_and_warmup_s": t_warm - t_load,
                  "generate_s": t_end - t_warm, "process_s": t_end - t0}))
"""


def run_once(model: str, level: int, cache_dir: Path) -> dict[str, float]:
    """One child process with ``TORCHINDUCTOR_CACHE_DIR=cache_dir``; its timings (seconds) and its wall time."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(level)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"the child process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an alias or a model folder")
    parser.add_argument("--compile-level", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--runs", type=int, default=2, choices=(2, 3), help="3: a second cold start on a new cache")
    parser.add_argument("--json", type=Path, help="write the runs and the machine here")
    parser.add_argument("--markdown", type=Path, help="write the table (with commit and CPU) here")
    parser.add_argument("--from-json", type=Path, help="run nothing: the table of a --json file written before")
    args = parser.parse_args()
    if args.from_json is not None:
        payload = json.loads(args.from_json.read_text())
        print(markdown(payload))
        if args.markdown is not None:
            args.markdown.write_text(markdown(payload))
        return
    from benchmarks.report import machine_info

    runs = []
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        plan = [("cold (empty cache)", first), ("warm (second process, same cache)", first)]
        if args.runs == 3:
            plan.append(("cold (another empty cache)", second))
        for label, cache in plan:
            result = run_once(args.model, args.compile_level, Path(cache))
            result["run"] = label
            runs.append(result)
            print(f"{label}: warmup {result['warmup_s']:.1f} s, process {result['wall_s']:.1f} s", flush=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info("cpu"), "runs": runs}
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(markdown(payload))
    if args.markdown is not None:
        args.markdown.write_text(markdown(payload))


def markdown(payload: dict) -> str:
    """The runs as a table, headed by the command's settings, the commit, the CPU and torch."""
    args, machine = payload["args"], payload["machine"]
    lines = [
        f"Compile level {args['compile_level']} of `{args['model']}`, each run a new process "
        f"(`scripts/compile_warm_start.py`); commit `{machine['git_commit']}`, {machine['cpu_model']}, "
        f"{machine['torch_num_threads']} torch threads, torch {machine['torch']}.",
        "",
        "| run | warmup (s) | engine build + warmup (s) | model load (s) | whole process (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in payload["runs"]:
        cells = (r["warmup_s"], r["build_and_warmup_s"], r["load_s"], r["wall_s"])
        lines.append(f"| {r['run']} | " + " | ".join(f"{x:.1f}" for x in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
