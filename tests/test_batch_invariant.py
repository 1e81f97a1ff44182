"""Batch invariance (issue 46): with ``ContinuousBatchingConfig(batch_invariant=True)`` the engine's logprob of every
generated token equals, bitwise (``==``), the trainer's ``log_softmax(logits / T)`` from a plain transformers forward of
the same model inside ``rollout.batch_invariant()``, whatever else either side batched: the same request alone or
among 63 others, chunked prefill at several budgets, a prefix-cache hit, a fork, preemption (recompute and offload),
async batching; the trainer's forward alone or batched (right- or left-padded). The modes are thread-local: a forward
of the same model in another thread is untouched while the engine decodes.
"""

from __future__ import annotations

import math

import pytest
import torch

import rollout
from rollout import ContinuousBatchingConfig, GenerationOutput, SamplingParams
from rollout.engine import Engine
from rollout.engine.attention.cpu import load_kernel
from tests.tiny_models import (
    VOCAB_SIZE,
    random_prompts,
    tiny_gemma,
    tiny_gemma2,
    tiny_llama,
    tiny_mistral,
    tiny_qwen2,
    tiny_qwen3,
)
from tests.utils import assert_close, run_engine
from trainers.loss import completion_logprobs

pytestmark = pytest.mark.skipif(load_kernel() is not None, reason="rollout's CPU extension does not build here")

T = 0.7


def config(**kwargs: object) -> ContinuousBatchingConfig:
    values = dict(page_size=4, num_blocks=256, max_batch_tokens=24, return_logprobs=True, batch_invariant=True)
    values.update(kwargs)
    return ContinuousBatchingConfig(**values)


def sampled(seed: int, n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, do_sample=True, temperature=T, seed=seed)


def generate(
    model: torch.nn.Module, prompts: list[list[int]], cfg: ContinuousBatchingConfig, **kw: object
) -> tuple[list[GenerationOutput], Engine]:
    """Each prompt i sampled with seed i (or the ``params`` given), through one engine; outputs in prompt order."""
    engine = Engine(model, cfg)
    params = kw.get("params")
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, params[i] if params else sampled(i), request_id=f"r{i}")  # type: ignore[index]
        out = run_engine(engine)
    finally:
        engine.close()
    return [out[f"r{i}"] for i in range(len(prompts))], engine


def trainer_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], temperature: float = T
) -> list[torch.Tensor]:
    """The trainer's side: ``trainers.loss.completion_logprobs`` (one left-padded forward, with autograd) inside
    ``rollout.batch_invariant()``; the logprobs of each completion."""
    with rollout.batch_invariant():
        logps, _ = completion_logprobs(model, prompts, completions, temperature, pad_token_id=0)
    return [logps[i, : len(c)].detach() for i, c in enumerate(completions)]


def assert_bitwise(engine_out: list[GenerationOutput], trainer: list[torch.Tensor]) -> None:
    for i, (out, lp) in enumerate(zip(engine_out, trainer, strict=True)):
        got = torch.tensor(out.logprobs, dtype=torch.float32)
        assert got.shape == lp.shape, i
        differ = int((got != lp).sum())
        assert differ == 0, f"request {i}: {differ} of {len(got)} logprobs differ (max {float((got - lp).abs().max())})"


@pytest.mark.parametrize(
    "make", [tiny_llama, tiny_qwen2, tiny_qwen3, tiny_mistral, tiny_gemma], ids=lambda f: f.__name__
)
def test_engine_logprobs_equal_trainer_forward_bitwise(make: object) -> None:
    """Six sampled requests (prompts up to 40 tokens, chunked at 24 a step): every logprob equals the trainer's
    batched forward and its forward of each request alone (Mistral and Gemma 3 with an 8-token sliding window)."""
    model = make()  # type: ignore[operator]
    prompts = random_prompts(6, VOCAB_SIZE, max_len=40, seed=7)
    outs, _ = generate(model, prompts, config())
    completions = [o.generated_tokens for o in outs]
    assert_bitwise(outs, trainer_logprobs(model, prompts, completions))
    for i in range(len(prompts)):
        assert_bitwise([outs[i]], trainer_logprobs(model, [prompts[i]], [completions[i]]))


def test_raw_logprobs_equal_the_trainers_at_temperature_1() -> None:
    model = tiny_llama()
    prompts = random_prompts(4, VOCAB_SIZE, max_len=30, seed=3)
    outs, _ = generate(model, prompts, config(logprobs_mode="raw"))
    assert_bitwise(outs, trainer_logprobs(model, prompts, [o.generated_tokens for o in outs], temperature=1.0))


def test_default_mode_is_not_bitwise() -> None:
    """Without the mode the two sides differ in the last bits (what the mode is for): the test above can fail."""
    model = tiny_llama()
    prompts = random_prompts(6, VOCAB_SIZE, max_len=40, seed=7)
    outs, _ = generate(model, prompts, config(batch_invariant=False))
    logps, _ = completion_logprobs(model, prompts, [o.generated_tokens for o in outs], T, pad_token_id=0)
    engine = torch.cat([torch.tensor(o.logprobs) for o in outs])
    trainer = torch.cat([logps[i, : len(o.logprobs)].detach() for i, o in enumerate(outs)])
    assert_close(engine, trainer, atol=1e-4)
    assert not torch.equal(engine, trainer)


def test_a_request_alone_and_among_63_others_and_at_any_budget() -> None:
    """One request's logprobs (same seed, so the same tokens) alone, among 63 others, and with chunked prefill at
    budgets of 5, 16 and 512 tokens a step: all equal, and equal to the trainer's."""
    model = tiny_llama()
    prompts = random_prompts(64, VOCAB_SIZE, max_len=40, seed=11)
    target = prompts[17]
    alone, _ = generate(model, [target], config(), params=[sampled(17)])
    params = [sampled(i) for i in range(64)]
    crowd, engine = generate(model, prompts, config(num_blocks=2048, max_batch_tokens=256), params=params)
    assert crowd[17].generated_tokens == alone[0].generated_tokens
    assert crowd[17].logprobs == alone[0].logprobs
    for budget in (5, 16, 512):
        out, _ = generate(model, [target], config(max_batch_tokens=budget), params=[sampled(17)])
        assert out[0].logprobs == alone[0].logprobs, budget
    assert_bitwise(alone, trainer_logprobs(model, [target], [alone[0].generated_tokens]))


def test_prefix_cache_hit_and_forks() -> None:
    """A prompt served twice, the second time from the prefix cache, then four copies of one prompt in one step
    (three forks of the first): every logprob equals the trainer's."""
    model = tiny_llama()
    prompt = random_prompts(1, VOCAB_SIZE, max_len=30, seed=5)[0]
    engine = Engine(model, config())
    try:
        engine.add_request(prompt, sampled(0), request_id="first")
        first = run_engine(engine)["first"]
        engine.add_request(prompt, sampled(1), request_id="again")
        again = run_engine(engine)["again"]
        assert engine.stats.num_prefix_cache_hit_blocks > 0
        for i in range(4):
            engine.add_request(prompt, sampled(10 + i), request_id=f"g{i}")
        group = run_engine(engine)
        assert engine.stats.num_forks == 3
    finally:
        engine.close()
    outs = [first, again, *(group[f"g{i}"] for i in range(4))]
    assert_bitwise(outs, trainer_logprobs(model, [prompt] * 6, [o.generated_tokens for o in outs]))


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_preemption(mode: str) -> None:
    """Eight requests on a cache too small for them (preempted and resumed, by recompute or from the CPU pool)."""
    model = tiny_llama()
    prompts = random_prompts(8, VOCAB_SIZE, max_len=24, seed=13)
    extra = dict(cpu_offload_space=0.01) if mode == "offload" else {}
    outs, engine = generate(
        model, prompts, config(num_blocks=24, preemption_mode=mode, **extra), params=[sampled(i, 16) for i in range(8)]
    )
    assert engine.stats.num_preemptions > 0
    if mode == "offload":
        assert engine.stats.num_offloads > 0
    assert_bitwise(outs, trainer_logprobs(model, prompts, [o.generated_tokens for o in outs]))


def manager_generate(
    model: torch.nn.Module, prompts: list[list[int]], cfg: ContinuousBatchingConfig, n: int = 10
) -> list[GenerationOutput]:
    """Each prompt i sampled with seed i through a persistent manager (its background thread)."""
    manager = rollout.ContinuousBatchingManager(model, continuous_batching_config=cfg)
    manager.start()
    try:
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"m{i}", max_new_tokens=n, temperature=T, seed=i, do_sample=True)
        outs = [manager.get_result(f"m{i}", timeout=300) for i in range(len(prompts))]
    finally:
        manager.stop(block=True)
    assert all(o is not None for o in outs)
    return outs  # type: ignore[return-value]


def test_async_batching_and_the_manager() -> None:
    """Through a manager (its background thread) with async batching: equal to the trainer's."""
    model = tiny_qwen2()
    prompts = random_prompts(6, VOCAB_SIZE, max_len=30, seed=17)
    outs = manager_generate(model, prompts, config(use_async_batching=True))
    assert_bitwise(outs, trainer_logprobs(model, prompts, [o.generated_tokens for o in outs]))


def test_trainer_side_rows_do_not_depend_on_the_batch() -> None:
    """The trainer's forward alone, batched with others (left-padded by ``completion_logprobs``) and with its
    gradient: the same logprobs; the backward runs and its gradient is the default forward's to 1e-4."""
    model = tiny_mistral()
    prompts = random_prompts(5, VOCAB_SIZE, max_len=30, seed=19)
    completions = random_prompts(5, VOCAB_SIZE, max_len=12, seed=23)
    batched = trainer_logprobs(model, prompts, completions)
    for i in range(5):
        assert torch.equal(trainer_logprobs(model, [prompts[i]], [completions[i]])[0], batched[i])
    with rollout.batch_invariant():
        logps, mask = completion_logprobs(model, prompts, completions, T, pad_token_id=0)
    (logps * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logps, mask = completion_logprobs(model, prompts, completions, T, pad_token_id=0)
    (logps * mask).sum().backward()
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        assert p.grad is not None
        assert_close(grads[n].flatten(), p.grad.flatten(), atol=1e-4)


def test_other_threads_forwards_are_untouched() -> None:
    """While a manager decodes in batch-invariant mode, a plain forward of the same model in this thread gives
    exactly what it gives alone (the modes live on the manager's thread only)."""
    model = tiny_llama()
    ids = torch.tensor(random_prompts(3, VOCAB_SIZE, max_len=20, seed=29, min_len=20))
    with torch.no_grad():
        alone = model(input_ids=ids).logits
    manager = rollout.ContinuousBatchingManager(model, continuous_batching_config=config(num_blocks=1024))
    manager.start()
    try:
        prompts = random_prompts(16, VOCAB_SIZE, max_len=30, seed=31)
        for i, p in enumerate(prompts):
            manager.add_request(p, request_id=f"bg{i}", max_new_tokens=40, temperature=T, seed=i, do_sample=True)
        for _ in range(30):
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, alone)
        assert manager.get_result("bg0", timeout=120) is not None
    finally:
        manager.stop(block=True)


@pytest.mark.parametrize(
    ("kwargs", "model_dtype", "needle"),
    [
        (dict(default_compile_level=1), torch.float32, "eager"),
        (dict(enable_lora=True), torch.float32, "LoRA"),
        (dict(cpu_attention="sdpa"), torch.float32, "cpu_attention"),
        ({}, torch.bfloat16, "float32"),
    ],
)
def test_what_the_mode_refuses(kwargs: dict, model_dtype: torch.dtype, needle: str) -> None:
    model = tiny_llama().to(model_dtype)
    with pytest.raises(ValueError, match=f"batch_invariant=True: .*{needle}"):
        Engine(model, config(**kwargs))


@pytest.mark.parametrize("which", ["gemma2", "llama_eager"])
def test_a_model_whose_own_attention_is_not_sdpa_is_refused(which: str) -> None:
    """Eager attention (Gemma 2's softcapping, or chosen by hand) computes its own matmuls and softmax in the
    trainer's forward, which the mode does not route: refused rather than silently not bitwise (a review found 49 of
    60 logprobs differing)."""
    if which == "gemma2":
        model = tiny_gemma2()
    else:
        model = tiny_llama()
        model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="batch_invariant=True: .*'eager' attention"):
        Engine(model, config())


def test_weights_changed_inside_one_context_are_read_anew() -> None:
    """A trainer loop inside one ``batch_invariant()``: after an optimizer step, or an in-place change that moves no
    version counter, the next forward computes the new weights (a review found the old weights' packed copies
    served, max |dlogit| 7)."""
    model = tiny_llama()
    ids = torch.tensor(random_prompts(2, VOCAB_SIZE, min_len=20, max_len=20, seed=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def fresh() -> torch.Tensor:
        with rollout.batch_invariant(), torch.no_grad():
            return model(input_ids=ids).logits

    with rollout.batch_invariant():
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        optimizer.step()
        with torch.no_grad():
            after_step = model(input_ids=ids).logits
    assert torch.equal(after_step, fresh())
    with rollout.batch_invariant():
        with torch.inference_mode():
            before = model(input_ids=ids).logits
        for p in model.parameters():
            p.data.mul_(1.5)
        with torch.inference_mode():
            after_data = model(input_ids=ids).logits
    assert torch.equal(after_data, fresh()) and not torch.equal(after_data, before)


def test_a_bfloat16_forward_inside_the_mode_says_it_is_not_routed() -> None:
    model = tiny_llama().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16 operation on cpu ran with ATen's kernels"):
        with rollout.batch_invariant(), torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))


def test_kernels_rows_do_not_depend_on_the_other_rows() -> None:
    """The GEMM, mean and log-softmax of a row are the same computed alone, among 1-70 rows, at any offset;
    and close to ATen's."""
    assert load_kernel() is None
    torch.manual_seed(0)
    a, w = torch.randn(70, 200), torch.randn(37, 200)
    full = torch.ops.rollout_cpu.invariant_mm(a, w)
    assert_close(full.flatten(), (a @ w.T).flatten(), atol=1e-4)
    for m in (1, 3, 4, 5, 17, 69):
        assert torch.equal(torch.ops.rollout_cpu.invariant_mm(a[m : m + 1], w), full[m : m + 1])
        assert torch.equal(torch.ops.rollout_cpu.invariant_mm(a[:m], w), full[:m])
    x = torch.randn(33, 1000)
    mean, lsm = torch.ops.rollout_cpu.invariant_mean(x), torch.ops.rollout_cpu.invariant_log_softmax(x)
    assert_close(mean, x.mean(-1), atol=1e-6)
    assert_close(lsm.flatten(), torch.log_softmax(x, -1).flatten(), atol=1e-5)
    for r in (0, 5, 32):
        assert torch.equal(torch.ops.rollout_cpu.invariant_mean(x[r : r + 1]), mean[r : r + 1])
        assert torch.equal(torch.ops.rollout_cpu.invariant_log_softmax(x[r : r + 1]), lsm[r : r + 1])
    y = torch.randn(1001)
    silu = torch.ops.rollout_cpu.invariant_unary(y, 0)
    assert_close(silu, torch.nn.functional.silu(y), atol=1e-6)
    for start in (1, 7, 990):  # every element the same wherever it lies (ATen's scalar tails round otherwise)
        assert torch.equal(torch.ops.rollout_cpu.invariant_unary(y[start:], 0), silu[start:])


def test_over_http_and_the_serve_flag() -> None:
    """``rollout-serve --batch-invariant`` sets the config field; a real server on 127.0.0.1 answers a real OpenAI
    client with logprobs equal to the trainer's (JSON floats carry float32 values exactly)."""
    import openai

    from rollout.serve.cli import build_parser, config_from_args
    from tests.serve_utils import running_server
    from tests.tiny_models import tiny_tokenizer

    assert config_from_args(build_parser().parse_args(["--batch-invariant"])).batch_invariant is True
    assert config_from_args(build_parser().parse_args([])).batch_invariant is False
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, max_len=30, seed=37)
    with running_server(model, tiny_tokenizer(), config(num_blocks=256, page_size=16)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(
            model="tiny", prompt=prompts, max_tokens=10, temperature=T, seed=3, logprobs=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
    completions = [c.token_ids for c in out.choices]
    trainer = trainer_logprobs(model, prompts, completions)
    for choice, lp in zip(out.choices, trainer, strict=True):
        assert torch.equal(torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float32), lp)


def test_grpo_with_batch_invariant_has_importance_ratio_exactly_one(tmp_path: object) -> None:
    """A synchronous GRPO run with ``batch_invariant: true``: every step's IS ratio is exactly 1.0 (min and max) and
    the behaviour KL exactly 0; without it both move in the last bits (so the assertion can fail)."""
    from tests.test_grpo import tiny_trainer

    rows = tiny_trainer(tmp_path / "bi", max_steps=3, batch_invariant=True).train()  # type: ignore[operator]
    for row in rows:
        assert row["staleness_max"] == 0
        assert row["is_ratio_min"] == 1.0 and row["is_ratio_max"] == 1.0 and row["behaviour_kl"] == 0.0, row
    plain = tiny_trainer(tmp_path / "plain", max_steps=3).train()  # type: ignore[operator]
    assert any(row["is_ratio_max"] != 1.0 or row["is_ratio_min"] != 1.0 for row in plain)
    assert all(row["behaviour_kl"] > 0 for row in plain)


def test_ppo_with_batch_invariant_has_importance_ratio_exactly_one(tmp_path: object) -> None:
    from tests.test_ppo import tiny_trainer

    rows = tiny_trainer(tmp_path / "bi", batch_invariant=True).train()  # type: ignore[operator]
    assert all(row["first_ratio_max_dev"] == 0.0 for row in rows), rows
    plain = tiny_trainer(tmp_path / "plain").train()  # type: ignore[operator]
    assert any(row["first_ratio_max_dev"] != 0.0 for row in plain)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (dict(lora_r=4), "lora_r"),
        (dict(dtype="bfloat16"), "float32"),
        (dict(engine={"batch_invariant": False}), "engine.batch_invariant"),
        (dict(batch_invariant="yes"), "true or false"),
    ],
)
def test_trainer_config_refusals(tmp_path: object, overrides: dict, needle: str) -> None:
    from tests.test_grpo import tiny_config
    from trainers.config import ConfigError

    values = dict(batch_invariant=True)
    values.update(overrides)
    with pytest.raises(ConfigError, match=needle):
        tiny_config(tmp_path, **values)  # type: ignore[operator]


def test_scoring_equals_the_trainers_forward() -> None:
    """``rollout.score`` (what ``rollout-score --batch-invariant`` runs) with the mode: each completion token's
    logprob equals the trainer's; and the flag parses."""
    from rollout.scoring.cli import parse_args

    args = ["--dataset", "d.jsonl", "--prompt-column", "p", "--completion-column", "c", "--output", "o.jsonl"]
    assert parse_args([*args, "--batch-invariant"]).batch_invariant and not parse_args(args).batch_invariant
    model = tiny_qwen2()
    prompts = random_prompts(5, VOCAB_SIZE, max_len=30, seed=41)
    completions = random_prompts(5, VOCAB_SIZE, max_len=12, seed=43)
    results = rollout.score(
        model, prompts, completions, temperature=T, batch_tokens=16, continuous_batching_config=config()
    )
    for result, lp in zip(results, trainer_logprobs(model, prompts, completions), strict=True):
        assert torch.equal(torch.tensor(result.completion_logprobs, dtype=torch.float32), lp)


def test_trl_plugin_importance_sampling_ratio_is_exactly_one(tmp_path: object) -> None:
    """``RolloutGRPOTrainer`` with a batch-invariant engine: TRL's own logged sampling/training logprob gap is 0 and
    its importance-sampling ratio 1.0 exactly at every step (TRL's forward ran inside ``batch_invariant()``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests.test_trl_plugin import mean_token_id_reward, trl_args, word_prompts
    from tests.tiny_models import tiny_tokenizer
    from trainers.trl_plugin import RolloutGRPOTrainer

    path = tmp_path / "tiny"  # type: ignore[operator]
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    args = trl_args(tmp_path, temperature=T)
    trainer = RolloutGRPOTrainer(
        model=str(path),
        reward_funcs=mean_token_id_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": word_prompts()}),
        processing_class=AutoTokenizer.from_pretrained(path),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64, batch_invariant=True),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["sampling/sampling_logp_difference/max"] == 0.0, entry
        for name in ("min", "mean", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{name}"] == 1.0, entry


def test_async_grpo_tokens_at_staleness_0_have_ratio_exactly_one(tmp_path: object) -> None:
    """The default recipe's async rollouts (max_staleness 1) with ``batch_invariant: true``: the sequences sampled
    wholly under the current weights have IS ratio exactly 1 (``is_ratio_fresh_min`` = ``is_ratio_fresh_max`` = 1.0),
    stale ones not."""
    from tests.test_grpo import tiny_trainer

    rows = tiny_trainer(  # type: ignore[operator]
        tmp_path, max_steps=4, batch_invariant=True, async_rollouts=True, max_staleness=1
    ).train()
    fresh = [row for row in rows if not math.isnan(row["is_ratio_fresh_max"])]
    assert fresh, rows
    for row in fresh:
        assert row["is_ratio_fresh_min"] == 1.0 and row["is_ratio_fresh_max"] == 1.0, row
    assert any(row["staleness_max"] == 1 and row["is_ratio_max"] != 1.0 for row in rows)


def test_the_engines_packed_weights_follow_every_weight_change() -> None:
    """The engine keeps its packed copies of the linear weights across steps: after the weights change in place (an
    optimizer-like ``add_``, and a ``param.data.copy_`` that bumps no version counter, reported by
    ``update_weights``), its logprobs are the new weights' (equal to the trainer's forward of them), not the old
    copies'."""
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, max_len=20, seed=47)
    manager = rollout.ContinuousBatchingManager(model, continuous_batching_config=config())
    manager.start()
    try:
        for change in ("add_", "data.copy_"):
            with manager.pause():
                with torch.no_grad():
                    for p in model.parameters():
                        if change == "add_":
                            p.add_(0.01 * torch.randn_like(p))
                        else:
                            p.data.copy_(p.data * 1.01)
                manager.update_weights(None)
            for i, p in enumerate(prompts):
                manager.add_request(
                    p, request_id=f"{change}{i}", max_new_tokens=8, temperature=T, seed=i, do_sample=True
                )
            outs = [manager.get_result(f"{change}{i}", timeout=120) for i in range(3)]
            assert_bitwise(outs, trainer_logprobs(model, prompts, [o.generated_tokens for o in outs]))
    finally:
        manager.stop(block=True)


@pytest.mark.slow
def test_smollm2_engine_logprobs_equal_the_trainers_forward() -> None:
    """The real default model: 8 chat prompts sampled 24 tokens each through a batch-invariant engine (chunked at 64
    tokens a step), every logprob equal to the trainer's batched forward."""
    model, tokenizer = rollout.load_model()
    questions = ["What is 17 + 25?", "Name a prime above 50.", "Spell 'rollout' backwards.", "What is 9 x 12?"] * 2
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    outs, _ = generate(
        model,
        prompts,
        config(page_size=16, num_blocks=128, max_batch_tokens=64),
        params=[sampled(i, 24) for i in range(len(prompts))],
    )
    assert_bitwise(outs, trainer_logprobs(model, prompts, [o.generated_tokens for o in outs]))
