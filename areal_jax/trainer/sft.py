"""Supervised fine-tuning on completions: the warm start before RL (`areal-jax sft` alone).

Works for the built-in arithmetic task and for user data alike: an example is a (prompt_ids,
completion_ids) pair, or an `SFTExample` (token ids and the mask of trained tokens: a chat's
assistant turns, areal_jax/data/sft_data.py, which reads JSONL, Parquet and `datasets` files).
The loss is the token-mean cross-entropy over completion tokens only (prompt tokens are
context, not targets). Sequences are packed into fixed-shape rows `[B, T]` (areal_jax.packing,
first-fit-decreasing, never splitting a sequence) with segment ids masking attention across
sequence boundaries, so every step runs one compiled program.

Per sequence s of N tokens, the model reads `x = s[:-1]` and predicts `y = s[1:]`; target j is
trained iff token j + 1 is a completion token (for a pair of prompt length P: j >= P - 1).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from areal_jax.data.sft_data import SFTExample
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, forward, lm_head
from areal_jax.models.sharding import TRAIN_RULES, activation_rules, sharding_for
from areal_jax.packing import ffd_allocate, pack_sequences
from areal_jax.parallel.distributed import fully_local
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS, hidden_logprobs
from areal_jax.trainer.config import SFTConfig
from areal_jax.trainer.optimizer import build_optimizer, learning_rate_schedule
from areal_jax.trainer.train_step import opt_state_shardings, param_shardings

Example = tuple[Sequence[int], Sequence[int]] | SFTExample  # (prompt_ids, completion_ids), or ids + trained mask
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---- data -----------------------------------------------------------------------------------------


def sequence_arrays(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-token arrays `[L]` (L = P + C - 1) of one (prompt, completion) pair: input_ids, targets, loss_mask."""
    return example_arrays(SFTExample.from_pair(prompt_ids, completion_ids))


def example_arrays(example: Example) -> dict[str, np.ndarray]:
    """Per-token arrays `[N - 1]` of one example of N tokens: input_ids, targets, loss_mask (1.0 where
    the target is a trained token)."""
    if not isinstance(example, SFTExample):
        example = SFTExample.from_pair(*example)
    return {"input_ids": example.ids[:-1], "targets": example.ids[1:],
            "loss_mask": example.trained[1:].astype(np.float32)}


def _pack_bins(seqs: Sequence[Mapping[str, np.ndarray]], bins: Sequence[Sequence[int]], max_len: int,
               rows: int) -> dict[str, np.ndarray]:
    """One packed batch `[rows, max_len]`: bin r (indices into `seqs`) becomes row r, the rest padding."""
    order = [i for b in bins for i in b]
    groups, start = [], 0
    for b in bins:
        groups.append(list(range(start, start + len(b))))
        start += len(b)
    return pack_sequences([seqs[i] for i in order], groups, max_len, num_rows=rows)


def packed_eval_batches(examples: Sequence[Example], batch_size: int, max_len: int) -> list[dict[str, np.ndarray]]:
    """Every example once, packed first-fit-decreasing into batches `[B, T]` (the last one padded)."""
    seqs = [example_arrays(e) for e in examples]
    bins = ffd_allocate([len(s["input_ids"]) for s in seqs], max_len)
    return [_pack_bins(seqs, bins[i:i + batch_size], max_len, batch_size) for i in range(0, len(bins), batch_size)]


class PackedBatches:
    """Endless stream of packed batches `{input_ids, targets, loss_mask, segment_ids, positions}`,
    each `[B, T]`, over epochs reshuffled from `seed`. Sequences left over when B rows are full
    start the next batch, so every example is seen once per epoch."""

    def __init__(self, examples: Sequence[Example], batch_size: int, max_len: int, seed: int = 0):
        if not examples:
            raise ValueError("SFT needs at least one example")
        self.seqs = [example_arrays(e) for e in examples]
        self.lengths = [len(s["input_ids"]) for s in self.seqs]
        for i, n in enumerate(self.lengths):
            if n > max_len:
                raise ValueError(f"example {i} has {n + 1} tokens, more than max_len + 1 = {max_len + 1}; raise "
                                 "SFTConfig.max_len")
        self.batch_size, self.max_len = batch_size, max_len
        self._rng = np.random.default_rng(seed)
        self._pending: collections.deque[int] = collections.deque()
        self.epoch = 0

    def _refill(self) -> None:
        self._pending.extend(self._rng.permutation(len(self.seqs)).tolist())
        self.epoch += 1

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        budget = self.batch_size * self.max_len
        chosen: list[int] = []
        tokens = 0
        while tokens < budget:
            if not self._pending:
                self._refill()
            idx = self._pending.popleft()
            chosen.append(idx)
            tokens += self.lengths[idx]
        bins = ffd_allocate([self.lengths[i] for i in chosen], self.max_len)
        kept, extra = bins[:self.batch_size], bins[self.batch_size:]
        # Sequences that did not fit go back to the front, in their original order.
        leftover = [chosen[j] for j in sorted(j for b in extra for j in b)]
        self._pending.extendleft(reversed(leftover))
        return _pack_bins(self.seqs, [[chosen[j] for j in b] for b in kept], self.max_len, self.batch_size)


# ---- loss and step --------------------------------------------------------------------------------


def completion_loss(params: Params, model_cfg: ModelConfig, batch: Mapping[str, jax.Array], *,
                    compute_dtype=None, scan_layers: bool = True,
                    logit_chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS,
                    attention_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy over completion tokens of a packed (or padded) batch.

    batch: input_ids, targets, loss_mask `[B, T]`, and optionally segment_ids / positions `[B, T]`
    (without them each row is one sequence starting at position 0). Returns (loss, n_tokens).
    A batch of more than `logit_chunk_tokens` tokens takes its log-probs chunk by chunk
    (ppo/logprobs.py), so its logits `[B, T, V]` never exist whole.
    """
    hidden, _ = forward(params, model_cfg, batch["input_ids"], batch.get("positions"), batch.get("segment_ids"),
                        compute_dtype=compute_dtype, scan_layers=scan_layers, return_hidden=True,
                        attention_impl=attention_impl)
    logp = hidden_logprobs(hidden, functools.partial(lm_head, params, model_cfg), batch["targets"],
                           chunk_tokens=logit_chunk_tokens)  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    n = jnp.sum(mask)
    return -jnp.sum(logp * mask) / jnp.maximum(n, 1.0), n


def make_train_step(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, compute_dtype=None,
                    scan_layers: bool = True, out_shardings: Any = None, attention_impl: str = "auto"
                    ) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """Jitted `(params, opt_state, batch) -> (params, opt_state, metrics)`; params/state donated.
    out_shardings: (params, opt_state, metrics) shardings on a mesh, so every step keeps one layout."""

    def step(params, opt_state, batch):
        (loss, n), grads = jax.value_and_grad(
            lambda p: completion_loss(p, model_cfg, batch, compute_dtype=compute_dtype, scan_layers=scan_layers,
                                      attention_impl=attention_impl),
            has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "tokens": n, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1), **({} if out_shardings is None else {"out_shardings": out_shardings}))


class _MeshPlacement:
    """SFT state on a train mesh: weights and optimizer state sharded by the training rule table
    (FSDP x TP), batch rows over "fsdp". Works across processes: every process builds the same
    host batch and places the rows its devices hold."""

    def __init__(self, model_cfg: ModelConfig, mesh: Mesh, batch_shape: tuple[int, int]):
        self.mesh = mesh
        self.params = param_shardings(model_cfg, TRAIN_RULES, mesh)
        self.rows = sharding_for(("batch", "seq"), TRAIN_RULES, mesh, batch_shape)  # every batch is [B, T]
        self.replicated = NamedSharding(mesh, PartitionSpec())

    @staticmethod
    def _global(host: np.ndarray, sharding) -> jax.Array:
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def place_params(self, params: Params) -> Params:
        host = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.device_get(fully_local(params)))
        return jax.tree.map(self._global, host, self.params)

    def batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: self._global(np.asarray(v), self.rows) for k, v in batch.items()}


def _whole_on_this_host(tree: Any) -> Any:
    """Every leaf whole (gathered across processes if need be) on the default device, uncommitted
    like any fresh array, so that a later `device_put` may place it on a mesh spanning hosts."""
    return jax.tree.map(jnp.asarray, jax.device_get(fully_local(tree)))


def run_sft(model_cfg: ModelConfig, params: Params, examples: Sequence[Example], cfg: SFTConfig, *,
            progress: bool = True, validate: Callable[[Params], float] | None = None, mesh: Mesh | None = None,
            val_examples: Sequence[Example] = (), on_step: Callable[[int, dict[str, float]], None] | None = None
            ) -> tuple[Params, list[dict[str, float]]]:
    """Fine-tunes `params` on examples (pairs or `SFTExample`s); returns new params and metrics.

    Metrics: one dict per `log_every` steps (and the last step) with step, loss (mean over the
    steps since the previous entry), tokens (completion tokens trained), grad_norm, lr and
    elapsed seconds (compilation included); at validation steps also val_accuracy and/or val_loss,
    and `stopped_early` on the last entry when `cfg.stop_accuracy` ended the run (the last entry's
    step is then the number of steps run).

    val_examples: held-out examples; `val_loss` (their token-mean completion loss, every example
    once) at every `cfg.val_every`-th step and the last one.
    on_step: called once per step, in order, with (step, {loss, tokens, grad_norm, lr}, plus val_loss /
    val_accuracy where computed); the calls come in bursts when metrics are read back (every
    `log_every` steps), so the device is not synchronised every step for them.

    validate: params -> accuracy in [0, 1], called at the steps `cfg.validates_at` names
    (required when `cfg.eval_every` > 0; e.g. a `GreedyAccuracy`), with whole weights on this
    process's default device.

    mesh: a train mesh (("fsdp", "expert", "tensor"), `parallel.build_meshes(...).train`), possibly spanning
    processes: weights, optimizer state and batch rows are sharded on it, as the RL trainer's are.
    On a multi-host run every process calls run_sft alike (same examples and config). Without it,
    one device. Either way the returned weights are whole, on this process's default device.
    """
    if cfg.eval_every and validate is None:
        raise ValueError("SFTConfig.eval_every > 0 needs a `validate` function (validation prompts)")
    compute_dtype = _DTYPES[cfg.compute_dtype]
    opt_cfg = cfg.optimizer_config()
    optimizer = build_optimizer(opt_cfg)
    placement = _MeshPlacement(model_cfg, mesh, (cfg.batch_size, cfg.max_len)) if mesh is not None else None
    if placement is None:
        params = jax.tree.map(lambda a: jnp.array(a, jnp.float32), params)  # own copy: the step donates it
        opt_state = optimizer.init(params)
        step_fn = make_train_step(model_cfg, optimizer, compute_dtype, cfg.scan_layers,
                                  attention_impl=cfg.attention_impl)
    else:
        params = placement.place_params(params)
        opt_shardings = opt_state_shardings(optimizer, params, placement.params, mesh)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        step_fn = make_train_step(model_cfg, optimizer, compute_dtype, cfg.scan_layers,
                                  out_shardings=(placement.params, opt_shardings, placement.replicated),
                                  attention_impl=cfg.attention_impl)
    schedule = learning_rate_schedule(opt_cfg)
    batches = PackedBatches(examples, cfg.batch_size, cfg.max_len, cfg.seed)
    val_batches = packed_eval_batches(val_examples, cfg.batch_size, cfg.max_len) if val_examples else []
    loss_fn = jax.jit(functools.partial(completion_loss, model_cfg=model_cfg, compute_dtype=compute_dtype,
                                        scan_layers=cfg.scan_layers, attention_impl=cfg.attention_impl))

    def val_loss() -> float:
        sums = []  # (loss * tokens, tokens) per batch: the mean over every held-out token
        for b in val_batches:
            if placement is None:
                loss, n = loss_fn(params, batch=b)
            else:
                with activation_rules(TRAIN_RULES, placement.mesh):
                    loss, n = loss_fn(params, batch=placement.batch(b))
            sums.append((loss * n, n))
        host = jax.device_get(fully_local(sums))
        return float(sum(s for s, _ in host) / max(sum(n for _, n in host), 1.0))

    metrics: list[dict[str, float]] = []
    window: list[dict[str, jax.Array]] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, dynamic_ncols=True)
    for step in range(1, cfg.steps + 1):
        if placement is None:
            params, opt_state, m = step_fn(params, opt_state, next(batches))
        else:
            with activation_rules(TRAIN_RULES, placement.mesh):
                params, opt_state, m = step_fn(params, opt_state, placement.batch(next(batches)))
        window.append(m)
        accuracy = validate(_whole_on_this_host(params) if placement else params) if cfg.validates_at(step) else None
        stop = accuracy is not None and cfg.stop_accuracy > 0 and accuracy >= cfg.stop_accuracy
        last = step == cfg.steps or stop
        loss_val = val_loss() if val_batches and (last or (cfg.val_every and step % cfg.val_every == 0)) else None
        if step % cfg.log_every == 0 or last or accuracy is not None or loss_val is not None:
            host = jax.device_get(fully_local(window))
            entry = {"step": step, "loss": float(np.mean([w["loss"] for w in host])),
                     "tokens": float(sum(w["tokens"] for w in host)), "grad_norm": float(host[-1]["grad_norm"]),
                     "lr": float(schedule(step - 1)), "seconds": time.perf_counter() - start}
            checks = {"val_accuracy": accuracy, "val_loss": loss_val}
            entry.update({k: float(v) for k, v in checks.items() if v is not None})
            metrics.append(entry)
            if on_step is not None:
                for k, w in enumerate(host, start=step - len(host) + 1):
                    record = {"loss": float(w["loss"]), "tokens": float(w["tokens"]),
                              "grad_norm": float(w["grad_norm"]), "lr": float(schedule(k - 1))}
                    on_step(k, record if k < step else {**record, **{n: entry[n] for n in checks if n in entry}})
            window = []
            bar.set_postfix(loss=f"{entry['loss']:.4f}", **({} if accuracy is None else {"val": f"{accuracy:.2f}"}))
        bar.update(1)
        if stop:
            metrics[-1]["stopped_early"] = True
            break
    bar.close()
    return (params if placement is None else _whole_on_this_host(params)), metrics

