"""A second, independent implementation of the two engine seams (areal_jax/api.py), in numpy.

The policy is a bigram table: logits[prev token, next token], shape [V, V]. `BigramEngine`
samples from it on its own thread, token by token, reporting each token's behaviour log-prob and
the version of the table that drew it; weights pushed with `update_weights` are swapped in
between tokens (a sample may span versions, as the native engine's do), `abort` ends a request's
samples, `pause` holds the thread. `BigramTrainer` takes the loop's packed micro-batches and
takes real policy-gradient steps on the table (decoupled PPO's clipped objective, the proximal
policy being the table at the start of the step), with the analytic gradient of the log-softmax.

Shapes: V vocabulary, R rows, T row length.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from areal_jax.generation.requests import Completion, GroupResult, RequestHandle
from areal_jax.generation.sampling import SamplingParams
from areal_jax.trainer.config import PPOConfig


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class BigramEngine:
    """api.InferenceEngine over a [V, V] logits table (see the module docstring)."""

    def __init__(self, params: Mapping[str, np.ndarray], *, max_seq_len: int, version: int = 0, seed: int = 0):
        self._table = np.asarray(params["table"], np.float32)
        self._version, self.max_seq_len, self.seed = version, max_seq_len, seed
        self._lock = threading.Condition()
        self._queue: list[tuple[str, np.ndarray, SamplingParams, int, int, RequestHandle]] = []
        self._aborts: set[str] = set()
        self._pending: tuple[np.ndarray, int, concurrent.futures.Future] | None = None
        self._paused = self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids, self._seeds = itertools.count(), itertools.count()
        self.generated_tokens, self.swaps, self._busy_s = 0, 0, 0.0
        self.versions_served: list[int] = [version]

    # ---- the contract ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1, *,
               seed: int | None = None) -> RequestHandle:
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        if prompt.size == 0 or prompt.size >= self.max_seq_len:
            raise ValueError(f"prompt of {prompt.size} tokens does not fit max_seq_len {self.max_seq_len}")
        handle = RequestHandle()
        handle.request_id = f"bigram-{next(self._ids)}"
        with self._lock:
            self._queue.append((handle.request_id, prompt, sampling, n,
                                next(self._seeds) if seed is None else int(seed), handle))
            self._lock.notify_all()
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def update_weights(self, params: Mapping[str, np.ndarray], version: int) -> concurrent.futures.Future:
        table = np.asarray(params["table"], np.float32)
        if table.shape != self._table.shape:
            raise ValueError(f"new table {table.shape} does not match the served {self._table.shape}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._pending is not None:
                self._pending[2].set_result(False)  # superseded before it served
            self._pending = (table.copy(), int(version), done)
            self._lock.notify_all()
        return done

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def stats(self) -> Any:
        class Stats:  # the counters the rollout side reads
            tokens_per_s = self.generated_tokens / self._busy_s if self._busy_s else 0.0
            preempted_samples = 0
            reprefill_tokens = 0  # in-flight samples continue across a swap: nothing to recompute

        return Stats()

    def timings(self) -> dict[str, Any]:
        return {}  # no compiled programs to time

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="bigram-engine", daemon=True)
        self._thread.start()

    def stop(self, abort_pending: bool = True) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:  # whatever is still queued ends aborted
            queued, self._queue = self._queue, []
        for rid, prompt, _, n, _, handle in queued:
            empty = Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), "aborted")
            handle.set_result(GroupResult(rid, prompt, [empty] * n))

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {"table": self._table.copy()}

    # ---- the engine thread ----------------------------------------------------------------------

    def _swap(self) -> None:
        """Installs pushed weights (called between tokens, with the lock held)."""
        if self._pending is not None:
            table, version, done = self._pending
            self._pending = None
            self._table, self._version = table, version
            self.swaps += 1
            self.versions_served.append(version)
            done.set_result(True)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and (self._paused or not self._queue) and self._pending is None:
                    self._lock.wait(0.05)
                if self._stopping:
                    return
                self._swap()
                if self._paused or not self._queue:
                    continue
                request = self._queue.pop(0)
            self._generate(*request)

    def _generate(self, rid: str, prompt: np.ndarray, sampling: SamplingParams, n: int, seed: int,
                  handle: RequestHandle) -> None:
        t0 = time.perf_counter()
        completions = []
        for i in range(n):
            rng = np.random.default_rng([self.seed, seed, i])
            tokens, logprobs, versions, reason, last = [], [], [], "length", int(prompt[-1])
            budget = min(sampling.max_new_tokens, self.max_seq_len - prompt.size)
            while len(tokens) < budget:
                with self._lock:
                    self._swap()
                    while self._paused and not self._stopping and rid not in self._aborts:
                        self._lock.wait(0.05)
                        self._swap()
                    if rid in self._aborts or self._stopping:
                        reason = "aborted"
                        break
                    table, version = self._table, self._version
                temperature = sampling.temperature or 1.0
                logp = log_softmax(table[last] / temperature)
                token = int(np.argmax(logp)) if sampling.temperature == 0 else int(rng.choice(logp.size, p=np.exp(logp)))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                versions.append(version)
                last = token
                if token in sampling.stop_token_ids:
                    reason = "stop"
                    break
            completions.append(Completion(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32),
                                          np.asarray(versions, np.int32), reason))
        with self._lock:
            self._aborts.discard(rid)
            self.generated_tokens += sum(len(c.tokens) for c in completions)
            self._busy_s += time.perf_counter() - t0
        handle.set_result(GroupResult(rid, prompt, completions))


class BigramTrainer:
    """api.TrainEngine over a [V, V] logits table (see the module docstring)."""

    def __init__(self, params: Mapping[str, np.ndarray], ppo: PPOConfig, *, lr: float):
        self.ppo_config = ppo
        self.lr = lr
        self._table = np.asarray(params["table"], np.float64).copy()
        self._step = 0

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {"table": self._table.astype(np.float32)}

    def compute_logprobs(self, microbatch: Any, params: Any = None) -> np.ndarray:
        """log pi(targets | input_ids) [R, T] at the PPO temperature."""
        table = self._table if params is None else np.asarray(params["table"], np.float64)
        a = microbatch.arrays
        logp = log_softmax(table[a["input_ids"]] / self.ppo_config.logit_temperature)  # [R, T, V]
        return np.take_along_axis(logp, a["targets"][..., None], axis=-1)[..., 0]

    def train_step(self, minibatches: Sequence[Sequence[Any]], *, current_version: int | None = None
                   ) -> dict[str, Any]:
        t0 = time.perf_counter()
        proximal = self._table.copy()  # decoupled PPO: the pre-step policy anchors the clip
        eps, temperature = self.ppo_config.eps_clip, self.ppo_config.logit_temperature
        tokens, losses, lags = 0.0, [], {}
        for minibatch in minibatches:
            grad = np.zeros_like(self._table)
            loss = 0.0
            for micro in minibatch:
                a = micro.arrays
                mask = np.asarray(a["loss_mask"], np.float64)
                denom = max(float(micro.minibatch_valid_tokens), 1.0)
                logp_all = log_softmax(self._table[a["input_ids"]] / temperature)  # [R, T, V]
                logp = np.take_along_axis(logp_all, a["targets"][..., None], axis=-1)[..., 0]
                prox = np.take_along_axis(log_softmax(proximal[a["input_ids"]] / temperature),
                                          a["targets"][..., None], axis=-1)[..., 0]
                behav = np.asarray(a["behavior_logprobs"], np.float64)
                adv = np.asarray(a["advantages"], np.float64)
                ratio = np.exp(logp - prox)
                weight = np.exp(prox - behav) * mask  # pi_prox / pi_behav on trained tokens
                unclipped, clipped = ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv
                loss -= float((weight * np.minimum(unclipped, clipped)).sum()) / denom
                # d/dlogp of the objective: nonzero where the unclipped term is the minimum
                active = (unclipped <= clipped) | np.isclose(unclipped, clipped)
                dlogp = weight * active * ratio * adv / denom  # [R, T]
                # d logp / d table[input, :] = (onehot(target) - softmax) / temperature
                d_rows = (np.eye(self._table.shape[1])[a["targets"]] - np.exp(logp_all)) * (dlogp[..., None] / temperature)
                np.add.at(grad, a["input_ids"], d_rows)
                tokens += float(mask.sum())
                if current_version is not None:
                    for lag in (current_version - a["versions"][mask > 0]).tolist():
                        lags[int(lag)] = lags.get(int(lag), 0) + 1
            self._table += self.lr * grad  # gradient ascent on the objective
            losses.append(loss)
        self._step += 1
        out = {"loss": float(np.mean(losses)), "trained_tokens": tokens, "time_step_s": time.perf_counter() - t0,
               "grad_norm": 0.0}
        if current_version is not None:
            out["version_lag_hist"] = lags
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"table": self._table.copy(), "step": np.asarray(self._step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._table = np.asarray(state["table"], np.float64).copy()
        self._step = int(state["step"])


class LetterTokenizer:
    """Token i is the letter chr(ord("a") + i): what the workflow decodes completions with."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)


def letter_reward(completion: str, gold: str) -> float:
    """The share of the completion's letters that are `gold` (a reward RL can raise smoothly)."""
    return completion.count(gold) / len(completion) if completion else 0.0
