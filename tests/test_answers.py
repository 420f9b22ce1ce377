"""areal_jax/answers.py: the one reader of final answers (boxes, `#### N`, the last number).

Data (gold answers), the rewards and the evaluator all read answers through it; the identity
checks below fail if any of them grows its own copy again (two `extract_last_boxed` once gave
'5' and None for the same text)."""

import pytest

from areal_jax import answers
from areal_jax.answers import (
    extract_final_answer,
    extract_hashes_answer,
    extract_last_boxed,
    first_number,
    hashes_line,
    last_number,
    ungroup_number,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"\boxed{1}", "1"),
        ("so \\boxed{5}.", "5"),
        (r"a \boxed{1} b \boxed{2} c", "2"),  # the last box counts
        (r"\boxed{\frac{\sqrt{3}}{2}} tail", r"\frac{\sqrt{3}}{2}"),  # braces nest
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are text
        (r"\boxed{\}}", r"\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{a} \fbox{b}", "b"),
        (r"\boxed {x}", "x"),  # LaTeX skips the space before the group
        # Without braces: the token after the space, up to a closing $ (the MATH graders' rule).
        (r"so \boxed 5", "5"),
        (r"the answer is $\boxed 7$", "7"),
        (r"\boxed 12 apples", "12"),
        # An unterminated or empty last box gives None, never an earlier box.
        (r"\boxed{1} \boxed{2", None),
        (r"\boxed{3} and a broken \boxed{4", None),
        (r"\boxed{1} then \boxed{}", None),
        (r"\boxed{1} then \boxed", None),
        (r"\boxed5", None),
        # \boxedfoo is another macro, not a box.
        (r"\boxedfoo{2}", None),
        (r"\boxed{2} and \boxedfoo{3}", "2"),
        ("no box", None),
        ("", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_hashes_answer_and_numbers():
    assert extract_hashes_answer("work\n#### 1,234,567") == "1234567"
    assert extract_hashes_answer("a #### 1 #### -3.5 ") == "-3.5"
    assert extract_hashes_answer("#### $72.\nnext line") == "72"
    assert extract_hashes_answer("#### 1,2,3") == "1,2,3"  # a set, not a grouped number
    assert extract_hashes_answer("no marker") is None and extract_hashes_answer("####   ") is None
    assert hashes_line("x #### 5 apples\n#### no") == "no" and hashes_line("none") is None
    assert ungroup_number("-3,500.25") == "-3500.25" and ungroup_number("12,34") == "12,34"
    assert first_number("a 1,234 b 7") == "1,234" and last_number("a 1,234 b -7.5.") == "-7.5"
    assert first_number("none") is None and last_number("") is None
    assert extract_final_answer(r"\boxed{3} then #### 4") == "4"
    assert extract_final_answer(r"#### 4 then \boxed{3}") == "3"
    assert extract_final_answer("#### 4\n\\boxedfoo") == "4"  # not a box: the marker holds
    with pytest.raises(TypeError, match="must be a str"):
        extract_last_boxed(None)


def test_data_rewards_and_evaluation_read_answers_through_one_module():
    from areal_jax import data
    from areal_jax.data import formats
    from areal_jax.evaluation import runner
    from areal_jax.reward import gsm8k, math
    from areal_jax.tasks import reward as task_reward

    for module in (data, formats, math, runner):
        assert module.extract_last_boxed is answers.extract_last_boxed, module.__name__
    assert data.extract_hashes_answer is formats.extract_hashes_answer is answers.extract_hashes_answer
    assert math.extract_final_answer is answers.extract_final_answer
    assert gsm8k.hashes_line is answers.hashes_line and gsm8k.last_number is answers.last_number
    assert task_reward.extract_last_boxed is answers.extract_last_boxed


@pytest.mark.parametrize("solution", [r"so \boxed 5", r"$\boxed{5}$.", r"\boxed{2} then \boxed{5}"])
def test_a_gold_read_from_data_is_what_the_rewards_read_from_the_same_text(solution):
    from areal_jax.data import parse_record
    from areal_jax.reward.math import math_reward
    from areal_jax.tasks.reward import arithmetic_reward

    row = parse_record({"problem": "p", "solution": solution}, source="t")
    assert row.answer == "5"
    assert math_reward(solution, row.answer) == 1.0 and arithmetic_reward(solution, row.answer) == 1.0
