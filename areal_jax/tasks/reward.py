"""Reward of the arithmetic task: exact integer match of the last ``\\boxed{...}``.

In-process and cheap (a regular expression, no sympy), so the rollout side may call it inline
or through `areal_jax.reward.RewardPool` by name ("arithmetic", registered when
`areal_jax.tasks` is imported) or by path ("areal_jax.tasks.reward:arithmetic_reward").
"""

from __future__ import annotations

import re

from areal_jax.answers import extract_last_boxed

REWARD_PATH = "areal_jax.tasks.reward:arithmetic_reward"

_INTEGER = re.compile(r"[+-]?\d+")


def parse_boxed_integer(completion_text: str) -> int | None:
    """Integer in the last ``\\boxed{...}`` of the text (`areal_jax.answers.extract_last_boxed`:
    the rule every reward reads boxes by); None when there is no box, the last one is unterminated,
    or its content is not exactly an integer (surrounding spaces allowed)."""
    content = extract_last_boxed(completion_text)
    if content is None:
        return None
    content = content.strip()
    return int(content) if _INTEGER.fullmatch(content) else None


def arithmetic_reward(completion_text: str, answer: int | str) -> float:
    """1.0 iff the last ``\\boxed{}`` of `completion_text` holds exactly the integer `answer`, else 0.0."""
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text must be a str, got {type(completion_text).__name__}")
    gold = int(answer) if not isinstance(answer, str) else int(answer.strip())
    value = parse_boxed_integer(completion_text)
    return 1.0 if value is not None and value == gold else 0.0
