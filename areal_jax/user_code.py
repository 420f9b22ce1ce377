"""Where user code (reward functions, workflows, losses) is imported from, and what a failed import says.

`python -m` puts the working directory first on sys.path; the `areal-jax` console script puts
only its own bin directory there, so a `rewards.py` beside the user's data would not import.
`add_import_paths` restores what `python -m` does and adds `--import_path` directories, in
sys.path (this process, and the fork server the reward pool starts from it) and in PYTHONPATH
(every other subprocess). `load_callable` imports a "package.module:function" path. Imports nothing
of the package, so any layer may use it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_import_paths", "import_hint", "load_callable"]


def add_import_paths(extra: Sequence[str] = (), *, cwd: bool = True) -> list[str]:
    """Puts `extra` (in order) then the working directory first on sys.path and PYTHONPATH,
    each once; returns those that were not on sys.path. Call it before any reward pool starts."""
    wanted = list(dict.fromkeys([os.path.abspath(p) for p in extra] + ([os.getcwd()] if cwd else [])))
    added = [d for d in wanted if d not in sys.path]
    sys.path[:] = wanted + [p for p in sys.path if p not in wanted]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(wanted + current))
    return added


def import_hint(module: str) -> str:
    """How to make `module` importable, for the end of an error line."""
    top = module.split(".", 1)[0]
    return (f"areal-jax imports user code from the working directory, --import_path=DIR and PYTHONPATH: run it "
            f"from the directory that holds {top}.py (or the package {top}/), or pass --import_path=<that directory>")


def load_callable(path: str, field: str) -> Callable[..., Any]:
    """The callable at `path` ("package.module:function", the function possibly dotted). Any problem
    is a ValueError of one line naming `field` and the path (no such module, no such attribute, a
    broken module, not callable)."""
    where = f"{field} = {path!r}"
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{where}: is not of the form 'package.module:function'")
    module_name, attr_path = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"{where}: cannot import module {module_name!r}: no module named {exc.name!r}; "
                             f"{import_hint(exc.name)}") from None
        raise ValueError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's module itself is broken: say so, keep the cause
        raise ValueError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"{where}: is not callable (a {type(obj).__name__})")
    return obj
