"""Gin-style configuration over frozen, typed dataclasses.

Every config dataclass is registered with gin under its class name, so users write
`PPOConfig.eps_clip = 0.1` in a .gin file or `--gin_param='PPOConfig.eps_clip = 0.1'`. `build`
constructs a config from the bindings and checks every field against its annotation, so an
unknown name, a wrong type or an invalid value fails before any work starts, naming the culprit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import re
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import gin

T = TypeVar("T")
_REGISTERED: dict[str, type] = {}
_MOVED: dict[str, str] = {}  # "Class.field" of a field that moved -> what to bind instead


class ConfigError(ValueError):
    """A configuration problem found before any work starts."""


def register(cls: type[T]) -> type[T]:
    """Makes the dataclass `cls` configurable by gin under its own name; returns `cls` unchanged."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    name = cls.__name__
    if name in _REGISTERED:
        if _REGISTERED[name] is not cls:
            raise ConfigError(f"two config classes are named {name!r}: {_REGISTERED[name]} and {cls}")
        return cls
    gin.external_configurable(cls, name=name)
    _REGISTERED[name] = cls
    return cls


def register_moved(moved: dict[str, str]) -> None:
    """Names fields that moved ("PPOConfig.remat" -> "TrainEngineConfig.remat"): a binding of the
    old name then fails saying what to bind instead."""
    _MOVED.update(moved)


def registered() -> dict[str, type]:
    """Every registered config class by name, in registration order."""
    return dict(_REGISTERED)


def bindings(cls: type) -> dict[str, Any]:
    """The values the current bindings give fields of `cls` (unbound fields absent)."""
    return dict(gin.get_bindings(cls.__name__))


def parse(gin_files: Sequence[str | pathlib.Path] = (), gin_params: Sequence[str] = (), *,
          skip_unknown: bool = False) -> None:
    """Loads .gin files then single bindings (later ones win); errors name the file or binding.

    skip_unknown: bindings of classes not registered (yet) are ignored instead of refused; for a
    first pass that finds which modules register them (a custom workflow's config class).
    """
    gin.clear_config()
    with _no_gin_path_log():
        _parse(gin_files, gin_params, skip_unknown)


def _parse(gin_files: Sequence[str | pathlib.Path], gin_params: Sequence[str], skip_unknown: bool) -> None:
    for f in gin_files:
        path = pathlib.Path(f)
        if not path.exists():
            raise ConfigError(f"gin file not found: {path}")
        try:
            gin.parse_config_file(str(path), skip_unknown=skip_unknown)
        except Exception as e:  # gin raises several exception types; all mean a bad file
            raise ConfigError(f"{path}: {_moved_hint(e) or _first_line(e)}") from None
    for binding in gin_params:
        try:
            gin.parse_config(binding, skip_unknown=skip_unknown)
        except Exception as e:
            raise ConfigError(f"--gin_param {binding!r}: {_moved_hint(e) or _first_line(e)}") from None


class _GinPathFilter(logging.Filter):
    """gin logs "Path not found: X" on the root logger before raising the error that says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Path not found")


@contextlib.contextmanager
def _no_gin_path_log() -> Iterator[None]:
    """A missing include is reported once, by ConfigError's one line."""
    root, quiet = logging.getLogger(), _GinPathFilter()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def build(cls: type[T], **overrides: Any) -> T:
    """An instance of registered `cls` from the current bindings (plus `overrides`), type-checked.

    Types are checked before construction, so `__post_init__` validation only ever sees values
    of the declared types.
    """
    register(cls)
    values = {**gin.get_bindings(cls.__name__), **overrides}
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in hints and not _matches(value, hints[name]):
            raise ConfigError(f"{cls.__name__}.{name} = {value!r} does not match its type {_type_name(hints[name])}")
    try:
        obj = gin.get_configurable(cls.__name__)(**overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{cls.__name__}: {_first_line(e)}") from None
    check_types(obj)
    return obj


def check_types(obj: Any, prefix: str = "") -> None:
    """Raises ConfigError if a field's value does not match its annotation."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{prefix or type(obj).__name__}.{f.name}"
        if f.name in hints and not _matches(value, hints[f.name]):
            raise ConfigError(f"{where} = {value!r} does not match its type {_type_name(hints[f.name])}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value, where)


def operative_config() -> str:
    """The bindings gin actually used, as .gin text."""
    return gin.operative_config_str()


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        if origin is tuple and args:
            return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # annotations we don't model (callables, forward refs to protocols) are not checked


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _moved_hint(e: Exception) -> str | None:
    """For gin's unknown-parameter error on a field that moved: where it went."""
    match = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", str(e))
    old = match and f"{match.group(1)}.{match.group(2)}"
    return f"{old} moved: bind {_MOVED[old]} instead" if old in _MOVED else None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
