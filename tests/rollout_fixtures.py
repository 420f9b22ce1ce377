"""Reward functions for the rollout controller tests, importable by path (in-process or in pool workers).

The gold answer of a test row is a small script, so one function covers every behavior a
test needs and works the same in a worker process: ';'-separated directives, run in order.
"""

import hashlib
import random
import time


def scripted_reward(completion: str, answer: str) -> float:
    """Reward of `completion` as scripted by `answer`.

    Directives: "sleep=S" sleeps S seconds; "sleep_rand=S" sleeps uniform(0, S); "raise"
    raises RuntimeError; "const=X" returns X; "text_hash" returns a number in [0, 1) that
    differs between different completions (so a group's rewards are distinct); "coin" returns 1.0
    for about half the completions, 0.0 for the others (right or wrong, by the text alone).
    """
    for directive in answer.split(";"):
        name, _, arg = directive.partition("=")
        if name == "sleep":
            time.sleep(float(arg))
        elif name == "sleep_rand":
            time.sleep(random.uniform(0.0, float(arg)))
        elif name == "raise":
            raise RuntimeError(f"scripted reward failure for {completion!r}")
        elif name == "const":
            return float(arg)
        elif name == "text_hash":
            return text_hash(completion)
        elif name == "coin":
            return float(text_hash(completion) >= 0.5)
        else:
            raise ValueError(f"unknown reward directive {directive!r}")
    return text_hash(completion)


def text_hash(text: str) -> float:
    """A deterministic number in [0, 1) from the text."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:6], "big") / 2**48
