"""Final answers in text: the one place that reads ``\\boxed{...}``, ``#### N`` and the last number.

Data (gold answers of GSM8K, MATH and AReaL rows), the rewards (math, gsm8k, arithmetic) and the
evaluator's maj@k answers all read answers here, so a gold and a completion are always read by
the same rule. The conventions are those of the MATH dataset's graders, which AReaL and
math-verify's users share:

- the last box is the ``\\boxed`` or ``\\fbox`` that starts last (a control word: ``\\boxedx`` is
  another macro). Its content is the brace group after it (braces nest, ``\\{``/``\\}`` are
  literal text, spaces before the group are skipped as LaTeX does), or, written without braces
  (``\\boxed 5``), the token after the space up to whitespace or a closing ``$``. A last box that
  is unterminated or empty gives None, never an earlier box: a truncated generation is not
  credited with an answer it went on to revise.
- ``####`` (GSM8K): the rest of the line after the last marker, without a trailing period or
  ``$`` delimiters; a number's thousands separators are dropped ("1,234" -> "1234").
- the last number: GSM8K's fallback when a completion has no marker.

Pure string functions, no imports from the package: reward workers import this without jax.
"""

from __future__ import annotations

import re

__all__ = ["NUMBER", "extract_final_answer", "extract_hashes_answer", "extract_last_boxed", "first_number",
           "hashes_line", "last_number", "ungroup_number"]

BOX_MACROS = ("\\boxed", "\\fbox")
# A number as GSM8K writes them: "72", "-3.5", "1,234". No nested quantifiers: linear time.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# A number with thousands separators: "1,234", "-3,500.5" (not "1,2,3", a set).
_GROUPED_NUMBER = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")


def _require_str(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


def _last_box_start(text: str) -> tuple[int, int]:
    """(start, macro length) of the last ``\\boxed``/``\\fbox`` control word; (-1, 0) when none."""
    best = (-1, 0)
    for macro in BOX_MACROS:
        start = text.rfind(macro)
        # "\boxedfoo" is another macro: step back to an earlier occurrence.
        while start >= 0 and start + len(macro) < len(text) and text[start + len(macro)].isalpha():
            start = text.rfind(macro, 0, start)
        if start > best[0]:
            best = (start, len(macro))
    return best


def _group_content(text: str, pos: int) -> str | None:
    """Content of the brace group opening at text[pos] == "{"; None when unbalanced."""
    depth = 0
    i = pos
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character (\{ and \} are text, not grouping)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1:i]
        i += 1
    return None


def extract_last_boxed(text: str) -> str | None:
    """Content of the last box of `text` (see the module docstring); None when there is no box or
    the last one is unterminated or empty.

    ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``; ``$\\boxed 7$`` -> ``7``; ``\\boxed {x}`` -> ``x``;
    ``\\boxed{1} \\boxed{2`` -> None.
    """
    text = _require_str(text)
    start, macro_len = _last_box_start(text)
    if start < 0:
        return None
    pos = start + macro_len
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        return _group_content(text, pos) or None
    if pos == start + macro_len:
        return None  # "\boxed5", "\boxed$": no argument LaTeX would read as an answer
    return text[pos:].split(maxsplit=1)[0].split("$", 1)[0] or None


def hashes_line(text: str) -> str | None:
    """The rest of the line after the last ``####`` of `text`, whitespace stripped; None when
    there is no marker."""
    _, sep, tail = _require_str(text).rpartition("####")
    return tail.split("\n", 1)[0].strip() if sep else None


def extract_hashes_answer(text: str) -> str | None:
    """GSM8K's marked answer: the line after the last ``####`` without a trailing period or ``$``
    delimiters, a number's thousands separators dropped; None without a marker or when the line
    is empty."""
    line = hashes_line(text)
    if line is None:
        return None
    return ungroup_number(line.rstrip(".").strip().strip("$").strip()) or None


def ungroup_number(text: str) -> str:
    """`text` without thousands separators when it is one number written with them ("1,234" ->
    "1234"); anything else unchanged ("1,2,3" is a set)."""
    return text.replace(",", "") if _GROUPED_NUMBER.match(_require_str(text)) else text


def extract_final_answer(text: str) -> str | None:
    """The marked final answer of `text`: the last box's content or the ``####`` answer, whichever
    marker starts later; None when that marker holds nothing usable or there is no marker."""
    text = _require_str(text)
    if text.rfind("####") > _last_box_start(text)[0]:
        return extract_hashes_answer(text)
    return extract_last_boxed(text)


def first_number(text: str) -> str | None:
    """The first number (`NUMBER`) in `text`, as written; None when there is none."""
    found = NUMBER.search(_require_str(text))
    return None if found is None else found.group()


def last_number(text: str) -> str | None:
    """The last number (`NUMBER`) in `text`, as written; None when there is none."""
    found = None
    for found in NUMBER.finditer(_require_str(text)):
        pass
    return None if found is None else found.group()
