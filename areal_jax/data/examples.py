"""A prompt example with its gold answer: the one typed view of a loader row.

Loaders (data/pipeline.py, tasks/arithmetic.py) yield rows ``{"prompt_ids": int32 [P], "row":
PromptRow}`` and workflows receive them as they are (their contract). Whatever reads such a row
(the RLVR and multi-turn workflows, held-out evaluation, ``areal-jax eval``) reads it through
`prompt_example`, which is also the one place that decides the reward's reference: the answer of a
math row, the test cases of a code row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from areal_jax.data.formats import PromptRow

__all__ = ["PromptExample", "gold_answer", "prompt_example"]

_ROW_FIELDS = ("query_id", "source", "task", "answer", "test_cases")  # what PromptRow gives


@dataclasses.dataclass(frozen=True, eq=False)
class PromptExample:
    """One prompt and what its completions are scored against.

    prompt_ids: int32 [P], the tokenized prompt. gold: the reward's reference, called as
    reward(completion_text, gold): the answer (math) or the test cases (code). row: the normalized
    record (messages, source, task) it came from.
    """

    prompt_ids: np.ndarray
    gold: Any
    row: PromptRow

    @property
    def query_id(self) -> str:
        return str(self.row.query_id)

    @property
    def source(self) -> str:
        return self.row.source


def prompt_example(row: Any) -> PromptExample:
    """The typed example of a loader row; a malformed row is a one-line error naming the key or
    attribute it lacks."""
    if isinstance(row, PromptExample):
        return row
    if not isinstance(row, Mapping):
        raise TypeError(f"a prompt example is a loader row {{'prompt_ids', 'row'}}, got {type(row).__name__}")
    for key in ("prompt_ids", "row"):
        if key not in row:
            raise ValueError(f"prompt example has no key {key!r} (a loader row is {{'prompt_ids': int32 [P], "
                           f"'row': PromptRow}}; it has {sorted(map(str, row))})")
    record = row["row"]
    for attr in _ROW_FIELDS:
        if not hasattr(record, attr):
            raise TypeError(f"prompt example's 'row' has no .{attr}: expected a PromptRow, got {type(record).__name__}")
    gold = record.answer if record.task == "math" else record.test_cases
    return PromptExample(prompt_ids=np.asarray(row["prompt_ids"], np.int32).reshape(-1), gold=gold, row=record)


def gold_answer(row: Any) -> Any:
    """The reward's reference of a loader row (`prompt_example(row).gold`)."""
    return prompt_example(row).gold
