"""``scripts/bench_structured.py`` (``benchmarks.structured``) on the tiny Llama with the byte-level tokenizer that can
spell JSON: each round's unconstrained batch generates exactly its constrained twin's tokens, every constrained output
parses and validates, and the tables carry the ratio, the compile times and the mask's cost."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from benchmarks.structured import CASES, main
from tests.tiny_models import tiny_json_tokenizer, tiny_llama

# Bounded values: a random model's free strings would run to max_new_tokens before closing their quotes.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ab", "cd"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def test_bench_structured_reports_both_batches_equal_tokens_and_valid_constrained_outputs(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path / "model")
    tokenizer = tiny_json_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the real model's path
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    out, md = tmp_path / "structured.json", tmp_path / "structured.md"
    argv = [
        "--model",
        str(tmp_path / "model"),
        "--schema",
        str(tmp_path / "schema.json"),
        "--prompts",
        "4",
        "--num-blocks",
        "64",
    ]
    assert main([*argv, "--max-new-tokens", "48", "--repeats", "2", "--json", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == SCHEMA
    assert sorted(result["rounds"]) == sorted(CASES)
    assert all(len(runs) == 2 and min(r["tokens_per_s"] for r in runs) > 0 for runs in result["rounds"].values())
    for constrained, unconstrained in zip(result["rounds"]["constrained"], result["rounds"]["unconstrained"]):
        assert constrained["tokens"] == unconstrained["tokens"] > 0  # same lengths: the ratio is the mask's cost
    assert result["ratio"] == [
        c["tokens_per_s"] / u["tokens_per_s"]
        for c, u in zip(result["rounds"]["constrained"], result["rounds"]["unconstrained"])
    ]
    checked = result["outputs"]["constrained"]
    assert checked["valid"] == checked["parsed"] == checked["of"] == 4
    for text in checked["texts"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(len(v) == 2 and min(v) > 0 for v in result["compile"].values())
    assert min(result["compile"]["cached_compile_s"]) < min(result["compile"]["first_compile_s"])
    mask = result["mask"]
    assert mask["steps"] >= 1 and 0 < mask["mean_rows"] <= 4 and mask["mask_ms_per_step"] > 0
    text = md.read_text()
    assert "| constrained | " in text and "| unconstrained | " in text and "| free | " in text
    assert "first compile of the schema" in text and "parse and validate against the schema: 4 of 4" in text
    assert result["machine"]["git_commit"] in text
