"""The gsm8k reward and math's `#### N` marker: GSM8K solutions score 1 with either reward, under
randomized numbers and formatting, and wrong or missing answers score 0."""

import random

import pytest

from areal_jax.reward.gsm8k import final_number, gold_number, gsm8k_reward
from areal_jax.reward.math import extract_final_answer, math_reward
from areal_jax.reward.registry import reward_spec


def _formatted(value: int, rng: random.Random) -> str:
    text = f"{value:,}" if rng.random() < 0.5 else str(value)
    return ("$" if rng.random() < 0.3 else "") + text + ("." if rng.random() < 0.3 else "")


@pytest.mark.parametrize("seed", range(5))
def test_gsm8k_solutions_score_one_with_both_rewards(seed):
    rng = random.Random(seed)
    for _ in range(40):
        a, b = rng.randint(0, 50_000), rng.randint(0, 50_000)
        gold = a + b
        solution = f"She has {a} and gets {b} more.\n{a} + {b} = <<{a}+{b}={gold}>>{gold}\n#### {_formatted(gold, rng)}"
        assert gsm8k_reward(solution, str(gold)) == 1.0
        assert gsm8k_reward(solution, f"blah\n#### {gold:,}") == 1.0  # a whole solution as gold
        assert math_reward(solution, str(gold)) == 1.0
        wrong = solution.rsplit("####", 1)[0] + f"#### {gold + rng.randint(1, 9)}"
        assert gsm8k_reward(wrong, str(gold)) == 0.0
        assert math_reward(wrong, str(gold)) == 0.0


def test_last_number_fallback_is_gsm8k_only():
    assert gsm8k_reward("17 - 1 = 16, so she has 16 eggs left.", "16") == 1.0
    assert gsm8k_reward("16 eggs, minus 1 is 15.", "16") == 0.0  # the last number counts
    assert math_reward("17 - 1 = 16, so she has 16 eggs left.", "16") == 0.0  # math needs a marker
    assert gsm8k_reward("no digits here", "16") == 0.0
    assert final_number("#### -3.50") == final_number("-3.5")
    assert final_number("####\nthe answer is 7") == 7  # a '####' line with no number falls back


def test_math_takes_the_later_marker():
    assert extract_final_answer(r"\boxed{3} then #### 4") == "4"
    assert extract_final_answer(r"#### 4 then \boxed{3}") == "3"
    assert extract_final_answer("#### 1,234.") == "1234"
    assert extract_final_answer("no marker") is None
    assert math_reward(r"#### \frac{1}{2}", "0.5") == 1.0  # math-verify still decides equality


def test_gold_must_hold_a_number():
    assert gold_number(72) == 72 and gold_number("1,234") == 1234
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k_reward("#### 3", "three")


def test_gsm8k_is_registered_in_process():
    spec = reward_spec("gsm8k")
    assert spec.in_process and spec.path == "areal_jax.reward.gsm8k:gsm8k_reward"
