"""`areal-jax config`: every configurable field with its value, type and one line of doc.

Each field prints as a gin binding, `Class.field = value  # type: doc`, so the output can be
pasted into a .gin file. The value is the one the given gin files and params bind, else the
field's default. The doc line comes from the class docstring (`field: text` lines, as in an
Attributes section) or else from the comment beside or just above the field in the source.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from collections.abc import Sequence
from typing import Any

from areal_jax import config_system as cs

# A docstring entry starts a line or follows the end of a sentence: "name: text".
_DOC_ENTRY = re.compile(r"(?:^|(?<=[.;]\s))(\w+):\s+", re.MULTILINE)


def describe_configs(gin_files: Sequence[str] = (), gin_params: Sequence[str] = ()) -> str:
    """Every registered config field as `Class.field = value  # type: doc`, one class per block.

    Raises ConfigError (naming the file or binding) when the bindings do not parse.
    """
    classes = _config_classes()
    cs.parse(gin_files, gin_params)
    return "\n\n".join(_describe_class(cls) for cls in classes) + "\n"


def _config_classes() -> list[type]:
    """The job's config classes, then any other registered one (e.g. EvalConfig)."""
    from areal_jax.evaluation import EvalConfig
    from areal_jax.jobs.configs import JOB_CONFIG_CLASSES

    cs.register(EvalConfig)
    rest = [c for c in cs.registered().values() if c not in JOB_CONFIG_CLASSES]
    return list(JOB_CONFIG_CLASSES) + rest


def _describe_class(cls: type) -> str:
    bound = cs.bindings(cls)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = [f"# {cls.__name__}: {_summary(cls)}".rstrip(": ")]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = bound[f.name] if f.name in bound else _default(f)
        note = type_name(hints.get(f.name, Any))
        if f.name in bound:
            note += f", bound (default {_show(_default(f))})"
        doc = docs.get(f.name, "")
        lines.append(f"{cls.__name__}.{f.name} = {_show(value)}  # {note}" + (f": {doc}" if doc else ""))
    return "\n".join(lines)


def _show(value: Any) -> str:
    return "<required>" if value is dataclasses.MISSING else repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING  # required: no default


def type_name(hint: Any) -> str:
    """A readable annotation: `int`, `str | None`, `tuple[int, ...]`, `Literal['a', 'b']`."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return re.sub(r"\btyping\.|<class '(\w+)'>", lambda m: m.group(1) or "", str(hint))


def _summary(cls: type) -> str:
    doc = _own_doc(cls)
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def _own_doc(cls: type) -> str:
    """The class docstring, not the signature dataclasses writes when there is none."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc)


def field_docs(cls: type) -> dict[str, str]:
    """One line of doc per field: its docstring entry, else the comment beside or above it."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {**_comment_docs(cls, names), **_docstring_docs(_own_doc(cls), names)}


def _docstring_docs(doc: str, names: set[str]) -> dict[str, str]:
    """`name: text` entries of a docstring: one per line (an Attributes section) or several in
    running prose ("steps: optimizer steps. batch_size: rows per step.")."""
    out: dict[str, str] = {}
    for paragraph in re.split(r"\n\s*\n", doc):
        text = "\n".join(line.strip() for line in paragraph.splitlines())
        starts = [m for m in _DOC_ENTRY.finditer(text) if m.group(1) in names]
        for m, nxt in zip(starts, starts[1:] + [None]):
            out.setdefault(m.group(1), _first_sentence(text[m.end():nxt.start() if nxt else len(text)]))
    return out


def _comment_docs(cls: type, names: set[str]) -> dict[str, str]:
    """The comment on a field's line, else the comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines, start=1):
        m = re.match(r"\s+(\w+)\s*:", line)
        if not m or m.group(1) not in names or m.group(1) in out:
            continue
        if i in comments and not line.lstrip().startswith("#"):
            out[m.group(1)] = _first_sentence(comments[i])
            continue
        above = []
        j = i - 1
        while j in comments and lines[j - 1].lstrip().startswith("#"):
            above.insert(0, comments[j])
            j -= 1
        if above:
            out[m.group(1)] = _first_sentence(" ".join(above))
    return out


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    m = re.search(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s", text)
    return text[:m.start()] if m else text
