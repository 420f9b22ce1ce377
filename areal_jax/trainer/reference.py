"""Optional KL penalty against a frozen reference policy (off in the paper: kl_coef = 0).

With `AdvantageConfig.kl_coef > 0`, every completion token t is penalized by
`kl_coef * sum_{s >= t} kl_s` (reward shaping with gamma = 1, see ppo/advantages.py), where
kl_s is a k1/k2/k3 estimate from two log-probs of the sampled target s: under the current
policy (the pre-update weights, i.e. what the decoupled proximal uses) and under the frozen
reference. This module computes both on the train mesh:

1. `ReferencePolicy` keeps a frozen copy of the reference weights (default: the trainer's
   weights at construction) laid out exactly like the trainer's, so the trainer's compiled
   log-prob program runs on it unchanged (no extra compilation); that program takes log-probs
   `TrainEngineConfig.logit_chunk_tokens` tokens at a time (a larger micro-batch never holds its whole logits).
2. `sequences_with_kl` packs the step's sequences with `make_microbatches` (one minibatch),
   runs the log-prob program with both weight sets on every micro-batch, unpacks per sequence
   and hands both to `build_sequences`. The policy log-probs are also attached as
   `proximal_logprobs` (decoupled PPO), so `train_step` does not recompute them.

Shapes: N sequences, L_i tokens of sequence i, R rows and T row length of a micro-batch.
Runs on the trainer thread: the log-prob programs span every process, so every process calls
this at the same point with the same `agree_max`, and runs the same micro-batch count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import lora as lora_lib
from areal_jax.models.transformer import Params
from areal_jax.packing import unpack
from areal_jax.ppo import AdvantageConfig, kl_estimate
from areal_jax.api import TrajectoryGroup
from areal_jax.trainer.batching import PackedBatch, build_sequences, make_microbatches
from areal_jax.trainer.programs import PROXIMAL_KEY
from areal_jax.trainer.train_step import JaxTrainEngine


class ReferencePolicy:
    """Frozen reference weights on the trainer's mesh, with the trainer's shardings.

    Args:
        trainer: the JaxTrainEngine whose log-prob program and layout are used.
        params: reference weights (the trainer's layout, any float dtype; stored in the
            trainer's dtypes). Default: a copy of `trainer.params` now. Always copied: the
            trainer donates its own buffers on every `train_step`, and the caller's arrays stay
            the caller's. With LoRA the default shares the trainer's frozen base (never
            donated) and copies only the adapters.
    """

    def __init__(self, trainer: JaxTrainEngine, params: Params | None = None):
        if not isinstance(trainer, JaxTrainEngine):
            raise TypeError(f"trainer must be a JaxTrainEngine, got {type(trainer).__name__}")
        current = trainer.params
        source = current if params is None else params
        want, got = jax.tree.structure(current), jax.tree.structure(source)
        if got != want:
            raise ValueError(f"reference params layout {got} does not match the trainer's {want}")
        for (path, ref), cur in zip(jax.tree.leaves_with_path(source), jax.tree.leaves(current)):
            if np.shape(ref) != cur.shape:
                raise ValueError(f"reference param {jax.tree_util.keystr(path)} has shape {np.shape(ref)}, "
                                 f"the trainer's has {cur.shape}")
        shardings = jax.tree.map(lambda x: x.sharding, current)
        if params is not None:
            source = jax.device_put(source, shardings)
        # A jitted copy writes fresh buffers with the trainer's shardings: same dtype and layout
        # means the trainer's compiled log-prob program is reused as is.
        frozen, trainable = lora_lib.split_trainable(source)
        if frozen is not None and params is None:
            # LoRA: the base is frozen (never updated or donated), so the reference shares it and
            # copies only the adapters.
            copied = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                             out_shardings=lora_lib.split_trainable(shardings)[1])(trainable)
            self._params = lora_lib.join_trainable(frozen, copied)
        else:
            dtypes = [x.dtype for x in jax.tree.leaves(current)]
            self._params = jax.jit(lambda p: jax.tree.unflatten(jax.tree.structure(p), [
                jnp.copy(x.astype(d)) for x, d in zip(jax.tree.leaves(p), dtypes)]), out_shardings=shardings)(source)
        self.trainer = trainer

    @property
    def params(self) -> Params:
        """The frozen reference weights, in the trainer's dtypes (never donated)."""
        return self._params

    def compute_logprobs(self, microbatch: PackedBatch) -> jax.Array:
        """Log-probs `[R, T]` of the micro-batch's targets under the reference weights."""
        return self.trainer.compute_logprobs(microbatch, self._params)


@dataclasses.dataclass(frozen=True, eq=False)
class KLSequences:
    """What `sequences_with_kl` returns.

    Attributes:
        sequences: `build_sequences` output (per-token `[L_i]` dicts), advantages KL-shaped;
            with the policy log-probs as `proximal_logprobs` when they were attached.
        kl_mean: mean per-token KL estimate over this process's completion tokens (None when
            kl_coef == 0: nothing was computed).
        kl_sum, kl_tokens: its numerator and denominator, to combine across processes.
        logprobs, ref_logprobs: per-sequence `[L_i]` log-probs of the targets under the policy
            and the reference (None when kl_coef == 0).
    """

    sequences: list[dict[str, np.ndarray]]
    kl_mean: float | None = None
    kl_sum: float = 0.0
    kl_tokens: int = 0
    logprobs: list[np.ndarray] | None = None
    ref_logprobs: list[np.ndarray] | None = None


def sequences_with_kl(
    groups: Sequence[TrajectoryGroup],
    adv_cfg: AdvantageConfig,
    trainer: JaxTrainEngine,
    reference: ReferencePolicy | None,
    *,
    row_multiple: int = 1,
    buckets: Sequence[int] | None = None,
    agree_max: Callable[[int], int] | None = None,
    reduce_sum: Callable[[np.ndarray], np.ndarray] | None = None,
    attach_proximal: bool = True,
) -> KLSequences:
    """Training sequences whose advantages carry the KL penalty against `reference`.

    With `adv_cfg.kl_coef == 0` this is exactly `build_sequences(groups, adv_cfg)` (nothing
    runs on devices, `reference` may be None). Otherwise the log-probs of every target under
    the trainer's current weights and under the reference are computed on packed micro-batches
    (token budget `trainer.engine_config.max_tokens_per_microbatch`, at the objective's temperature) and
    the advantages come from `build_sequences(..., logprobs=..., ref_logprobs=...)`.

    Args:
        groups, adv_cfg: as for `build_sequences`.
        trainer: supplies the current (pre-update) weights and the compiled log-prob program.
        reference: the frozen reference; required when kl_coef > 0.
        row_multiple, buckets: packing, as for `make_microbatches` (row_multiple: each process's
            share of the "fsdp" axis, so rows shard evenly).
        agree_max: cross-process max (areal_jax.parallel.agree_max) when several processes
            train: every process then packs into the same number and shapes of micro-batches
            and runs the same programs. Called the same number of times on every process.
        reduce_sum: cross-process float sum for the batch-level advantage statistics
            (`build_sequences`), when several processes train.
        attach_proximal: store the policy log-probs as `proximal_logprobs` (decoupled PPO's
            pi_prox: PPOStep passes PPOConfig.decoupled) so the step skips recomputing them. Valid only while the trainer's weights are
            unchanged, i.e. when these sequences feed the very next `train_step`.
    """
    if adv_cfg.kl_coef == 0:
        return KLSequences(build_sequences(groups, adv_cfg, reduce_sum=reduce_sum))
    if not isinstance(reference, ReferencePolicy):
        raise TypeError(f"kl_coef={adv_cfg.kl_coef} needs a ReferencePolicy, got {type(reference).__name__}")
    if reference.trainer is not trainer:
        raise ValueError("reference was built for another JaxTrainEngine; its layout and program may differ")
    rows = build_sequences(groups, dataclasses.replace(adv_cfg, kl_coef=0.0))  # token arrays; advantages redone
    logprobs, ref_logprobs = _per_sequence_logprobs(rows, trainer, reference, row_multiple=row_multiple,
                                                    buckets=buckets, agree_max=agree_max)
    seqs = build_sequences(groups, adv_cfg, logprobs=logprobs, ref_logprobs=ref_logprobs, reduce_sum=reduce_sum)
    if attach_proximal:
        for seq, logp in zip(seqs, logprobs):
            seq[PROXIMAL_KEY] = np.where(seq["loss_mask"] > 0, logp, 0.0).astype(np.float32)

    kl_sum, kl_tokens = 0.0, 0
    for seq, logp, ref in zip(seqs, logprobs, ref_logprobs):
        mask = seq["loss_mask"] > 0
        kl_sum += float(np.sum(kl_estimate(logp[mask].astype(np.float64), ref[mask].astype(np.float64),
                                           adv_cfg.kl_estimator)))
        kl_tokens += int(mask.sum())
    return KLSequences(seqs, kl_mean=kl_sum / max(kl_tokens, 1), kl_sum=kl_sum, kl_tokens=kl_tokens,
                       logprobs=logprobs, ref_logprobs=ref_logprobs)


def _per_sequence_logprobs(rows, trainer: JaxTrainEngine, reference: ReferencePolicy, *, row_multiple, buckets,
                           agree_max) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`[L_i]` target log-probs of every row under the trainer's weights and the reference."""
    [microbatches] = make_microbatches(rows, max_tokens_per_microbatch=trainer.engine_config.max_tokens_per_microbatch,
                                       num_minibatches=1, buckets=buckets, row_multiple=row_multiple,
                                       agree_max=agree_max)
    # Enqueue every program first (all micro-batches, padding ones too: each process must run
    # the same sequence of programs), then bring the results to the host.
    outputs = [(micro, trainer.compute_logprobs(micro), reference.compute_logprobs(micro)) for micro in microbatches]
    logprobs: list[np.ndarray | None] = [None] * len(rows)
    ref_logprobs: list[np.ndarray | None] = [None] * len(rows)
    for micro, policy_out, ref_out in outputs:
        if not micro.rows:
            continue
        members = micro.sequence_indices
        local_groups, k = [], 0  # positions into `members`, one list per packed row
        for row in micro.rows:
            local_groups.append(list(range(k, k + len(row))))
            k += len(row)
        packed = {"segment_ids": np.asarray(micro.arrays["segment_ids"]),
                  "logprobs": process_local_rows(policy_out), "ref_logprobs": process_local_rows(ref_out)}
        for i, seq in zip(members, unpack(packed, local_groups)):
            logprobs[i], ref_logprobs[i] = seq["logprobs"], seq["ref_logprobs"]
    missing = [i for i, x in enumerate(logprobs) if x is None]
    if missing:  # make_microbatches places every sequence exactly once
        raise AssertionError(f"sequences {missing} were not packed")
    return logprobs, ref_logprobs  # type: ignore[return-value]


def process_local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded `[R * processes, ...]` result, in local order.

    The inverse of `jax.make_array_from_process_local_data` (which JaxTrainEngine uses to build
    a micro-batch): the process's data covers the row ranges of its addressable shards,
    concatenated by increasing global row. With one process that is the whole array.
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = x.addressable_shards
    spans = sorted({_span(s.index[0], x.shape[0]) for s in shards})
    if any(nxt[0] < stop for (_, stop), nxt in zip(spans, spans[1:])):
        raise ValueError(f"overlapping row shards {spans}: not a row-sharded array")
    offsets, total = {}, 0
    for start, stop in spans:
        offsets[start] = total
        total += stop - start
    out = np.empty((total, *x.shape[1:]), x.dtype)
    for s in shards:
        start, stop = _span(s.index[0], x.shape[0])
        out[(slice(offsets[start], offsets[start] + stop - start), *s.index[1:])] = np.asarray(s.data)
    if total * jax.process_count() != x.shape[0]:
        raise ValueError(f"this process holds {total} of {x.shape[0]} rows, not 1/{jax.process_count()}")
    return out


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, _ = index.indices(size)
    return start, stop
