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
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from areal_jax.api import PackedBatch
from areal_jax.data.sft_data import SFTExample
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params
from areal_jax.packing import ffd_allocate, pack_sequences
from areal_jax.parallel.distributed import agree_sum_array, fully_local
from areal_jax.trainer.config import SFTConfig
from areal_jax.trainer.engine_config import Objective, TrainEngineConfig
from areal_jax.trainer.objectives import completion_nll
from areal_jax.trainer.optimizer import learning_rate_schedule
from areal_jax.trainer.reference import process_local_rows
from areal_jax.trainer.train_step import JaxTrainEngine

Example = tuple[Sequence[int], Sequence[int]] | SFTExample  # (prompt_ids, completion_ids), or ids + trained mask


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


def packed_eval_batches(examples: Sequence[Example], rows: int, max_len: int) -> list[dict[str, np.ndarray]]:
    """Every example once, packed first-fit-decreasing into batches `[B, T]` (the last one padded)."""
    seqs = [example_arrays(e) for e in examples]
    bins = ffd_allocate([len(s["input_ids"]) for s in seqs], max_len)
    return [_pack_bins(seqs, bins[i:i + rows], max_len, rows) for i in range(0, len(bins), rows)]


class PackedBatches:
    """Endless stream of packed batches `{input_ids, targets, loss_mask, segment_ids, positions}`,
    each `[B, T]`, over epochs reshuffled from `seed`. Sequences left over when B rows are full
    start the next batch, so every example is seen once per epoch."""

    def __init__(self, examples: Sequence[Example], rows: int, max_len: int, seed: int = 0):
        if not examples:
            raise ValueError("SFT needs at least one example")
        self.seqs = [example_arrays(e) for e in examples]
        self.lengths = [len(s["input_ids"]) for s in self.seqs]
        for i, n in enumerate(self.lengths):
            if n > max_len:
                raise ValueError(f"example {i} has {n + 1} tokens, more than max_len + 1 = {max_len + 1}; raise "
                                 "SFTConfig.max_len")
        self.rows, self.max_len = rows, max_len
        self._rng = np.random.default_rng(seed)
        self._pending: collections.deque[int] = collections.deque()
        self.epoch = 0

    def _refill(self) -> None:
        self._pending.extend(self._rng.permutation(len(self.seqs)).tolist())
        self.epoch += 1

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        budget = self.rows * self.max_len
        chosen: list[int] = []
        tokens = 0
        while tokens < budget:
            if not self._pending:
                self._refill()
            idx = self._pending.popleft()
            chosen.append(idx)
            tokens += self.lengths[idx]
        bins = ffd_allocate([self.lengths[i] for i in chosen], self.max_len)
        kept, extra = bins[:self.rows], bins[self.rows:]
        # Sequences that did not fit go back to the front, in their original order.
        leftover = [chosen[j] for j in sorted(j for b in extra for j in b)]
        self._pending.extendleft(reversed(leftover))
        return _pack_bins(self.seqs, [[chosen[j] for j in b] for b in kept], self.max_len, self.rows)


# ---- the step ---------------------------------------------------------------------------------------


def sft_objective() -> Objective:
    """SFT's loss for the training engine: the token-mean negative log-likelihood of the trained
    (completion) tokens at temperature 1 (`trainer.objectives.completion_nll`)."""
    return Objective(completion_nll, None, 1.0, name="sft")


def sft_microbatch(batch: Mapping[str, np.ndarray]) -> PackedBatch:
    """A packed batch `[B, T]` (the same on every process) as the engine's one micro-batch of a
    one-micro-batch minibatch, its loss divided by the batch's trained tokens (the token mean):
    this process's share of the rows (the engine stacks the processes' rows into one array)."""
    count, index = jax.process_count(), jax.process_index()
    rows = len(batch["input_ids"]) // count
    if rows * count != len(batch["input_ids"]):
        raise ValueError(f"SFTConfig.rows_per_step {len(batch['input_ids'])} must divide over {count} processes")
    local = {k: np.asarray(v)[index * rows:(index + 1) * rows] for k, v in batch.items()}
    return PackedBatch(local, (), int(np.asarray(batch["loss_mask"]).sum()))


def _whole_on_this_host(tree: Any) -> Any:
    """Every leaf whole (gathered across processes if need be) on the default device, uncommitted
    like any fresh array, so that a later `device_put` may place it on a mesh spanning hosts."""
    return jax.tree.map(jnp.asarray, jax.device_get(fully_local(tree)))


def run_sft(model_cfg: ModelConfig, params: Params, examples: Sequence[Example], cfg: SFTConfig, *,
            engine: TrainEngineConfig | None = None, progress: bool = True, validate: Callable[[Params], float] | None = None, mesh: Mesh | None = None,
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

    engine: how the training engine computes (TrainEngineConfig: compute dtype, layer scan, attention,
    logit chunks; the RL trainer's); SFT runs on the same engine (`JaxTrainEngine`) as RL, with the
    completion loss (`sft_objective`), one optimizer update per packed batch.

    mesh: a train mesh (("fsdp", "expert", "tensor"), `parallel.build_meshes(...).train`), possibly spanning
    processes: weights, optimizer state and batch rows are sharded on it, as the RL trainer's are.
    On a multi-host run every process calls run_sft alike (same examples and config). Without it,
    one device. Either way the returned weights are whole, on this process's default device.
    """
    if cfg.eval_every and validate is None:
        raise ValueError("SFTConfig.eval_every > 0 needs a `validate` function (validation prompts)")
    opt_cfg = cfg.optimizer_config()
    trainer = JaxTrainEngine(model_cfg, params, opt_cfg, sft_objective(), engine=engine, mesh=mesh)
    del params  # the trainer holds its own fp32 copy
    schedule = learning_rate_schedule(opt_cfg)
    batches = PackedBatches(examples, cfg.rows_per_step, cfg.max_len, cfg.seed)
    val_batches = packed_eval_batches(val_examples, cfg.rows_per_step, cfg.max_len) if val_examples else []

    def val_loss() -> float:
        total = np.zeros(2)  # nll sum and tokens over every held-out token (this process's rows)
        for b in val_batches:
            micro = sft_microbatch(b)
            logp = process_local_rows(trainer.compute_logprobs(micro))  # [B / processes, T]
            mask = np.asarray(micro.arrays["loss_mask"], np.float64)
            total += (-float(np.sum(logp * mask)), float(mask.sum()))
        if jax.process_count() > 1:
            total = agree_sum_array(total)
        return float(total[0] / max(total[1], 1.0))

    metrics: list[dict[str, float]] = []
    window: list[dict[str, jax.Array]] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, dynamic_ncols=True)
    for step in range(1, cfg.steps + 1):
        window.append(trainer.update([sft_microbatch(next(batches))]))  # device values: no sync per step
        accuracy = validate(_whole_on_this_host(trainer.params)) if cfg.validates_at(step) else None
        stop = accuracy is not None and cfg.stop_accuracy > 0 and accuracy >= cfg.stop_accuracy
        last = step == cfg.steps or stop
        loss_val = val_loss() if val_batches and (last or (cfg.val_every and step % cfg.val_every == 0)) else None
        if step % cfg.log_every == 0 or last or accuracy is not None or loss_val is not None:
            host = [{"loss": float(w["loss"]), "tokens": float(w["n_valid"]), "grad_norm": float(w["grad_norm"])}
                    for w in jax.device_get(fully_local(window))]
            entry = {"step": step, "loss": float(np.mean([w["loss"] for w in host])),
                     "tokens": float(sum(w["tokens"] for w in host)), "grad_norm": host[-1]["grad_norm"],
                     "lr": float(schedule(step - 1)), "seconds": time.perf_counter() - start}
            checks = {"val_accuracy": accuracy, "val_loss": loss_val}
            entry.update({k: float(v) for k, v in checks.items() if v is not None})
            metrics.append(entry)
            if on_step is not None:
                for k, w in enumerate(host, start=step - len(host) + 1):
                    record = {**w, "lr": float(schedule(k - 1))}
                    on_step(k, record if k < step else {**record, **{n: entry[n] for n in checks if n in entry}})
            window = []
            bar.set_postfix(loss=f"{entry['loss']:.4f}", **({} if accuracy is None else {"val": f"{accuracy:.2f}"}))
        bar.update(1)
        if stop:
            metrics[-1]["stopped_early"] = True
            break
    bar.close()
    return _whole_on_this_host(trainer.params), metrics

