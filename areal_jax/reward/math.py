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
import re

from math_verify import parse, verify

__all__ = ["extract_final_answer", "extract_last_boxed", "gold_expressions", "math_reward"]

# math-verify warns once per process that its timeouts are off; that is our design, not news.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# GSM8K golds: "72", "1,234", "-3.5" (thousands separators are not set delimiters here).
_GSM8K_NUMBER = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last complete ``\\boxed{...}``/``\\fbox{...}`` in ``text``.

    Braces are matched with a depth counter, so nested groups such as
    ``\\boxed{\\frac{\\sqrt{3}}{2}}`` come back whole. If the last box is unterminated
    (a truncated generation), the result is None rather than an earlier box: the final
    answer is what is graded.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The marked final answer of `text`: the last box's content or the line after the last
    ``####``, whichever marker starts later; None when the later marker holds nothing usable
    (an unterminated box, an empty ``####`` line) or there is no marker."""
    hashes = text.rfind("####")
    if hashes > max(text.rfind(cmd) for cmd in _BOX_COMMANDS):
        line = text[hashes + 4:].strip().split("\n", 1)[0].strip()
        line = line.rstrip(".").strip().strip("$").strip()
        if _GSM8K_NUMBER.match(line):
            line = line.replace(",", "")
        return line or None
    return extract_last_boxed(text)


def _normalize_gold(answer: str) -> str:
    """Reduce a gold answer to the LaTeX that goes inside a box."""
    answer = answer.strip()
    if "####" in answer:  # a full GSM8K solution: the answer follows the last "####"
        answer = answer.rsplit("####", 1)[1].strip()
    boxed = extract_last_boxed(answer)
    if boxed is not None:
        answer = boxed.strip()
    if answer.startswith("$") and answer.endswith("$") and len(answer) > 1:
        answer = answer.strip("$").strip()
    if _GSM8K_NUMBER.match(answer):
        answer = answer.replace(",", "")
    return answer


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
