"""Names of reward functions: built-in short names and validated ``module:function`` paths.

Reward functions cross a process boundary by name, not by pickled object, so a worker can
import them fresh. This module resolves and checks those names; it imports nothing heavy.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Callable

__all__ = ["BUILTIN_REWARDS", "register_reward", "resolve_reward_path", "load_reward_function"]

BUILTIN_REWARDS: dict[str, str] = {
    "math": "areal_jax.reward.math:math_reward",
    "code": "areal_jax.reward.code:code_reward",
}

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def register_reward(name: str, path: str) -> None:
    """Register ``name`` as a short name for the reward function at ``path`` ("module:function").

    Registration is per process; pools resolve names in the parent, so registering before
    submitting is enough (workers only ever see full paths).
    """
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':'")
    if not _PATH.match(path):
        raise ValueError(f"reward path {path!r} is not of the form 'package.module:function'")
    BUILTIN_REWARDS[name] = path


def resolve_reward_path(name_or_path: str) -> str:
    """Map a short name or a ``module:function`` path to a checked ``module:function`` path.

    Checks the syntax and that the module exists (``importlib.util.find_spec``, which imports
    parent packages but not the module itself). A missing attribute is only found when a
    worker imports the module.
    """
    if not isinstance(name_or_path, str):
        raise TypeError(f"reward function must be named by a str, got {type(name_or_path).__name__}")
    path = BUILTIN_REWARDS.get(name_or_path, name_or_path)
    if not _PATH.match(path):
        known = ", ".join(sorted(BUILTIN_REWARDS))
        raise ValueError(
            f"reward function {name_or_path!r} is neither a registered name ({known}) "
            "nor a 'package.module:function' path"
        )
    module = path.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as exc:  # a parent package is missing
        raise ValueError(f"reward function {name_or_path!r}: cannot find module {module!r}: {exc}") from exc
    if spec is None:
        raise ValueError(f"reward function {name_or_path!r}: no module named {module!r}")
    return path


def load_reward_function(path: str) -> Callable[..., object]:
    """Import ``module`` and return the (possibly dotted) attribute named after the colon."""
    module_name, attr_path = path.split(":", 1)
    obj: object = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise LookupError(f"reward function {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise LookupError(f"reward function {path!r} is not callable (got {type(obj).__name__})")
    return obj
