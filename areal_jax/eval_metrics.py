"""Evaluation metrics over sampled answers: pass@k and maj@k, per prompt and averaged.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of which c are
correct, the chance that k samples drawn without replacement hold at least one correct
one is 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never
forms the huge binomials.

maj@k takes the first k samples' extracted answers, votes, and scores the winner.
Answers are compared as exact strings, so callers pass canonical forms; None (no answer
extracted) casts no vote. Ties go to the tied answer that appears first among the k
samples: deterministic, and blind to correctness (breaking ties towards the correct
answer would inflate the metric).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with `n` samples, `c` of them correct (1 <= k <= n)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"pass_at_k: {name} must be an int, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0  # every k-subset must contain a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """Most frequent non-None answer; ties go to the one seen first. None if no votes."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    # Counter preserves first-insertion order and max() returns the first maximal item.
    return max(votes, key=votes.__getitem__)


def maj_at_k(answers_per_prompt: Sequence[str | None], correct_flags: Sequence[bool], k: int) -> float:
    """1.0 if the majority answer of the first `k` samples of one prompt is correct, else 0.0.

    `answers_per_prompt[i]` is sample i's extracted answer (None if none) and
    `correct_flags[i]` whether sample i was judged correct. The winner's correctness is
    the flag of its first sample (identical answers are normally judged alike).
    """
    if len(answers_per_prompt) != len(correct_flags):
        raise ValueError(
            f"maj_at_k: {len(answers_per_prompt)} answers but {len(correct_flags)} correctness flags"
        )
    if not isinstance(k, int) or not 1 <= k <= len(answers_per_prompt):
        raise ValueError(f"maj_at_k: need 1 <= k <= {len(answers_per_prompt)} samples, got k={k!r}")
    answers = list(answers_per_prompt[:k])
    winner = majority_answer(answers)
    if winner is None:
        return 0.0
    return 1.0 if correct_flags[answers.index(winner)] else 0.0


@dataclasses.dataclass(frozen=True)
class PromptSamples:
    """The samples of one prompt: extracted answers (None: none found) and correctness."""

    answers: tuple[str | None, ...]
    correct: tuple[bool, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "answers", tuple(self.answers))
        object.__setattr__(self, "correct", tuple(bool(c) for c in self.correct))
        if len(self.answers) != len(self.correct):
            raise ValueError(f"PromptSamples: {len(self.answers)} answers but {len(self.correct)} flags")
        if not self.answers:
            raise ValueError("PromptSamples needs at least one sample")

    @property
    def n(self) -> int:
        """Number of samples."""
        return len(self.correct)

    @property
    def num_correct(self) -> int:
        """Number of correct samples."""
        return sum(self.correct)


def summarize(prompts: Sequence[PromptSamples], ks: Sequence[int]) -> dict[str, float]:
    """Mean over prompts of pass@k and maj@k for each k, plus accuracy and the prompt count.

    Keys: "pass@{k}", "maj@{k}", "accuracy" (mean fraction of correct samples, which is
    pass@1), "num_prompts". Every prompt needs at least max(ks) samples.
    """
    if not prompts:
        raise ValueError("summarize: no prompts")
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"summarize: ks must be positive ints, got {ks!r}")
    fewest = min(p.n for p in prompts)
    if max(ks) > fewest:
        raise ValueError(f"summarize: k={max(ks)} exceeds the {fewest} samples of some prompt")
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(p.n, p.num_correct, k) for p in prompts) / len(prompts)
        out[f"maj@{k}"] = sum(maj_at_k(p.answers, p.correct, k) for p in prompts) / len(prompts)
    out["accuracy"] = sum(p.num_correct / p.n for p in prompts) / len(prompts)
    out["num_prompts"] = float(len(prompts))
    return out
