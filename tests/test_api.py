"""api: the entry points take what transformers' take, keep a manager when asked, and ``attach`` makes them the model's.

The last test runs TRL's own ``GRPOTrainer`` with ``use_transformers_continuous_batching=True`` on an
attached tiny model: TRL calls ``model.generate_batch`` as it would on transformers, and every
completion comes from rollout's engine.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

import rollout
import rollout.engine
from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    RequestStatus,
    continuous_batching_context_manager,
    generate_batch,
    init_continuous_batching,
)
from rollout.manager.persistence import persistent_manager_of
from tests.tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, random_prompts, tiny_llama, tiny_tokenizer
from tests.utils import reference_greedy

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


def cfg(**kw) -> ContinuousBatchingConfig:  # noqa: ANN003
    kw.setdefault("page_size", 4)
    kw.setdefault("num_blocks", 64)
    return ContinuousBatchingConfig(**kw)


# ---------------------------------------------------------------- persistence
def test_generate_batch_persistent_manager_keeps_the_manager_for_the_next_call() -> None:
    model = tiny_llama()
    prompts = random_prompts(3, VOCAB_SIZE, 5, 12, seed=1)
    expected = [reference_greedy(model, p, 6, EOS_TOKEN_ID) for p in prompts]
    out = generate_batch(model, prompts, GREEDY, cfg(), persistent_manager=True)
    assert [o.generated_tokens for o in out.values()] == expected
    manager = persistent_manager_of(model)
    assert manager is not None and not manager.is_running()  # kept, stopped, cache kept
    assert manager.cb_config.page_size == 4
    again = generate_batch(model, prompts, GREEDY)  # runs on it: its prefix cache serves the prompts
    assert [o.generated_tokens for o in again.values()] == expected
    assert sum(o.num_cached_prompt_tokens for o in again.values()) > 0
    assert init_continuous_batching(model) is manager
    assert model.config._attn_implementation == "rollout_paged|sdpa"  # still paged while the manager lives
    manager.destroy()
    assert persistent_manager_of(model) is None and model.config._attn_implementation == "sdpa"


def test_generate_batch_takes_transformers_keywords() -> None:
    model = tiny_llama()
    prompts = [[5, 6, 7], [8, 9]]
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    out = generate_batch(
        model, prompts, gc, cfg(), record_timestamps=True, progress_bar=False, warmup=True,
        workload_hints=WorkloadHints(max_prompt_length=3, max_generated_length=6, num_requests=2),
    )  # fmt: skip
    assert [len(o.generated_tokens) for o in out.values()] == [6, 6]
    assert all(len(o.timestamps) == 6 for o in out.values())
    # transformers reads max_new_tokens from **kwargs and drops the rest without a word; rollout names them.
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['max_new_tokens', 'top_p'\\]"):
        generate_batch(model, prompts, GREEDY, top_p=0.5, max_new_tokens=3)
    with pytest.raises(ValueError, match="workload_hints.num_requests must be an int >= 0"):
        generate_batch(model, prompts, GREEDY, workload_hints={"num_requests": -1})
    with pytest.raises(TypeError, match="continuous_batching_config must be a rollout.ContinuousBatchingConfig"):
        generate_batch(model, prompts, GREEDY, {"page_size": 4})


# ---------------------------------------------------------------- transformers' config objects
def test_a_transformers_config_is_converted_at_every_entry_point(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama()
    theirs = transformers.ContinuousBatchingConfig(page_size=8, num_blocks=32, max_batch_tokens=64, seed=3)
    out = generate_batch(model, [[5, 6, 7]], GREEDY, theirs)
    assert out["req_0"].generated_tokens == reference_greedy(model, [5, 6, 7], 6, EOS_TOKEN_ID)
    manager = init_continuous_batching(model, GREEDY, theirs)
    assert isinstance(manager.cb_config, ContinuousBatchingConfig)
    assert (manager.engine.block_size, manager.engine.num_blocks, manager.cb_config.seed) == (8, 32, 3)
    assert manager.continuous_batching_config is manager.cb_config
    manager.destroy()
    scored = rollout.score(model, [[5, 6, 7]], [[8]], continuous_batching_config=theirs)
    assert scored[0].num_tokens == 1
    with caplog.at_level(logging.WARNING, logger="rollout.config"):
        ContinuousBatchingManager(
            model, GREEDY, transformers.ContinuousBatchingConfig(auto_switch_to_flash=False)
        ).destroy()
    assert "auto_switch_to_flash=False" in caplog.text


def test_a_config_inside_the_generation_config_is_honoured_with_a_deprecation_warning() -> None:
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own warning, at construction
        gc = GenerationConfig(max_new_tokens=4, do_sample=False, continuous_batching_config=cfg(num_blocks=24))
    with pytest.warns(FutureWarning, match="inside the GenerationConfig is deprecated"):
        manager = init_continuous_batching(model, gc)
    assert manager.engine.num_blocks == 24 and manager.engine.block_size == 4
    manager.destroy()
    with pytest.warns(FutureWarning, match="inside the GenerationConfig is deprecated"):
        out = generate_batch(model, [[5, 6]], gc)
    assert len(out["req_0"].generated_tokens) == 4


def test_workload_hints_bound_the_cache_of_a_manager() -> None:
    model = tiny_llama()
    hints = WorkloadHints(max_prompt_length=10, max_generated_length=6, num_requests=3)
    with continuous_batching_context_manager(
        model, GREEDY, ContinuousBatchingConfig(page_size=4), workload_hints=hints
    ) as manager:
        # 3 requests of 16 tokens, 4 blocks each, plus one spare block.
        assert manager.engine.num_blocks == 13
        assert manager.get_result(manager.add_request([5] * 10), timeout=30).status == RequestStatus.FINISHED


# ---------------------------------------------------------------- attach
def test_attach_binds_transformers_entry_points_with_transformers_signatures() -> None:
    model = tiny_llama()
    other = tiny_llama()
    assert rollout.attach(model) is model and rollout.is_attached(model) and not rollout.is_attached(other)
    prompts = random_prompts(2, VOCAB_SIZE, 4, 9, seed=5)
    expected = [reference_greedy(model, p, 6, EOS_TOKEN_ID) for p in prompts]
    out = model.generate_batch(prompts, GREEDY, cfg(), False, False)  # transformers' positional order
    assert [o.generated_tokens for o in out.values()] == expected
    # transformers' order: generation_config, block, timeout, continuous_batching_config, persistent_manager
    with model.continuous_batching_context_manager(GREEDY, True, None, cfg(), True) as manager:
        assert isinstance(manager, ContinuousBatchingManager)
        ids = manager.add_requests(prompts, 6)  # transformers' add_requests(inputs, max_new_tokens)
        assert [manager.get_result(r, timeout=30).generated_tokens for r in ids] == expected
    assert model.init_continuous_batching() is manager  # kept for the next session
    model.destroy_cached_continuous_batching_manager()
    assert persistent_manager_of(model) is None and manager.state == "destroyed"
    twin = copy.deepcopy(model)  # a deep copy is attached to itself, not to the original
    assert rollout.is_attached(twin) and twin.generate_batch.__self__ is twin
    assert not rollout.is_attached(other)  # the class is untouched
    with pytest.raises(rollout.UnsupportedModelError):
        rollout.attach(torch.nn.Linear(2, 2))


def test_trl_grpo_trainer_with_transformers_continuous_batching_runs_on_an_attached_model(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    # TRL passes repetition_penalty and min_p through the GenerationConfig: they stay at their neutral
    # defaults here (1.0 and None); the logits processors are another branch's work.
    model = rollout.attach(tiny_llama())
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    engines: list[rollout.engine.Engine] = []
    real_engine = rollout.manager.batch.Engine

    def counting_engine(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        engine = real_engine(*args, **kwargs)
        engines.append(engine)
        return engine

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("transformers' own continuous batching ran")

    monkeypatch.setattr(rollout.manager.batch, "Engine", counting_engine)
    monkeypatch.setattr(transformers.generation.continuous_batching.ContinuousBatchingManager, "__init__", refuse)
    prompts = [" ".join(f"t{3 + (7 * i + 5 * j) % 250}" for j in range(10)) for i in range(4)]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"page_size": 4, "num_blocks": 64},
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        temperature=0.7,
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    assert args.repetition_penalty == 1.0 and args.min_p is None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completion_ids, **kw: [sum(ids) / (255 * max(len(ids), 1)) for ids in completion_ids],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny_tokenizer(),
    )
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert len(logs) == 2 and trainer.state.global_step == 2
    # Two generation calls (one per step), each a fresh rollout engine of TRL's converted config,
    # that produced every completion token TRL logged.
    assert len(engines) == 2 and all(e.block_size == 4 and e.num_blocks == 64 for e in engines)
    generated = sum(e.stats.num_generated_tokens for e in engines)
    assert generated == round(sum(entry["completions/mean_length"] * 8 for entry in logs))
    assert all(e.closed for e in engines) and model.config._attn_implementation == "sdpa"
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())  # it trained
