"""What regional compilation (``ContinuousBatchingConfig(regional_compile=True)``) costs and gains (issue 45 item 3).

    python scripts/bench_regional_compile.py --json docs/regional_compile.json --markdown docs/regional_compile.md
    python scripts/bench_regional_compile.py --from-json docs/regional_compile.json      # the tables again

Two parts, on two models of SmolLM2-135M's shapes: ``smollm2`` (the real default model, a Llama) and ``gemma3-135m``
(Gemma 3 with SmolLM2's widths and depth, random seeded weights, 5 sliding layers to 1 full: a family outside the
fused decoder layers; throughput depends on the shapes, not the weights, and every sequence runs to its budget).

1. The compile's cost, each run a new process timing the engine's build (which compiles the regions): ``cold`` (an
   empty inductor cache and an empty rollout compile cache: a new machine), ``warm`` (a second process on both caches:
   the same machine later), ``cache file only`` (an empty inductor cache, the compile cache file kept: a new machine
   given ``$ROLLOUT_HOME/compile``).
2. Throughput in one process, the systems alternating round by round (greedy, fixed-length sequences of random prompt
   tokens): ``gemma3-135m`` eager against regional; ``smollm2`` with its fused decoder layers (the default), with
   transformers' layers (``fused_layers="off"``) and with transformers' layers compiled by region. Ratios are taken
   within a round. Greedy tokens of each system are compared with the model's first system's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("gemma3-135m", "smollm2")
SYSTEMS = {  # model -> system -> ContinuousBatchingConfig fields
    "gemma3-135m": {"eager": {}, "regional": {"regional_compile": True}},
    "smollm2": {
        "fused": {},
        "unfused": {"fused_layers": "off"},
        "unfused-regional": {"fused_layers": "off", "regional_compile": True},
    },
}


def build_model(name: str):  # noqa: ANN201
    """The model called ``name`` (see the module docstring), float32 on the CPU, in eval mode."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import rollout

    if name == "smollm2":
        return rollout.load_model("smollm2-135m-instruct")[0]
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        sliding_window=512,
    )
    return Gemma3ForCausalLM(config).eval()


def child(model_name: str) -> None:
    """One process: the model, a regional engine built (compiling the regions) and timed, one request generated."""
    t0 = time.perf_counter()
    from rollout import ContinuousBatchingConfig, SamplingParams
    from rollout.engine import Engine

    fields = {"fused_layers": "off"} if model_name == "smollm2" else {}
    model = build_model(model_name)
    t_load = time.perf_counter()
    engine = Engine(model, ContinuousBatchingConfig(regional_compile=True, **fields))
    t_built = time.perf_counter()
    compiles = engine.stats.num_compiles
    engine.add_request(list(range(1, 33)), SamplingParams(max_new_tokens=8, do_sample=False), request_id="r")
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats
    engine.close()
    t_end = time.perf_counter()
    print(
        json.dumps(
            {
                "load_s": t_load - t0,
                "build_s": t_built - t_load,
                "compiles": compiles,
                "compiles_in_steps": stats.num_compiles - compiles,
                "process_s": t_end - t0,
            }
        )
    )


def compile_costs(model_name: str) -> list[dict]:
    """The three runs of part 1 for one model, each a child process."""
    runs = []
    temp = tempfile.TemporaryDirectory
    with temp() as inductor, temp() as other, temp() as home:
        plan = [("cold", inductor), ("warm", inductor), ("cache file only", other)]
        for label, inductor_dir in plan:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "ROLLOUT_COMPILE_CACHE": home}
            cmd = [sys.executable, __file__, "--child", model_name]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"the child process failed ({out.returncode}):\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result.update(model=model_name, run=label)
            print(f"{model_name} {label}: build {result['build_s']:.1f} s, process {result['process_s']:.1f} s")
            runs.append(result)
    return runs


def throughput(model_name: str, batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """Part 2 for one model: for each batch size, each system's tokens/s in each round (systems alternating)."""
    import torch
    from transformers import GenerationConfig

    from rollout import ContinuousBatchingConfig, generate_batch

    model = build_model(model_name)
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        lengths = torch.randint(64, 129, (batch,), generator=g).tolist()
        prompts = [torch.randint(1, 49152, (n,), generator=g).tolist() for n in lengths]
        systems = SYSTEMS[model_name]
        tokens: dict[str, list] = {}
        rates: dict[str, list[float]] = {s: [] for s in systems}
        for round_ in range(repeats + 1):  # round 0 warms each system up (a regional engine compiles), untimed
            for system, fields in systems.items():
                config = ContinuousBatchingConfig(max_batch_tokens=512, **fields)
                t0 = time.perf_counter()
                out = generate_batch(model, prompts, generation_config=generation, continuous_batching_config=config)
                seconds = time.perf_counter() - t0
                generated = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
                if round_ == 0:
                    tokens[system] = generated
                    continue
                rates[system].append(sum(map(len, generated)) / seconds)
                print(f"{model_name} x{batch} round {round_} {system}: {rates[system][-1]:.1f} tokens/s", flush=True)
        first = next(iter(systems))
        for system in systems:
            equal = sum(a == b for a, b in zip(tokens[system], tokens[first], strict=True))
            rows.append(
                {"model": model_name, "batch": batch, "system": system, "tokens_per_s": rates[system], "equal": equal}
            )
    return rows


def markdown(payload: dict) -> str:
    """Both parts as tables, headed by the settings, the commit, the CPU and torch."""
    args, machine = payload["args"], payload["machine"]
    lines = [
        f"`scripts/bench_regional_compile.py` at commit `{machine['git_commit']}`, {machine['cpu_model']}, "
        f"{machine['torch_num_threads']} torch threads, torch {machine['torch']}.",
        "",
        "| model | run | engine build, the regions compiled (s) | compilations | in the steps after | process (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in payload["compile"]:
        lines.append(
            f"| {r['model']} | {r['run']} | {r['build_s']:.1f} | {r['compiles']} | {r['compiles_in_steps']} | "
            f"{r['process_s']:.1f} |"
        )
    lines += [
        "",
        f"Greedy, {args['new_tokens']} new tokens a sequence, prompts of 64-128 random tokens, {args['repeats']} "
        "timed rounds after one warm round, systems alternating; ratio: this system's tokens/s over the model's "
        "first system's in the same round (median, min-max).",
        "",
        "| model | sequences | system | tokens/s (median) | ratio to the first | greedy equal |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    rows = payload["throughput"]
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["batch"] == r["batch"])
        ratios = [a / b for a, b in zip(r["tokens_per_s"], base["tokens_per_s"], strict=True)]
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['system']} | {statistics.median(r['tokens_per_s']):.1f} | {ratio} | "
            f"{r['equal']}/{r['batch']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 64], help="sequences a run (default 32 64)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated a sequence (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--skip-compile-costs", action="store_true", help="part 2 only")
    parser.add_argument("--json", type=Path, help="write the results and the machine here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--from-json", type=Path, help="run nothing: the tables of a --json file written before")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if args.repeats < 1 or min(args.batches) < 1 or args.new_tokens < 1:
        parser.error("--repeats, --batches and --new-tokens must be at least 1")
    if args.from_json is None:
        from benchmarks.report import machine_info

        payload = {"args": {k: v for k, v in vars(args).items() if k != "child"}}
        payload["compile"] = [] if args.skip_compile_costs else [r for m in args.models for r in compile_costs(m)]
        payload["throughput"] = [
            r for m in args.models for r in throughput(m, args.batches, args.new_tokens, args.repeats)
        ]
        payload["machine"] = machine_info("cpu")
        payload["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in payload["args"].items()}
        if args.json is not None:
            args.json.write_text(json.dumps(payload, indent=1) + "\n")
    else:
        payload = json.loads(args.from_json.read_text())
    print(markdown(payload))
    if args.markdown is not None:
        args.markdown.write_text(markdown(payload))


if __name__ == "__main__":
    main()
