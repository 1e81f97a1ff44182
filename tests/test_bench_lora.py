"""``scripts/bench_lora.py`` (``benchmarks.lora``) on a tiny Llama: every case generates its tokens, the
adapter's bytes are exactly its A and B tensors, the full sync's every parameter, and the tables say so."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lora import TARGETS, main
from tests.tiny_models import tiny_llama, tiny_tokenizer


def test_bench_lora_measures_three_batches_and_both_syncs_with_exact_bytes(tmp_path: Path) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    out, md = tmp_path / "lora.json", tmp_path / "lora.md"
    argv = ["--model", str(tmp_path / "model"), "--prompts", "4", "--prompt-len", "6", "--new-tokens", "3"]
    assert main([*argv, "--rank", "4", "--repeats", "2", "--json", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())
    assert sorted(result["tokens_per_s"]) == ["1 adapter", "4 adapters", "base"]
    assert all(len(v) == 2 and min(v) > 0 for v in result["tokens_per_s"].values())
    assert len(result["adapter_sync_s"]) == 4 and len(result["full_sync_s"]) == 2
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]
    assert len(linears) == 7 * model.config.num_hidden_layers
    assert result["adapter_bytes"] == sum(4 * (m.in_features + m.out_features) * 4 for m in linears)  # rank 4, fp32
    assert result["full_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    text = md.read_text()
    assert "| base | " in text and "| 1 adapter | " in text and "| 4 adapters | " in text
    assert f"{100 * result['adapter_bytes'] / result['full_bytes']:.2f}%" in text
    assert result["machine"]["git_commit"] in text
