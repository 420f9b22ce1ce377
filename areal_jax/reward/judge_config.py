"""`JudgeConfig`: what a generative judge is (reward/judge.py runs it). Imports nothing heavy, so
RLVRConfig can carry one."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

__all__ = ["DEFAULT_TEMPLATE", "JudgeConfig"]

DEFAULT_TEMPLATE = ("Question: {question}\nAnswer: {answer}\n"
                    "Is the answer correct? Reply Yes or No.")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """A generative judge (gin: `JudgeConfig.field = ...`).

    model: HF directory of a causal LM with its tokenizer.
    template: the judge's prompt, `str.format`ted with {question} and {answer}; rendered as a user
        turn by the judge's chat template when it has one and `chat` is on, else encoded as is.
    parse: "regex" (generate, then read `pattern`) or "logprob" (read the choices' probabilities).
    pattern: regex mode: the score is float(first group) of the last match (the whole match
        when the pattern has no group).
    choices: logprob mode: the answers whose next-token probabilities are read (first token each;
        the first tokens must differ).
    values: logprob mode: the value of each choice (default: the choices as numbers when all are
        numbers, else 1.0 for the first choice and 0.0 for the rest).
    timeout_s: a prompt's deadline from submission; one past it scores 0.0, counted.
    """

    model: str = ""
    template: str = DEFAULT_TEMPLATE
    parse: Literal["regex", "logprob"] = "logprob"
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    choices: tuple[str, ...] = ("Yes", "No")
    values: tuple[float, ...] = ()
    max_new_tokens: int = 32
    timeout_s: float = 30.0
    chat: bool = True
    dtype: str = "float32"
    batch_size: int = 16  # logprob mode: prompts per prefill; regex mode: the engine's decode slots
    max_seq_len: int = 1024  # prompt + judge output tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"JudgeConfig.model must name the judge's model directory, got {self.model!r}")
        if self.parse not in ("regex", "logprob"):
            raise ValueError(f"JudgeConfig.parse must be 'regex' or 'logprob', got {self.parse!r}")
        try:
            self.template.format(question="", answer="")
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(f"JudgeConfig.template may use only {{question}} and {{answer}}: "
                             f"{type(e).__name__}: {e}") from None
        if "{answer}" not in self.template:
            raise ValueError("JudgeConfig.template must contain {answer}")
        try:
            re.compile(self.pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"JudgeConfig.pattern {self.pattern!r} is not a regular expression: {e}") from None
        if not self.choices or not all(isinstance(c, str) and c for c in self.choices) \
                or len(set(self.choices)) != len(self.choices):
            raise ValueError(f"JudgeConfig.choices must be distinct non-empty strings, got {self.choices!r}")
        if self.values and len(self.values) != len(self.choices):
            raise ValueError(f"JudgeConfig.values has {len(self.values)} entries for {len(self.choices)} choices")
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError(f"JudgeConfig.values must be finite, got {self.values!r}")
        for name in ("max_new_tokens", "batch_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"JudgeConfig.{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < float("inf")):
            raise ValueError(f"JudgeConfig.timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"JudgeConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def choice_values(self) -> tuple[float, ...]:
        if self.values:
            return self.values
        try:
            return tuple(float(c) for c in self.choices)
        except ValueError:
            return (1.0,) + (0.0,) * (len(self.choices) - 1)
