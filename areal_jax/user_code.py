"""Where user code (reward functions, workflows) is imported from, and what a failed import says.

`python -m` puts the working directory first on sys.path; the `areal-jax` console script puts
only its own bin directory there, so a `rewards.py` beside the user's data would not import.
`add_import_paths` restores what `python -m` does and adds `--import_path` directories, in
sys.path (this process, and the fork server the reward pool starts from it) and in PYTHONPATH
(every other subprocess). Imports nothing, so any layer may use `import_hint`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["add_import_paths", "import_hint"]


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
