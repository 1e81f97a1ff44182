"""Tensor parallelism through transformers' ``tp_plan`` on CPU (gloo): ranks launched by ``torchrun`` give
what one process gives, and only the driver returns results.

Each ``torchrun`` run executes ``tests/tp_scenario.py`` on every rank (the model saved with
``save_pretrained`` and loaded with ``tp_plan="auto"``); the reference is the same scenario run here, in
one process, on the unsharded model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rollout.engine.worker.distributed import check_kv_heads_divisible
from rollout.weights.loading import default_model_dir
from rollout.weights.model_info import layer_kv_shapes
from tests.tiny_models import EOS_TOKEN_ID, tiny_llama
from tests.tp_scenario import prompts_for, run_scenario
from tests.utils import assert_close, reference_greedy

REPO = Path(__file__).resolve().parents[1]
SCENARIO = REPO / "tests" / "tp_scenario.py"
ATOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, model_dir: Path, out_dir: Path, *extra: str, eos: int) -> list[dict[str, Any]]:
    """Run the scenario under ``torchrun`` with ``nproc`` ranks; each rank's record, in rank order."""
    out_dir.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(SCENARIO),
        str(model_dir),
        str(out_dir),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TP_SCENARIO_EOS": str(eos), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def assert_outputs_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same request ids, tokens, weight versions and cache hits; logprobs within ``ATOL``."""
    assert sorted(actual) == sorted(expected)
    for rid, want in expected.items():
        got = actual[rid]
        assert got["tokens"] == want["tokens"], rid
        assert got["versions"] == want["versions"], rid
        assert got["cached"] == want["cached"], rid
        assert_close(got["logprobs"], want["logprobs"], atol=ATOL)


def assert_scores_equal(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert_close(got["completion"], want["completion"], atol=ATOL)
        assert_close(got["prompt"], want["prompt"], atol=ATOL)


def one_process_on_mkl(model: torch.nn.Module, eos: int, **kwargs: Any) -> dict[str, Any]:
    """``run_scenario`` in this process with every CPU linear layer on MKL: what the ranks run (a sharded layer
    keeps its own linear, and a tensor-parallel engine keeps MKL by default; rollout/engine/worker/onednn.py
    ``linear_plan``), so
    the comparison is of the sharding, not of two kernels' rounding."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLOUT_ONEDNN_LINEAR", "0")
        return run_scenario(model, eos, **kwargs)


def kv3_llama() -> LlamaForCausalLM:
    """A tiny Llama with 6 heads and 3 KV heads: its KV heads do not split over 2 ranks."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any], Path]:
    """(the two ranks' records, the one-process record, the model folder) of the tiny Llama (4 heads, 2 KV)."""
    tmp = tmp_path_factory.mktemp("tp2")
    model_dir, bad_dir = tmp / "llama", tmp / "llama_kv3"
    tiny_llama().save_pretrained(model_dir)
    kv3_llama().save_pretrained(bad_dir)
    ranks = launch(2, model_dir, tmp / "out", "--kv-error", str(bad_dir), eos=EOS_TOKEN_ID)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    single = one_process_on_mkl(model, EOS_TOKEN_ID)
    return ranks, single, model_dir


def test_two_ranks_generate_batch_equals_one_process_and_model_generate(two_ranks) -> None:
    ranks, single, model_dir = two_ranks
    assert_outputs_equal(ranks[0]["generate_batch"], single["generate_batch"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts_for(256)):
        expected = reference_greedy(model, prompt, 10, EOS_TOKEN_ID)
        assert ranks[0]["generate_batch"][f"req_{i}"]["tokens"] == expected


def test_two_ranks_manager_streams_then_pauses_and_updates_weights_as_one_process(two_ranks) -> None:
    ranks, single, _ = two_ranks
    driver = ranks[0]
    assert driver["stream_ids"] == single["stream_ids"] == ["req_0", "req_1", "req_2"]
    assert sorted(driver["streams"]) == sorted(single["streams"])
    for rid, want in single["streams"].items():
        got = driver["streams"][rid]
        assert got["lengths"] == want["lengths"] == list(range(1, 11))  # one snapshot per token
        assert got["status"] == want["status"] == "FINISHED"
        assert_outputs_equal({rid: got["final"]}, {rid: want["final"]})
    # The requests added inside the pause ran after the update: new weights, version 1 on every token,
    # and no prefix-cache block of the old weights. Rank 1 entered its pause a second after the driver
    # left its own: had the driver stepped meanwhile, rank 1's old shards would have changed the tokens.
    assert driver["version"] == single["version"] == 1
    assert driver["later_ids"] == single["later_ids"]
    assert_outputs_equal(driver["later"], single["later"])
    assert all(out["versions"] == [1] * 10 for out in driver["later"].values())
    # Prompts 1 and 2 share 16 tokens: before the update prompt 2 found them cached; after it, prompt 1
    # computes them again (its old blocks carry version 0) and prompt 2 finds prompt 1's new ones.
    assert [driver["later"][rid]["cached"] for rid in driver["later_ids"]] == [0, 0, 16, 0]
    assert driver["streams"]["req_2"]["final"]["cached"] == 16
    before = {tuple(out["final"]["tokens"]) for out in driver["streams"].values()}
    after = {tuple(out["tokens"]) for out in driver["later"].values()}
    assert not before & after, "the update should change the completions"


def test_two_ranks_generate_batch_on_a_persistent_manager_equals_one_process(two_ranks) -> None:
    ranks, single, _ = two_ranks
    assert sorted(ranks[0]["persistent"]) == [f"req_{i}" for i in range(4)]
    assert_outputs_equal(ranks[0]["persistent"], single["persistent"])
    assert ranks[1]["persistent"] == {}


def test_two_ranks_score_equals_one_process(two_ranks) -> None:
    ranks, single, _ = two_ranks
    assert_scores_equal(ranks[0]["score"], single["score"])


def test_every_rank_appends_the_drivers_sampled_tokens(two_ranks) -> None:
    ranks, _, _ = two_ranks
    # Unseeded sampling: each rank's generator was seeded from the OS, so only the broadcast of the
    # driver's tokens makes the ranks agree.
    assert len(ranks[0]["engine_sampled"]) == 4
    assert ranks[1]["engine_sampled"] == ranks[0]["engine_sampled"]


def test_only_the_driver_returns_results(two_ranks) -> None:
    ranks, _, _ = two_ranks
    other = ranks[1]
    assert other["generate_batch"] == {}
    assert other["stream_ids"] == [None, None, None] and other["later_ids"] == [None] * 4
    assert other["streams"] == {} and other["later"] == {}
    assert other["score"] == []
    assert other["version"] == 1  # its update_weights ran too


def test_each_rank_caches_its_own_kv_heads(two_ranks) -> None:
    ranks, _, model_dir = two_ranks
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert {kv for kv, _ in layer_kv_shapes(model)} == {2}
    assert [r["local_kv_heads"] for r in ranks] == [1, 1]


def test_kv_heads_not_divisible_by_the_tp_size_is_a_value_error(two_ranks) -> None:
    ranks, _, _ = two_ranks
    for record in ranks:
        assert "num_key_value_heads (3) is not divisible by the tensor-parallel size (2)" in record["kv_error"]
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(3\) is not divisible by the tensor-parallel size \(2\)"
    ):
        check_kv_heads_divisible(3, 2)
    check_kv_heads_divisible(3, 3)
    check_kv_heads_divisible(2, 2)


def test_async_batching_is_off_under_tensor_parallelism_and_refused_when_asked(two_ranks) -> None:
    ranks, _, _ = two_ranks
    for record in ranks:
        assert record["async_default"] is False
        assert "use_async_batching=True is not supported under tensor parallelism" in record["async_error"]


@pytest.mark.slow
def test_three_ranks_smollm2_equal_one_process(tmp_path: Path) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: one KV head per rank at tp=3."""
    model_dir = default_model_dir()
    if not model_dir.is_dir():
        pytest.skip(f"SmolLM2 is not provisioned in {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    ranks = launch(3, model_dir, tmp_path / "out", "--quick", eos=eos)
    single = one_process_on_mkl(model, eos, quick=True)
    assert_outputs_equal(ranks[0]["generate_batch"], single["generate_batch"])
    assert_scores_equal(ranks[0]["score"], single["score"])
    assert [r["local_kv_heads"] for r in ranks] == [1, 1, 1]
    assert ranks[1]["generate_batch"] == ranks[2]["generate_batch"] == {}
