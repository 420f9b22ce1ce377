"""pass@k against the closed form and exhaustive enumeration; maj@k voting rules."""

import itertools
import math

import pytest

from areal_jax.eval_metrics import PromptSamples, maj_at_k, majority_answer, pass_at_k, summarize


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def enumerated(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (10, 0, 1, 0.0),  # nothing correct
        (10, 0, 10, 0.0),
        (10, 10, 1, 1.0),  # everything correct
        (10, 3, 1, 0.3),  # pass@1 is the fraction correct
        (10, 3, 8, 1.0),  # k > n - c: every subset hits a correct one
        (10, 1, 10, 1.0),  # k = n
        (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2)
        (5, 1, 2, 0.4),  # 1 - C(4,2)/C(5,2) = 1 - 6/10
    ],
)
def test_pass_at_k_hand_made(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)


def test_pass_at_k_matches_enumeration_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(enumerated(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    # The binomials here have hundreds of digits; the product form must still agree.
    n, c, k = 1000, 7, 100
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-10)


@pytest.mark.parametrize("n,c,k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_bad_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_ints():
    with pytest.raises(TypeError, match="k"):
        pass_at_k(5, 2, 1.0)


def test_majority_answer_ties_go_to_first_seen():
    assert majority_answer(["3", "5", "5", "3"]) == "3"
    assert majority_answer(["5", "3", "3", "5"]) == "5"
    assert majority_answer(["1", "2", "2"]) == "2"
    assert majority_answer([None, None]) is None
    assert majority_answer([None, "7", None]) == "7"  # None casts no vote


def test_maj_at_k_uses_only_first_k_samples():
    answers = ["4", "4", "9", "9", "9"]
    correct = [False, False, True, True, True]
    assert maj_at_k(answers, correct, 2) == 0.0
    assert maj_at_k(answers, correct, 5) == 1.0
    assert maj_at_k(answers, correct, 4) == 0.0  # 2-2 tie: "4" appeared first


def test_maj_at_k_scores_the_winner_not_any_correct_sample():
    assert maj_at_k(["1", "1", "2"], [False, False, True], 3) == 0.0
    assert maj_at_k([None, None, "2"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_maj_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="flags"):
        maj_at_k(["1", "2"], [True], 1)
    with pytest.raises(ValueError, match="k=3"):
        maj_at_k(["1", "2"], [True, False], 3)


def test_summarize_averages_over_prompts():
    prompts = [
        PromptSamples(("2", "2", "3", None), (True, True, False, False)),  # c=2
        PromptSamples(("8", "7", "7", "7"), (True, False, False, False)),  # c=1
    ]
    out = summarize(prompts, ks=(1, 4))
    assert out["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert out["pass@4"] == pytest.approx(1.0)
    assert out["accuracy"] == pytest.approx(out["pass@1"])
    assert out["maj@1"] == pytest.approx((1.0 + 1.0) / 2)
    assert out["maj@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["num_prompts"] == 2


def test_summarize_rejects_k_above_samples():
    with pytest.raises(ValueError, match="k=3"):
        summarize([PromptSamples(("1", "2"), (True, False))], ks=(3,))
    with pytest.raises(ValueError, match="flags"):
        PromptSamples(("1",), (True, False))
