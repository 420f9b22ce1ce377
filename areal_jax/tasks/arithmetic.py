"""Synthetic multi-step arithmetic with verifiable answers: the built-in reasoning task.

A problem is an integer expression such as ``37+58-21``; its solution evaluates it one
operation per line (multiplications first, then left to right) and ends with the answer in
``\\boxed{...}``::

    Compute 37+58-21.          (question)
    37+58=95                   (solution: one step per line)
    95-21=74
    \\boxed{74}

Everything is a pure function of (config, seed, split, index): the same arguments always
give the same problems. Train and test never share a problem because the split of an
expression is decided by a hash of its text, not by the generator's stream.

Rows come in three shapes: `ArithmeticProblem` (question, solution, answer), MATH-style
JSONL records (``{"problem", "solution"}``, see `write_jsonl`) that areal_jax.data reads, and
loader-style dicts ``{"prompt_ids", "row"}`` (`prompt_rows`) like `build_prompt_loader` yields;
`ProblemStream` is the task's endless, checkpointable RL prompt stream of those dicts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import random
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from areal_jax.data.formats import PromptRow, PromptTemplate

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")
OPERATORS = "+-*"


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty of the task.

    min_operands / max_operands: operands per expression (each problem draws a count uniformly).
    max_digits: operands have 1..max_digits digits (digit count drawn uniformly, then the value).
    operators: which of "+", "-", "*" may appear.
    mul_max_digits: operands next to a "*" have at most this many digits (keeps products short).
    test_percent: share of the expression space (by hash) that belongs to the test split.
    """

    min_operands: int = 3
    max_operands: int = 4
    max_digits: int = 1
    operators: str = "+-"
    mul_max_digits: int = 1
    test_percent: int = 10

    def __post_init__(self):
        for name in ("min_operands", "max_operands", "max_digits", "mul_max_digits", "test_percent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"ArithmeticConfig.{name} must be an int, got {value!r}")
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"ArithmeticConfig needs 2 <= min_operands ({self.min_operands}) <= max_operands "
                             f"({self.max_operands})")
        if not 1 <= self.max_digits <= 9:
            raise ValueError(f"ArithmeticConfig.max_digits must be in [1, 9], got {self.max_digits}")
        if not 1 <= self.mul_max_digits <= self.max_digits:
            raise ValueError(f"ArithmeticConfig.mul_max_digits must be in [1, max_digits], got {self.mul_max_digits}")
        if not self.operators or any(op not in OPERATORS for op in self.operators) or \
                len(set(self.operators)) != len(self.operators):
            raise ValueError(f"ArithmeticConfig.operators must be distinct characters of {OPERATORS!r}, "
                             f"got {self.operators!r}")
        if not 1 <= self.test_percent <= 50:
            raise ValueError(f"ArithmeticConfig.test_percent must be in [1, 50], got {self.test_percent}")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: `expression` ("37+58-21"), the chat `question`, the step-by-step `solution`
    (ending in ``\\boxed{answer}``) and the integer `answer`."""

    expression: str
    question: str
    solution: str
    answer: int

    @property
    def query_id(self) -> str:
        """Stable id: the expression itself (unique within a split)."""
        return self.expression

    def math_record(self) -> dict[str, str]:
        """MATH-format record (areal_jax.data reads the gold from the last box of `solution`)."""
        return {"problem": self.question, "solution": self.solution, "query_id": self.query_id}

    def prompt_row(self, template: PromptTemplate = PromptTemplate(), source: str = "arithmetic") -> PromptRow:
        """The normalized row areal_jax.data would build from `math_record()`."""
        return PromptRow(self.query_id, template.messages(self.question), str(self.answer), None, "math", source)


def split_of(expression: str, test_percent: int) -> Split:
    """Split an expression belongs to, from a hash of its text (independent of any seed)."""
    digest = hashlib.sha256(expression.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 100 < test_percent else "train"


def solve(expression: str) -> tuple[list[str], int]:
    """Steps ("a+b=c" lines) and value of an integer expression of +, -, *.

    Multiplications are reduced first (left to right), then + and - left to right: the usual
    precedence, so the value equals Python's evaluation of the expression.
    """
    numbers, ops = _tokenize(expression)
    steps: list[str] = []
    i = 0
    while i < len(ops):  # '*' binds tighter: reduce those first
        if ops[i] == "*":
            value = numbers[i] * numbers[i + 1]
            steps.append(f"{numbers[i]}*{numbers[i + 1]}={value}")
            numbers[i:i + 2] = [value]
            del ops[i]
        else:
            i += 1
    value = numbers[0]
    for op, rhs in zip(ops, numbers[1:]):
        new = value + rhs if op == "+" else value - rhs
        steps.append(f"{value}{op}{rhs}={new}")
        value = new
    return steps, value


def _tokenize(expression: str) -> tuple[list[int], list[str]]:
    numbers: list[int] = []
    ops: list[str] = []
    current = ""
    for ch in expression:
        if ch.isdigit():
            current += ch
        elif ch in OPERATORS and current:
            numbers.append(int(current))
            ops.append(ch)
            current = ""
        else:
            raise ValueError(f"cannot parse expression {expression!r} at {ch!r}")
    if not current:
        raise ValueError(f"expression {expression!r} must end with a number")
    numbers.append(int(current))
    return numbers, ops


def make_problem(expression: str) -> ArithmeticProblem:
    """The problem for one expression (question, solution steps, boxed answer)."""
    steps, value = solve(expression)
    solution = "\n".join(steps + [f"\\boxed{{{value}}}"])
    return ArithmeticProblem(expression, f"Compute {expression}.", solution, value)


def _random_operand(rng: random.Random, digits: int) -> int:
    n = rng.randint(1, digits)
    return rng.randint(0 if n == 1 else 10 ** (n - 1), 10 ** n - 1)


def _random_expression(rng: random.Random, cfg: ArithmeticConfig) -> str:
    count = rng.randint(cfg.min_operands, cfg.max_operands)
    ops = [rng.choice(cfg.operators) for _ in range(count - 1)]
    parts = []
    for i in range(count):
        next_to_mul = (i > 0 and ops[i - 1] == "*") or (i < count - 1 and ops[i] == "*")
        parts.append(str(_random_operand(rng, cfg.mul_max_digits if next_to_mul else cfg.max_digits)))
        if i < count - 1:
            parts.append(ops[i])
    return "".join(parts)


def iter_problems(cfg: ArithmeticConfig, split: Split, seed: int = 0, *, unique: bool = True,
                  ) -> Iterator[ArithmeticProblem]:
    """Endless deterministic stream of problems of one split.

    The generator's stream depends on (seed, split); expressions whose hash falls in the other
    split are skipped, so the splits are disjoint whatever the seeds. With `unique`, an
    expression appears at most once (the stream ends if the space is exhausted).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"arithmetic/{seed}/{split}")
    seen: set[str] = set()
    misses = 0
    while misses < 100_000:  # consecutive draws without a new problem: the space is exhausted
        expression = _random_expression(rng, cfg)
        if split_of(expression, cfg.test_percent) != split or (unique and expression in seen):
            misses += 1
            continue
        misses = 0
        if unique:
            seen.add(expression)
        yield make_problem(expression)


def problems(cfg: ArithmeticConfig, split: Split, n: int, seed: int = 0) -> list[ArithmeticProblem]:
    """The first `n` distinct problems of `split` (raises if the space holds fewer)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    out = []
    for problem in iter_problems(cfg, split, seed):
        if len(out) == n:
            break
        out.append(problem)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} problems exist for {cfg}, asked for {n}")
    return out


def write_jsonl(path: str | pathlib.Path, split: Split, n: int, *, cfg: ArithmeticConfig = ArithmeticConfig(),
                seed: int = 0, fmt: Literal["math", "areal"] = "math") -> pathlib.Path:
    """Writes `n` problems of `split` as JSONL that areal_jax.data reads.

    fmt "math": ``{"problem", "solution", "query_id"}``; fmt "areal": ``{"prompt", "solutions",
    "query_id"}``. The gold answer is the last ``\\boxed{}`` of the solution in both.
    """
    if fmt not in ("math", "areal"):
        raise ValueError(f"fmt must be 'math' or 'areal', got {fmt!r}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in problems(cfg, split, n, seed):
            record = p.math_record() if fmt == "math" else {
                "prompt": p.question, "solutions": [p.solution], "query_id": p.query_id}
            f.write(json.dumps(record) + "\n")
    return path


def prompt_ids(tokenizer: Any, problem: ArithmeticProblem, template: PromptTemplate = PromptTemplate()) -> np.ndarray:
    """Chat-templated prompt ids `[P]` (int32) of one problem, as the data loader builds them."""
    ids = tokenizer.apply_chat_template(template.messages(problem.question), add_generation_prompt=True,
                                        tokenize=True)
    return np.asarray(ids, np.int32)


def prompt_rows(tokenizer: Any, items: Sequence[ArithmeticProblem],
                template: PromptTemplate = PromptTemplate()) -> Iterator[dict[str, Any]]:
    """Loader-style examples ``{"prompt_ids": int32 [P], "row": PromptRow}`` for `items`."""
    for p in items:
        yield {"prompt_ids": prompt_ids(tokenizer, p, template), "row": p.prompt_row(template)}


def sft_examples(tokenizer: Any, items: Sequence[ArithmeticProblem],
                 template: PromptTemplate = PromptTemplate()) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt_ids, completion_ids) pairs for SFT: the completion is the solution then eos."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; SFT completions must end with one")
    out = []
    for p in items:
        completion = tokenizer.encode(p.solution, add_special_tokens=False) + [eos]
        out.append((prompt_ids(tokenizer, p, template), np.asarray(completion, np.int32)))
    return out


class ProblemStream:
    """The task's RL prompt stream: endless loader-style rows (`prompt_rows`) over `items`, a fresh
    permutation per epoch; checkpointable (`get_state` / `set_state`, as the data loader)."""

    def __init__(self, tokenizer: Any, items: Sequence[ArithmeticProblem], *, seed: int):
        if not items:
            raise ValueError("no training problems for this process")
        self._tokenizer, self._items, self._seed = tokenizer, items, seed
        self._epoch, self._index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self._seed, self._epoch]).permutation(len(self._items))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, Any]:
        if self._index == len(self._items):
            self._epoch, self._index = self._epoch + 1, 0
            self._order = self._permutation()
        item = self._items[self._order[self._index]]
        self._index += 1
        return next(prompt_rows(self._tokenizer, [item]))

    def get_state(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def set_state(self, state: dict[str, int]) -> None:
        self._epoch, self._index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()
