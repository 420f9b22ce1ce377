"""GSM8K reward: the number after the completion's last ``####``, else its last number, against
the gold number.

The convention GSM8K solutions are written in ("... so she has 16 left.\\n#### 16"), and the
fallback the dataset's graders use when a completion does not follow it. Numbers compare
exactly as decimals after thousands separators, a leading currency sign and a trailing period
are dropped: "1,234" = "1234.00", "$5" = "5".

In-process and cheap: two linear regular expressions over the text and a decimal compare (no
sympy), so it is registered `in_process` and needs no reward workers.
"""

from __future__ import annotations

import decimal

from areal_jax.answers import first_number, hashes_line, last_number

__all__ = ["final_number", "gold_number", "gsm8k_reward"]


def _to_decimal(text: str) -> decimal.Decimal | None:
    try:
        return decimal.Decimal(text.replace(",", "").rstrip("."))
    except decimal.InvalidOperation:
        return None


def final_number(text: str) -> decimal.Decimal | None:
    """The first number on the line after the last ``####`` of `text`, or (none there) the last
    number of `text`; None when it holds no number."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    line = hashes_line(text)
    number = first_number(line) if line else None
    if number is None:
        number = last_number(text)
    return None if number is None else _to_decimal(number)


def gold_number(answer: str | int | float) -> decimal.Decimal:
    """The gold as a number: "72", "1,234", or a whole GSM8K solution ending in "#### 72".
    ValueError when it holds no number: an unreadable gold is a data bug, not a wrong answer."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return decimal.Decimal(str(answer))
    if not isinstance(answer, str):
        raise TypeError(f"gold answer must be a str or a number, got {type(answer).__name__}")
    value = final_number(answer)
    if value is None:
        raise ValueError(f"gold answer {answer!r} holds no number")
    return value


def gsm8k_reward(completion: str, answer: str | int | float) -> float:
    """1.0 if the completion's final number (see `final_number`) equals the gold, else 0.0."""
    gold = gold_number(answer)
    value = final_number(completion)
    return 1.0 if value is not None and value == gold else 0.0
