"""Names of reward functions: built-in short names and validated ``module:function`` paths, and
where each may run.

Reward functions cross a process boundary by name, not by pickled object, so a worker can
import them fresh. This module resolves and checks those names; it imports nothing heavy.

Where a reward runs is a declared property of its registration (`RewardSpec.in_process`), not a
judgement each caller makes: only rewards registered as cheap and safe (bounded time, no sympy,
no user code, no backtracking regex on model text) may run in the trainer's process. Everything
else - math, code, any "package.module:function" path - runs in `RewardPool` worker processes,
where a deadline can kill it: a call stuck in C code holds the GIL, and no thread of the process
that called it would run until it returned.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import math
import numbers
import re
import subprocess
import sys
import types
from typing import Callable

from areal_jax.user_code import import_hint

__all__ = ["REWARDS", "RewardSpec", "check_reward_function", "probe_reward", "register_reward", "register_reward_callable",
           "resolve_reward_path", "reward_spec", "reward_value", "load_reward_function", "runs_in_process"]

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A registered reward.

    path: "package.module:function".
    in_process: declared cheap and safe: may run in the calling process (no worker, no deadline).
    runs_code: executes model-written code (in the sandbox): jobs check the sandbox's network
        isolation before they start.
    """

    path: str
    in_process: bool = False
    runs_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not _PATH.match(self.path):
            raise ValueError(f"reward path {self.path!r} is not of the form 'package.module:function'")


REWARDS: dict[str, RewardSpec] = {
    "math": RewardSpec("areal_jax.reward.math:math_reward"),
    # GSM8K's "#### N" or the last number: two linear regular expressions and a decimal compare.
    "gsm8k": RewardSpec("areal_jax.reward.gsm8k:gsm8k_reward", in_process=True),
    "code": RewardSpec("areal_jax.reward.code:code_reward", runs_code=True),
    # A regular expression without nested quantifiers over the text, then an int compare.
    "arithmetic": RewardSpec("areal_jax.tasks.reward:arithmetic_reward", in_process=True),
}


def register_reward(name: str, path: str, *, in_process: bool = False, runs_code: bool = False) -> None:
    """Register ``name`` as a short name for the reward function at ``path`` ("module:function").

    in_process=True declares the function cheap and safe to call in the trainer's process; say it
    only of code whose running time is bounded whatever the completion holds.
    Registration is per process; pools resolve names in the parent, so registering before
    submitting is enough (workers only ever see full paths).
    """
    if not name or not isinstance(name, str) or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':'")
    REWARDS[name] = RewardSpec(path, in_process=in_process, runs_code=runs_code)


# Python callables registered by `register_reward_callable`, addressed by path like any reward
# ("areal_jax.reward.registry:PYTHON_REWARDS.<name>"): found in this process only.
PYTHON_REWARDS = types.SimpleNamespace()
# The name each registered callable got, by id (the callable is held in PYTHON_REWARDS, so its id
# is never reused while it is here).
_CALLABLE_NAMES: dict[int, str] = {}


def register_reward_callable(fn: Callable[..., object], name: str | None = None) -> str:
    """Registers the callable `fn(completion, gold) -> float` (a lambda or closure will do) as an
    in-process reward and returns its name, for RLVRConfig.reward.

    It runs in this process: rollouts call it on the reward threads under
    RLVRConfig.reward_timeout_s, but a call stuck in C code cannot be cut off there. A reward that
    may hang (sympy, user code) is better named by "package.module:function", run in worker processes.
    Default name: "py_<module>_<qualname>", with "_2", "_3"... for a different callable of the same
    module and qualified name (two lambdas, two closures of one factory): each registration keeps
    its own function, so a second Trainer never redirects the first one's reward. The same callable
    registered again keeps its name; a script that registers in the same order gets the same names
    in every process. An explicit `name` already given to another callable is refused."""
    if not callable(fn):
        raise TypeError(f"reward_fn must be callable, got {type(fn).__name__}")
    if name is None:
        known = _CALLABLE_NAMES.get(id(fn))
        if known is not None and getattr(PYTHON_REWARDS, known, None) is fn:
            return known
        base = re.sub(r"\W", "_", f"py_{getattr(fn, '__module__', 'fn')}_{getattr(fn, '__qualname__', 'fn')}")
        name = next(n for n in (base if i == 1 else f"{base}_{i}" for i in itertools.count(1))
                    if not hasattr(PYTHON_REWARDS, n) and n not in REWARDS)
    elif not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"reward name {name!r} must be a Python identifier")
    elif getattr(PYTHON_REWARDS, name, fn) is not fn or (name in REWARDS and not hasattr(PYTHON_REWARDS, name)):
        raise ValueError(f"reward name {name!r} is taken by another reward: pass another name")
    setattr(PYTHON_REWARDS, name, fn)
    _CALLABLE_NAMES[id(fn)] = name
    REWARDS[name] = RewardSpec(f"{__name__}:PYTHON_REWARDS.{name}", in_process=True)
    return name


def reward_spec(name_or_path: str) -> RewardSpec:
    """The registration of a short name or a path; an unregistered path is a pool-only reward.

    Checks the syntax and that the module exists (``importlib.util.find_spec``, which imports
    parent packages but not the module itself). A missing attribute is only found when a
    worker imports the module.
    """
    if not isinstance(name_or_path, str):
        raise TypeError(f"reward function must be named by a str, got {type(name_or_path).__name__}")
    # A registered path keeps the properties declared for it under its name.
    spec = REWARDS.get(name_or_path) or next((s for s in REWARDS.values() if s.path == name_or_path), None)
    if spec is None:
        if not _PATH.match(name_or_path):
            known = ", ".join(sorted(REWARDS))
            raise ValueError(f"reward function {name_or_path!r} is neither a registered name ({known}) "
                             "nor a 'package.module:function' path")
        spec = RewardSpec(name_or_path)
    module = spec.path.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except ImportError as exc:  # a parent package is missing
        raise ValueError(f"reward function {name_or_path!r}: cannot find module {module!r}: {exc}; "
                         f"{import_hint(module)}") from exc
    if found is None:
        raise ValueError(f"reward function {name_or_path!r}: no module named {module!r}; {import_hint(module)}")
    return spec


def check_reward_function(name_or_path: str, field: str) -> None:
    """Resolves the reward fully before any work: a registered name, or a user's path whose
    module imports and holds a callable of that name. ValueError of one line naming `field`.

    A user's module is imported in a short-lived child process with this process's sys.path, as a
    worker would import it: its import-time effects (heavy imports, even an exit) stay out of the
    trainer. Registered rewards are not imported, so math-verify and sympy stay out too."""
    try:
        spec = reward_spec(name_or_path)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: {e}") from None
    if spec in REWARDS.values():
        return
    code = ("import sys; sys.path[:] = sys.argv[2:]; from areal_jax.reward.registry import probe_reward; "
            "sys.exit(probe_reward(sys.argv[1]))")
    try:
        done = subprocess.run([sys.executable, "-c", code, spec.path, *sys.path], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{field} = {name_or_path!r}: importing {spec.path.split(':')[0]!r} took more than "
                         f"{_PROBE_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        lines = done.stdout.strip().splitlines()
        why = lines[-1] if done.returncode == 1 and lines else (
            f"importing {spec.path.split(':')[0]!r} ended the process (exit code {done.returncode})")
        raise ValueError(f"{field} = {name_or_path!r}: {why}")


_PROBE_TIMEOUT_S = 120.0


def probe_reward(path: str) -> int:
    """`check_reward_function`'s child: loads `path`; prints one line saying why and returns 1 if
    it cannot. An exit of the module's own making returns its code."""
    module = path.split(":", 1)[0]
    try:
        load_reward_function(path)
    except ModuleNotFoundError as e:
        print(f"importing {module!r} failed: {e}; {import_hint(e.name or module)}")
        return 1
    except LookupError as e:
        print(str(e).replace("\n", " "))
        return 1
    except Exception as e:  # the user's module itself is broken: say how
        print(f"importing {module!r} failed: {type(e).__name__}: {' '.join(str(e).split())}")
        return 1
    return 0


def resolve_reward_path(name_or_path: str) -> str:
    """Map a short name or a ``module:function`` path to a checked ``module:function`` path."""
    return reward_spec(name_or_path).path


def runs_in_process(name_or_path: str) -> bool:
    """Whether the reward is registered as cheap and safe to run in the calling process."""
    return reward_spec(name_or_path).in_process


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


def reward_value(value: object, reward: str) -> float:
    """`value`, which reward `reward` returned, as a float: a finite real number (bool and numpy
    scalars count as real), else TypeError/ValueError of one line naming the reward. One rule for
    both places a reward runs: a pool worker (where it makes the call an error scored 0.0) and this
    process (where it fails the rollout group: `rollout.workflow.RolloutClient`)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward {reward!r} returned {type(value).__name__} {str(value)[:40]!r}, "
                        "expected a real number")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward {reward!r} returned a non-finite value {result!r}")
    return result
