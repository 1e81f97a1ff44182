"""benchmarks.profile_step (scripts/profile_step.py): the per-category CPU profile of a step."""

from __future__ import annotations

import json

import pytest

from benchmarks.profile_step import CATEGORIES, markdown, new_report, op_category, profile_steps
from tests.tiny_models import PAD_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("aten::addmm", "matmul"),
        ("rollout::onednn_linear", "matmul"),
        ("mkldnn::_linear_pointwise", "matmul"),
        ("rollout_cpu::packed_linear", "matmul"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::index_select", "copies"),
        ("aten::mul", "elementwise"),
        ("cpp_fused_add_mean_mul_pow_rsqrt_0", "elementwise"),
        ("Torch-Compiled Region: 0/0", None),
        ("profile_step.forward", None),
    ],
)
def test_op_category_by_name(name: str, category: str | None) -> None:
    assert op_category(name) == category


def test_profile_of_a_tiny_model_has_every_category_and_shares_that_sum_to_one(tmp_path) -> None:  # noqa: ANN001
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, min_len=8, max_len=24, seed=71)
    results = profile_steps(model, prompts, PAD_TOKEN_ID, compile_levels=(), decode_offset=2, warmup=1, repeats=2)
    assert [(r.system, r.step) for r in results] == [
        ("rollout", "decode"),
        ("hf-forward", "decode"),
        ("hf-generate", "decode"),
        ("rollout", "prefill"),
        ("hf-forward", "prefill"),
    ]
    report = new_report("tiny-llama", model.device, {"command": "test"}, results)
    report["load_avg_1m_start"] = 0.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(report))
    loaded = json.loads(path.read_text())
    assert loaded["machine"]["git_commit"] is not None and loaded["machine"]["torch"]
    for r in loaded["results"]:
        assert set(r["categories"]) == set(CATEGORIES)
        assert sum(c["share"] for c in r["categories"].values()) == pytest.approx(1.0, abs=1e-9)
        assert r["categories"]["matmul"]["ms"] > 0 and r["wall_ms"] > 0
    assert loaded["results"][0]["batch"]["requests"] == 4
    assert loaded["results"][3]["batch"]["query_tokens"] == 512  # the CPU token budget
    assert loaded["results"][1]["categories"]["sampling"]["ms"] > 0  # the argmax after the forward
    text = markdown(loaded)
    assert "## decode step" in text and "## prefill step" in text and "| hf-generate |" in text
    assert "- decode, rollout: " in text and "- prefill, hf-forward: " in text  # what bounds each step
