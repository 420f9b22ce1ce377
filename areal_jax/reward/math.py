"""Verifiable math reward: the final answer of a completion against a gold answer.

Contract (AReaL's, widened to GSM8K's convention): the completion must mark its final answer,
either in a box or after ``####`` as GSM8K solutions do. Whichever marker comes last counts:
the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), or the rest of the
line after the last ``####``. There is no fallback to the last number in the text: a completion
with neither marker scores 0.0, so the policy is rewarded for the answer format as well as the
answer (the `gsm8k` reward, reward/gsm8k.py, has that fallback).

Equivalence is decided by math-verify (numeric and symbolic: fractions vs decimals, radicals,
percentages, sets, intervals, ...). math-verify's own timeouts use ``signal.alarm``, which
only works in a process's main thread, so they are switched off here; callers bound the time
from outside (``RewardPool`` kills a worker whose call overruns).
"""

from __future__ import annotations

import functools
import logging

from math_verify import parse, verify

from areal_jax.answers import extract_final_answer, extract_hashes_answer, extract_last_boxed, ungroup_number

__all__ = ["extract_final_answer", "extract_last_boxed", "gold_expressions", "math_reward"]

# math-verify warns once per process that its timeouts are off; that is our design, not news.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _normalize_gold(answer: str) -> str:
    """Reduce a gold answer to the LaTeX that goes inside a box."""
    answer = answer.strip()
    if "####" in answer:  # a full GSM8K solution: its marked answer (thousands separators dropped)
        return extract_hashes_answer(answer) or ""
    boxed = extract_last_boxed(answer)
    if boxed is not None:
        answer = boxed.strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    return ungroup_number(answer)


@functools.lru_cache(maxsize=65536)
def gold_expressions(answer: str) -> tuple:
    """Parse a gold answer once per process (cached by the answer string).

    Accepts bare LaTeX (``\\frac{1}{2}``), GSM8K numbers (``72``, ``1,234``), a full GSM8K
    solution ending in ``#### 72``, or an already boxed answer. Raises ValueError if
    math-verify extracts nothing: an unparseable gold is a data bug, not a wrong answer.
    """
    if not isinstance(answer, str):
        raise TypeError(f"gold answer must be str, got {type(answer).__name__}")
    normalized = _normalize_gold(answer)
    if not normalized:
        raise ValueError(f"gold answer {answer!r} is empty")
    parsed = parse(f"\\boxed{{{normalized}}}", parsing_timeout=None)
    if not parsed:
        raise ValueError(f"math-verify could not parse gold answer {answer!r}")
    return tuple(parsed)


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the marked final answer of ``completion`` (`extract_final_answer`: the last box, or
    the line after a later ``####``) equals ``answer`` mathematically, else 0.0.

    No marker (or an unterminated last box) scores 0.0; there is no last-number fallback.
    Runs without internal timeouts: call it through ``RewardPool`` (or another process-level
    deadline) when completions are untrusted.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    gold = gold_expressions(answer)
    boxed = extract_final_answer(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold), pred, timeout_seconds=None) else 0.0
