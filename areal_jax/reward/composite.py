"""A reward made of weighted terms: verifiers, scalar reward models and a generative judge.

    RLVRConfig(reward=(("math", 1.0), ("rm:path/to/rm", 0.5), ("judge", 0.5)), judge=JudgeConfig(...))

A term is a verifier (a registered name or "package.module:function", run as a single reward is),
"rm:<directory>" (a `RewardModel`, scoring the chat [user: question, assistant: completion] with
its own template), "lm:<directory>" (a causal LM scoring the completion by its mean log-likelihood,
reward/likelihood.py) or "judge" (the `Judge` of `RLVRConfig.judge`). The reward of a completion is
the weighted sum of its terms; a term that fails (past its deadline, unparseable, raised) counts
0.0 and is counted as failed. Each group records per term [sum, count, failed] in
`info["reward_terms"]`, which the step's record turns into reward/<name>/mean and
reward/<name>/failed (`term_metrics`).

The learned terms run on `LearnedRewards`' threads, one per model, each taking every request
queued at once as one batch: a group's scoring waits there while other groups decode.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["LearnedRewards", "TermsScorer", "check_terms", "is_learned", "normalize_reward", "question_text",
           "rm_input_ids", "term_metrics"]

RewardTerms = tuple[tuple[str, float], ...]
RM_PREFIX = "rm:"
LM_PREFIX = "lm:"
JUDGE = "judge"


def is_learned(name: str) -> bool:
    return name == JUDGE or name.startswith((RM_PREFIX, LM_PREFIX))


def normalize_reward(reward: Any, field: str = "RLVRConfig.reward") -> str | RewardTerms:
    """A reward name as given, or weighted terms as a tuple of (name, float) pairs; ValueError of
    one line naming `field` otherwise."""
    if isinstance(reward, str):
        if not reward:
            raise ValueError(f"{field} must name a reward function, got ''")
        return reward
    try:
        terms = tuple((name, weight) for name, weight in reward)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a reward name or (name, weight) pairs, got {reward!r}") from None
    if not terms:
        raise ValueError(f"{field} has no terms")
    out = []
    for name, weight in terms:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field}: term name {name!r} must be a non-empty str")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{field}: weight of {name!r} must be a finite number, got {weight!r}")
        for prefix in (RM_PREFIX, LM_PREFIX):
            if name.startswith(prefix) and not name[len(prefix):]:
                raise ValueError(f"{field}: term {name!r} must name the reward model's directory after {prefix!r}")
        out.append((name, float(weight)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: a term is named twice in {names}")
    return tuple(out)


def check_terms(terms: RewardTerms, check_verifier: Callable[[str, str], None], field: str) -> None:
    """Resolves each verifier term (`check_verifier(name, field)`) and checks each reward model's
    directory holds a reward model, before any work."""
    import pathlib

    for name, _ in terms:
        if name.startswith(RM_PREFIX):
            from areal_jax.models.reward_head import read_reward_config

            try:
                read_reward_config(pathlib.Path(name[len(RM_PREFIX):]))
            except (OSError, ValueError) as e:
                raise ValueError(f"{field}: term {name!r}: {e}") from None
        elif name.startswith(LM_PREFIX):
            from areal_jax.reward.likelihood import check_causal_lm

            try:
                check_causal_lm(name[len(LM_PREFIX):])
            except ValueError as e:
                raise ValueError(f"{field}: term {name!r}: {e}") from None
        elif name != JUDGE:
            check_verifier(name, f"{field} term {name!r}")


class _Batcher:
    """One thread running `fn(items) -> results` over every item queued when it looks."""

    def __init__(self, name: str, fn: Callable[[list], list]) -> None:
        self._fn = fn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"reward-{name}", daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> Future:
        future: Future = Future()
        self._queue.put((item, future))
        return future

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            live = [(item, f) for item, f in batch if f.set_running_or_notify_cancel()]
            try:
                results = self._fn([item for item, _ in live])
            except Exception as e:  # noqa: BLE001 - each waiter learns why
                for _, f in live:
                    f.set_exception(e)
                continue
            for (_, f), r in zip(live, results):
                f.set_result(r)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class LearnedRewards:
    """The learned terms of a reward: `submit(name, question, answer)` -> a Future of
    (score, failed reason or None)."""

    def __init__(self, names: Iterable[str], *, judge: Any = None, rm_dtype: str = "float32",
                 warmup_tokens: int = 256, devices: Sequence[Any] | None = None) -> None:
        """Loads each learned term's model on `devices` (a generation mesh over them: rows split
        over "data"; default: this process's default device); a reward model's programs for
        inputs up to `warmup_tokens` are compiled here, before any call runs under a deadline."""
        import jax.numpy as jnp

        mesh = None
        if devices:
            from areal_jax.parallel.meshes import generation_mesh

            mesh = generation_mesh(list(devices), tensor=1)
        self.mesh = mesh
        self._batchers: dict[str, _Batcher] = {}
        self.judge = None
        for name in names:
            if name == JUDGE:
                from areal_jax.reward.judge import Judge, JudgeConfig

                if not isinstance(judge, JudgeConfig):
                    raise ValueError("the reward term 'judge' needs RLVRConfig.judge (a JudgeConfig)")
                self.judge = Judge(judge, mesh=mesh)
                self._batchers[name] = _Batcher(name, self._judge_batch)
            elif name.startswith(RM_PREFIX):
                from areal_jax.reward.reward_model import RewardModel

                rm = RewardModel.from_pretrained(name[len(RM_PREFIX):], dtype=jnp.dtype(rm_dtype), mesh=mesh)
                rm.warmup(warmup_tokens)
                self._batchers[name] = _Batcher(name, lambda items, rm=rm: _rm_batch(rm, items))
            elif name.startswith(LM_PREFIX):
                from areal_jax.reward.likelihood import LikelihoodReward, likelihood_batch

                lm = LikelihoodReward.from_pretrained(name[len(LM_PREFIX):], dtype=jnp.dtype(rm_dtype), mesh=mesh)
                lm.warmup(warmup_tokens)
                self._batchers[name] = _Batcher(name, lambda items, lm=lm: likelihood_batch(lm, items))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._batchers)

    def deadline_s(self, name: str, reward_timeout_s: float) -> float:
        """How long a caller waits for term `name`: the judge's own deadline when longer (it
        enforces it itself, and its engine compiles on first use)."""
        if name == JUDGE and self.judge is not None:
            return max(reward_timeout_s, self.judge.config.timeout_s + 1.0)
        return reward_timeout_s

    def submit(self, name: str, question: str, answer: str) -> Future:
        return self._batchers[name].submit((question, answer))

    def _judge_batch(self, items: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
        return [(v.score, v.failed) for v in self.judge.score(items)]

    def close(self) -> None:
        for b in self._batchers.values():
            b.close()
        if self.judge is not None:
            self.judge.close()


def learned_reward_memory(terms: Iterable[tuple[str, float]], judge: Any = None, rm_dtype: str = "float32"
                          ) -> dict[str, dict[str, int]]:
    """Device bytes of each learned term, from the models' config.json (no weights read): weights
    (a reward model without lm_head, in `rm_dtype`; the judge in JudgeConfig.dtype) and, for a
    regex judge, its engine's KV cache (batch_size slots x max_seq_len, dense, in the weights' dtype)."""
    import pathlib

    import numpy as np

    from areal_jax.models.hf_io import read_config

    out: dict[str, dict[str, int]] = {}
    for name, _ in terms:
        if name.startswith(RM_PREFIX):
            cfg = read_config(pathlib.Path(name[len(RM_PREFIX):]))
            lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
            params = cfg.num_params() - lm_head + cfg.hidden_size  # + the one-label score head
            out[name] = {"weights_bytes": params * np.dtype(rm_dtype).itemsize, "kv_bytes": 0}
        elif name.startswith(LM_PREFIX):  # the whole LM, output head included, and its reference's, in `rm_dtype`
            from areal_jax.reward.likelihood import reference_dir

            path = pathlib.Path(name[len(LM_PREFIX):])
            params = sum(read_config(p).num_params() for p in (path, reference_dir(path)) if p is not None)
            out[name] = {"weights_bytes": params * np.dtype(rm_dtype).itemsize, "kv_bytes": 0}
        elif name == JUDGE and judge is not None:
            import ml_dtypes  # noqa: F401  names numpy's bfloat16

            cfg = read_config(pathlib.Path(judge.model))
            item = np.dtype(judge.dtype).itemsize
            kv = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * judge.batch_size * judge.max_seq_len * item
                  if judge.parse == "regex" else 0)
            out[name] = {"weights_bytes": cfg.num_params() * item, "kv_bytes": kv}
    return out


def question_text(example: Any) -> str:
    """What a learned reward reads as the question of a prompt example: its row's last user turn."""
    users = [m.get("content", "") for m in example.row.messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def rm_input_ids(tokenizer: Any, question: str, answer: str) -> list[int]:
    """The tokens a reward-model term scores for one (question, answer): the chat
    [user: question, assistant: answer] through the RM's chat template, or the two texts joined
    (special tokens added) when it has none. Training an RM on these ids trains it on what it
    will be asked (examples/learned_reward_model.py)."""
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": question},
                                                   {"role": "assistant", "content": answer}], tokenize=True))
    return list(tokenizer.encode(question + answer))


def _rm_batch(rm: Any, items: list[tuple[str, str]]) -> list[tuple[float, str | None]]:
    """A reward model's scores of (question, answer) pairs (`rm_input_ids`)."""
    if rm.tokenizer is None:
        raise ValueError(f"reward model {rm.name}: no tokenizer to read the completions with")
    scores = rm.score_ids([rm_input_ids(rm.tokenizer, q, a) for q, a in items])
    return [(float(s), None) if math.isfinite(s) else (0.0, "non-finite") for s in scores]


def term_metrics(infos: Iterable[Mapping[str, Any]], prefix: str = "") -> dict[str, float]:
    """`prefix`reward/<name>/mean (over the completions scored) and `prefix`reward/<name>/failed (a
    count) of every term recorded in the groups' `info["reward_terms"]`."""
    totals: dict[str, list[float]] = {}
    for info in infos:
        for name, (total, count, failed) in (info.get("reward_terms") or {}).items():
            t = totals.setdefault(name, [0.0, 0, 0])
            t[0] += total
            t[1] += count
            t[2] += failed
    out: dict[str, float] = {}
    for name, (total, count, failed) in totals.items():
        out[f"{prefix}reward/{name}/mean"] = total / count if count else math.nan
        out[f"{prefix}reward/{name}/failed"] = int(failed)
    return out


class TermsScorer:
    """Every term of a reward over (question, completion text, gold) items, on the caller's thread:
    the held-out evaluation and `areal-jax eval` score with the rollouts' definition
    (`rollout.workflow.score_terms`): the weighted sum, a term that fails counting 0.0, counted.

    Verifier terms run as `RewardScorer`s (in `pool` under `timeout_s`, else in this process);
    learned terms on `learned` (the rollouts' own `LearnedRewards`, shared), or on ones loaded here
    (`judge`: the JudgeConfig of a "judge" term) and closed by `close`."""

    def __init__(self, terms: RewardTerms, *, pool: Any = None, learned: LearnedRewards | None = None,
                 timeout_s: float, judge: Any = None, devices: Sequence[Any] | None = None) -> None:
        from areal_jax.reward.scoring import RewardScorer

        self.terms, self.timeout_s = tuple(terms), timeout_s
        self.verifier = next((name for name, _ in self.terms if not is_learned(name)), None)
        self._verifiers = {name: RewardScorer(name, pool, timeout_s=timeout_s)
                           for name, _ in self.terms if not is_learned(name)}
        learned_names = [name for name, _ in self.terms if is_learned(name)]
        self._owned = None
        if learned_names and learned is None:
            learned = self._owned = LearnedRewards(learned_names, judge=judge, devices=devices)
        self.learned = learned

    def score(self, items: Sequence[tuple[str, str, Any]]
              ) -> tuple[list[float], list[dict[str, float]], list[tuple[str, ...]], dict[str, list]]:
        """(weighted reward of each item, each item's term values, each item's failed terms, per
        term [sum, count, failed]).
        Every call is submitted before any is awaited (the pool's workers and the learned models'
        batches take them together)."""
        submitted = []
        for question, text, gold in items:
            calls: dict[str, Any] = {}
            for name, _ in self.terms:
                try:
                    calls[name] = (self.learned.submit(name, question, text) if is_learned(name)
                                   else self._verifiers[name].submit(text, gold))
                except Exception as e:  # noqa: BLE001 - an in-process verifier raised: failed, counted
                    calls[name] = e
            submitted.append(calls)
        values: list[dict[str, float]] = []
        failures: list[tuple[str, ...]] = []
        totals = {name: [0.0, 0, 0] for name, _ in self.terms}
        for calls in submitted:
            got, failed_names = {}, []
            for name, call in calls.items():
                got[name], failed = self._result(name, call)
                t = totals[name]
                t[0], t[1], t[2] = t[0] + got[name], t[1] + 1, t[2] + int(failed)
                if failed:
                    failed_names.append(name)
            values.append(got)
            failures.append(tuple(failed_names))
        rewards = [sum(w * v[name] for name, w in self.terms) for v in values]
        return rewards, values, failures, totals

    def _result(self, name: str, call: Any) -> tuple[float, bool]:
        if isinstance(call, BaseException):
            return 0.0, True
        try:
            if is_learned(name):
                score, failed = call.result(timeout=self.learned.deadline_s(name, self.timeout_s))
                return float(score), failed is not None
            return float(call.result()), False
        except Exception:  # noqa: BLE001 - past its deadline or raised: 0.0, counted
            return 0.0, True

    def close(self) -> None:
        """Stops the learned models loaded here (shared ones are their owner's)."""
        if self._owned is not None:
            self._owned.close()
