"""generate_batch on the real default model, SmolLM2-135M-Instruct (fp32, CPU)."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import rollout
import rollout.engine
from tests.utils import assert_close, reference_generate, reference_greedy, run_engine, teacher_forced_logprobs

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


STEP_KINDS = {  # the three ways a step runs: eager, compiled (padded shapes), async batching
    "eager": {},
    # Level 1's settings on the decode path only: compiling both paths doubles the minutes of compilation
    # and the padded varlen step has its parity tests on tiny models (test_static_step.py).
    "compiled": {"decode_compile_config": {"mode": "default", "dynamic": True}},
    "async": {"use_async_batching": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("step_kind", list(STEP_KINDS))
def test_greedy_matches_generate_and_logprobs_match_teacher_forcing_smollm2(smollm2, step_kind: str) -> None:
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
        rollout.ContinuousBatchingConfig(
            return_logprobs=True, logprobs_mode="raw", num_blocks=256, **STEP_KINDS[step_kind]
        ),
        warmup=False,  # compile only the shapes this batch meets
    )
    assert len(outputs) == 16
    for prompt, out in zip(prompts, outputs.values()):
        assert out.generated_tokens == reference_greedy(model, prompt, MAX_NEW, eos)
        assert_close(out.logprobs, teacher_forced_logprobs(model, prompt, out.generated_tokens), atol=1e-4)
    assert "5" in tokenizer.decode(outputs["req_0"].generated_tokens)


PROCESSOR_QUESTIONS = [  # answers of 8 and 14 tokens end early; the list repeats itself
    "What is 2+3?",
    "Name a prime number larger than 10.",
    "List three colours.",
]
PROCESSOR_MAX_NEW = 24


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:  # noqa: ANN001
    """Each question as a user turn in the model's chat template, ready for the answer."""
    messages = [[{"role": "user", "content": q}] for q in questions]
    return [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)) for m in messages]


def processor_cases(tokenizer) -> dict[str, dict]:  # noqa: ANN001
    """generate() settings, one case per processor, each changing some answer of PROCESSOR_QUESTIONS."""
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("5", " 11", " prime number", " Red")]
    return {
        "repetition_penalty": {"repetition_penalty": 1.3},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "min_new_tokens": {"min_new_tokens": 12},
        "min_length": {"min_length": 50},  # prompts are 34-40 tokens
        "bad_words_ids": {"bad_words_ids": words},
        "min_p": {"min_p": 0.3},  # greedy: ignored, by both
        "stop_strings": {"stop_strings": [".", "ime"]},  # "ime" ends inside " prime"
        "together": {
            "repetition_penalty": 1.2,
            "no_repeat_ngram_size": 3,
            "bad_words_ids": words[:2],
            "min_new_tokens": 10,
            "stop_strings": ["!", "Blue"],
        },
    }


@pytest.mark.slow
def test_every_logits_processor_and_stop_strings_match_generate_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = chat_prompts(tokenizer, PROCESSOR_QUESTIONS)
    plain = [reference_generate(model, p, PROCESSOR_MAX_NEW) for p in prompts]
    config = rollout.ContinuousBatchingConfig(num_blocks=64)
    for name, kwargs in processor_cases(tokenizer).items():
        gc = GenerationConfig(max_new_tokens=PROCESSOR_MAX_NEW, do_sample=False, **kwargs)
        outputs = rollout.generate_batch(model, prompts, gc, config, tokenizer=tokenizer)
        got = [out.generated_tokens for out in outputs.values()]
        expected = [reference_generate(model, p, PROCESSOR_MAX_NEW, tokenizer=tokenizer, **kwargs) for p in prompts]
        assert got == expected, name
        assert (got != plain) is (name != "min_p"), f"{name} changed no answer: the comparison proves nothing"


@pytest.mark.slow
def test_vllm_style_stop_ends_at_the_first_stop_string_of_the_generated_text_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = chat_prompts(tokenizer, PROCESSOR_QUESTIONS)
    stop = ("</answer>", " is", ":")
    engine = rollout.engine.Engine(model, rollout.ContinuousBatchingConfig(num_blocks=64), tokenizer=tokenizer)
    try:
        params = rollout.SamplingParams(max_new_tokens=PROCESSOR_MAX_NEW, eos_token_ids=(2,), stop=stop)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=f"r{i}")
        outputs = run_engine(engine)
    finally:
        engine.close()
    num_cut = 0
    for i, p in enumerate(prompts):
        plain = reference_generate(model, p, PROCESSOR_MAX_NEW)
        texts = [tokenizer.decode(plain[: k + 1]) for k in range(len(plain))]
        cut = next((k + 1 for k, text in enumerate(texts) if any(s in text for s in stop)), len(plain))
        assert outputs[f"r{i}"].generated_tokens == plain[:cut], i
        num_cut += cut < len(plain)
        stopped = any(s in texts[cut - 1] for s in stop) or plain[cut - 1] == 2  # a stop string or eos
        assert outputs[f"r{i}"].finish_reason == ("stop" if stopped else "length")
    assert num_cut >= 2  # " is" and ":" end two answers early
