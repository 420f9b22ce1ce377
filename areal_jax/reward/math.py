"""Verifiable math reward: the last ``\\boxed{...}`` of a completion against a gold answer.

Contract (AReaL's): the completion must put its final answer in a box; the last complete
``\\boxed{...}`` (or ``\\fbox{...}``) counts and every earlier box is ignored. There is no
fallback to the last number in the text: a completion without a box scores 0.0, so the policy
is rewarded for the answer format as well as the answer.

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

__all__ = ["extract_last_boxed", "gold_expressions", "math_reward"]

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
    """1.0 if the last boxed answer of ``completion`` equals ``answer`` mathematically, else 0.0.

    No box (or an unterminated last box) scores 0.0; there is no last-number fallback.
    Runs without internal timeouts: call it through ``RewardPool`` (or another process-level
    deadline) when completions are untrusted.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    gold = gold_expressions(answer)
    boxed = extract_last_boxed(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold), pred, timeout_seconds=None) else 0.0
