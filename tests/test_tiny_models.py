"""The tiny test models themselves: deterministic, runnable with `generate`, windows really applied.

If these fail, every engine test built on them means nothing: in particular an engine that ignores
a sliding window must give different tokens than `generate` on `tiny_mistral` and `tiny_gemma`.
"""

import pytest
import torch

from tests.tiny_models import (
    ALL_TINY_MODELS,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    random_prompts,
    tiny_gemma,
    tiny_mistral,
    tiny_tokenizer,
)

WINDOW = 8
PROMPT_LEN = 24  # three windows long


def greedy_without_cache(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding: a full forward over the whole sequence per token, no KV cache."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
        if tokens[-1] == EOS_TOKEN_ID:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(ALL_TINY_MODELS))
def test_builder_gives_same_weights_and_small_config(name: str) -> None:
    first, second = ALL_TINY_MODELS[name](), ALL_TINY_MODELS[name]()
    for (key, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), key

    config = first.config
    assert not first.training
    assert all(p.dtype == torch.float32 for p in first.parameters())
    assert config._attn_implementation == "sdpa"
    assert config.vocab_size == VOCAB_SIZE
    assert config.hidden_size == 64
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2
    assert 2 <= config.num_hidden_layers <= 4
    assert config.max_position_embeddings >= 512
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)
    gen = first.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID)


@pytest.mark.parametrize("name", sorted(ALL_TINY_MODELS))
def test_generate_greedy_matches_uncached_forwards(name: str) -> None:
    model = ALL_TINY_MODELS[name]()
    prompt = random_prompts(1, min_len=PROMPT_LEN, max_len=PROMPT_LEN, seed=5)[0]

    out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    generated = out[0, PROMPT_LEN:].tolist()

    assert 1 <= len(generated) <= 16
    assert all(0 <= t < VOCAB_SIZE for t in generated)
    assert generated == greedy_without_cache(model, prompt, 16)


@pytest.mark.parametrize("builder", [tiny_mistral, tiny_gemma], ids=["mistral", "gemma"])
def test_sliding_window_changes_logits_from_position_window(builder) -> None:
    windowed, unwindowed = builder(sliding_window=WINDOW), builder(sliding_window=1024)
    prompt = torch.tensor(random_prompts(1, min_len=PROMPT_LEN, max_len=PROMPT_LEN, seed=5))
    with torch.no_grad():
        logits_windowed = windowed(prompt).logits[0]
        logits_unwindowed = unwindowed(prompt).logits[0]

    # A query at position i sees keys i - WINDOW < j <= i: the first WINDOW positions see everything.
    torch.testing.assert_close(logits_windowed[:WINDOW], logits_unwindowed[:WINDOW], rtol=0, atol=1e-5)
    max_diff = (logits_windowed[WINDOW:] - logits_unwindowed[WINDOW:]).abs().amax(dim=-1)
    assert (max_diff > 1e-2).all(), max_diff


def test_mistral_sliding_window_changes_greedy_tokens() -> None:
    prompt = random_prompts(1, min_len=PROMPT_LEN, max_len=PROMPT_LEN, seed=5)[0]
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    windowed = tiny_mistral(sliding_window=WINDOW).generate(torch.tensor([prompt]), **kwargs)
    full = tiny_mistral(sliding_window=None).generate(torch.tensor([prompt]), **kwargs)
    huge = tiny_mistral(sliding_window=1024).generate(torch.tensor([prompt]), **kwargs)

    assert windowed.shape == full.shape == (1, PROMPT_LEN + 16)
    assert torch.equal(full, huge)  # a window longer than the sequence is full attention
    assert windowed[0, PROMPT_LEN:].tolist() != full[0, PROMPT_LEN:].tolist()


def test_gemma_has_alternating_sliding_and_full_layers() -> None:
    config = tiny_gemma().config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert config.sliding_window == WINDOW


def test_random_prompts_are_reproducible_and_in_range() -> None:
    prompts = random_prompts(50, vocab_size=VOCAB_SIZE, min_len=3, max_len=9, seed=7)

    assert prompts == random_prompts(50, vocab_size=VOCAB_SIZE, min_len=3, max_len=9, seed=7)
    assert prompts != random_prompts(50, vocab_size=VOCAB_SIZE, min_len=3, max_len=9, seed=8)
    assert len(prompts) == 50
    assert all(3 <= len(p) <= 9 for p in prompts)
    assert {len(p) for p in prompts} == set(range(3, 10))
    assert all(3 <= t < VOCAB_SIZE for p in prompts for t in p)  # never pad, bos or eos


def test_random_prompts_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError):
        random_prompts(2, min_len=5, max_len=4)
    with pytest.raises(ValueError):
        random_prompts(2, min_len=0, max_len=4)


def test_tiny_tokenizer_round_trips_ids() -> None:
    tokenizer = tiny_tokenizer()

    assert tokenizer("t5 t7 t255").input_ids == [5, 7, 255]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([5, 7, EOS_TOKEN_ID], skip_special_tokens=True) == "t5 t7"
    assert len(tokenizer) == VOCAB_SIZE
