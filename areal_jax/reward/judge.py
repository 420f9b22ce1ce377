"""Generative judges: an LLM reads a question and an answer and says how good the answer is.

    judge = Judge(JudgeConfig(model="path/to/judge", parse="logprob", choices=("Yes", "No")))
    verdicts = judge.score([("What is 2+3?", "5")])    # [Verdict(score=0.93, failed=None, text="")]

The judge holds its own weights, loaded once and never swapped: nothing in the RL loop reaches it
(the cluster's weight sync pushes to the policy engine only). Two ways to read a score:

- parse="regex": the judge generates (greedy, `max_new_tokens`) on its own instance of our
  `GenerationEngine`, which batches the prompts of every group queued at once; the score is the
  first group of the last match of `pattern` in the text.
- parse="logprob": one prefill of the prompt on the judge's weights; the next token's
  probabilities of the `choices` (their first tokens), renormalized over them, weight the choices'
  `values`: the expectation ("1".."10" -> the mean grade; ("Yes", "No") -> P(Yes)).

A prompt that misses its deadline (`timeout_s`, from submission) or whose output does not parse
scores 0.0, and is counted (`JudgeStats`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from areal_jax.api import SamplingParams
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import GenerationEngine
from areal_jax.models.hf_io import load_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import forward, lm_head
from areal_jax.reward.judge_config import DEFAULT_TEMPLATE, JudgeConfig
from areal_jax.reward.reward_model import length_bucket

__all__ = ["DEFAULT_TEMPLATE", "Judge", "JudgeConfig", "JudgeStats", "Verdict", "choices_program", "judge_engine_config",
           "judge_prompt_ids", "parse_regex_score"]

@dataclasses.dataclass(frozen=True)
class Verdict:
    """One judged answer: its score (0.0 when failed), why it failed ("timeout", "unparseable",
    "error") or None, and the judge's text (regex mode)."""

    score: float
    failed: str | None = None
    text: str = ""


@dataclasses.dataclass
class JudgeStats:
    calls: int = 0
    timeouts: int = 0
    unparseable: int = 0
    errors: int = 0

    @property
    def failed(self) -> int:
        return self.timeouts + self.unparseable + self.errors


def parse_regex_score(text: str, pattern: str | re.Pattern) -> float | None:
    """float of the last match's first group (or whole match) of `pattern` in `text`; None when
    nothing matches or the match is not a finite number."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = float(last.group(1) if last.re.groups else last.group(0))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class Judge:
    """A judge over its own weights (`JudgeConfig.model`), on `mesh` (a generation mesh) or one device."""

    def __init__(self, config: JudgeConfig, *, mesh: Mesh | None = None) -> None:
        if not isinstance(config, JudgeConfig):
            raise TypeError(f"Judge takes a JudgeConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.model_config, params = load_params(config.model, dtype=jnp.dtype(config.dtype), mesh=mesh)
        self.stats = JudgeStats()
        self._lock = threading.Lock()
        self.engine: GenerationEngine | None = None
        if config.parse == "regex":
            self._sampling = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=0.0,
                                            stop_token_ids=self.tokenizer.stop_token_ids)
            self.engine = GenerationEngine((self.model_config, params),
                                           judge_engine_config(config, mesh.shape["data"] if mesh is not None else 1))
            self.engine.start()
        else:
            self._params = params
            self._choice_ids = self._first_tokens(config.choices)
            self._values = np.asarray(config.choice_values, np.float32)
            self._next_logprobs = choices_program(self.model_config, self._choice_ids)

    def _first_tokens(self, choices: Sequence[str]) -> np.ndarray:
        ids = []
        for c in choices:
            enc = self.tokenizer.encode(c, add_special_tokens=False)
            if not enc:
                raise ValueError(f"JudgeConfig.choices: {c!r} encodes to no token")
            ids.append(enc[0])
        if len(set(ids)) != len(ids):
            raise ValueError(f"JudgeConfig.choices {tuple(choices)!r} do not differ in their first token "
                             f"({ids}) under {self.config.model}'s tokenizer")
        return np.asarray(ids, np.int32)

    def prompt_ids(self, question: str, answer: str) -> list[int]:
        """The judge's prompt for one answer (`judge_prompt_ids`)."""
        return judge_prompt_ids(self.tokenizer, self.config, question, answer)

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """Verdicts of (question, answer) pairs, all submitted at once (one batch for the engine)."""
        start = time.monotonic()
        prompts = [self.prompt_ids(q, a) for q, a in pairs]
        limit = self.config.max_seq_len - (self.config.max_new_tokens if self.engine is not None else 0)
        too_long = [len(p) > limit for p in prompts]
        if self.engine is not None:
            verdicts = self._generate(prompts, too_long, start)
        else:
            verdicts = self._read_choices(prompts, too_long, start)
        with self._lock:
            self.stats.calls += len(verdicts)
            for v in verdicts:
                if v.failed == "timeout":
                    self.stats.timeouts += 1
                elif v.failed == "unparseable":
                    self.stats.unparseable += 1
                elif v.failed is not None:
                    self.stats.errors += 1
        return verdicts

    def _generate(self, prompts: list[list[int]], too_long: list[bool], start: float) -> list[Verdict]:
        handles = [None if skip else self.engine.submit(p, self._sampling) for p, skip in zip(prompts, too_long)]
        verdicts = []
        for handle in handles:
            if handle is None:
                verdicts.append(Verdict(0.0, "error: prompt too long"))
                continue
            try:
                result = handle.result(timeout=max(0.0, start + self.config.timeout_s - time.monotonic()))
            except FutureTimeout:
                self.engine.abort(handle.request_id)
                verdicts.append(Verdict(0.0, "timeout"))
                continue
            completion = result.completions[0]
            if completion.stop_reason == "aborted":
                verdicts.append(Verdict(0.0, "error: aborted"))
                continue
            text = self.tokenizer.decode(completion.tokens, skip_special_tokens=True)
            value = parse_regex_score(text, self.config.pattern)
            verdicts.append(Verdict(0.0, "unparseable", text) if value is None else Verdict(value, None, text))
        return verdicts

    def _read_choices(self, prompts: list[list[int]], too_long: list[bool], start: float) -> list[Verdict]:
        out: list[Verdict | None] = [Verdict(0.0, "error: prompt too long") if skip else None for skip in too_long]
        todo = [i for i, skip in enumerate(too_long) if not skip]
        B = self.config.batch_size
        for k in range(0, len(todo), B):
            rows = todo[k:k + B]
            if time.monotonic() - start > self.config.timeout_s:
                for i in rows:
                    out[i] = Verdict(0.0, "timeout")
                continue
            T = length_bucket(max(len(prompts[i]) for i in rows))
            nb = B if len(rows) == B else max(1, 1 << (len(rows) - 1).bit_length())
            ids, seg = np.zeros((nb, T), np.int32), np.zeros((nb, T), np.int32)  # [B, T], right-padded
            last = np.zeros((nb,), np.int32)
            for b, i in enumerate(rows):
                ids[b, :len(prompts[i])], seg[b, :len(prompts[i])] = prompts[i], 1
                last[b] = len(prompts[i]) - 1
            logp = np.asarray(self._next_logprobs(self._params, ids, seg, last))[:len(rows)]  # [b, C]
            late = time.monotonic() - start > self.config.timeout_s
            for b, i in enumerate(rows):
                p = np.exp(logp[b] - logp[b].max())
                total = p.sum()
                if late:
                    out[i] = Verdict(0.0, "timeout")
                elif not (np.isfinite(total) and total > 0):
                    out[i] = Verdict(0.0, "unparseable")
                else:
                    out[i] = Verdict(float(np.dot(p / total, self._values)))
        return out  # type: ignore[return-value]

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def judge_prompt_ids(tokenizer: Tokenizer, config: JudgeConfig, question: str, answer: str) -> list[int]:
    """The judge's prompt for one answer: the template, as a chat's user turn (generation prompt
    added) when `config.chat` and the tokenizer has a chat template, else encoded as is. Training a
    judge on these ids trains it on what it will be asked (examples/learned_judge.py)."""
    text = config.template.format(question=question, answer=answer)
    if config.chat and tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


def judge_engine_config(config: JudgeConfig, data: int = 1) -> EngineConfig:
    """The regex judge's engine over `data` replicas: `batch_size` slots (rounded up to split evenly),
    all admitted in one prefill."""
    slots = -(-config.batch_size // data) * data
    return EngineConfig(num_slots=slots, max_seq_len=config.max_seq_len, max_prefill_batch=slots)


def choices_program(cfg, choice_ids: np.ndarray):
    """The jitted logprob-mode read `(params, input_ids [B, T], segment_ids [B, T], last [B]) ->
    [B, C]` a `Judge` runs and the planner compiles for its target (reward/programs.py)."""
    return jax.jit(lambda params, ids, seg, last: _choice_logprobs(params, cfg, ids, seg, last, choice_ids))


def _choice_logprobs(params, cfg, input_ids, segment_ids, last, choice_ids) -> jax.Array:
    """Log-probabilities `[B, C]` of the choices' tokens as the next token after position `last [B]`."""
    hidden, _ = forward(params, cfg, input_ids, segment_ids=segment_ids, return_hidden=True)  # [B, T, D]
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    logp = jax.nn.log_softmax(lm_head(params, cfg, h)[:, 0], axis=-1)  # [B, V]
    return logp[:, jnp.asarray(choice_ids)]
