"""LoRA training (``trainers.lora``): GRPO and PPO train a peft adapter and sync only the adapter to the rollout
engine, in process (the manager's ``load_lora``) and to ``rollout-serve`` replicas over the transfer group.

After a sync, a request must run under the new adapter: greedy tokens equal to the trainer's peft model's
``generate``, logprobs within 1e-4 of its teacher-forced forward, never KV of the base model or of another adapter
(a prompt cached under the base model first). The bytes of a sync are the adapter's, checked against the full
weights.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaConfig

import rollout
from rollout import ContinuousBatchingConfig, RolloutPool, RolloutServerError
from rollout.weights.transfer import TensorMeta, update_info
from tests.serve_utils import running_server
from tests.test_grpo import low_token_reward, tiny_config, tiny_trainer, token_dataset
from tests.test_ppo import tiny_trainer as tiny_ppo_trainer
from tests.tiny_models import tiny_llama, tiny_tokenizer
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs
from trainers.cli import parse_config
from trainers.config import ConfigError
from trainers.grpo import GRPOTrainer
from trainers.lora import LoraRollouts, adapter_sync_bytes
from trainers.report import report

pytest.importorskip("peft")

LOGPROB_ATOL = 1e-4
# 33 tokens: two full blocks of 16 are cached under the base model before the sync.
PROMPT = [5 + (7 * i) % 90 for i in range(33)]
NEW_TOKENS = 8
LORA = dict(lora_r=4, lora_alpha=8.0)


def adapter_bytes(peft_model: torch.nn.Module) -> int:
    """Bytes of the peft model's LoRA tensors, counted from its own parameters."""
    return sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if ".lora_" in n)


def state_dict_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def check_against_peft(peft_model: torch.nn.Module, base: torch.nn.Module, tokens: list[int], logprobs: list[float]):
    """Greedy tokens of the peft model, logprobs of its teacher-forced forward (1e-4), and not the base model's."""
    assert tokens == reference_greedy(peft_model, PROMPT, NEW_TOKENS, None)[: len(tokens)]
    assert len(tokens) == NEW_TOKENS
    assert_close(logprobs, teacher_forced_logprobs(peft_model, PROMPT, tokens), LOGPROB_ATOL)
    base_logprobs = teacher_forced_logprobs(base, PROMPT, tokens)
    # The step moved the adapter enough that base KV or base weights would fail the 1e-4 check above.
    assert max(abs(a - b) for a, b in zip(logprobs, base_logprobs)) > 1e-3


def served_greedy(url: str, model: str) -> tuple[list[int], list[float]]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status().json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def lora_server_config() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(
        num_blocks=128, page_size=16, return_logprobs=True, enable_lora=True, max_loras=2, max_lora_rank=4
    )


def test_grpo_lora_step_syncs_only_the_adapter_and_the_engine_then_matches_peft(tmp_path: Path) -> None:
    trainer = tiny_trainer(tmp_path, max_steps=1, engine={"page_size": 16}, **LORA)
    backend = trainer.backend
    assert isinstance(backend, LoraRollouts)
    manager = backend.backend
    base_before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    backend.start()
    try:
        # The prompt's blocks are cached under the base model (no adapter before the first sync).
        before = backend.get_result(backend.add_request(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))
        assert before is not None and before.weight_versions == [0] * len(before.generated_tokens)
        row = trainer.train_step(0)
        assert row["weight_version"] == 1
        assert backend.adapter == "grpo-v1" and manager.lora_adapters == ["grpo-v1"]
        sent = adapter_bytes(trainer.trained_policy)
        assert row["lora_sync_bytes"] == backend.last_sync_bytes == sent
        assert row["full_sync_bytes"] == sum(p.numel() * p.element_size() for p in trainer.policy.parameters())
        assert sent < 0.1 * state_dict_bytes(trainer.policy)  # the tiny model: 32 KiB of 449 KiB
        for name, p in trainer.policy.named_parameters():  # the base weights are frozen and never sent
            assert torch.equal(p, base_before[name]), name
        out = backend.get_result(backend.add_request(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False))
        assert out is not None and out.weight_versions == [1] * NEW_TOKENS
        check_against_peft(trainer.trained_policy, trainer.policy, list(out.generated_tokens), list(out.logprobs))
    finally:
        trainer.close()


def test_ppo_lora_step_trains_the_adapter_on_the_engines_logprobs(tmp_path: Path) -> None:
    trainer = tiny_ppo_trainer(tmp_path, max_steps=2, kl_coef=0.05, **LORA)
    rows = trainer.train()
    assert [r["weight_version"] for r in rows] == [1, 2]
    # Step 2 samples under adapter v1: the engine's logprobs equal the trainer's peft forward of the same weights.
    assert rows[1]["logprob_diff_max"] < 1e-3
    assert trainer.backend.adapter == "ppo-v2"
    assert rows[1]["lora_sync_bytes"] == adapter_bytes(trainer.trained_policy)
    assert trainer.reference is trainer.policy  # the initial LoRA policy is the base model itself: no copy
    # The run's report names the adapter and the bytes each sync sent against a full sync.
    text = report(tmp_path / "out", None, "CMD")
    sent, full = adapter_bytes(trainer.trained_policy), rows[1]["full_sync_bytes"]
    assert "the default recipe with a rank-4 LoRA adapter" in text and "a LoRA adapter (peft) of rank 4" in text
    figures = f"**{sent:,} bytes** against {full:,.0f} for a full sync of the weights (**{100 * sent / full:.2f}%**)"
    assert f"{figures}, over 2 syncs" in text


def test_grpo_lora_on_a_server_sends_only_the_adapter_over_the_transfer_group(tmp_path: Path) -> None:
    served = tiny_llama(seed=3)  # other weights: the base weights are sent once, at start
    with running_server(served, tiny_tokenizer(), lora_server_config()) as srv:
        trainer = GRPOTrainer(
            tiny_config(tmp_path, rollout_server=srv.url, max_steps=2, **LORA),
            model=tiny_llama(),
            tokenizer=tiny_tokenizer(),
            train_dataset=token_dataset(),
            reward_funcs=[low_token_reward],
        )
        rows = trainer.train()
        assert [r["weight_version"] for r in rows] == [1, 2]
        assert abs(rows[1]["is_ratio_max"] - 1) < 1e-3  # step 2 sampled under adapter v1 on the server
        pool = trainer.backend.backend.client
        assert pool.last_send["bytes"] == adapter_bytes(trainer.trained_policy) == rows[1]["lora_sync_bytes"]
        assert srv.manager.lora_adapters == ["grpo-v2"]  # v1 unloaded once v2 was in
        for (name, base), (_, live) in zip(trainer.policy.named_parameters(), served.named_parameters()):
            assert torch.equal(base, live), name
        tokens, logprobs = served_greedy(srv.url, "grpo-v2")
        check_against_peft(trainer.trained_policy, trainer.policy, tokens, logprobs)


def test_grpo_lora_on_a_pool_of_two_servers_loads_the_adapter_on_both(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    with running_server(tiny_llama(seed=3), tok, lora_server_config()) as a:
        with running_server(tiny_llama(seed=4), tok, lora_server_config()) as b:
            trainer = GRPOTrainer(
                tiny_config(tmp_path, rollout_server=f"{a.url},{b.url}", max_steps=1, **LORA),
                model=tiny_llama(),
                tokenizer=tok,
                train_dataset=token_dataset(),
                reward_funcs=[low_token_reward],
            )
            trainer.train()
            last = trainer.backend.backend.client.last_send
            assert sorted(last["servers"]) == sorted([a.url, b.url])
            assert last["bytes"] == adapter_bytes(trainer.trained_policy)  # one broadcast for both
            for srv in (a, b):
                assert srv.manager.lora_adapters == ["grpo-v1"]
                tokens, logprobs = served_greedy(srv.url, "grpo-v1")
                check_against_peft(trainer.trained_policy, trainer.policy, tokens, logprobs)


def test_adapter_over_the_transfer_group_is_refused_with_the_field_named() -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj"]))
    big = rollout.LoraAdapter.from_tensors("big", rollout.adapter_state_dict(model), r=8, lora_alpha=8)
    plain = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True)
    with running_server(tiny_llama(), tiny_tokenizer(), plain) as srv, RolloutPool(srv.url) as pool:
        with pytest.raises(RolloutServerError) as e:
            pool.send_lora_adapter(big)
        assert e.value.status == 400 and e.value.param == "lora_adapter" and "--enable-lora" in e.value.message
    with running_server(tiny_llama(), tiny_tokenizer(), lora_server_config()) as srv, RolloutPool(srv.url) as pool:
        with pytest.raises(RolloutServerError) as e:
            pool.send_lora_adapter(big)  # rank 8 > --max-lora-rank 4
        assert e.value.status == 400 and e.value.param == "max_lora_rank"
        # A name that is not a LoRA tensor: refused at the announcement, before any byte is received.
        pool.init_weight_transfer()
        lora = {"lora_name": "x", "r": 4, "lora_alpha": 8}
        httpx.post(f"{srv.url}/start_weight_update", json={"lora_adapter": lora}, timeout=10).raise_for_status()
        info = update_info([TensorMeta("model.embed_tokens.weight", torch.float32, (256, 64))])
        response = httpx.post(f"{srv.url}/update_weights", json={"update_info": info}, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "update_info.names"
        assert srv.manager.lora_adapters == []


def test_lora_run_on_a_server_without_enable_lora_fails_at_start_naming_the_flag(tmp_path: Path) -> None:
    plain = ContinuousBatchingConfig(num_blocks=64, page_size=16, return_logprobs=True)
    with running_server(tiny_llama(), tiny_tokenizer(), plain) as srv:
        trainer = GRPOTrainer(
            tiny_config(tmp_path, rollout_server=srv.url, max_steps=1, **LORA),
            model=tiny_llama(),
            tokenizer=tiny_tokenizer(),
            train_dataset=token_dataset(),
            reward_funcs=[low_token_reward],
        )
        with pytest.raises(ValueError, match=r"rollout_server .* --enable-lora --max-lora-rank 4 --max-loras 2"):
            trainer.backend.start()
        trainer.close()
        assert srv.manager.weight_version == 0  # nothing was sent


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"lora_r": 0}, "lora_r"),
        ({"lora_r": -2}, "lora_r"),
        ({"lora_r": 4, "lora_alpha": 0.0}, "lora_alpha"),
        ({"lora_r": 4, "lora_target_modules": []}, "lora_target_modules"),
        ({"lora_r": 4, "lora_target_modules": ["all-linear", "q_proj"]}, "lora_target_modules"),
        ({"lora_r": 4, "lora_plus_ratio": 0.0}, "lora_plus_ratio"),
        ({"lora_r": 4, "lora_plus_ratio": "16"}, "lora_plus_ratio"),
        ({"lora_plus_ratio": 16.0}, "lora_plus_ratio"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(tmp_path: Path, overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}\b"):
        tiny_config(tmp_path, **overrides)


@pytest.mark.parametrize(
    ("targets", "says"), [(["q_proj", "qkv_proj"], "'qkv_proj' matches no linear layer"), (["lm_head"], "LM head")]
)
def test_unknown_lora_target_is_refused_before_any_work(tmp_path: Path, monkeypatch, targets, says) -> None:
    def no_backend(*args, **kwargs):
        raise AssertionError("the rollout backend was built before the targets were checked")

    monkeypatch.setattr("trainers.recipe.rollout_backend", no_backend)
    with pytest.raises(ConfigError, match=rf"^lora_target_modules: .*{says}"):
        tiny_trainer(tmp_path, lora_r=4, lora_target_modules=targets)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_lora_plus_ratio_puts_the_b_matrices_at_ratio_times_the_learning_rate(tmp_path: Path, algo: str) -> None:
    """LoRA+: every lora_B at 16 x learning_rate, every lora_A at learning_rate (PPO's value head in its own group),
    and one step moves B from zero; with the default ratio 1 all adapter tensors share one group."""
    make = tiny_trainer if algo == "grpo" else tiny_ppo_trainer
    trainer = make(tmp_path / "plus", max_steps=1, lora_plus_ratio=16.0, **LORA)
    lr = trainer.config.learning_rate
    try:
        names = {id(p): n for n, p in trainer.trained_policy.named_parameters()}
        by_lr: dict[float, set[str]] = {}
        for group in trainer.optimizer.param_groups:
            kinds = {"B" if ".lora_B." in names.get(id(p), "") else "A" if ".lora_A." in names.get(id(p), "") else
                     "other" for p in group["params"]}  # fmt: skip
            by_lr.setdefault(group["initial_lr"], set()).update(kinds)
        assert by_lr[16 * lr] == {"B"} and "A" in by_lr[lr] and "B" not in by_lr[lr]
        trainer.train()
        b = [p for n, p in trainer.trained_policy.named_parameters() if ".lora_B." in n]
        assert b and all(p.abs().max() > 0 for p in b)
    finally:
        trainer.close()
    trainer = make(tmp_path / "plain", max_steps=1, **LORA)
    try:
        adapter = [g for g in trainer.optimizer.param_groups if g["initial_lr"] == trainer.config.learning_rate]
        names = {
            n for g in adapter for n, p in trainer.trained_policy.named_parameters() if any(p is q for q in g["params"])
        }
        assert any(".lora_B." in n for n in names) and any(".lora_A." in n for n in names)
    finally:
        trainer.close()


def test_ppo_lora_with_a_critic_is_refused(tmp_path: Path) -> None:
    from trainers.ppo_config import PPOConfig

    with pytest.raises(ConfigError, match="value_model 'critic'"):
        PPOConfig(model="tiny", lora_r=4, value_model="critic", output_dir=str(tmp_path))


def test_lora_flags_parse() -> None:
    config = parse_config(["--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "v_proj"])
    assert (config.lora_r, config.lora_alpha, config.lora_target_modules) == (8, 16.0, ["q_proj", "v_proj"])
    assert config.engine_config().enable_lora and config.engine_config().max_lora_rank == 8
    assert config.engine_config().max_loras == config.effective_prefetch + 2


def test_smollm2_shaped_adapter_is_under_two_percent_of_the_full_weights() -> None:
    """SmolLM2-135M's shapes (its config.json), counted on the meta device: r=8 on every linear layer."""
    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    adapter, full = adapter_sync_bytes(config, r=8)
    # Per layer r * (in + out) for q, k, v, o (576x576, 576x192 twice, 576x576) and gate, up, down (576x1536 each).
    per_layer = 8 * ((576 + 576) + 2 * (576 + 192) + (576 + 576) + 3 * (576 + 1536))
    assert adapter == 30 * per_layer * 4
    assert full == 538_060_032  # 134.5 M float32 parameters, the tied embedding once
    assert adapter / full < 0.02
