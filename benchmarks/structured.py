"""Structured outputs (``scripts/bench_structured.py``, issue 47 item 5): generated tokens/s of concurrent requests
constrained by a JSON schema against the same requests unconstrained, the schema's grammar compile time and the
grammar mask's cost per decode step, measured in the same run on the same prompts.

The requests: ``--prompts`` chat prompts (default 32) that each ask for one person as a JSON object with the schema's
keys (a different city per prompt), all queued at once on one manager, greedy, at most ``--max-new-tokens`` each. Three
batches per round, alternated within a round (best of ``--repeats`` rounds):

- ``constrained``: each request carries ``structured_outputs={"json": schema}`` (``--schema FILE``, default
  ``SCHEMA``: a small tool-call-like object); it ends on the EOS where the grammar may end.
- ``unconstrained``: the same prompts with no constraint and no EOS, each request as long as its constrained twin
  of the same round (``max_new_tokens`` = that length). Both batches generate exactly the same number of tokens per
  request, so they have the same batch size at every step and the ratio of their tokens/s is the constraint's cost
  alone. The issue's target: constrained at least 0.90x of this.
- ``free``: the same prompts unconstrained, ending on the EOS or at ``--max-new-tokens``: what a user gets without
  the constraint (how many tokens, how many outputs parse as JSON); not the ratio's denominator, since its lengths
  differ.

Greedy decoding keeps the constrained lengths the same from round to round. The compile time is that of a cold
``GrammarCache`` (its tokenizer's vocabulary read by xgrammar, then the schema compiled) and of a cached lookup; the
mask's cost per step replays the constrained outputs through fresh matchers (``apply_grammar_masks`` on random logits
of the real width, then ``accept_token`` per row), beside the engine's own decode step times. Tables: ``--markdown``
(docs/structured_bench.md); everything measured: ``--json`` (docs/structured_bench.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import machine_info
from rollout import ContinuousBatchingConfig, ContinuousBatchingManager, SamplingParams, StructuredOutputs, load_model
from rollout.engine.sample.structured import GrammarCache, apply_grammar_masks, new_matcher
from trainers.prompts import encode_prompt, eos_token_ids

# A tool call's arguments, as an agent would be asked for them: two free strings and a bounded integer.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CITIES = (
    "Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Berlin", "Madrid", "Rome", "Dublin", "Vienna", "Prague", "Lisbon",
    "Warsaw", "Athens", "Helsinki", "Seoul", "Delhi", "Nairobi", "Toronto", "Chicago", "Boston", "Denver", "Sydney",
    "Perth", "Quito", "Bogota", "Havana", "Manila", "Hanoi", "Bangkok", "Istanbul", "Zurich",
)  # fmt: skip
CASES = ("constrained", "unconstrained", "free")


def build_prompts(tokenizer: Any, schema: dict[str, Any], n: int) -> list[list[int]]:
    """``n`` chat prompts asking for one JSON object with ``schema``'s properties, a different city each (cycled, with
    a number, past ``len(CITIES)``); through the chat template when the tokenizer has one (``encode_prompt``)."""
    keys = ", ".join(schema.get("properties", {})) or "any keys"
    prompts = []
    for i in range(n):
        city = CITIES[i % len(CITIES)] + (f" {i // len(CITIES)}" if i >= len(CITIES) else "")
        text = f"Invent a person who lives in {city}. Reply with only a JSON object with the keys {keys}."
        prompts.append(encode_prompt(tokenizer, [{"role": "user", "content": text}]))
    return prompts


def run_batch(
    manager: ContinuousBatchingManager, prompts: list[list[int]], spec: StructuredOutputs | None,
    max_new_tokens: list[int], eos: list[int],
) -> dict[str, Any]:  # fmt: skip
    """One batch, every request queued at once; its wall time, outputs and the engine's decode steps.

    Args:
        manager: a started manager (its prefix cache is reset first: every batch prefills its prompts).
        prompts: token ids of each request.
        spec: the constraint of every request, or None.
        max_new_tokens: per request.
        eos: the end-of-sequence ids of every request ([]: none, the request runs to ``max_new_tokens``).

    Returns:
        ``seconds``, ``tokens`` (generated, EOS included), ``tokens_per_s``, ``outputs`` (each request's generated
        ids) and ``decode_step_ms`` (median wall time of the batch's decode-only steps, ``EngineStats``).
    """
    manager.reset_prefix_cache()
    stats = manager.engine.stats
    first_step = len(stats.decode_step_seconds)
    t0 = time.perf_counter()
    ids = [
        manager.add_request(p, max_new_tokens=m, eos_token_id=eos, structured_outputs=spec)
        for p, m in zip(prompts, max_new_tokens)
    ]
    outputs = [list(manager.get_result(rid, timeout=3600).generated_tokens) for rid in ids]
    seconds = time.perf_counter() - t0
    steps = stats.decode_step_seconds[first_step:]
    tokens = sum(len(o) for o in outputs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "outputs": outputs,
        "decode_step_ms": 1000 * statistics.median(steps) if steps else None,
    }


def compile_times(tokenizer: Any, vocab_size: int, spec: StructuredOutputs, repeats: int) -> dict[str, list[float]]:
    """Seconds to build a cold ``GrammarCache`` (xgrammar reads the vocabulary: once per tokenizer), to compile
    ``spec`` on it the first time, and to look the compiled grammar up again (the mean of 100 lookups), per repeat."""
    times: dict[str, list[float]] = {"tokenizer_info_s": [], "first_compile_s": [], "cached_compile_s": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache = GrammarCache(tokenizer, vocab_size)
        t1 = time.perf_counter()
        cache.compile(spec)
        t2 = time.perf_counter()
        for _ in range(100):
            cache.compile(spec)
        t3 = time.perf_counter()
        times["tokenizer_info_s"].append(t1 - t0)
        times["first_compile_s"].append(t2 - t1)
        times["cached_compile_s"].append((t3 - t2) / 100)
    return times


def mask_cost(
    tokenizer: Any, vocab_size: int, spec: StructuredOutputs, eos: list[int], outputs: list[list[int]]
) -> dict[str, float]:
    """The grammar's own work per decode step, replayed on the constrained outputs outside the engine.

    Every step ``t`` fills and applies the bitmask of the rows still generating (``apply_grammar_masks`` with
    ``copy=True``, as the sampler calls it when no logits processor ran: the raw logits stay for the logprobs) on
    random float32 logits [B, V], then advances each such row's matcher over its token ``t`` (what
    ``Request.append_token`` does).

    Returns:
        ``mask_ms_per_step`` and ``accept_ms_per_step`` (means over the steps), ``mean_rows`` (rows per step) and
        ``steps``.
    """
    compiled = GrammarCache(tokenizer, vocab_size).compile(spec)
    matchers = [new_matcher(compiled, eos) for _ in outputs]
    logits = torch.randn(len(outputs), vocab_size, generator=torch.Generator().manual_seed(0))
    mask_s, accept_s, rows = [], [], []
    for t in range(max(len(o) for o in outputs)):
        live = [len(o) > t for o in outputs]
        t0 = time.perf_counter()
        apply_grammar_masks(logits, [m if ok else None for m, ok in zip(matchers, live)], copy=True)
        t1 = time.perf_counter()
        for m, o, ok in zip(matchers, outputs, live):
            if ok and not m.accept_token(o[t]):
                raise RuntimeError(f"step {t}: token {o[t]} of a constrained output does not follow its grammar")
        t2 = time.perf_counter()
        mask_s.append(t1 - t0)
        accept_s.append(t2 - t1)
        rows.append(sum(live))
    return {
        "mask_ms_per_step": 1000 * statistics.mean(mask_s),
        "accept_ms_per_step": 1000 * statistics.mean(accept_s),
        "mean_rows": statistics.mean(rows),
        "steps": len(rows),
    }


def check_outputs(tokenizer: Any, schema: dict[str, Any], outputs: list[list[int]]) -> dict[str, Any]:
    """How many outputs parse as JSON and validate against ``schema`` (with ``jsonschema`` when it is installed;
    else parsing alone counts), and their texts."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    parsed = valid = 0
    for text in texts:
        try:
            value = json.loads(text.strip().removeprefix("```json").removesuffix("```"))
        except ValueError:
            continue
        parsed += 1
        if jsonschema is None:
            valid += 1
            continue
        try:
            jsonschema.validate(value, schema)
            valid += 1
        except jsonschema.ValidationError:
            pass
    return {"parsed": parsed, "valid": valid, "of": len(texts), "texts": texts}


def measure(
    model: torch.nn.Module, tokenizer: Any, schema: dict[str, Any], num_prompts: int, max_new_tokens: int,
    repeats: int, num_blocks: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The three batches of the module's docstring, ``repeats`` rounds, then the compile and mask costs.

    ``num_blocks`` sizes the KV cache (None: the engine's default, as the other benchmarks run).

    Returns:
        ``rounds`` (case -> one dict per round: ``tokens``, ``seconds``, ``tokens_per_s``, ``decode_step_ms``),
        ``ratio`` (constrained / unconstrained tokens/s, one per round), ``compile`` (``compile_times``), ``mask``
        (``mask_cost``), ``outputs`` (``check_outputs`` of the last round's constrained and free batches),
        ``prompt_tokens`` (per prompt) and ``engine`` (the engine's async batching and KV blocks).
    """
    spec = StructuredOutputs(json=schema)
    prompts = build_prompts(tokenizer, schema, num_prompts)
    eos = eos_token_ids(model, tokenizer)
    manager = ContinuousBatchingManager(
        model,
        SamplingParams(max_new_tokens=max_new_tokens),
        ContinuousBatchingConfig(num_blocks=num_blocks),
        tokenizer=tokenizer,
    )
    manager.start()
    engine_spec = manager.engine.spec
    # The width the engine compiles its grammars against (engine/gate.py), so the replayed masks are its masks.
    vocab_size = engine_spec.logits_width or engine_spec.vocab_size
    rounds: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    last: dict[str, list[list[int]]] = {}
    try:
        # Warm: the first step of each kind, and the engine's own compile of the schema (cached from then on).
        run_batch(manager, prompts[:2], spec, [4, 4], eos)
        run_batch(manager, prompts[:2], None, [4, 4], eos)
        for _ in range(repeats):
            constrained = run_batch(manager, prompts, spec, [max_new_tokens] * len(prompts), eos)
            lengths = [len(o) for o in constrained["outputs"]]
            unconstrained = run_batch(manager, prompts, None, lengths, [])
            free = run_batch(manager, prompts, None, [max_new_tokens] * len(prompts), eos)
            for case, run in zip(CASES, (constrained, unconstrained, free)):
                last[case] = run.pop("outputs")
                rounds[case].append(run)
        engine = {
            "use_async_batching": manager.engine.async_batching,
            "num_blocks": manager.engine.num_blocks,
        }
    finally:
        manager.stop(block=True)
    return {
        "rounds": rounds,
        "ratio": [
            c["tokens_per_s"] / u["tokens_per_s"] for c, u in zip(rounds["constrained"], rounds["unconstrained"])
        ],
        "compile": compile_times(tokenizer, vocab_size, spec, repeats),
        "mask": mask_cost(tokenizer, vocab_size, spec, eos, last["constrained"]),
        "outputs": {case: check_outputs(tokenizer, schema, last[case]) for case in ("constrained", "free")},
        "prompt_tokens": [len(p) for p in prompts],
        "engine": engine,
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the most tokens/s."""
    return max(runs, key=lambda r: r["tokens_per_s"])


def _ms(seconds: list[float], micro: bool = False) -> str:
    """The fastest and the slowest of ``seconds`` as two table cells, in ms (or µs with ``micro``)."""
    scale, unit = (1e6, "µs") if micro else (1e3, "ms")
    return f"{scale * min(seconds):.1f} {unit} | {scale * max(seconds):.1f} {unit}"


def markdown(result: dict[str, Any], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    """The tables of ``measure``'s result, headed by the command's settings, the commit and the CPU."""
    rounds, ratio = result["rounds"], result["ratio"]
    base = _best(rounds["unconstrained"])["tokens_per_s"]
    n = len(result["prompt_tokens"])
    lines = [
        f"Structured outputs: `{args.model}`, {n} concurrent requests ({min(result['prompt_tokens'])}-"
        f"{max(result['prompt_tokens'])} prompt tokens) each asking for a JSON object, greedy, at most "
        f"{args.max_new_tokens} new tokens; commit `{machine['git_commit']}`, {machine['cpu_model']}, "
        f"{machine['torch_num_threads']} torch threads, torch {machine['torch']}, async batching "
        f"{'on' if result['engine']['use_async_batching'] else 'off'}. Best of {args.repeats} rounds (the three "
        "batches alternate within a round). `unconstrained` runs each request exactly as long as its `constrained` "
        "twin (no EOS), so both generate the same tokens per request; `free` stops at the EOS.",
        "",
        f"Schema: `{json.dumps(result['schema'])}`",
        "",
        "| batch | tokens | tokens/s | vs unconstrained | decode step (ms, median) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for case in CASES:
        best = _best(rounds[case])
        step = "-" if best["decode_step_ms"] is None else f"{best['decode_step_ms']:.1f}"
        lines.append(
            f"| {case} | {best['tokens']} | {best['tokens_per_s']:.1f} | {best['tokens_per_s'] / base:.2f} | {step} |"
        )
    outputs, compile_s, mask = result["outputs"], result["compile"], result["mask"]
    constrained_step = _best(rounds["constrained"])["decode_step_ms"]
    share = (
        f" ({100 * (mask['mask_ms_per_step'] + mask['accept_ms_per_step']) / constrained_step:.1f}% of the constrained "
        "batch's median decode step)"
        if constrained_step
        else ""
    )
    lines += [
        "",
        f"- Constrained / unconstrained tokens/s within a round: median {statistics.median(ratio):.2f}x "
        f"({min(ratio):.2f}-{max(ratio):.2f}) over {len(ratio)} rounds; the target is at least 0.90x.",
        f"- Constrained outputs that parse and validate against the schema: {outputs['constrained']['valid']} of "
        f"{outputs['constrained']['of']}; free outputs that parse as JSON: {outputs['free']['parsed']} of "
        f"{outputs['free']['of']} (validate: {outputs['free']['valid']}).",
        f"- The mask replayed on the constrained outputs ({mask['steps']} steps, {mask['mean_rows']:.1f} rows a step "
        f"on average): fill and apply {mask['mask_ms_per_step']:.2f} ms a step, the matchers' accept "
        f"{mask['accept_ms_per_step']:.2f} ms a step{share}.",
        "",
        "| grammar compile | best | slowest |",
        "| --- | ---: | ---: |",
        f"| tokenizer info (a cold `GrammarCache`, once per tokenizer) | {_ms(compile_s['tokenizer_info_s'])} |",
        f"| first compile of the schema | {_ms(compile_s['first_compile_s'])} |",
        f"| cached (the same schema again) | {_ms(compile_s['cached_compile_s'], micro=True)} |",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="an alias or a model folder")
    parser.add_argument("--schema", type=Path, help="a JSON schema file (default: name, age and city)")
    parser.add_argument("--prompts", type=int, default=32, help="concurrent requests")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best one")
    parser.add_argument("--num-blocks", type=int, help="KV cache blocks (default: the engine's own size)")
    parser.add_argument("--json", type=Path, help="write the measurements and the machine here")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    args = parser.parse_args(argv)
    schema = json.loads(args.schema.read_text()) if args.schema is not None else SCHEMA
    model, tokenizer = load_model(args.model)
    result = {
        "schema": schema,
        **measure(model, tokenizer, schema, args.prompts, args.max_new_tokens, args.repeats, args.num_blocks),
    }
    machine = machine_info("cpu")
    text = markdown(result, args, machine)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine,
                                         **result}, indent=1) + "\n")  # fmt: skip
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0
