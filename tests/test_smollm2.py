"""generate_batch on the real default model, SmolLM2-135M-Instruct (fp32, CPU)."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import rollout
from tests.utils import assert_close, reference_greedy, teacher_forced_logprobs

QUESTIONS = [
    "What is 2+3?",
    "Name a prime number larger than 10.",
    "Write one sentence about the sea.",
    "A shop sells pens at 3 dollars each. How much do 4 pens cost?",
    "What is the capital of France?",
    "Translate 'good morning' into Spanish.",
    "List three colours.",
    "Tom has 7 apples and eats 2. How many are left?",
    "Give me a synonym of 'happy'.",
    "What is 12 times 12?",
    "Why is the sky blue? Answer briefly.",
    "Count from 1 to 5.",
    "Write a haiku about autumn.",
    "What day comes after Monday?",
    "Is 17 an even number?",
    "Explain in one sentence what a computer is.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def smollm2():
    return rollout.load_model()


@pytest.mark.slow
def test_greedy_matches_generate_and_logprobs_match_teacher_forcing_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]
    eos = model.generation_config.eos_token_id
    outputs = rollout.generate_batch(
        model,
        prompts,
        GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False),
        rollout.ContinuousBatchingConfig(return_logprobs=True, logprobs_mode="raw", num_blocks=256),
    )
    assert len(outputs) == 16
    for prompt, out in zip(prompts, outputs.values()):
        assert out.generated_tokens == reference_greedy(model, prompt, MAX_NEW, eos)
        assert_close(out.logprobs, teacher_forced_logprobs(model, prompt, out.generated_tokens), atol=1e-4)
    assert "5" in tokenizer.decode(outputs["req_0"].generated_tokens)
