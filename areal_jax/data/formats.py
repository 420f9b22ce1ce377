"""Turn one raw dataset record into a normalized `PromptRow`.

Supported record formats (auto-detected from the keys, or forced):

- ``gsm8k``: ``question`` / ``answer``; the gold is the line after the last ``####``,
  thousands separators removed ("1,234" -> "1234").
- ``math`` (Hendrycks MATH): ``problem`` / ``solution``; the gold is the content of the
  last ``\\boxed{...}`` of the solution (nested braces handled).

Answers are read by `areal_jax.answers`, the rules the rewards read completions by.
- ``areal``: AReaL's math format ``{prompt, solutions, query_id}``; ``solutions`` is a
  list of strings with ``\\boxed{}``; the gold is the last box of the first solution.
- ``code``: ``input_output`` (a JSON string or a dict with equal-length ``inputs`` and
  ``outputs`` lists) with ``question`` or ``prompt`` as the text.

Parsing is pure: a bad record raises `RowFormatError` with the reason; the caller
attaches the file/line and decides what to do (the loader counts and skips).
"""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Mapping
from typing import Any, Literal

from areal_jax.answers import extract_hashes_answer, extract_last_boxed

Task = Literal["math", "code"]
RecordFormat = Literal["auto", "gsm8k", "math", "areal", "code"]
RECORD_FORMATS: tuple[str, ...] = ("auto", "gsm8k", "math", "areal", "code")


class RowFormatError(ValueError):
    """A record does not fit its format (missing field, wrong type, no gold answer)."""


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One prompt, normalized across formats.

    `messages` is the chat to feed the tokenizer's chat template; `answer` is the math
    gold (None for code); `test_cases` is ``{"inputs": [...], "outputs": [...], ...}``
    for code (None for math); `source` says where the row came from ("path:line" for
    JSONL, "path[row]" for Parquet and `datasets` directories).
    """

    query_id: str
    messages: list[dict[str, str]]
    answer: str | None
    test_cases: dict[str, Any] | None
    task: Task
    source: str

    def __post_init__(self) -> None:
        if self.task not in ("math", "code"):
            raise ValueError(f"PromptRow.task must be 'math' or 'code', got {self.task!r}")
        if (self.task == "math") != (self.answer is not None):
            raise ValueError(f"PromptRow {self.source}: math rows need an answer, code rows none")
        if (self.task == "code") != (self.test_cases is not None):
            raise ValueError(f"PromptRow {self.source}: code rows need test_cases, math rows none")


class TemplateFieldError(ValueError):
    """`prompt_template` names a field a record lacks: a configuration mistake, so it stops the load
    (naming the field and the file) instead of skipping the row."""


def template_fields(template: str) -> tuple[str, ...]:
    """The field names a `str.format` template reads; ValueError unless each is a plain name."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"prompt_template {template!r} is not a format string: {err}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        # Plain names only: positional "{}" has nothing to fill it, and "{a.b}" / "{a[0]}" would
        # reach into the row's values.
        if not name.isidentifier():
            raise ValueError(f"prompt_template field {{{name}}} must be a row's field name, e.g. {{question}} "
                             "(write {{ and }} for literal braces)")
        names.append(name)
    if not names:
        raise ValueError(f"prompt_template {template!r} names no field of the row, e.g. {{question}}")
    return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """How a row becomes the prompt.

    With a chat template (the default): chat messages with an optional system prompt and a suffix
    on the user turn. With `prompt_template` (base models, which ship no chat template): the whole
    prompt text, a format string over the row's fields such as "Question: {question}\nAnswer:";
    the row's `messages` are then one user message holding that text.
    """

    prompt_suffix: str = ""
    system_prompt: str | None = None
    prompt_template: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_suffix, str):
            raise TypeError(f"prompt_suffix must be a str, got {type(self.prompt_suffix).__name__}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise TypeError(f"system_prompt must be a str or None, got {type(self.system_prompt).__name__}")
        if self.prompt_template is not None:
            if not isinstance(self.prompt_template, str):
                raise TypeError(f"prompt_template must be a str or None, got {type(self.prompt_template).__name__}")
            template_fields(self.prompt_template)
            if self.prompt_suffix or self.system_prompt is not None:
                raise ValueError("prompt_template is the whole prompt: write the suffix into it; prompt_suffix and "
                                 "system_prompt apply to a chat template only")

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one question."""
        out = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        out.append({"role": "user", "content": question + self.prompt_suffix})
        return out

    def fill(self, record: Mapping[str, Any], source: str) -> str:
        """`prompt_template` filled from `record`; TemplateFieldError naming the field and `source`
        (which names the file) when the record lacks one."""
        for name in template_fields(self.prompt_template):
            if record.get(name) is None:
                fields = sorted(k for k, v in record.items() if v is not None)
                raise TemplateFieldError(f"DataConfig.prompt_template names the field {{{name}}}, which {source} "
                                         f"lacks (its fields: {', '.join(fields[:12]) or 'none'})")
        return self.prompt_template.format_map(record)

    def row_messages(self, record: Mapping[str, Any], question: str, source: str) -> list[dict[str, str]]:
        """The prompt of one record as messages (see the class docstring)."""
        if self.prompt_template is None:
            return self.messages(question)
        return [{"role": "user", "content": self.fill(record, source)}]


def detect_format(record: Mapping[str, Any]) -> str:
    """Name the format of `record` from its keys; raises RowFormatError if none fits."""
    # Null counts as absent: Parquet and `datasets` give every row every column of a
    # mixed file, with None where a row had no such key.
    present = {key for key, value in record.items() if value is not None}
    if "input_output" in present:
        return "code"
    if {"prompt", "solutions"} <= present:
        return "areal"
    if {"problem", "solution"} <= present:
        return "math"
    if {"question", "answer"} <= present:
        return "gsm8k"
    raise RowFormatError(f"cannot detect the format from keys {sorted(present)[:8]}")


def parse_record(
    record: Mapping[str, Any], *, source: str, fmt: str = "auto", template: PromptTemplate = PromptTemplate()
) -> PromptRow:
    """Parse one raw record into a PromptRow; raises RowFormatError on bad records."""
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; expected one of {RECORD_FORMATS}")
    if not isinstance(record, Mapping):
        raise RowFormatError(f"expected an object/dict record, got {type(record).__name__}")
    if fmt == "auto":
        fmt = detect_format(record)
    query_id = _query_id(record, source)
    if fmt == "code":
        question = _text_field(record, "question" if record.get("question") is not None else "prompt")
        return PromptRow(query_id, template.row_messages(record, question, source), None, _test_cases(record), "code",
                         source)
    if fmt == "gsm8k":
        question = _text_field(record, "question")
        answer = extract_hashes_answer(_text_field(record, "answer"))
        if answer is None:
            raise RowFormatError("field 'answer' has no '#### <gold>' part")
    elif fmt == "math":
        question = _text_field(record, "problem")
        answer = extract_last_boxed(_text_field(record, "solution"))
        if answer is None:
            raise RowFormatError("field 'solution' has no \\boxed{...} answer")
    else:  # areal
        question = _text_field(record, "prompt")
        solutions = record.get("solutions")
        if not isinstance(solutions, (list, tuple)) or not solutions or not isinstance(solutions[0], str):
            raise RowFormatError("field 'solutions' must be a non-empty list of strings")
        answer = extract_last_boxed(solutions[0])
        if answer is None:
            raise RowFormatError("first entry of 'solutions' has no \\boxed{...} answer")
    return PromptRow(query_id, template.row_messages(record, question, source), answer, None, "math", source)


def solution_pair(record: Mapping[str, Any], fmt: str = "auto") -> tuple[str, str]:
    """(question, whole solution text) of a GSM8K, MATH or AReaL record, for supervised training;
    RowFormatError for code records (no reference solution) and bad records."""
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; expected one of {RECORD_FORMATS}")
    if fmt == "auto":
        fmt = detect_format(record)
    if fmt == "gsm8k":
        return _text_field(record, "question"), _text_field(record, "answer")
    if fmt == "math":
        return _text_field(record, "problem"), _text_field(record, "solution")
    if fmt == "areal":
        solutions = record.get("solutions")
        if not isinstance(solutions, (list, tuple)) or not solutions or not isinstance(solutions[0], str):
            raise RowFormatError("field 'solutions' must be a non-empty list of strings")
        if not solutions[0].strip():
            raise RowFormatError("first entry of 'solutions' is empty")
        return _text_field(record, "prompt"), solutions[0]
    raise RowFormatError(f"{fmt} rows have no reference solution to train on")


def _query_id(record: Mapping[str, Any], source: str) -> str:
    # Formats without an id (GSM8K, MATH) get their provenance as id: stable per file.
    for key in ("query_id", "id"):
        value = record.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
            return str(value)
    return source


def _text_field(record: Mapping[str, Any], key: str) -> str:
    if record.get(key) is None:
        raise RowFormatError(f"missing field {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise RowFormatError(f"field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowFormatError(f"field {key!r} is empty")
    return value


def _test_cases(record: Mapping[str, Any]) -> dict[str, Any]:
    raw = record.get("input_output")
    if raw is None:
        raise RowFormatError("missing field 'input_output'")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as err:
            raise RowFormatError(f"field 'input_output' is not valid JSON: {err}") from None
    if not isinstance(raw, Mapping):
        raise RowFormatError(f"field 'input_output' must be an object, got {type(raw).__name__}")
    inputs, outputs = raw.get("inputs"), raw.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise RowFormatError("field 'input_output' needs list-valued 'inputs' and 'outputs'")
    if len(inputs) != len(outputs) or not inputs:
        raise RowFormatError(
            f"field 'input_output' needs as many inputs as outputs, at least one (got {len(inputs)}/{len(outputs)})"
        )
    return dict(raw)
