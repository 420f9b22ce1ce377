"""A second, independent implementation of the two engine seams (areal_jax/api/), in numpy and jax.numpy.

The policy is a bigram table: logits[prev token, next token], shape [V, V]. `BigramEngine`
samples from it on its own thread, token by token, reporting each token's behaviour log-prob and
the version of the table that drew it; weights pushed with `update_weights` are swapped in
between tokens (a sample may span versions, as the native engine's do), `abort` ends a request's
samples, `pause` holds the thread. `BigramTrainEngine` takes the loop's packed micro-batches and
takes real gradient steps on the table of the objective it is given (the built-in decoupled PPO,
or a user's `module:function` such as `reinforce_loss` below), masked and normalised as the engine
contract says (trainer/objectives.py); where the algorithm gave no proximal log-probs, the table
before the update is pi_prox.

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

import jax
import jax.numpy as jnp

from areal_jax.api import Completion, GroupResult, SamplingParams
from areal_jax.generation.requests import RequestHandle
from areal_jax.trainer.engine_config import Objective, TrainEngineConfig


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
            kv_pages_shared = 0
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


class BigramTrainEngine:
    """api.TrainEngine over a [V, V] logits table (see the module docstring)."""

    def __init__(self, params: Mapping[str, np.ndarray], objective: Objective, *, lr: float,
                 engine: TrainEngineConfig = TrainEngineConfig()):
        self.objective, self.engine_config = objective, engine
        self.lr = lr
        self._table = np.asarray(params["table"], np.float64).copy()
        self._step = 0

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {"table": self._table.astype(np.float32)}

    def compute_logprobs(self, microbatch: Any, params: Any = None) -> np.ndarray:
        """log pi(targets | input_ids) [R, T] at the objective's temperature."""
        table = self._table if params is None else np.asarray(params["table"], np.float64)
        a = microbatch.arrays
        logp = log_softmax(table[a["input_ids"]] / self.objective.temperature)  # [R, T, V]
        return np.take_along_axis(logp, a["targets"][..., None], axis=-1)[..., 0]

    def _loss(self, table, arrays, denom):
        """The objective's minibatch-normalised loss of one micro-batch, and its summed metrics."""
        scaled = table[arrays["input_ids"]] / self.objective.temperature  # [R, T, V]
        logp_all = scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
        logp = jnp.take_along_axis(logp_all, arrays["targets"][..., None], axis=-1)[..., 0]  # [R, T]
        batch = dict(arrays)
        if "proximal_logprobs" not in batch:  # the pre-update policy: this table, without gradient
            batch["proximal_logprobs"] = jax.lax.stop_gradient(logp)
        per_token, metrics = self.objective.fn(logp, batch, self.objective.config)
        mask = arrays["loss_mask"] > 0
        sums = {k: jnp.max(jnp.where(mask, m, 0.0)) if k.endswith("_max") else
                jnp.sum(jnp.where(mask.reshape(mask.shape + (1,) * (m.ndim - 2)), m, 0.0), axis=(0, 1))
                for k, m in metrics.items()}
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / denom, sums

    def train_step(self, minibatches: Sequence[Sequence[Any]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        tokens, losses, totals = 0.0, [], {}
        grad_fn = jax.grad(self._loss, has_aux=True)
        for minibatch in minibatches:
            grad = np.zeros_like(self._table)
            loss = 0.0
            for micro in minibatch:
                arrays = {k: jnp.asarray(v) for k, v in micro.arrays.items()}
                denom = max(float(micro.minibatch_valid_tokens), 1.0)
                table = jnp.asarray(self._table)
                g, sums = grad_fn(table, arrays, denom)
                loss += float(self._loss(table, arrays, denom)[0])
                grad += np.asarray(g, np.float64)
                for k, v in sums.items():
                    totals[k] = np.maximum(totals[k], v) if k in totals and k.endswith("_max") else totals.get(k, 0) + v
                tokens += float(np.sum(micro.arrays["loss_mask"]))
            self._table -= self.lr * grad  # gradient descent on the loss
            losses.append(loss)
        self._step += 1
        out = {k: float(v) if k.endswith("_max") else np.asarray(v, np.float64) / max(tokens, 1.0)
               for k, v in totals.items()}
        out = {k: float(v) if np.ndim(v) == 0 else v for k, v in out.items()}
        out.update(loss=float(np.mean(losses)), trained_tokens=tokens, time_step_s=time.perf_counter() - t0,
                   grad_norm=0.0)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"table": self._table.copy(), "step": np.asarray(self._step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._table = np.asarray(state["table"], np.float64).copy()
        self._step = int(state["step"])


def reinforce_loss(logprobs, batch, config):
    """A user objective for tests (`PPOConfig.objective = "tests.seam_fixtures:reinforce_loss"`):
    plain REINFORCE, -A * log pi, with the ratio pi_theta / pi_prox as a metric of its own."""
    ratio = jnp.exp(jax.lax.stop_gradient(logprobs) - batch["proximal_logprobs"])
    return -batch["advantages"] * logprobs, {"reinforce_ratio": ratio}


class LetterTokenizer:
    """Token i is the letter chr(ord("a") + i): what the workflow decodes completions with."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)


def letter_reward(completion: str, gold: str) -> float:
    """The share of the completion's letters that are `gold` (a reward RL can raise smoothly)."""
    return completion.count(gold) / len(completion) if completion else 0.0
