"""Sampling: top-k/top-p masks on hand-made logits, greedy rows, per-request seeds, frequencies, logprob modes."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.requests import SamplingParams
from rollout.sampling import apply_top_k_top_p, sample_tokens
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
    gens = [None, generator(1), None, None, None, None]
    tokens, _ = sample_tokens(logits, params, gens, generator(0), return_logprobs=False)
    argmax = logits.argmax(dim=-1)
    greedy_rows = [0, 2, 4, 5]
    assert tokens[greedy_rows].tolist() == argmax[greedy_rows].tolist()


def test_top_k_one_equals_greedy_on_every_row() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 100)
    params = [SamplingParams(do_sample=True, temperature=1.5, top_k=1)] * 64
    tokens, _ = sample_tokens(logits, params, [None] * 64, generator(0), return_logprobs=False)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_same_seed_gives_same_tokens_whatever_the_other_rows() -> None:
    torch.manual_seed(2)
    vocab = 50
    row = torch.randn(vocab)
    seeded = SamplingParams(do_sample=True, temperature=1.0, seed=42)

    def draw(batch_logits: torch.Tensor, params: list[SamplingParams], index: int, other_seed: int) -> list[int]:
        own = generator(42)
        gens = [own if i == index else (generator(7) if p.seed is not None else None) for i, p in enumerate(params)]
        out = []
        for _ in range(20):
            tokens, _ = sample_tokens(batch_logits, params, gens, generator(other_seed), return_logprobs=False)
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


@pytest.mark.parametrize("own_generator", [False, True], ids=["engine_generator", "request_generator"])
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
    own_generator: bool,
) -> None:
    logits = torch.tensor([FREQ_LOGITS] * NUM_DRAWS)
    params = [SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)] * NUM_DRAWS
    gens = [generator(321)] * NUM_DRAWS if own_generator else [None] * NUM_DRAWS
    tokens, _ = sample_tokens(logits, params, gens, generator(123), return_logprobs=False)
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
    tokens, logprobs = sample_tokens(lp_logits(), LP_PARAMS, [None] * len(LP_PARAMS), generator(5), logprobs_mode=mode)
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
    tokens, logprobs = sample_tokens(logits, LP_PARAMS, [None] * len(LP_PARAMS), generator(5), return_logprobs=False)
    assert logprobs is None
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == draw_with_logprobs("temperature")[0]
