"""LoRA adapters served unmerged, per token (``rollout.lora``): against peft's own model of each adapter.

Each adapter is built by peft (``get_peft_model`` with random A and B, ``init_lora_weights=False``) on a copy of the
tiny model; the engine serves the base model and the adapters' tensors. A request under adapter X must give the
greedy tokens of X's peft model and logprobs within 1e-4 of its teacher-forced forward, whatever else shares the
step, and must never reuse KV computed under the base weights or another adapter.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.engine import Engine
from rollout.lora import LoraAdapter, adapter_state_dict
from tests.tiny_models import VOCAB_SIZE, random_prompts, tiny_llama
from tests.utils import assert_close, reference_greedy, run_engine, teacher_forced_logprobs

peft = pytest.importorskip("peft")

LOGPROB_ATOL = 1e-4
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(base: torch.nn.Module, seed: int, r: int = 4, targets: list[str] | None = None) -> torch.nn.Module:
    """A peft LoRA model on a copy of ``base``, A and B random (seeded), alpha = 2 r, in eval mode."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets or ALL_LINEAR, lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # peft's random B is small; larger B moves the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model.eval()


def adapter_of(model: torch.nn.Module, name: str, r: int = 4) -> LoraAdapter:
    return LoraAdapter.from_tensors(name, adapter_state_dict(model), r=r, lora_alpha=2 * r)


def config(**kwargs: object) -> ContinuousBatchingConfig:
    values = dict(page_size=4, num_blocks=128, max_batch_tokens=64, return_logprobs=True, enable_lora=True)
    values.update(kwargs)
    return ContinuousBatchingConfig(**values)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    base = tiny_llama()
    return base, peft_model(base, seed=1), peft_model(base, seed=2, targets=["q_proj", "v_proj", "down_proj"])


def test_adapters_and_base_in_one_batch_match_peft(models: tuple) -> None:
    """Two adapters and the base model in the same steps: each request's greedy tokens equal its own model's
    ``generate``, its logprobs its teacher-forced forward (1e-4); the adapters change the tokens (else the test
    could not fail)."""
    base, x, y = models
    engine = Engine(base, config(max_loras=2))
    engine.load_lora(adapter_of(x, "x"))
    engine.load_lora(adapter_of(y, "y"))
    prompts = random_prompts(6, VOCAB_SIZE, seed=3)
    which = [None, "x", "y", "x", None, "y"]
    refs = {None: base, "x": x, "y": y}
    try:
        for i, (p, lora) in enumerate(zip(prompts, which)):
            engine.add_request(p, SamplingParams(max_new_tokens=8), request_id=f"r{i}", lora=lora)
        out = run_engine(engine)
    finally:
        engine.close()
    for i, (p, lora) in enumerate(zip(prompts, which)):
        tokens = out[f"r{i}"].generated_tokens
        assert tokens == reference_greedy(refs[lora], p, 8, None), (i, lora)
        assert_close(out[f"r{i}"].logprobs, teacher_forced_logprobs(refs[lora], p, tokens), atol=LOGPROB_ATOL)
    differs = [reference_greedy(refs[w], prompts[1], 8, None) for w in (None, "x", "y")]
    assert len({tuple(t) for t in differs}) == 3
    # The hooks are gone: the model is the base model again.
    assert reference_greedy(base, prompts[0], 8, None) == out["r0"].generated_tokens


@pytest.mark.parametrize("cpu_attention", ["auto", "sdpa"])
def test_a_step_reads_only_its_adapters_rows_and_masks_only_mixed_rows(models: tuple, cpu_attention: str) -> None:
    """Adapters in slots 1 and 2 (slot 0 holds a third): a batch all under y (slot 2) runs its hooks on y's rows of the
    stacked buffers without a mask, a batch of x and y on slots 1-2 with one mask per step; both give each request its
    peft model's greedy tokens and teacher-forced logprobs (1e-4), with rollout's CPU kernel (``auto``: the extension
    is loaded) and with torch's GEMMs (``sdpa``: it is not)."""
    base, x, y = models
    engine = Engine(base, config(max_loras=3, cpu_attention=cpu_attention))
    assert engine.runner.lora.cpu_kernel == (cpu_attention == "auto")
    engine.load_lora(adapter_of(peft_model(base, seed=5), "first"))
    engine.load_lora(adapter_of(x, "x"))
    engine.load_lora(adapter_of(y, "y"))
    lora = engine.runner.lora
    plans = []
    step = lora.step

    @contextlib.contextmanager
    def spy(*args: object, **kwargs: object):  # the plan each step's hooks read
        with step(*args, **kwargs):
            plans.append(getattr(lora._local, "plan", None))
            yield

    lora.step = spy
    prompts = random_prompts(4, VOCAB_SIZE, seed=11)
    refs = {"x": x, "y": y}
    R = lora.max_lora_rank
    try:
        for which, (lo, hi), masked in ((["y"] * 4, (2 * R, 3 * R), False), (["x", "y", "y", "x"], (R, 3 * R), True)):
            plans.clear()
            for i, (p, name) in enumerate(zip(prompts, which)):
                engine.add_request(p, SamplingParams(max_new_tokens=6), request_id=f"{which}{i}", lora=name)
            out = run_engine(engine)
            for i, (p, name) in enumerate(zip(prompts, which)):
                tokens = out[f"{which}{i}"].generated_tokens
                assert tokens == reference_greedy(refs[name], p, 6, None), (which, i)
                expected = teacher_forced_logprobs(refs[name], p, tokens)
                assert_close(out[f"{which}{i}"].logprobs, expected, atol=LOGPROB_ATOL)
            assert plans and all(plan is not None for plan in plans)
            assert {plan.rows for plan in plans} == {(lo, hi)}
            assert {plan.mask is not None for plan in plans} == {masked}
            if masked:
                assert {tuple(plan.mask.shape[1:]) for plan in plans} == {(hi - lo,)}
    finally:
        engine.close()


def test_cpu_kernel_adds_the_masked_product() -> None:
    """``rollout_cpu::lora_add_`` adds ((x A^T) * mask) B into ``out`` in place, as torch computes it (1e-5 relative),
    for a decode step's few rows (inline) and a prefill's many (split over threads), x a strided view, with a mask
    and without; rows whose mask is all zero are left exactly as they were."""
    from rollout.engine.attention.cpu import load_kernel

    if load_kernel() is not None:
        pytest.skip("rollout's CPU extension does not build here")
    g = torch.Generator().manual_seed(0)
    for rows, masked in ((3, True), (16, False), (700, True)):
        x = torch.randn(rows, 80, generator=g)[:, 5:69]  # [T, 64], row stride 80
        a, b = torch.randn(12, 64, generator=g), torch.randn(12, 40, generator=g)
        out = torch.randn(rows, 40, generator=g)
        mask = (torch.rand(rows, 12, generator=g) > 0.5).float() if masked else None
        if mask is not None:
            mask[0] = 0
        expected = out + ((x @ a.t()) * (mask if mask is not None else 1)) @ b
        before = out.clone()
        torch.ops.rollout_cpu.lora_add_(out, x, a, b, mask)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
        if mask is not None:
            assert torch.equal(out[0], before[0])


def test_cpu_kernel_for_sibling_layers_adds_each_members_product() -> None:
    """``rollout_cpu::lora_add_group_`` (q/k/v or gate/up on one input): each member's out gets torch's
    ((x A_i^T) * mask) B_i (1e-5 relative), bitwise what ``lora_add_`` gives that member alone, for 1, 2 and 3 members
    of odd widths, a decode step's few rows (inline) and a prefill's many (threaded), x a strided view, with a mask
    and without (then members may differ in rank); rows whose mask is zero are left exactly as they were."""
    from rollout.engine.attention.cpu import load_kernel

    if load_kernel() is not None:
        pytest.skip("rollout's CPU extension does not build here")
    g = torch.Generator().manual_seed(0)
    K = 67
    for rows, masked in ((3, True), (5, False), (700, True), (700, False)):
        x = torch.randn(rows, 83, generator=g)[:, 5 : 5 + K]  # [T, 67], row stride 83
        for widths, ranks in (((37,), (11,)), ((37, 19), (11, 11)), ((37, 13, 13), (11, 11, 11 if masked else 5))):
            a = [torch.randn(r, K, generator=g) for r in ranks]
            b = [torch.randn(r, n, generator=g) for r, n in zip(ranks, widths)]
            outs = [torch.randn(rows, n, generator=g) for n in widths]
            mask = (torch.rand(rows, ranks[0], generator=g) > 0.5).float() if masked else None
            if mask is not None:
                mask[0] = 0
            alone = [out.clone() for out in outs]
            for out, ai, bi in zip(alone, a, b):
                torch.ops.rollout_cpu.lora_add_(out, x, ai, bi, mask)
            grouped = [out.clone() for out in outs]
            torch.ops.rollout_cpu.lora_add_group_(grouped, x, a, b, mask)
            for i, (out, ai, bi) in enumerate(zip(outs, a, b)):
                expected = out + ((x @ ai.t()) * (mask if mask is not None else 1)) @ bi
                torch.testing.assert_close(grouped[i], expected, rtol=1e-5, atol=1e-4)
                assert torch.equal(grouped[i], alone[i]), (rows, widths, i)
                if mask is not None:
                    assert torch.equal(grouped[i][0], out[0])
    with pytest.raises(RuntimeError, match="mask's W rows"):
        a = [torch.randn(4, K), torch.randn(3, K)]
        b = [torch.randn(4, 8), torch.randn(3, 8)]
        torch.ops.rollout_cpu.lora_add_group_([torch.zeros(2, 8)] * 2, x[:2], a, b, torch.ones(2, 4))


def test_peft_folder_matches_in_memory(models: tuple, tmp_path: object) -> None:
    """An adapter saved by peft's ``save_pretrained`` loads to the same tensors and scaling as the live one."""
    _, x, _ = models
    x.save_pretrained(str(tmp_path))
    folder = LoraAdapter.from_peft_dir("x", tmp_path)
    memory = adapter_of(x, "x")
    assert folder.rank == 4 and folder.scaling == memory.scaling == 2.0
    assert folder.target_modules == memory.target_modules and len(folder.target_modules) == 2 * 7
    for name, (a, b) in memory.weights.items():
        torch.testing.assert_close(folder.weights[name][0], a, atol=0, rtol=0)
        torch.testing.assert_close(folder.weights[name][1], b, atol=0, rtol=0)


def test_prefix_cache_never_shared_across_adapters(models: tuple) -> None:
    """The same prompt under the base model, x, y, then x again: only the second x request hits cached blocks (its
    own adapter's), and each gets its own model's tokens."""
    base, x, y = models
    engine = Engine(base, config(max_loras=2))
    engine.load_lora(adapter_of(x, "x"))
    engine.load_lora(adapter_of(y, "y"))
    prompt = random_prompts(1, VOCAB_SIZE, min_len=17, max_len=17, seed=5)[0]
    refs = {None: base, "x": x, "y": y}
    try:
        hits = []
        for i, lora in enumerate([None, "x", "y", "x"]):
            before = engine.block_manager.num_prefix_cache_hit_blocks
            engine.add_request(prompt, SamplingParams(max_new_tokens=4), request_id=f"r{i}", lora=lora)
            out = run_engine(engine)
            hits.append(engine.block_manager.num_prefix_cache_hit_blocks - before)
            assert out[f"r{i}"].generated_tokens == reference_greedy(refs[lora], prompt, 4, None), lora
    finally:
        engine.close()
    assert hits == [0, 0, 0, 4]


def test_prompt_forks_never_cross_adapters(models: tuple) -> None:
    """Requests with the same prompt queued together under the base model and x: no fork parks across adapters
    (each samples from its own model's logits)."""
    base, x, _ = models
    engine = Engine(base, config())
    engine.load_lora(adapter_of(x, "x"))
    prompt = random_prompts(1, VOCAB_SIZE, min_len=9, max_len=9, seed=6)[0]
    try:
        for i, lora in enumerate([None, "x", None, "x"]):
            engine.add_request(prompt, SamplingParams(max_new_tokens=5), request_id=f"r{i}", lora=lora)
        out = run_engine(engine)
    finally:
        engine.close()
    for i, lora in enumerate([None, "x", None, "x"]):
        assert out[f"r{i}"].generated_tokens == reference_greedy(x if lora else base, prompt, 5, None)


def nan_adapter(model: torch.nn.Module) -> LoraAdapter:
    """``model``'s adapter with one NaN in one layer's B (a diverged run)."""
    adapter = adapter_of(model, "diverged")
    name = sorted(adapter.weights)[3]
    adapter.weights[name][1][0, 0] = float("nan")
    return adapter


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: adapter_of(peft_model(m, 3, r=8), "big", r=8), "max_lora_rank=4"),
        (lambda m: LoraAdapter("head", 2, 1.0, {"lm_head": (torch.zeros(2, 64), torch.zeros(256, 2))}), "lm_head"),
        (lambda m: LoraAdapter("odd", 2, 1.0, {"model.nope": (torch.zeros(2, 64), torch.zeros(64, 2))}), "target_mod"),
        (lambda m: nan_adapter(peft_model(m, 3)), "non-finite"),
    ],
)
def test_bad_adapters_are_refused_by_name(models: tuple, make: object, match: str) -> None:
    """Rank above max_lora_rank, the LM head, a module the model lacks, a NaN (its slot's rows are read, masked, by
    every step whose slots span it): a ValueError naming the setting, nothing loaded."""
    base = models[0]
    engine = Engine(base, config(max_lora_rank=4))
    try:
        with pytest.raises(ValueError, match=match):
            engine.load_lora(make(base))  # type: ignore[operator]
        assert engine.lora_adapters == {}
    finally:
        engine.close()


def test_too_many_adapters_and_unknown_names_are_refused(models: tuple) -> None:
    base, x, y = models
    engine = Engine(base, config(max_loras=1))
    try:
        engine.load_lora(adapter_of(x, "x"))
        with pytest.raises(ValueError, match="max_loras=1"):
            engine.load_lora(adapter_of(y, "y"))
        with pytest.raises(ValueError, match="lora_name 'x' is loaded already"):
            engine.load_lora(adapter_of(y, "x"))
        with pytest.raises(ValueError, match="lora 'y' is not a loaded adapter"):
            engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), lora="y")
        engine.unload_lora("x")
        engine.load_lora(adapter_of(y, "y"))  # the slot is free again: nothing ran under x
        assert sorted(engine.lora_adapters) == ["y"]
    finally:
        engine.close()
    plain = Engine(base, ContinuousBatchingConfig(page_size=4, num_blocks=32))
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            plain.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), lora="x")
    finally:
        plain.close()


def test_manager_and_generate_batch_serve_adapters(models: tuple) -> None:
    """The manager: ``load_lora`` bumps the weight version (recorded by the adapter's tokens), ``add_request(lora=)``
    and ``add_scoring_requests(lora=)`` run under it; ``generate_batch(lora=adapter)`` on a fresh engine too."""
    from transformers import GenerationConfig

    from rollout import ContinuousBatchingManager, generate_batch

    base, x, _ = models
    prompt = random_prompts(1, VOCAB_SIZE, seed=8)[0]
    expected = reference_greedy(x, prompt, 6, None)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = ContinuousBatchingManager(base, gc, config(max_loras=2))
    manager.start()
    try:
        version = manager.load_lora(adapter_of(x, "x"))
        assert version == 1 and manager.weight_version == 1 and manager.lora_adapters == ["x"]
        rid = manager.add_request(prompt, lora="x")
        base_id = manager.add_request(prompt)
        out = manager.get_result(rid, timeout=60)
        assert out.generated_tokens == expected and out.weight_versions == [1] * 6
        assert manager.get_result(base_id, timeout=60).generated_tokens == reference_greedy(base, prompt, 6, None)
        (sid,) = manager.add_scoring_requests([prompt + expected], score_from=len(prompt), lora="x")
        scored = manager.get_result(sid, timeout=60).prompt_logprobs
        assert_close(scored, teacher_forced_logprobs(x, prompt, expected), atol=LOGPROB_ATOL)
        manager.unload_lora("x")
        with pytest.raises(ValueError, match="not a loaded adapter"):
            manager.add_request(prompt, lora="x")
    finally:
        manager.stop(block=True)
    outputs = generate_batch(base, [prompt], gc, config(enable_lora=False), lora=adapter_of(x, "x"))
    assert outputs["req_0"].generated_tokens == expected


@pytest.mark.slow  # about 150 s on 2 cores: the padded paths compile
def test_compiled_steps_serve_adapters(models: tuple) -> None:
    """The compiled (padded) path runs the same hooks: greedy tokens of two adapters and the base model equal their
    models' ``generate``."""
    base, x, y = models
    engine = Engine(base, config(max_loras=2, default_compile_level=1, q_padding_interval_size=8))
    engine.load_lora(adapter_of(x, "x"))
    engine.load_lora(adapter_of(y, "y"))
    prompts = random_prompts(3, VOCAB_SIZE, seed=9)
    which = ["x", None, "y"]
    try:
        for i, (p, lora) in enumerate(zip(prompts, which)):
            engine.add_request(p, SamplingParams(max_new_tokens=5), request_id=f"r{i}", lora=lora)
        out = run_engine(engine)
    finally:
        engine.close()
    refs = {None: base, "x": x, "y": y}
    for i, (p, lora) in enumerate(zip(prompts, which)):
        assert out[f"r{i}"].generated_tokens == reference_greedy(refs[lora], p, 5, None), lora


def test_server_loads_adapters_for_trl(models: tuple, tmp_path: object) -> None:
    """rollout-serve with --enable-lora, driven by TRL's ``VLLMClient`` and the openai client: ``/server_info``'s
    ``lora_config`` passes TRL's adapter-sync probe; a loaded adapter is listed in ``/v1/models`` and chosen by a
    request's ``model`` (tokens of its peft model); unknown models 404, bad paths and ranks 400 naming the field;
    unloading removes it."""
    import httpx
    import openai
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from tests.serve_utils import running_server
    from tests.tiny_models import tiny_tokenizer

    base, x, _ = models
    folder = tmp_path / "x"  # type: ignore[operator]
    x.save_pretrained(str(folder))
    big = tmp_path / "big"  # type: ignore[operator]
    peft_model(base, 4, r=8).save_pretrained(str(big))
    prompt = random_prompts(1, VOCAB_SIZE, seed=11)[0]
    with running_server(base, tiny_tokenizer(), config(max_loras=3, max_lora_rank=4)) as srv:
        trl = VLLMClient(srv.url)
        info = trl.get_server_info()
        assert info["lora_config"]["max_lora_rank"] == 4 and info["lora_config"]["max_loras"] == 3

        class Args:  # what select_adapter_sync reads of AsyncGRPOConfig
            max_staleness = 1

        assert select_adapter_sync(info, x, Args()) is True
        trl.load_lora_adapter("policy-v1", str(folder))
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["tiny", "policy-v1"]
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        for model, ref in (("policy-v1", x), ("tiny", base)):
            out = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert out.choices[0].token_ids == reference_greedy(ref, prompt, 6, None), model
        with pytest.raises(openai.NotFoundError, match="policy-v2"):
            client.completions.create(model="policy-v2", prompt=prompt, max_tokens=2)
        bad = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path / "no")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        rank = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(big)})
        assert rank.status_code == 400 and rank.json()["error"]["param"] == "max_lora_rank"
        trl.unload_lora_adapter("policy-v1")
        assert [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]] == ["tiny"]
        gone = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "policy-v1"})
        assert gone.status_code == 404
