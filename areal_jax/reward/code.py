"""Code reward: run the completion's last Python code block on stdin/stdout test cases.

Each test case runs in a fresh sandboxed process (`areal_jax.reward.sandbox`: a private uid, no
network, rlimits, a wall clock, every process it started killed afterwards). This module is the
reward's side: which block counts, test-case formats, output comparison, verdicts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from typing import Any

from areal_jax.reward.sandbox import WALL_TIMEOUT_EXIT, SandboxLimits, run_program

__all__ = ["CaseResult", "SandboxLimits", "code_reward", "extract_last_code_block", "run_test_cases"]

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"", "python", "py", "python3"}


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Outcome of one test case: verdict is passed / wrong_answer / runtime_error / timeout."""

    verdict: str
    uid: int
    exit_code: int | None
    stderr_tail: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"


def extract_last_code_block(completion: str) -> str | None:
    """Return the body of the last complete fenced block tagged python/py/python3 or untagged."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise ValueError(f"test case {what} must be a str or a list of str, got {type(value).__name__}")


def normalize_test_cases(test_cases: dict | list | str) -> list[tuple[str, str]]:
    """(stdin, expected stdout) pairs from APPS ``{"inputs", "outputs"}`` (dict or JSON string)
    or a list of ``{"input", "output"}`` dicts."""
    if isinstance(test_cases, str):
        test_cases = json.loads(test_cases)
    if isinstance(test_cases, dict):
        if test_cases.get("fn_name"):
            raise ValueError("call-based test cases (fn_name) are not supported; use stdin/stdout cases")
        if "inputs" not in test_cases or "outputs" not in test_cases:
            raise ValueError(f"test cases dict needs 'inputs' and 'outputs', got keys {sorted(test_cases)}")
        inputs, outputs = test_cases["inputs"], test_cases["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("test cases 'inputs' and 'outputs' must be lists of equal length")
        pairs = list(zip(inputs, outputs))
    elif isinstance(test_cases, list):
        if not all(isinstance(c, dict) and "input" in c and "output" in c for c in test_cases):
            raise ValueError("a list of test cases must hold dicts with 'input' and 'output'")
        pairs = [(c["input"], c["output"]) for c in test_cases]
    else:
        raise ValueError(f"test cases must be a dict, list or JSON string, got {type(test_cases).__name__}")
    if not pairs:
        raise ValueError("no test cases: a program cannot pass an empty test set")
    return [(_as_text(i, "input"), _as_text(o, "output")) for i, o in pairs]


def outputs_match(actual: str, expected: str) -> bool:
    """Compare line by line after collapsing whitespace and stripping the ends."""
    def lines(text: str) -> list[str]:
        return [" ".join(line.split()) for line in text.strip().splitlines()]

    return lines(actual) == lines(expected)


def code_reward(completion: str, test_cases: dict | list | str, *, limits: SandboxLimits | None = None) -> float:
    """1.0 if the last Python code block of ``completion`` passes every test case, else 0.0.

    No code block scores 0.0. Cases run one by one and stop at the first failure.
    Malformed ``test_cases`` raise ValueError (a data bug, not a wrong answer). ``limits`` None:
    the sandbox's defaults (in a ``RewardPool`` worker, its pool's).
    Through a ``RewardPool``, give the call a timeout above ``len(cases) * limits.wall_s``
    (plus ~0.2 s per case of start-up), or slow-but-correct programs will be cut off.
    """
    cases = normalize_test_cases(test_cases)
    code = extract_last_code_block(completion)
    if code is None:
        return 0.0
    results = _run_cases(code, cases, limits, stop_at_first_failure=True)
    return 1.0 if all(r.passed for r in results) else 0.0


def run_test_cases(
    code: str,
    test_cases: dict | list | str,
    *,
    limits: SandboxLimits | None = None,
    stop_at_first_failure: bool = False,
) -> list[CaseResult]:
    """Run ``code`` once per test case in the sandbox; one ``CaseResult`` per case run."""
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    return _run_cases(code, normalize_test_cases(test_cases), limits, stop_at_first_failure)


def _run_cases(code: str, cases: list[tuple[str, str]], limits: SandboxLimits | None, stop_at_first_failure: bool):
    results = []
    for stdin, expected in cases:
        result = _run_case(code, stdin, expected, limits)
        results.append(result)
        if stop_at_first_failure and not result.passed:
            break
    return results


def _run_case(code: str, stdin: str, expected: str, limits: SandboxLimits | None) -> CaseResult:
    run = run_program(code, stdin, limits)
    if run.exit_code == WALL_TIMEOUT_EXIT or run.exit_code == 128 + signal.SIGXCPU:
        verdict = "timeout"
    elif run.exit_code != 0:
        verdict = "runtime_error"
    else:
        verdict = "passed" if outputs_match(run.stdout, expected) else "wrong_answer"
    return CaseResult(verdict=verdict, uid=run.uid, exit_code=run.exit_code, stderr_tail=run.stderr_tail)
