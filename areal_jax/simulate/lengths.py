"""Prompt and completion lengths of simulated samples: a rollout dump or a parametric long tail.

`--length-dist SPEC`, SPEC = KIND:key=value,... (completion tokens; every kind takes `cap`, the
longest completion, default RLVRConfig.max_new_tokens, and `prompt`, a constant prompt length):

    lognormal:mean=3000,sigma=1.0     lengths e^N(mu, sigma^2) with mean `mean` before the cap
    geometric:mean=48                 a random policy that stops with probability 1/mean per token
    constant:length=512               every completion equally long
    uniform:lo=100,hi=1000            integers in [lo, hi]

`--lengths PATH`: a run directory (its rollouts/step_*.jsonl) or one such file; completion
lengths are the records' token counts, prompt lengths their `prompt_tokens` where recorded.
Samples draw completion lengths independently (a group's samples are not correlated).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

KINDS = {"lognormal": ("mean", "sigma"), "geometric": ("mean",), "constant": ("length",), "uniform": ("lo", "hi")}
COMMON = ("cap", "prompt")


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """A parsed SPEC; `params` holds the kind's keys. None for cap/prompt: the config's value."""

    kind: str
    params: tuple[tuple[str, float], ...]
    cap: int | None = None
    prompt: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"length distribution kind {self.kind!r} unknown; one of {sorted(KINDS)}")
        p = dict(self.params)
        missing = [k for k in KINDS[self.kind] if k not in p]
        if missing:
            raise ValueError(f"--length-dist {self.kind} needs {', '.join(missing)}")
        for key, value in p.items():
            if not value > 0:
                raise ValueError(f"--length-dist {self.kind}: {key} must be > 0, got {value}")
        if self.kind == "uniform" and p["lo"] > p["hi"]:
            raise ValueError(f"--length-dist uniform: lo {p['lo']} > hi {p['hi']}")
        for name in ("cap", "prompt"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--length-dist: {name} must be >= 1, got {value}")

    def describe(self) -> str:
        inner = ",".join(f"{k}={v:g}" for k, v in self.params)
        return f"{self.kind}:{inner}"


def parse_length_spec(spec: str) -> LengthDist:
    """'lognormal:mean=3000,sigma=1,cap=16384' -> LengthDist; a ValueError names the bad part."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"--length-dist {spec!r}: kind {kind!r} unknown; one of {sorted(KINDS)}")
    params, cap, prompt = {}, None, None
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq and kind == "constant" and not params:
            key, value = "length", part
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--length-dist {spec!r}: {part!r} is not key=number") from None
        if key == "cap":
            cap = int(number)
        elif key == "prompt":
            prompt = int(number)
        elif key in KINDS[kind]:
            params[key] = number
        else:
            raise ValueError(f"--length-dist {spec!r}: {kind} takes {', '.join(KINDS[kind] + COMMON)}, not {key!r}")
    return LengthDist(kind, tuple(sorted(params.items())), cap, prompt)


@dataclasses.dataclass(frozen=True)
class RolloutLengths:
    """Lengths read from rollout dumps."""

    completions: np.ndarray  # [N] int
    prompts: np.ndarray | None  # [N] int, or None when the dump did not record them
    source: str


def read_rollout_lengths(path: str | pathlib.Path) -> RolloutLengths:
    """Lengths from a run directory's rollouts/step_*.jsonl or from one JSONL file."""
    path = pathlib.Path(path)
    files = sorted((path / "rollouts").glob("step_*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"--lengths {path}: no rollouts/step_*.jsonl there (RLConfig.dump_rollouts_every writes them)")
    completions, prompts = [], []
    for f in files:
        for line_no, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                completions.append(len(record["versions"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{f}:{line_no}: not a rollout record (needs 'versions')") from None
            prompts.append(record.get("prompt_tokens"))
    if not completions:
        raise ValueError(f"--lengths {path}: the rollout files hold no records")
    have_prompts = all(p is not None for p in prompts)
    return RolloutLengths(np.asarray(completions, np.int64),
                          np.asarray(prompts, np.int64) if have_prompts else None, str(path))


class LengthSampler:
    """Draws (prompt length, completion lengths) per group, from one seeded generator."""

    def __init__(self, source: LengthDist | RolloutLengths, *, cap: int, prompt: int, seed: int) -> None:
        self.source = source
        self.cap = int(source.cap if isinstance(source, LengthDist) and source.cap else cap)
        self.prompt = int(source.prompt if isinstance(source, LengthDist) and source.prompt else prompt)
        self._rng = np.random.default_rng(seed)

    def group(self, n: int) -> tuple[int, np.ndarray]:
        src, rng = self.source, self._rng
        if isinstance(src, RolloutLengths):
            index = rng.integers(0, src.completions.size, size=n)
            prompt = int(src.prompts[index[0]]) if src.prompts is not None else self.prompt
            return prompt, np.clip(src.completions[index], 1, self.cap)
        p = dict(src.params)
        if src.kind == "lognormal":
            mu = math.log(p["mean"]) - p["sigma"] ** 2 / 2
            raw = rng.lognormal(mu, p["sigma"], size=n)
        elif src.kind == "geometric":
            raw = rng.geometric(min(1.0, 1.0 / p["mean"]), size=n)
        elif src.kind == "constant":
            raw = np.full(n, p["length"])
        else:
            raw = rng.integers(int(p["lo"]), int(p["hi"]) + 1, size=n)
        return self.prompt, np.clip(np.rint(raw).astype(np.int64), 1, self.cap)

    def describe(self) -> str:
        what = (self.source.describe() if isinstance(self.source, LengthDist)
                else f"rollout dump {self.source.source} ({self.source.completions.size} samples, mean "
                     f"{self.source.completions.mean():.0f})")
        return f"{what}, completions capped at {self.cap}, prompt {self.prompt} tokens" + (
            " (recorded per sample)" if isinstance(self.source, RolloutLengths) and self.source.prompts is not None
            else "")
