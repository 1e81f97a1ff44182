"""Tiny randomly initialised decoder-only models for tests.

Every builder makes its model from a config written here, under a fixed seed, so two calls give the
same weights, and nothing is downloaded. All models are fp32, in eval mode, on CPU, and use the
attention implementation `transformers` picks by default ("sdpa"). Shapes are the same for all:
hidden 64, 4 query heads and 2 KV heads (grouped-query attention), head_dim 16, vocab 256,
`max_position_embeddings` 512; bos=1, eos=2, pad=0.

`initializer_range` is 0.2 rather than the usual 0.02: with the default the logits of a random model
are almost flat, greedy decoding repeats one token, and near-ties make argmax flip under harmless
changes of summation order. Larger weights give varied completions with clear margins.

The families differ where an engine can go wrong:
- llama: plain RoPE attention with GQA.
- qwen2: bias on the q/k/v projections.
- qwen3: RMSNorm on queries and keys (`q_norm`, `k_norm`).
- mistral: one sliding window for every layer (`config.sliding_window`, no `layer_types`), shorter than
  the test sequences.
- gemma3 (text only): sliding and full attention layers alternating (`config.layer_types`), a
  different RoPE base for each, scaled embeddings, `query_pre_attn_scalar`, tied embeddings.

Not in ``ALL_TINY_MODELS`` (built for the KV cache's layer groups): ``tiny_gemma3_5to1``, Gemma 3's own
pattern of 5 sliding layers to 1 global layer, and ``tiny_gemma4``, whose global layers have another
head dim or KV-head count than its sliding layers.
- gemma2 (`tiny_gemma2`, not in ALL_TINY_MODELS): Gemma 2's tanh soft-capping of the attention scores,
  with sliding and full layers alternating; "eager" attention (transformers' "sdpa" refuses softcap).
"""

import itertools
from collections.abc import Callable

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB_SIZE = 256
SEED = 0
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

# Keyword arguments shared by every tiny config.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    pad_token_id=PAD_TOKEN_ID,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    tie_word_embeddings=False,
)


def _build(model_cls: type[PreTrainedModel], config: object, seed: int) -> PreTrainedModel:
    """Instantiate `model_cls(config)` under `torch.manual_seed(seed)`, fp32, eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # Generation defaults come from the config; make the special ids explicit there too.
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.generation_config.bos_token_id = BOS_TOKEN_ID
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    return model


def tiny_llama(seed: int = SEED) -> LlamaForCausalLM:
    """Llama: 2 layers, full causal attention, GQA 4/2."""
    config = LlamaConfig(**_COMMON, num_hidden_layers=2)
    return _build(LlamaForCausalLM, config, seed)


def tiny_qwen2(seed: int = SEED) -> Qwen2ForCausalLM:
    """Qwen2: 2 layers, full attention, bias on q/k/v projections."""
    config = Qwen2Config(**_COMMON, num_hidden_layers=2, use_sliding_window=False)
    return _build(Qwen2ForCausalLM, config, seed)


def tiny_qwen3(seed: int = SEED) -> Qwen3ForCausalLM:
    """Qwen3: 3 layers, full attention, RMSNorm on queries and keys."""
    config = Qwen3Config(**_COMMON, num_hidden_layers=3, use_sliding_window=False)
    return _build(Qwen3ForCausalLM, config, seed)


def tiny_mistral(sliding_window: int | None = 8, seed: int = SEED) -> MistralForCausalLM:
    """Mistral: 2 layers, every layer attends to at most `sliding_window` keys.

    In transformers 5.24 Mistral applies the window through `config.sliding_window` alone: the model
    builds its mask with `create_sliding_window_causal_mask` when the value is not None, and passes
    `sliding_window=config.sliding_window` to the attention function. There is no `layer_types`
    (setting one only logs a warning). A query at position i sees keys i - sliding_window < j <= i,
    that is the last `sliding_window` tokens including itself.

    Args:
        sliding_window: window length in tokens; None for full attention. The same seed gives the same
            weights whatever the window, so two windows can be compared on one set of weights.
        seed: torch seed for the weights.
    """
    config = MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=sliding_window)
    return _build(MistralForCausalLM, config, seed)


def tiny_gemma(sliding_window: int = 8, seed: int = SEED) -> Gemma3ForCausalLM:
    """Gemma3 text model: 4 layers alternating sliding (window `sliding_window`) and full attention.

    Layers 0 and 2 are `"sliding_attention"`, layers 1 and 3 `"full_attention"`, each with its own
    RoPE base (10,000 local, 1,000,000 global). The attention scale is `query_pre_attn_scalar ** -0.5`
    (set to head_dim here), embeddings are scaled by sqrt(hidden_size) and tied to the LM head.

    Args:
        sliding_window: window length of the sliding layers, in tokens.
        seed: torch seed for the weights.
    """
    common = dict(_COMMON)
    config = Gemma3TextConfig(
        **common,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=sliding_window,
        query_pre_attn_scalar=16,
    )
    return _build(Gemma3ForCausalLM, config, seed)


def tiny_gemma3_5to1(sliding_window: int = 64, seed: int = SEED) -> Gemma3ForCausalLM:
    """Gemma3 text model with Gemma 3's layer pattern: 5 sliding-window layers, then 1 global layer.

    Layers 0-4 are ``"sliding_attention"`` (window ``sliding_window``), layer 5 ``"full_attention"``;
    otherwise as ``tiny_gemma``, with ``max_position_embeddings`` 2048 so that 1,000-token prompts stay
    inside the model's context.

    Args:
        sliding_window: window length of the sliding layers, in tokens.
        seed: torch seed for the weights.
    """
    config = Gemma3TextConfig(
        **{**_COMMON, "max_position_embeddings": 2048},
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=sliding_window,
        query_pre_attn_scalar=16,
    )
    return _build(Gemma3ForCausalLM, config, seed)


def tiny_gemma4(
    global_head_dim: int = 32,
    num_global_key_value_heads: int | None = None,
    sliding_window: int = 8,
    seed: int = SEED,
) -> Gemma4ForCausalLM:
    """Gemma4 text model whose layers differ in KV shape: 4 layers, sliding and full alternating.

    The sliding layers (0, 2) have 2 KV heads of head dim 16; the full layers (1, 3) have head dim
    ``global_head_dim`` and, when ``num_global_key_value_heads`` is given, that many KV heads (Gemma 4
    then reuses the keys as values, ``attention_k_eq_v``). Per-layer input embeddings of width 16.

    Args:
        global_head_dim: head dim of the full-attention layers.
        num_global_key_value_heads: KV heads of the full-attention layers (None: 2, as the others).
        sliding_window: window length of the sliding layers, in tokens.
        seed: torch seed for the weights.
    """
    extra: dict = {"global_head_dim": global_head_dim}
    if num_global_key_value_heads is not None:
        extra.update(num_global_key_value_heads=num_global_key_value_heads, attention_k_eq_v=True)
    config = Gemma4TextConfig(
        **_COMMON,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=sliding_window,
        vocab_size_per_layer_input=VOCAB_SIZE,
        hidden_size_per_layer_input=16,
        **extra,
    )
    return _build(Gemma4ForCausalLM, config, seed)


def tiny_gemma2(softcap: float = 5.0, sliding_window: int = 8, seed: int = SEED) -> Gemma2ForCausalLM:
    """Gemma2: 2 layers (sliding, then full attention) whose attention scores are soft-capped.

    Each layer passes ``softcap=attn_logit_softcapping`` to its attention function, which computes
    ``softcap * tanh(scores / softcap)`` before the softmax. Gemma 2's default of 50 leaves the small
    scores of a random model unchanged; 5.0 changes the greedy completions (the final-logit softcap is
    off). The model uses the "eager" implementation: transformers' "sdpa" refuses softcap.

    Args:
        softcap: the attention scores' cap.
        sliding_window: window length of the sliding layer, in tokens.
        seed: torch seed for the weights.
    """
    config = Gemma2Config(
        **_COMMON,
        num_hidden_layers=2,
        sliding_window=sliding_window,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        attn_implementation="eager",
    )
    return _build(Gemma2ForCausalLM, config, seed)


ALL_TINY_MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
    "mistral": tiny_mistral,
    "gemma": tiny_gemma,
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer matching the tiny models' vocabulary: "<pad>"=0, "<s>"=1, "</s>"=2, "t3".."t255".

    Text is split on whitespace, so `tokenizer("t5 t7").input_ids == [5, 7]`, and decoding joins
    tokens with spaces. Unknown words map to "<pad>". It has no chat template.
    """
    vocab = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(3, VOCAB_SIZE)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level tokenizer over the tiny models' vocabulary, for stop-string tests.

    "<pad>"=0, "<s>"=1, "</s>"=2; 3 "Ã", 4 "©" and 5 "Ã©" (byte-level characters of the two UTF-8
    bytes of "é", so "é" can be split over two tokens); then 6..255 are the strings over "a", "b",
    "c" and "Ġ" (a space) of length 1 to 4, shortest first. Tokens overlap in many ways ("ab" then
    "cĠa" spells "abc a"), which exercises stop strings that start or end inside a token.
    Decoding maps the characters back to bytes (``ByteLevel`` decoder); the decoder is the one
    transformers' ``StopStringCriteria`` reads as byte-level. Encoding text is not supported.
    """
    vocab = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID, "Ã": 3, "©": 4, "Ã©": 5}
    words = ("".join(chars) for n in range(1, 5) for chars in itertools.product("abcĠ", repeat=n))
    vocab.update({word: i for i, word in zip(range(6, VOCAB_SIZE), words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_json_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level tokenizer over the tiny models' vocabulary that can spell JSON, for structured outputs.

    "<pad>"=0, "<s>"=1, "</s>"=2 (the tiny models' EOS); then the 95 printable ASCII characters (space as "Ġ"), newline
    ("Ċ") and tab ("ĉ"); then multi-character tokens (``{"``, ``":``, ``true``, ``false``, ``null``, ...), two-digit
    numbers, and filler tokens "x0", "x1", ... up to id 255. Decoding maps the byte-level characters back to bytes
    (``ByteLevel`` decoder), which is how xgrammar reads the vocabulary. Encoding text is not supported.
    """
    spell = {" ": "\u0120", "\n": "\u010a", "\t": "\u0109"}

    def byte_level(text: str) -> str:
        return "".join(spell.get(c, c) for c in text)

    vocab = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}
    for code in [*range(32, 127), 10, 9]:
        vocab.setdefault(byte_level(chr(code)), len(vocab))
    for word in ('{"', '":', '",', '"}', "true", "false", "null", ', "', ": ", "an", "sw", "er", "ok", "ab", "cd"):
        vocab.setdefault(byte_level(word), len(vocab))
    for pair in (a + b for a in "0123456789" for b in "0123456789"):
        if len(vocab) < VOCAB_SIZE:
            vocab.setdefault(pair, len(vocab))
    vocab.update({f"x{i}": len(vocab) + i for i in range(VOCAB_SIZE - len(vocab))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


LLAMA3_BOS = "<|begin_of_text|>"


def llama3_style_tokenizer(chat_template: bool = False) -> PreTrainedTokenizerFast:
    """The tiny vocabulary behind a Llama-3-style tokenizer: it adds ``<|begin_of_text|>`` (id 1) itself.

    Like Llama 3's, the BOS is a special token that a post-processor puts in front of every encoded
    text, and the same text inside the input is recognised as that token, so a text that already
    starts with it would get two. ``"t5 t7"`` encodes to ``[1, 5, 7]``; ``"<|eot_id|>"`` is id 2 (EOS).

    Args:
        chat_template: give it a Llama-3-like template that writes the BOS text itself.
    """
    vocab = {"<pad>": PAD_TOKEN_ID, LLAMA3_BOS: BOS_TOKEN_ID, "<|eot_id|>": EOS_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(3, VOCAB_SIZE)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", LLAMA3_BOS, "<|eot_id|>")])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A", pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B", special_tokens=[(LLAMA3_BOS, BOS_TOKEN_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token=LLAMA3_BOS, eos_token="<|eot_id|>"
    )
    if chat_template:
        tokenizer.chat_template = (
            "{{ bos_token }}{% for m in messages %}{{ m['content'] }} <|eot_id|> {% endfor %}"
            "{% if add_generation_prompt %}t9 {% endif %}"
        )
    return tokenizer


def random_prompts(
    n: int,
    vocab_size: int = VOCAB_SIZE,
    min_len: int = 4,
    max_len: int = 32,
    seed: int = SEED,
) -> list[list[int]]:
    """Draw `n` random prompts of token ids, reproducibly.

    Token ids are drawn from [3, vocab_size) so that no prompt contains pad, bos or eos.

    Args:
        n: number of prompts.
        vocab_size: size of the model's vocabulary.
        min_len: shortest prompt length, inclusive.
        max_len: longest prompt length, inclusive.
        seed: seed of a private `torch.Generator`; the global RNG is left alone.

    Returns:
        `n` lists of ints, lengths uniform in [min_len, max_len].

    Raises:
        ValueError: min_len < 1, max_len < min_len, or vocab_size <= 3.
    """
    if min_len < 1 or max_len < min_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if vocab_size <= 3:
        raise ValueError(f"vocab_size must exceed the 3 special ids, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]
