"""Supervised fine-tuning on (prompt, completion) pairs: the warm start before RL.

Works for the built-in arithmetic task and for user data alike: examples are token-id pairs.
The loss is the token-mean cross-entropy over completion tokens only (prompt tokens are
context, not targets). Sequences are packed into fixed-shape rows `[B, T]` (areal_jax.packing,
first-fit-decreasing, never splitting a sequence) with segment ids masking attention across
sequence boundaries, so every step runs one compiled program.

Per sequence of prompt p (P tokens) and completion c, the model reads `x = (p + c)[:-1]` and
predicts `y = (p + c)[1:]`; target j is trained iff it is a completion token (j >= P - 1).
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

from areal_jax.generation.engine import EngineConfig, GenerationEngine
from areal_jax.generation.offline import generate
from areal_jax.generation.sampling import SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, Transformer, forward, lm_head
from areal_jax.models.sharding import TRAIN_RULES, activation_rules, sharding_for
from areal_jax.packing import ffd_allocate, pack_sequences
from areal_jax.parallel.distributed import fully_local
from areal_jax.ppo.logprobs import DEFAULT_LOGIT_CHUNK_TOKENS, hidden_logprobs
from areal_jax.trainer.train_step import opt_state_shardings, param_shardings

Example = tuple[Sequence[int], Sequence[int]]  # (prompt_ids, completion_ids)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT hyper-parameters.

    steps: optimizer steps. batch_size: packed rows per step (B). max_len: tokens per row (T);
    every example must fit in one row. lr: peak AdamW learning rate, reached after `warmup`
    linear steps, then cosine decay to `lr * min_lr_ratio`. compute_dtype: "float32" or
    "bfloat16" for matmuls (weights and optimizer state stay float32). log_every: steps between
    metric read-backs (reading forces a device sync). scan_layers: run the layers as a scan (one
    compiled layer body) or unrolled (faster per step on CPU, longer compile for deep models).

    Validation (needs validation prompts, e.g. TaskSource.validation_size for the built-in task):
    eval_every: steps between greedy-accuracy checks on them (0 = none), from step `eval_from`
    on. stop_accuracy: end SFT at the first check whose accuracy reaches it (0 = run all `steps`;
    the schedule stays the one over `steps`). Stopping on accuracy rather than a step count gives
    RL the same kind of start on any machine: where a small policy lands after a fixed number of
    steps moves with the numerics (docs/benchmarks.md, quickstart).
    """

    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 50
    max_len: int = 256
    seed: int = 0
    compute_dtype: str = "float32"
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1
    log_every: int = 10
    scan_layers: bool = True
    eval_every: int = 0
    eval_from: int = 0
    stop_accuracy: float = 0.0

    def __post_init__(self):
        for name in ("steps", "batch_size", "max_len", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SFTConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup, int) or not 0 <= self.warmup <= self.steps:
            raise ValueError(f"SFTConfig.warmup must be an int in [0, steps={self.steps}], got {self.warmup!r}")
        if not self.lr > 0:
            raise ValueError(f"SFTConfig.lr must be positive, got {self.lr!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"SFTConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if self.compute_dtype not in _DTYPES:
            raise ValueError(f"SFTConfig.compute_dtype must be one of {sorted(_DTYPES)}, got {self.compute_dtype!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"SFTConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not self.grad_clip > 0:
            raise ValueError(f"SFTConfig.grad_clip must be positive, got {self.grad_clip!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"SFTConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        for name in ("eval_every", "eval_from"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SFTConfig.{name} must be an int >= 0, got {value!r}")
        if not 0.0 <= self.stop_accuracy <= 1.0:
            raise ValueError(f"SFTConfig.stop_accuracy must be in [0, 1] (0 = off), got {self.stop_accuracy!r}")
        if self.stop_accuracy > 0 and self.eval_every == 0:
            raise ValueError("SFTConfig.stop_accuracy needs validation checks: set SFTConfig.eval_every > 0")
        # The first check: the first multiple of eval_every at or after eval_from (steps count from 1).
        if self.eval_every and -(-max(self.eval_from, 1) // self.eval_every) * self.eval_every > self.steps:
            raise ValueError(f"SFTConfig.eval_every = {self.eval_every} with eval_from = {self.eval_from} runs no "
                             f"validation check within steps = {self.steps}: lower SFTConfig.eval_from, or set "
                             f"SFTConfig.eval_every = 0 and SFTConfig.stop_accuracy = 0.0 to train all steps")

    def validates_at(self, step: int) -> bool:
        """Whether step `step` (1-based) ends with a validation check."""
        return self.eval_every > 0 and step >= self.eval_from and step % self.eval_every == 0


# ---- data -----------------------------------------------------------------------------------------


def sequence_arrays(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-token arrays `[L]` (L = P + C - 1) of one example: input_ids, targets, loss_mask."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    completion = np.asarray(completion_ids, np.int32).reshape(-1)
    if prompt.size == 0 or completion.size == 0:
        raise ValueError(f"examples need a non-empty prompt and completion, got {prompt.size} and "
                         f"{completion.size} tokens")
    tokens = np.concatenate([prompt, completion])
    return {
        "input_ids": tokens[:-1],
        "targets": tokens[1:],
        "loss_mask": (np.arange(tokens.size - 1) >= prompt.size - 1).astype(np.float32),
    }


class PackedBatches:
    """Endless stream of packed batches `{input_ids, targets, loss_mask, segment_ids, positions}`,
    each `[B, T]`, over epochs reshuffled from `seed`. Sequences left over when B rows are full
    start the next batch, so every example is seen once per epoch."""

    def __init__(self, examples: Sequence[Example], batch_size: int, max_len: int, seed: int = 0):
        if not examples:
            raise ValueError("SFT needs at least one example")
        self.seqs = [sequence_arrays(p, c) for p, c in examples]
        self.lengths = [len(s["input_ids"]) for s in self.seqs]
        for i, n in enumerate(self.lengths):
            if n > max_len:
                raise ValueError(f"example {i} has {n + 1} tokens (prompt + completion), more than "
                                 f"max_len + 1 = {max_len + 1}; raise SFTConfig.max_len")
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
        order = [chosen[j] for b in kept for j in b]
        groups, start = [], 0
        for b in kept:
            groups.append(list(range(start, start + len(b))))
            start += len(b)
        return pack_sequences([self.seqs[i] for i in order], groups, self.max_len, num_rows=self.batch_size)


# ---- loss and step --------------------------------------------------------------------------------


def completion_loss(params: Params, model_cfg: ModelConfig, batch: Mapping[str, jax.Array], *,
                    compute_dtype=None, scan_layers: bool = True,
                    logit_chunk_tokens: int = DEFAULT_LOGIT_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy over completion tokens of a packed (or padded) batch.

    batch: input_ids, targets, loss_mask `[B, T]`, and optionally segment_ids / positions `[B, T]`
    (without them each row is one sequence starting at position 0). Returns (loss, n_tokens).
    A batch of more than `logit_chunk_tokens` tokens takes its log-probs chunk by chunk
    (ppo/logprobs.py), so its logits `[B, T, V]` never exist whole.
    """
    hidden, _ = forward(params, model_cfg, batch["input_ids"], batch.get("positions"), batch.get("segment_ids"),
                        compute_dtype=compute_dtype, scan_layers=scan_layers, return_hidden=True)
    logp = hidden_logprobs(hidden, functools.partial(lm_head, params, model_cfg), batch["targets"],
                           chunk_tokens=logit_chunk_tokens)  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    n = jnp.sum(mask)
    return -jnp.sum(logp * mask) / jnp.maximum(n, 1.0), n


def learning_rate_schedule(cfg: SFTConfig) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to `lr * min_lr_ratio`
    at `steps`."""
    # optax needs a decay phase of at least one step; warmup == steps is a valid (warmup-only) config.
    decay_end = max(cfg.steps, cfg.warmup + 1)
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, decay_end, cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""
    schedule = learning_rate_schedule(cfg)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay))


def make_train_step(model_cfg: ModelConfig, optimizer: optax.GradientTransformation, compute_dtype=None,
                    scan_layers: bool = True, out_shardings: Any = None
                    ) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """Jitted `(params, opt_state, batch) -> (params, opt_state, metrics)`; params/state donated.
    out_shardings: (params, opt_state, metrics) shardings on a mesh, so every step keeps one layout."""

    def step(params, opt_state, batch):
        (loss, n), grads = jax.value_and_grad(
            lambda p: completion_loss(p, model_cfg, batch, compute_dtype=compute_dtype, scan_layers=scan_layers),
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
            progress: bool = True, validate: Callable[[Params], float] | None = None, mesh: Mesh | None = None
            ) -> tuple[Params, list[dict[str, float]]]:
    """Fine-tunes `params` on (prompt_ids, completion_ids) pairs; returns new params and metrics.

    Metrics: one dict per `log_every` steps (and the last step) with step, loss (mean over the
    steps since the previous entry), tokens (completion tokens trained), grad_norm, lr and
    elapsed seconds (compilation included); at validation steps also val_accuracy, and
    `stopped_early` on the last entry when `cfg.stop_accuracy` ended the run (the last entry's
    step is then the number of steps run).

    validate: params -> accuracy in [0, 1], called at the steps `cfg.validates_at` names
    (required when `cfg.eval_every` > 0; e.g. a `GreedyAccuracy`), with whole weights on this
    process's default device.

    mesh: a train mesh (("fsdp", "tensor"), `parallel.build_meshes(...).train`), possibly spanning
    processes: weights, optimizer state and batch rows are sharded on it, as the RL trainer's are.
    On a multi-host run every process calls run_sft alike (same examples and config). Without it,
    one device. Either way the returned weights are whole, on this process's default device.
    """
    if cfg.eval_every and validate is None:
        raise ValueError("SFTConfig.eval_every > 0 needs a `validate` function (validation prompts)")
    compute_dtype = _DTYPES[cfg.compute_dtype]
    optimizer = make_optimizer(cfg)
    placement = _MeshPlacement(model_cfg, mesh, (cfg.batch_size, cfg.max_len)) if mesh is not None else None
    if placement is None:
        params = jax.tree.map(lambda a: jnp.array(a, jnp.float32), params)  # own copy: the step donates it
        opt_state = optimizer.init(params)
        step_fn = make_train_step(model_cfg, optimizer, compute_dtype, cfg.scan_layers)
    else:
        params = placement.place_params(params)
        opt_shardings = opt_state_shardings(optimizer, params, placement.params, mesh)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
        step_fn = make_train_step(model_cfg, optimizer, compute_dtype, cfg.scan_layers,
                                  out_shardings=(placement.params, opt_shardings, placement.replicated))
    schedule = learning_rate_schedule(cfg)
    batches = PackedBatches(examples, cfg.batch_size, cfg.max_len, cfg.seed)
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
        if step % cfg.log_every == 0 or step == cfg.steps or accuracy is not None:
            host = jax.device_get(fully_local(window))
            entry = {"step": step, "loss": float(np.mean([w["loss"] for w in host])),
                     "tokens": float(sum(w["tokens"] for w in host)), "grad_norm": float(host[-1]["grad_norm"]),
                     "lr": float(schedule(step - 1)), "seconds": time.perf_counter() - start}
            if accuracy is not None:
                entry["val_accuracy"] = float(accuracy)
            metrics.append(entry)
            window = []
            bar.set_postfix(loss=f"{entry['loss']:.4f}", **({} if accuracy is None else {"val": f"{accuracy:.2f}"}))
        bar.update(1)
        if stop:
            metrics[-1]["stopped_early"] = True
            break
    bar.close()
    return (params if placement is None else _whole_on_this_host(params)), metrics


# ---- evaluation -----------------------------------------------------------------------------------


def _row_answer(row: Mapping[str, Any]) -> Any:
    r = row["row"]
    return r["answer"] if isinstance(r, Mapping) else r.answer


def _completion_scorer(tokenizer: Any, reward_fn: Callable[[str, Any], float] | None
                       ) -> Callable[[Mapping[str, Any], Sequence[int]], float]:
    """`score(row, completion_tokens) -> reward` of the decoded completion against the row's answer
    (`reward_fn` default: the arithmetic reward)."""
    if reward_fn is None:
        from areal_jax.tasks.reward import arithmetic_reward as reward_fn
    return lambda row, tokens: reward_fn(tokenizer.decode(tokens, skip_special_tokens=True), _row_answer(row))


def sample_rewards(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                   max_new_tokens: int, batch: int = 64, n: int = 1, temperature: float = 0.0, seed: int = 0,
                   reward_fn: Callable[[str, Any], float] | None = None) -> np.ndarray:
    """Rewards `[R, n]` of `n` completions per row (`temperature=0`: greedy).

    rows: loader-style examples with `prompt_ids` and `row` (a PromptRow, or a dict, with `answer`).
    batch: decode slots of the generation engine. reward_fn: (completion_text, answer) -> float,
    default the arithmetic reward.
    """
    if not rows:
        return np.zeros((0, n), np.float32)
    score = _completion_scorer(tokenizer, reward_fn)
    model = Transformer(model_cfg, params)
    prompts = [np.asarray(r["prompt_ids"]).tolist() for r in rows]
    results = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, n=n, seed=seed,
                       stop_token_ids=tokenizer.stop_token_ids, num_slots=batch)
    out = np.zeros((len(rows), n), np.float32)
    for i, (row, completions) in enumerate(zip(rows, results)):
        for j, c in enumerate(completions):
            out[i, j] = score(row, c.tokens)
    return out


class GreedyAccuracy:
    """Greedy accuracy of changing weights on fixed prompt rows: `probe(params) -> float`.

    One generation engine serves every call (new weights are swapped in), so its programs are
    compiled once; a fresh `evaluate_accuracy` per check would compile them again each time.
    Same scoring as `evaluate_accuracy`: a row counts when its greedy completion earns reward >= 1.
    """

    def __init__(self, model_cfg: ModelConfig, rows: Sequence[Mapping[str, Any]], tokenizer: Any, *,
                 max_new_tokens: int, slots: int = 64, reward_fn: Callable[[str, Any], float] | None = None):
        if not rows:
            raise ValueError("GreedyAccuracy needs at least one prompt row")
        self.model_cfg, self.rows = model_cfg, list(rows)
        self.score = _completion_scorer(tokenizer, reward_fn)
        self.prompts = [np.asarray(r["prompt_ids"]).tolist() for r in self.rows]
        longest = max(len(p) for p in self.prompts)
        self.engine_config = EngineConfig(num_slots=min(slots, len(self.rows)),
                                          max_seq_len=-(-(longest + max_new_tokens + 1) // 16) * 16)
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                       stop_token_ids=tuple(tokenizer.stop_token_ids))
        self.engine: GenerationEngine | None = None
        self.calls = 0

    def __call__(self, params: Params) -> float:
        correct, total = self.count(params)
        return correct / total

    def _engine_config_for(self, params: Params) -> EngineConfig:
        """The engine config with its slots a multiple of the data size of the (generation) mesh the
        weights lie on: each data replica holds an equal share of the slots."""
        sharding = params["embed"].sharding
        data = sharding.mesh.shape.get("data", 1) if isinstance(sharding, NamedSharding) else 1
        slots = self.engine_config.num_slots
        return dataclasses.replace(self.engine_config, num_slots=max(data, slots - slots % data))

    def count(self, params: Params) -> tuple[int, int]:
        """(rows right, rows) under `params`."""
        self.calls += 1
        if self.engine is None:
            self.engine = GenerationEngine((self.model_cfg, params), self._engine_config_for(params),
                                           version=self.calls)
        else:
            self.engine.update_weights(params, self.calls)
        handles = [self.engine.submit(p, self.sampling, seed=0) for p in self.prompts]
        self.engine.run_until_idle()  # applies the new weights first, then generates
        correct = sum(self.score(row, h.result().completions[0].tokens) >= 1.0 for row, h in zip(self.rows, handles))
        return int(correct), len(self.rows)


def evaluate_accuracy(model_cfg: ModelConfig, params: Params, rows: Sequence[Mapping[str, Any]], tokenizer: Any,
                      *, max_new_tokens: int, batch: int = 64,
                      reward_fn: Callable[[str, Any], float] | None = None) -> float:
    """Share of rows whose greedy completion earns reward >= 1 (0.0 for no rows): a one-off
    `GreedyAccuracy`, whose engine has `batch` slots at most."""
    if not rows:
        return 0.0
    return GreedyAccuracy(model_cfg, rows, tokenizer, max_new_tokens=max_new_tokens, slots=batch,
                          reward_fn=reward_fn)(params)
