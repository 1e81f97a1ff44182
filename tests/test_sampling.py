"""Sampling on hand-made logits: top-k/top-p/min-p masks, logits processors, greedy rows, per-request seeds,
frequencies, logprob modes; the seeded streams, the one generator draw per step and the host staging."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from rollout.engine.sample.logits_processors import apply_logits_processors
from rollout.engine.sample.sampler import (
    SampleOutput,
    apply_min_p,
    apply_top_k_top_p,
    sample_tokens,
    seeded_uniforms,
    step_uniforms,
)
from rollout.engine.staging import HostStaging
from rollout.requests import SamplingParams
from tests.utils import assert_close

NEG = float("-inf")
PROBS = [0.1, 0.4, 0.3, 0.2]  # logits = log(PROBS): softmax gives PROBS back


def log_probs_logits(rows: int = 1) -> torch.Tensor:
    return torch.tensor([PROBS] * rows).log()


def kept(out: torch.Tensor) -> list[list[int]]:
    """Indices of the finite entries of each row."""
    return [[i for i, v in enumerate(row) if v != NEG] for row in out.tolist()]


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seed: int, counters: list[int] | None = None, **kwargs
) -> SampleOutput:
    """``sample_tokens`` with the engine's numbers: ``step_uniforms`` of a generator seeded ``seed``, each row at
    position ``counters[i]`` of its seed's stream (default 0)."""
    counters = [0] * len(params) if counters is None else counters
    return sample_tokens(logits, params, uniform=step_uniforms(params, counters, generator(seed)), **kwargs)


# ------------------------------------------------------------------------------------ apply_top_k_top_p


def test_top_k_2_masks_all_but_the_two_largest_logits() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG]]
    assert logits.tolist() == [[1.0, 4.0, 3.0, 2.0]]  # input untouched


@pytest.mark.parametrize(
    ("top_p", "expected_kept"),
    [
        (0.35, [1]),  # 0.4 alone reaches 0.35
        (0.65, [1, 2]),  # 0.4 < 0.65, 0.4 + 0.3 reaches it
        (0.75, [1, 2, 3]),  # 0.7 < 0.75
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, expected_kept: list[int]) -> None:
    logits = log_probs_logits()
    out = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert kept(out) == [expected_kept]
    assert_close(out[0, expected_kept], logits[0, expected_kept], atol=0.0)


def test_top_k_and_top_p_differ_per_row() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]] * 4)
    out = apply_top_k_top_p(logits, torch.tensor([0, 1, 3, 10]), None)
    # 0 keeps all, 1 keeps the max, 3 drops the min, 10 > vocab keeps all.
    assert out.tolist() == [
        [1.0, 4.0, 3.0, 2.0],
        [NEG, 4.0, NEG, NEG],
        [NEG, 4.0, 3.0, 2.0],
        [1.0, 4.0, 3.0, 2.0],
    ]
    out = apply_top_k_top_p(log_probs_logits(4), None, torch.tensor([1.0, 0.35, 0.65, 0.75]))
    assert kept(out) == [[0, 1, 2, 3], [1], [1, 2], [1, 2, 3]]


def test_top_p_applies_to_distribution_renormalised_after_top_k() -> None:
    # top_k=3 keeps 0.4, 0.3, 0.2 -> renormalised 4/9, 3/9, 2/9. Mass before the 0.2 token: 7/9 = 0.78 >= 0.75,
    # so it is dropped. (On the original probabilities it would be kept: 0.7 < 0.75.)
    out = apply_top_k_top_p(log_probs_logits(), torch.tensor([3]), torch.tensor([0.75]))
    assert kept(out) == [[1, 2]]


def test_top_p_one_keeps_every_token_even_far_below_float32_resolution() -> None:
    logits = torch.tensor([[0.0, -30.0, -40.0]])  # probabilities 1, 9e-14, 4e-18
    out = apply_top_k_top_p(logits, None, torch.tensor([1.0]))
    assert kept(out) == [[0, 1, 2]]


# ------------------------------------------------------------------------------------ greedy and seeds


def test_greedy_rows_equal_argmax_also_next_to_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=2.0, seed=1),
        SamplingParams(do_sample=True, temperature=0.0),
        SamplingParams(do_sample=True, temperature=3.0),
        SamplingParams(do_sample=False, temperature=0.7, top_k=5),
        SamplingParams(do_sample=True, temperature=2.0, top_k=1),
    ]
    tokens, _, _ = sample(logits, params, 0, return_logprobs=False)
    argmax = logits.argmax(dim=-1)
    greedy_rows = [0, 2, 4, 5]
    assert tokens[greedy_rows].tolist() == argmax[greedy_rows].tolist()


def test_top_k_one_equals_greedy_on_every_row() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 100)
    params = [SamplingParams(do_sample=True, temperature=1.5, top_k=1)] * 64
    tokens, _, _ = sample(logits, params, 0, return_logprobs=False)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_same_seed_gives_same_tokens_whatever_the_other_rows() -> None:
    torch.manual_seed(2)
    vocab = 50
    row = torch.randn(vocab)
    seeded = SamplingParams(do_sample=True, temperature=1.0, seed=42)

    def draw(batch_logits: torch.Tensor, params: list[SamplingParams], index: int, other_seed: int) -> list[int]:
        # As the engine draws: token t of every row takes position t of its seed's stream, and the unseeded
        # rows share the engine's generator (seeded other_seed), one draw per step.
        engine_generator = generator(other_seed)
        out = []
        for t in range(20):
            uniform = step_uniforms(params, [t] * len(params), engine_generator)
            tokens, _, _ = sample_tokens(batch_logits, params, uniform=uniform, return_logprobs=False)
            out.append(int(tokens[index]))
        return out

    alone = draw(row[None], [seeded], 0, other_seed=0)
    others_a = torch.randn(3, vocab)
    batch_a = torch.cat([row[None], others_a])
    params_a = [seeded, SamplingParams(do_sample=True), SamplingParams(), SamplingParams(do_sample=True, top_k=5)]
    others_b = torch.randn(4, vocab)
    batch_b = torch.cat([others_b[:2], row[None], others_b[2:]])
    params_b = [
        SamplingParams(do_sample=True, temperature=0.5, top_p=0.5),
        SamplingParams(do_sample=True, seed=7),
        seeded,
        SamplingParams(do_sample=True),
        SamplingParams(),
    ]
    assert draw(batch_a, params_a, 0, other_seed=1) == alone
    assert draw(batch_b, params_b, 2, other_seed=2) == alone
    assert len(set(alone)) > 1  # it really samples


# ------------------------------------------------------------------------------------ frequencies

FREQ_LOGITS = [1.0, 0.5, 0.0, -1.0]
NUM_DRAWS = 20_000
CHI2_BOUND = 25.0  # 3 degrees of freedom: P(chi2 > 25) ~ 1.5e-5; the draws are seeded, so the test is deterministic


def expected_frequencies(temperature: float, keep: list[int]) -> list[float]:
    """softmax(FREQ_LOGITS / T) restricted to `keep` and renormalised, in plain Python."""
    weights = [math.exp(v / temperature) if i in keep else 0.0 for i, v in enumerate(FREQ_LOGITS)]
    return [w / sum(weights) for w in weights]


def chi2(counts: list[int], probs: list[float]) -> float:
    return sum((c - NUM_DRAWS * p) ** 2 / (NUM_DRAWS * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("seeded", [False, True], ids=["engine_generator", "request_seed"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "keep", "wrong_temperature"),
    [
        (1.0, None, None, [0, 1, 2, 3], 2.0),
        (0.5, None, None, [0, 1, 2, 3], 1.0),
        (2.0, 3, None, [0, 1, 2], 1.0),
        # T=1: probabilities 0.474, 0.287, 0.174, 0.064; mass before the 3rd is 0.762 >= 0.7.
        (1.0, None, 0.7, [0, 1], 2.0),
    ],
)
def test_sampled_frequencies_match_softmax_of_logits_over_temperature(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    keep: list[int],
    wrong_temperature: float,
    seeded: bool,
) -> None:
    logits = torch.tensor([FREQ_LOGITS] * NUM_DRAWS)
    seed = 321 if seeded else None
    params = [SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)] * NUM_DRAWS
    # Seeded: the draws are the first NUM_DRAWS positions of one seed's stream, as one request's tokens.
    tokens, _, _ = sample(logits, params, 123, list(range(NUM_DRAWS)), return_logprobs=False)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert [counts[i] for i in range(4) if i not in keep] == [0] * (4 - len(keep))
    assert chi2(counts, expected_frequencies(temperature, keep)) < CHI2_BOUND
    # The bound is tight enough to catch a wrong temperature.
    assert chi2(counts, expected_frequencies(wrong_temperature, keep)) > 4 * CHI2_BOUND


# ------------------------------------------------------------------------------------ logprobs

LP_PARAMS = [
    SamplingParams(do_sample=False, temperature=0.7),  # greedy: T counts as 1
    SamplingParams(do_sample=True, temperature=0.7),
    SamplingParams(do_sample=True, temperature=1.3, top_k=3),
    SamplingParams(do_sample=True, temperature=1.0, top_p=0.6),
]


def lp_logits() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(len(LP_PARAMS), 10) * 2


def draw_with_logprobs(mode: str) -> tuple[list[int], list[float]]:
    tokens, logprobs, _ = sample(lp_logits(), LP_PARAMS, 5, logprobs_mode=mode)
    assert logprobs is not None and logprobs.dtype == torch.float32 and logprobs.shape == (len(LP_PARAMS),)
    return tokens.tolist(), logprobs.tolist()


def renormalised_logprob(
    row: torch.Tensor, temperature: float, token: int, top_k: int | None, top_p: float | None
) -> float:
    """log q(token), q = softmax(row / T) cut to top-k, renormalised, cut to top-p, renormalised (plain Python)."""
    probs = torch.softmax(row.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k:
        order = order[:top_k]
    total = sum(probs[i] for i in order)
    q = {i: probs[i] / total for i in order}
    if top_p is not None:
        keep, mass = [], 0.0
        for i in order:
            keep.append(i)
            mass += q[i]
            if mass >= top_p:
                break
        total = sum(q[i] for i in keep)
        q = {i: q[i] / total for i in keep}
    assert token in q, "the sampled token lies outside the top-k/top-p set"
    return math.log(q[token])


def test_raw_logprobs_equal_log_softmax_of_logits_at_token() -> None:
    tokens, logprobs = draw_with_logprobs("raw")
    logits = lp_logits()
    expected = [torch.log_softmax(logits[b], dim=-1)[tok].item() for b, tok in enumerate(tokens)]
    assert_close(logprobs, expected, atol=1e-5)


def test_temperature_logprobs_equal_log_softmax_of_logits_over_t_and_t_is_1_for_greedy() -> None:
    tokens, logprobs = draw_with_logprobs("temperature")
    logits = lp_logits()
    temps = [1.0, 0.7, 1.3, 1.0]
    expected = [torch.log_softmax(logits[b] / t, dim=-1)[tok].item() for b, (tok, t) in enumerate(zip(tokens, temps))]
    assert_close(logprobs, expected, atol=1e-5)


def test_sampled_logprobs_equal_log_of_renormalised_top_k_top_p_distribution() -> None:
    tokens, logprobs = draw_with_logprobs("sampled")
    logits = lp_logits()
    expected = [
        torch.log_softmax(logits[0], dim=-1)[tokens[0]].item(),  # greedy row: raw
        renormalised_logprob(logits[1], 0.7, tokens[1], None, None),
        renormalised_logprob(logits[2], 1.3, tokens[2], 3, None),
        renormalised_logprob(logits[3], 1.0, tokens[3], None, 0.6),
    ]
    assert_close(logprobs, expected, atol=1e-5)


def test_logprobs_mode_does_not_change_the_sampled_tokens() -> None:
    assert draw_with_logprobs("raw")[0] == draw_with_logprobs("temperature")[0] == draw_with_logprobs("sampled")[0]


def test_return_logprobs_false_returns_none_and_same_tokens() -> None:
    logits = lp_logits()
    tokens, logprobs, _ = sample(logits, LP_PARAMS, 5, return_logprobs=False)
    assert logprobs is None
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == draw_with_logprobs("temperature")[0]


@pytest.mark.parametrize("mode", ["raw", "temperature", "sampled"])
def test_top_logprobs_are_topk_of_the_distribution_of_the_sampled_tokens_logprob(mode: str) -> None:
    # Rows 0 and 2 ask for alternatives (5 and 3); rows 1 and 3 ask for none and get none.
    params = [
        dataclasses.replace(LP_PARAMS[0], num_top_logprobs=5),
        LP_PARAMS[1],
        dataclasses.replace(LP_PARAMS[2], num_top_logprobs=3),
        LP_PARAMS[3],
    ]
    logits = lp_logits()
    tokens, logprobs, top = sample(logits, params, 5, logprobs_mode=mode)
    assert tokens.tolist() == draw_with_logprobs(mode)[0]  # asking for alternatives changes no token
    assert_close(logprobs, draw_with_logprobs(mode)[1], atol=1e-6)
    assert top is not None and top.rows == [0, 2]
    assert top.token_ids.shape == top.logprobs.shape == (2, 5) and top.token_ids.dtype == torch.int64
    temps = {"raw": [1.0, 1.0], "temperature": [1.0, 1.3], "sampled": [1.0, 1.3]}[mode]
    for j, (row, t, n) in enumerate(zip([0, 2], temps, [5, 3])):
        dist = torch.log_softmax(logits[row] / t, dim=-1)
        if mode == "sampled" and row == 2:  # drawn from the top-3 set, renormalised: the rest is -inf
            dist = torch.log_softmax(apply_top_k_top_p(logits[row : row + 1] / t, torch.tensor([3]), None)[0], -1)
        values, ids = torch.topk(dist, n)
        assert top.token_ids[j, :n].tolist() == ids.tolist()
        assert_close(top.logprobs[j, :n], values, atol=1e-6)
        # The sampled token's logprob is the same distribution's value at the token.
        assert_close([logprobs[row].item()], [dist[tokens[row]].item()], atol=1e-6)


def test_no_row_asking_for_top_logprobs_gives_none() -> None:
    assert sample(lp_logits(), LP_PARAMS, 5).top is None
    assert sample(lp_logits(), LP_PARAMS, 5, return_logprobs=False).top is None


def test_top_logprobs_wider_than_the_vocabulary_are_capped_at_it() -> None:
    params = [SamplingParams(num_top_logprobs=20)]
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    top = sample_tokens(logits, params, logprobs_mode="raw").top
    assert top is not None and top.token_ids.tolist() == [[1, 0, 2]]
    assert_close(top.logprobs[0], torch.log_softmax(logits[0], -1)[[1, 0, 2]], atol=1e-6)


# ------------------------------------------------------------------------------------ logits processors


def processed(logits: list[list[float]], params: list[SamplingParams], token_ids: list[list[int]], prompt: list[int]):
    return apply_logits_processors(torch.tensor(logits), params, token_ids, prompt).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_only() -> None:
    logits = [[2.0, -1.0, 0.5, -0.25, 1.0]] * 3  # exact in float32
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(), SamplingParams(repetition_penalty=0.5)]
    out = processed(logits, params, [[0, 1, 1, 3], [0, 1], [2]], [1, 1, 1])
    # Row 0 saw 0, 1 and 3 (1 twice: penalised once); row 1 has no processor; row 2 rewards token 2.
    assert out == [[1.0, -2.0, 0.5, -0.5, 1.0], logits[1], [2.0, -1.0, 1.0, -0.25, 1.0]]


@pytest.mark.parametrize(
    ("n", "history", "banned"),
    [
        (2, [5, 6, 5, 7, 5], [6, 7]),  # prefix (5,): 5 was followed by 6 and by 7
        (3, [1, 2, 3, 1, 2], [3]),  # prefix (1, 2) was followed by 3
        (3, [1, 2, 3, 2, 1], []),  # prefix (2, 1) never seen before
        (1, [4, 4, 0], [0, 4]),  # every token seen is banned
        (3, [1, 2], []),  # shorter than n: nothing to ban yet
    ],
)
def test_no_repeat_ngram_bans_tokens_that_complete_an_earlier_ngram(
    n: int, history: list[int], banned: list[int]
) -> None:
    out = processed([[0.0] * 8], [SamplingParams(no_repeat_ngram_size=n)], [history], [1])
    assert [i for i, v in enumerate(out[0]) if v == NEG] == banned


def test_no_repeat_ngram_rows_of_different_lengths_and_sizes_in_one_batch() -> None:
    params = [SamplingParams(no_repeat_ngram_size=2), SamplingParams(no_repeat_ngram_size=2), SamplingParams()]
    params += [SamplingParams(no_repeat_ngram_size=3)]
    histories = [[5, 6, 5, 7, 5], [1, 2, 1], [1, 1, 1], [7, 7, 7, 7, 7, 7]]
    out = processed([[0.0] * 8] * 4, params, histories, [1, 1, 1, 1])
    assert kept(torch.tensor(out)) == [[0, 1, 2, 3, 4, 5], [0, 1, 3, 4, 5, 6, 7], list(range(8)), list(range(7))]


def test_bad_words_ban_single_tokens_always_and_the_last_token_of_a_sequence_whose_prefix_just_occurred() -> None:
    # eos = 2: the one-token bad word [2] is ignored (transformers filters eos out of bad words).
    params = SamplingParams(bad_words_ids=[[3], [2], [1, 4], [0, 1, 5], [6, 1, 7]], eos_token_ids=(2,))
    out = processed([[0.0] * 8] * 2, [params] * 2, [[9, 0, 1], [1, 0]], [1, 1])
    assert [i for i, v in enumerate(out[0]) if v == NEG] == [3, 4, 5]  # ends with (1,) and (0, 1), not (6, 1)
    assert [i for i, v in enumerate(out[1]) if v == NEG] == [3]


@pytest.mark.parametrize(
    ("kwargs", "length", "prompt", "eos_banned"),
    [
        ({"min_new_tokens": 2}, 4, 3, True),  # 1 generated < 2
        ({"min_new_tokens": 2}, 5, 3, False),
        ({"min_length": 5}, 4, 3, True),  # 4 tokens in all < 5
        ({"min_length": 5}, 5, 3, False),
    ],
)
def test_min_new_tokens_and_min_length_ban_every_eos_id_until_reached(
    kwargs: dict, length: int, prompt: int, eos_banned: bool
) -> None:
    params = SamplingParams(eos_token_ids=(2, 5), **kwargs)
    out = processed([[0.0] * 8], [params], [list(range(10, 10 + length))], [prompt])
    assert [i for i, v in enumerate(out[0]) if v == NEG] == ([2, 5] if eos_banned else [])


def test_min_new_tokens_without_eos_ids_changes_nothing_and_costs_nothing() -> None:
    params = SamplingParams(min_new_tokens=5, eos_token_ids=())
    assert not params.uses_logits_processors
    logits = torch.randn(1, 8)
    assert apply_logits_processors(logits, [params], None, None) is logits


def test_rows_without_processors_are_returned_untouched_and_need_no_token_ids() -> None:
    logits = torch.randn(3, 8)
    assert apply_logits_processors(logits, [SamplingParams()] * 3, None, None) is logits
    with pytest.raises(ValueError, match="token_ids"):
        apply_logits_processors(logits, [SamplingParams(repetition_penalty=1.1)] * 3, None, None)


def test_min_p_keeps_tokens_with_at_least_min_p_times_the_top_probability() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.25] * 4]).log()
    out = apply_min_p(logits, torch.tensor([0.4, 0.0, 1.0]))
    # 0.4 * 0.5 = 0.2: 0.15 and 0.05 go; min_p 0 keeps all; ties with the top token stay at min_p 1.
    assert kept(out) == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_greedy_takes_the_argmax_of_the_processed_logits() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.1], [1.0, 0.9, 0.1]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    tokens, _, _ = sample(logits, params, 0, token_ids=[[0], [0]], num_prompt_tokens=[1, 1])
    assert tokens.tolist() == [1, 0]  # 1.0 / 2 < 0.9 on the first row only


def test_sampled_rows_never_draw_a_banned_token() -> None:
    logits = torch.zeros(500, 6)
    params = [SamplingParams(do_sample=True, bad_words_ids=[[0], [4, 5]], no_repeat_ngram_size=2)] * 500
    histories = [[4, 1, 3, 4]] * 500  # bans 0, 5 (after 4) and 1 (4 was followed by 1)
    tokens, _, _ = sample(logits, params, 0, token_ids=histories, num_prompt_tokens=[1] * 500)
    assert set(tokens.tolist()) == {2, 3, 4}


PROC_PARAMS = [
    SamplingParams(repetition_penalty=1.5),  # greedy with a processor
    SamplingParams(do_sample=True, temperature=0.7, repetition_penalty=1.3, top_k=6, min_p=0.1),
    SamplingParams(do_sample=True, temperature=1.2, bad_words_ids=[[3], [1, 2]], min_p=0.05),
    SamplingParams(do_sample=True, no_repeat_ngram_size=2, top_p=0.9),
    SamplingParams(do_sample=True, temperature=0.9),  # no processor, next to the others
]
PROC_HISTORY = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [0, 1], [7, 8, 7, 2, 7], [1, 2, 3]]


def hand_processed_logprob(row: torch.Tensor, p: SamplingParams, history: list[int], token: int) -> float:
    """log q(token) for the distribution of ``p`` on raw logits ``row``, each step in plain Python."""
    values = [float(v) for v in row]
    if p.repetition_penalty != 1.0:
        values = [
            (v / p.repetition_penalty if v > 0 else v * p.repetition_penalty) if i in history else v
            for i, v in enumerate(values)
        ]
    banned = set(p.banned_tokens)
    for seq in p.bad_words_ids:
        if len(seq) > 1 and history[-(len(seq) - 1) :] == list(seq[:-1]):
            banned.add(seq[-1])
    n = p.no_repeat_ngram_size
    if n:
        prefix = history[len(history) - n + 1 :]
        banned |= {history[i + n - 1] for i in range(len(history) - n + 1) if history[i : i + n - 1] == prefix}
    allowed = [i for i in range(len(values)) if i not in banned]
    temperature = p.temperature if not p.greedy else 1.0
    weights = {i: math.exp(values[i] / temperature) for i in allowed}
    if not p.greedy:
        order = sorted(allowed, key=lambda i: -weights[i])
        if p.top_k:
            order = order[: p.top_k]
        if p.top_p is not None:
            total, mass, keep = sum(weights[i] for i in order), 0.0, []
            for i in order:
                keep.append(i)
                mass += weights[i] / total
                if mass >= p.top_p:
                    break
            order = keep
        if p.min_p:
            top = max(weights[i] for i in order)
            order = [i for i in order if weights[i] >= p.min_p * top]
        weights = {i: weights[i] for i in order}
    assert token in weights, "the token lies outside the processed distribution"
    return math.log(weights[token] / sum(weights.values()))


def test_sampled_logprobs_equal_the_hand_computed_processed_distribution() -> None:
    torch.manual_seed(4)
    logits = torch.randn(len(PROC_PARAMS), 10) * 2
    for seed in range(5):
        tokens, logprobs, _ = sample(
            logits,
            PROC_PARAMS,
            seed,
            logprobs_mode="sampled",
            token_ids=PROC_HISTORY,
            num_prompt_tokens=[1] * len(PROC_PARAMS),
        )
        expected = [
            hand_processed_logprob(logits[b], p, h, t)
            for b, (p, h, t) in enumerate(zip(PROC_PARAMS, PROC_HISTORY, tokens.tolist()))
        ]
        assert_close(logprobs, expected, atol=1e-5)


@pytest.mark.parametrize("mode", ["temperature", "raw"])
def test_temperature_and_raw_logprobs_ignore_the_processors(mode: str) -> None:
    torch.manual_seed(4)
    logits = torch.randn(len(PROC_PARAMS), 10) * 2
    tokens, logprobs, _ = sample(
        logits,
        PROC_PARAMS,
        0,
        logprobs_mode=mode,
        token_ids=PROC_HISTORY,
        num_prompt_tokens=[1] * len(PROC_PARAMS),
    )
    temps = [p.temperature if (mode == "temperature" and not p.greedy) else 1.0 for p in PROC_PARAMS]
    expected = [torch.log_softmax(logits[b] / t, dim=-1)[tok].item() for b, (tok, t) in enumerate(zip(tokens, temps))]
    assert_close(logprobs, expected, atol=1e-5)


# ------------------------------------------------------------------------------------ issue 13 case 7: host work
def test_seeded_uniforms_are_a_function_of_seed_and_position_only() -> None:
    seeds, counters = [7, 7, 8, 2**70, -3], [0, 1, 0, 5, 5]
    together = seeded_uniforms(seeds, counters)
    alone = [seeded_uniforms([s], [t])[0] for s, t in zip(seeds, counters, strict=True)]
    assert together.tolist() == alone  # a row's number does not depend on the other rows
    assert together.tolist() == seeded_uniforms(seeds, counters).tolist()  # reproducible
    assert len(set(together.tolist())) == 5  # position and seed both matter
    assert seeded_uniforms([2**70], [5])[0] == seeded_uniforms([2**70 % 2**64], [5])[0]  # seeds mod 2**64


@pytest.mark.parametrize("axis", ["neighbouring_seeds", "one_seed_positions"])
def test_seeded_uniforms_are_uniform_and_neighbouring_streams_uncorrelated(axis: str) -> None:
    n = 20_000
    if axis == "neighbouring_seeds":
        u = seeded_uniforms(list(range(n)), [0] * n)
        v = seeded_uniforms(list(range(1, n + 1)), [0] * n)  # seed s+1 next to seed s
    else:
        u = seeded_uniforms([1234] * n, list(range(n)))
        v = seeded_uniforms([1234] * n, list(range(1, n + 1)))  # position t+1 next to t
    assert ((u >= 0) & (u < 1)).all()
    counts = torch.histc(torch.from_numpy(u), bins=10, min=0.0, max=1.0).tolist()
    # 9 degrees of freedom: P(chi2 > 35) ~ 6e-5; the numbers are fixed, so the test is deterministic.
    assert sum((c - n / 10) ** 2 / (n / 10) for c in counts) < 35.0
    # Correlation of neighbours: about N(0, 1/sqrt(n)) = 0.007 for independent streams.
    assert abs(torch.corrcoef(torch.from_numpy(np.stack([u, v])))[0, 1].item()) < 0.03


def test_step_uniforms_draw_the_engine_generator_once_per_step_and_never_for_seeded_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real_rand = torch.rand

    def counting_rand(*args, **kwargs):
        calls.append(args[0])
        return real_rand(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", counting_rand)
    seeded = [SamplingParams(do_sample=True, seed=s) for s in range(4)]
    unseeded = [SamplingParams(do_sample=True)] * 3
    greedy = [SamplingParams()]
    u = step_uniforms(seeded + greedy, [3, 0, 1, 9, 0], generator(0))
    assert calls == []  # seeded rows: no generator at all
    assert u[:4].tolist() == seeded_uniforms([0, 1, 2, 3], [3, 0, 1, 9]).tolist() and u[4] == 0.0
    mixed = step_uniforms(unseeded[:1] + seeded[:2] + unseeded[1:] + greedy, [0] * 6, generator(0))
    assert calls == [3]  # the three unseeded rows share one draw
    assert mixed[[0, 3, 4]].tolist() == torch.rand(3, dtype=torch.float64, generator=generator(0)).tolist()


def test_sampled_rows_need_uniform_numbers() -> None:
    params = [SamplingParams(), SamplingParams(do_sample=True)]
    with pytest.raises(ValueError, match="needs uniform numbers"):
        sample_tokens(torch.randn(2, 10), params)


def test_top_k_with_the_largest_k_known_on_the_host_masks_the_same() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, 30)
    top_k = torch.tensor([0, 3, 45, 10])  # 0 and 45 mean all 30
    assert torch.equal(apply_top_k_top_p(logits, top_k, None, max_k=30), apply_top_k_top_p(logits, top_k, None))


def test_host_staging_sends_int64_and_float64_arrays_in_one_upload() -> None:
    staging = HostStaging(torch.device("cpu"))
    ints = np.arange(6, dtype=np.int64).reshape(2, 3)
    floats = np.array([0.1, -2.5, 1e-300], dtype=np.float64)
    empty = np.zeros(0, dtype=np.int64)
    a, b, c = staging.upload(ints, floats, empty)
    assert a.dtype == torch.int64 and a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert b.dtype == torch.float64 and b.tolist() == [0.1, -2.5, 1e-300]  # bit-exact
    assert c.shape == (0,)
    assert staging.num_uploads == 1
    with pytest.raises(TypeError, match="int64 or float64"):
        staging.upload(np.zeros(2, dtype=np.int32))


def test_host_staging_takes_its_buffer_sets_in_turn_and_refuses_bad_settings() -> None:
    staging = HostStaging(torch.device("cpu"), num_buffers=2)
    slots = []
    for i in range(3):
        (t,) = staging.upload(np.full(3, i, dtype=np.int64))
        slots.append(staging.last_slot)
        assert t.tolist() == [i] * 3
        staging.release(staging.last_slot)  # a no-op without a copy stream
    assert slots == [0, 1, 0] and staging.num_uploads == 3
    with pytest.raises(ValueError, match="num_buffers must be 1 or 2"):
        HostStaging(torch.device("cpu"), num_buffers=3)
    with pytest.raises(ValueError, match="copy_stream needs a CUDA device"):
        HostStaging(torch.device("cpu"), copy_stream=object())  # type: ignore[arg-type]  # checked before any use


def _torch_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's torch form of the draw (its fallback off the CPU kernel)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def _cpu_kernel_or_skip() -> None:
    from rollout.engine.attention.cpu import load_kernel

    if load_kernel() is not None:
        pytest.skip("rollout's CPU extension does not build here")


def test_cpu_inverse_cdf_kernel_draws_the_torch_forms_token_bit_for_bit() -> None:
    """``rollout_cpu::inverse_cdf_sample`` against cumsum + searchsorted: vocabularies below, at and across its
    1024-entry blocks, rows of zeros (banned tokens) around the mass, u at 0, near 1 and on a block's edge, one row and
    many (split over threads), a row-strided view."""
    _cpu_kernel_or_skip()
    g = torch.Generator().manual_seed(0)
    op = torch.ops.rollout_cpu.inverse_cdf_sample
    for rows, vocab in ((1, 7), (3, 1024), (70, 3000), (64, 49152)):
        wide = torch.softmax(torch.randn(rows, vocab + 5, generator=g) * 3, dim=-1)
        probs = wide[:, :vocab]  # row stride vocab + 5: rows need not be packed
        probs[: rows // 2, : vocab // 3] = 0.0  # banned tokens before the mass
        u = torch.rand(rows, generator=g, dtype=torch.float64)
        u[0] = 0.0
        if rows > 1:
            u[1] = 1.0 - 1e-16
        if rows > 2:  # exactly the running sum at the end of the first block
            u[2] = torch.cumsum(probs[2].double(), 0)[min(1023, vocab - 1)] / probs[2].double().sum()
        assert torch.equal(op(probs, u), _torch_inverse_cdf(probs, u)), (rows, vocab)
    with pytest.raises(RuntimeError, match="float64"):
        op(probs, u.float())


def test_sample_tokens_draws_the_same_tokens_with_the_cpu_kernel() -> None:
    """The sampler with ``cpu_kernel`` against its torch form: the same tokens and logprobs, every row sampled (no
    argmax, no row gather) and sampled rows beside greedy ones, with top-k / top-p rows."""
    _cpu_kernel_or_skip()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 5000, generator=g) * 4
    uniform = np.random.default_rng(0).random(40)
    sampled = [SamplingParams(do_sample=True, temperature=0.7 + 0.01 * i) for i in range(40)]
    mixed = [
        SamplingParams(do_sample=False)
        if i % 5 == 0
        else SamplingParams(do_sample=True, temperature=1.0, top_k=50 if i % 3 else 0, top_p=0.9 if i % 2 else None)
        for i in range(40)
    ]
    for params in (sampled, mixed):
        ref = sample_tokens(logits, params, uniform=uniform)
        out = sample_tokens(logits, params, uniform=uniform, cpu_kernel=True)
        assert torch.equal(out.tokens, ref.tokens)
        assert torch.equal(out.logprobs, ref.logprobs)
    greedy_rows = [i for i, p in enumerate(mixed) if not p.do_sample]
    assert torch.equal(out.tokens[greedy_rows], logits[greedy_rows].argmax(-1))


def test_sampler_benchmark_times_both_draws_and_checks_their_tokens() -> None:
    """``benchmarks.sampler`` (scripts/bench_sampler.py): one time per round and way, on the same tokens."""
    _cpu_kernel_or_skip()
    from benchmarks.sampler import measure

    times = measure(rows=5, vocab=300, repeats=3)
    assert sorted(times) == ["kernel", "torch"]
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in times.values())
