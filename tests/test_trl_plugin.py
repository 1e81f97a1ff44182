"""trainers.trl_plugin: TRL's GRPOTrainer generating with rollout's manager, on a tiny Llama."""

from __future__ import annotations

import re

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig

import rollout
import rollout.engine.kv.sizing as sizing
from rollout import ContinuousBatchingConfig
from tests.tiny_models import tiny_json_tokenizer, tiny_llama, tiny_tokenizer
from tests.utils import assert_close
from trainers.setup import training_memory_percent
from trainers.trl_plugin import RolloutGRPOTrainer

TEMPERATURE = 0.7
NUM_GENERATIONS = 4
BATCH = 8  # 2 prompts x 4 completions per step
MAX_STEPS = 2
CHECK_PROMPT = [5, 9, 11, 13, 17, 19, 23, 29, 31]


def mean_token_id_reward(completion_ids, **kwargs):
    """A reward with spread inside every group: the mean generated token id, scaled to [0, 1]."""
    return [sum(ids) / (255 * len(ids)) for ids in completion_ids]


def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token under a plain forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logps = torch.log_softmax(logits / temperature, dim=-1)
    return logps.gather(1, torch.tensor(completion)[:, None])[:, 0]


class Probe(TrainerCallback):
    """Records the manager's state at the points where the trainer must hold it paused."""

    def __init__(self) -> None:
        self.trainer: RolloutGRPOTrainer | None = None
        self.paused_at_pre_optimizer: list[bool] = []
        self.paused_at_step_end: list[bool] = []
        self.at_train_end: dict = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.paused_at_pre_optimizer.append(self.trainer.rollout_paused)

    def on_step_end(self, args, state, control, **kwargs):
        self.paused_at_step_end.append(self.trainer.rollout_paused)

    def on_train_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        manager = trainer.rollout_manager
        model = trainer.accelerator.unwrap_model(trainer.model)
        # A greedy completion through the manager, scored by a plain forward of the trained model
        # (greedy requests report log_softmax(logits), temperature 1).
        out = trainer.rollout_generate([CHECK_PROMPT], do_sample=False)[0]
        self.at_train_end = {
            "same_model": manager.model is model,
            "weight_version": manager.weight_version,
            "global_step": state.global_step,
            "manager_logprobs": list(out.logprobs),
            "trained_logprobs": teacher_forced_logprobs(model, CHECK_PROMPT, out.generated_tokens, 1.0),
            "initial_logprobs": teacher_forced_logprobs(tiny_llama(), CHECK_PROMPT, out.generated_tokens, 1.0),
            "paused_after_check": trainer.rollout_paused,
        }


@pytest.fixture
def tiny_llama_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    tiny_llama().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def word_prompts() -> list[str]:
    """Four non-conversational prompts of 10 word tokens each (the tiny tokenizer has no chat template)."""
    return [" ".join(f"t{3 + (7 * i + 5 * j) % 250}" for j in range(10)) for i in range(4)]


def trl_args(tmp_path, **overrides) -> GRPOConfig:
    """TRL's config of the runs here: 2 prompts x 4 completions per step, 8 tokens, MAX_STEPS steps; lr 1e-2 (large,
    so that stale weights would show in the logprob gap)."""
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        temperature=TEMPERATURE,
        learning_rate=1e-2,
        max_steps=MAX_STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def test_grpo_trainer_generates_with_manager_and_logs_importance_sampling(tiny_llama_dir, tmp_path):
    # Non-conversational prompts (the tiny tokenizer has no chat template): 10 word tokens each,
    # so with block_size 4 the G completions of a prompt share its 2 full blocks.
    dataset = Dataset.from_dict({"prompt": word_prompts()})
    args = trl_args(tmp_path)
    probe = Probe()
    trainer = RolloutGRPOTrainer(
        model=tiny_llama_dir,
        reward_funcs=mean_token_id_reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir),
        callbacks=[probe],
        continuous_batching_config=ContinuousBatchingConfig(block_size=4, num_blocks=64),
    )
    probe.trainer = trainer
    trainer.train()

    # Generation went through the manager: every completion token TRL logged was sampled by it.
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert len(logs) == MAX_STEPS
    summary = trainer.rollout_summary
    completion_tokens = sum(entry["completions/mean_length"] * BATCH for entry in logs)
    assert summary["num_generated_tokens"] == round(completion_tokens) + len(probe.at_train_end["manager_logprobs"])
    # The G completions of each prompt computed it once: the other G - 1 forked from the first
    # (2 prompts x 3 forks per step).
    assert summary["num_forks"] >= MAX_STEPS * 2 * (NUM_GENERATIONS - 1)
    assert all(entry["rollout/cached_prompt_fraction"] > 0 for entry in logs)

    # TRL's importance-sampling correction ran on our logprobs and logged its metrics; the manager
    # sampled under the current weights at every step (after the first update too), so the sampling
    # logprobs equal TRL's recomputed ones to float precision and the ratio is 1.
    for entry in logs:
        for name in ("min", "mean", "max"):
            assert entry[f"sampling/importance_sampling_ratio/{name}"] == pytest.approx(1.0, abs=1e-3)
        assert entry["sampling/sampling_logp_difference/max"] < 1e-4

    # One weight version per optimizer step; paused through every optimizer step.
    assert trainer.state.global_step == MAX_STEPS
    assert summary["weight_version"] == MAX_STEPS
    assert [entry["rollout/weight_version"] for entry in logs] == [0.0, 1.0]
    assert probe.paused_at_pre_optimizer == [True] * MAX_STEPS
    assert probe.paused_at_step_end == [True] * MAX_STEPS

    # The manager runs on the trained model itself: its logprobs are the trained weights', which moved.
    end = probe.at_train_end
    assert end["same_model"] and end["weight_version"] == end["global_step"] == MAX_STEPS
    assert end["paused_after_check"]
    assert_close(end["manager_logprobs"], end["trained_logprobs"], atol=1e-4)
    assert (end["trained_logprobs"] - end["initial_logprobs"]).abs().max() > 1e-2

    # Destroyed at the end of train(), attention restored.
    assert trainer.rollout_manager is None
    assert trainer.model.config._attn_implementation == "sdpa"


def test_rejects_unsupported_sampling_options(tiny_llama_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        min_p=0.1,
        report_to="none",
        bf16=False,
    )
    with pytest.raises(ValueError, match="min_p"):
        RolloutGRPOTrainer(
            model=tiny_llama_dir,
            reward_funcs=mean_token_id_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * 4}),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir),
        )


@pytest.mark.parametrize(
    ("given", "expected_percent"),
    [
        (ContinuousBatchingConfig(page_size=4), "training"),  # nothing set: the training share
        (ContinuousBatchingConfig(page_size=4, max_memory_percent=0.2), 0.2),  # the user's share stays
        (ContinuousBatchingConfig(page_size=4, num_blocks=48), None),  # an explicit cache size stays
    ],
    ids=["default", "explicit_share", "explicit_blocks"],
)
def test_manager_takes_the_training_share_of_memory_unless_told_otherwise(
    tiny_llama_dir, tmp_path, monkeypatch, given, expected_percent
):
    # Issue 13 case 4: the manager is built at the first generation, before gradients and optimizer
    # state exist; the engine's default (0.9 of memory on CUDA) would leave the first backward nothing.
    for module in (sizing, rollout):  # the engine's sizing and the trainer's share read it
        monkeypatch.setattr(module, "usable_memory_bytes", lambda device: 64 * 1024**2)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, report_to="none", bf16=False,
    )  # fmt: skip
    trainer = RolloutGRPOTrainer(
        model=tiny_llama_dir,
        reward_funcs=mean_token_id_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * 4}),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir),
        continuous_batching_config=given,
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    try:
        manager = trainer._ensure_manager()
        state = 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if expected_percent == "training":
            expected_percent = min(0.25, 0.5 * (64 * 1024**2 - state) / (64 * 1024**2))  # 0.25 cap on CPU
            assert training_memory_percent(model) == expected_percent
        assert manager.cb_config.max_memory_percent == expected_percent
        blocks = 48 if given.num_blocks else rollout.engine.num_blocks_for_model(model, manager.cb_config)
        assert manager.engine.num_blocks == blocks
    finally:
        trainer.close_rollout_manager()


# Sampling values a checkpoint's generation_config.json may carry (Qwen2.5-Instruct ships these).
CHECKPOINT_SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


def test_the_model_s_generation_config_does_not_reach_trl_s_sampling(tmp_path):
    # Issue 22, item 1 (TRL 5783): TRL sends top_k 0, top_p 1.0 and no repetition penalty; the checkpoint's
    # top_k 20, top_p 0.8 and repetition_penalty 1.05 must not be merged in, or the importance-sampling
    # ratio compares the policy with a distribution it was not sampled from.
    path = tmp_path / "tiny-llama-sampling"
    model = tiny_llama()
    model.generation_config.update(**CHECKPOINT_SAMPLING)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=12, temperature=1.0, report_to="none", bf16=False,
    )  # fmt: skip
    trainer = RolloutGRPOTrainer(
        model=str(path),
        reward_funcs=mean_token_id_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * 4}),
        processing_class=AutoTokenizer.from_pretrained(path),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert policy.generation_config.top_k == 20  # the checkpoint's values are loaded...
    try:
        manager = trainer._ensure_manager()
        # ...and none of them reaches the requests: exactly TRL's values (top_k 0: all tokens).
        assert manager.default_params == rollout.SamplingParams(
            max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_ids=tuple(trainer.eos_token_ids),
        )  # fmt: skip
        prompt = [5, 6, 7, 8, 5, 6, 7, 8]
        outs = trainer.rollout_generate([prompt] * 4, seed=3)
    finally:
        trainer.close_rollout_manager()
    for out in outs:
        expected = teacher_forced_logprobs(policy, prompt, out.generated_tokens, 1.0)
        ratio = torch.exp(expected - torch.tensor(out.logprobs))
        assert_close(ratio, torch.ones(len(out.generated_tokens)), atol=1e-4)


TRL_REGEX = "[a-c]{2}[0-9]{1,2}"


def test_vllm_structured_outputs_regex_constrains_every_completion(tmp_path):
    # Issue 47 item 4: TRL's GRPOConfig.vllm_structured_outputs_regex, honoured as TRL's vLLM backend does. The
    # byte-level tokenizer can spell the regex; its prompts are one-character words ("1 2 3": three ids).
    path = tmp_path / "tiny-llama-json"
    tiny_llama().save_pretrained(path)
    tiny_json_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    completions: list[str] = []

    def record(completions_text=None, completion_ids=None, **kwargs):
        completions.extend(tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids)
        return mean_token_id_reward(completion_ids)

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, temperature=1.0, max_steps=2, logging_steps=1, save_strategy="no",
        report_to="none", bf16=False, seed=0, disable_tqdm=True, vllm_structured_outputs_regex=TRL_REGEX,
    )  # fmt: skip
    trainer = RolloutGRPOTrainer(
        model=str(path),
        reward_funcs=record,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"{i} {i + 1} {i + 2}" for i in range(4)]}),
        processing_class=tokenizer,
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    assert trainer.rollout_structured_outputs == rollout.StructuredOutputs(regex=TRL_REGEX)
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(completions) == 2 * 8
    assert all(re.fullmatch(TRL_REGEX, text) for text in completions), completions
    # The logprobs stay the model's own (raw), the quantity TRL's forward computes: the ratio is 1.
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    ratios = [entry["sampling/importance_sampling_ratio/mean"] for entry in logs]
    assert ratios == pytest.approx([1.0, 1.0], abs=1e-3)


def test_a_bad_vllm_structured_outputs_regex_is_refused_naming_the_field(tiny_llama_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, report_to="none",
        bf16=False, vllm_structured_outputs_regex="[0-9",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"vllm_structured_outputs_regex: structured_outputs\.regex"):
        RolloutGRPOTrainer(
            model=tiny_llama_dir,
            reward_funcs=mean_token_id_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * 4}),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir),
        )
