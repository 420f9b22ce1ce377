"""The training engine: a jitted step of any objective over packed micro-batches.

One training step, given M minibatches of packed micro-batches (trainer/batching.py): for each
minibatch, gradients of the objective summed over its micro-batches, each micro-batch's loss
divided by the minibatch's valid-token count so the sum is the minibatch token mean (DESIGN.md
1.4); then one AdamW update, skipped (params and optimizer state untouched) when the gradient is
non-finite. The objective (`Objective`: a function, its config, the log-prob temperature) is the
algorithm's; the engine masks, normalises, differentiates and logs its metrics, and knows nothing
of what it computes (trainer/objectives.py states the contract). A micro-batch without
`proximal_logprobs` gets the differentiated weights' own stop-gradient log-probs in their place,
which is what a separate forward before the step's only update would compute (the algorithm
attaches pre-step log-probs itself when the step has several updates: trainer/algorithm.py).

Shapes: R rows, T row length (a bucket size). The programs are built by trainer/programs.py
(which also describes them for ahead-of-time planning). Compilation is bounded: one logprob
and one grad program per (R, T) shape plus one update program (`compile_counts` counts traces).
Params are fp32 master weights whatever `compute_dtype` (bf16 casts them inside forward,
so gradients and Adam moments stay fp32). With a train mesh, params and optimizer state
are sharded by their logical axes (`rules`) and micro-batch rows over "fsdp".
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.api import PackedBatch
from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.sharding import TRAIN_RULES, Rules, activation_rules, sharding_for
from areal_jax.models.transformer import Params, param_axes
from areal_jax.trainer.engine_config import REMATS, Objective, TrainEngineConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer, learning_rate_schedule
from areal_jax.trainer.prefix_tree import TREE_KEYS
from areal_jax.trainer.programs import (
    COMPUTE_DTYPES,
    ENGINE_STATS,
    FORWARD_KEYS,
    LOSS_KEYS,
    MOE_ROUTING_KEY,
    accumulate_stats,
    build_train_programs,
    opt_state_shardings,
    param_shardings,
    zero_loss_stats,
)

__all__ = ["COMPUTE_DTYPES", "FORWARD_KEYS", "LOSS_KEYS", "REMATS", "JaxTrainEngine", "opt_state_shardings",
           "param_shardings"]


class JaxTrainEngine:
    """The training engine (`api.TrainEngine`'s native implementation; PolicyTrainer before issue
    38, a name that still resolves with a DeprecationWarning): holds fp32 params + AdamW state and
    runs training steps of the objective it is given.

    Args:
        model_cfg: the decoder's ModelConfig.
        params: initial weights (layout of `param_axes(model_cfg)`; any float dtype, stored fp32;
            copied, so the caller's arrays stay valid).
        opt_cfg: OptimizerConfig.
        objective: the loss (trainer/objectives.py; `trainer.algorithm.ppo_objective` builds
            PPO's from a PPOConfig).
        engine: how it packs and computes (TrainEngineConfig).
        mesh: the train mesh (axes "fsdp", "expert", "tensor"); None = default device.
        rules: logical-axis rules for params and activations on `mesh`.
        lora: with rank > 0, LoRA: the base weights are frozen in `lora.base_dtype` (no fp32
            copy, no optimizer state, no gradients) and only the adapters train; `params` may
            hold adapters already (`params["layers"]["lora"]`), else fresh ones are drawn.
            `self.params` then holds base and adapters (models/lora.py).
    """

    def __init__(self, model_cfg: ModelConfig, params: Params, opt_cfg: OptimizerConfig, objective: Objective,
                 *, engine: TrainEngineConfig | None = None, mesh: Mesh | None = None, rules: Rules = TRAIN_RULES,
                 lora: LoRAConfig | None = None):
        lora = LoRAConfig() if lora is None else lora
        engine = TrainEngineConfig() if engine is None else engine
        for name, value, cls in (("model_cfg", model_cfg, ModelConfig), ("opt_cfg", opt_cfg, OptimizerConfig),
                                 ("objective", objective, Objective), ("engine", engine, TrainEngineConfig),
                                 ("lora", lora, LoRAConfig)):
            if not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        self.model_config = model_cfg
        self.opt_config = opt_cfg
        self.objective = objective
        self.engine_config = engine
        self.lora_config = lora
        self.mesh = mesh
        self.rules = rules
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.last_minibatch_metrics: list[dict[str, Any]] = []  # the last step's, one dict per minibatch
        self._optimizer = build_optimizer(opt_cfg)
        self._schedule = learning_rate_schedule(opt_cfg)
        self._axes = param_axes(model_cfg)
        if lora.enabled:
            self._axes = lora_lib.attach(self._axes, lora_lib.adapter_axes(model_cfg, lora))
            if lora_lib.adapters_of(params) is None:
                params = lora_lib.attach(params, lora_lib.init_adapters(model_cfg, lora))
        self._check_params(params)
        if engine.share_prefixes and model_cfg.moe is not None:
            raise ValueError("TrainEngineConfig.share_prefixes supports dense policies only: a mixture-of-experts "
                             "policy's routing records and router metrics are per plain row")
        self._param_shardings = self._make_param_shardings()
        self._params = self._place_params(params)
        self._opt_state_shardings = self._make_opt_state_shardings()
        self._opt_state = jax.jit(self._optimizer.init, out_shardings=self._opt_state_shardings)(
            self._trainable(self._params))
        self._step = 0
        # On the mesh, like the stats the grad program returns: an unplaced first accumulator
        # would be a different input type and compile every micro-batch shape twice.
        self._zero_stats = zero_loss_stats(objective, None if mesh is None else NamedSharding(mesh, PartitionSpec()))
        self._build_programs()

    # ---- public API -----------------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """Current weights (fp32; with LoRA the frozen base in its dtype plus fp32 adapters).
        The next `train_step` donates the trained buffers: use (or copy) them before calling it
        again."""
        return self._params

    @property
    def step(self) -> int:
        """Training steps taken (each is num_minibatches optimizer updates, minus skipped ones)."""
        return self._step

    @property
    def opt_state(self) -> optax.OptState:
        return self._opt_state

    @property
    def num_updates(self) -> int:
        """Optimizer updates applied so far (skipped updates excluded): the schedule's clock."""
        return _update_count(self._opt_state)

    def state_dict(self) -> dict[str, Any]:
        """{"params", "opt_state", "step"}: pytrees of (possibly sharded) arrays plus an int."""
        return {"params": self._params, "opt_state": self._opt_state, "step": self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a `state_dict()` (arrays are copied onto this trainer's shardings)."""
        missing = {"params", "opt_state", "step"} - set(state)
        if missing:
            raise ValueError(f"state dict lacks {sorted(missing)}")
        self._check_params(state["params"])
        want = jax.tree.structure(self._opt_state)
        if jax.tree.structure(state["opt_state"]) != want:
            raise ValueError(f"opt_state structure {jax.tree.structure(state['opt_state'])} does not match {want}")
        self._params = self._place_params(state["params"])
        self._opt_state = _copy_to(state["opt_state"], self._opt_state_shardings)
        self._step = int(state["step"])

    def compute_logprobs(self, microbatch: PackedBatch, params: Params | None = None) -> jax.Array:
        """Log-probs `[R, T]` of the targets under the current weights at the objective's
        temperature (meaningless on padding; the loss masks them).

        `params` (default: the current weights) may be another set laid out like `self.params`
        (same dtype and shardings, e.g. a frozen reference copy): the same compiled program runs.
        """
        keys = (*FORWARD_KEYS, *(k for k in TREE_KEYS if k in microbatch.arrays))
        batch = self._to_device(microbatch, self._with_routing(microbatch, keys))
        with self._activation_rules():
            return self._logprobs_fn(self._params if params is None else params, batch)

    def _with_routing(self, micro: PackedBatch, keys: Sequence[str], loss: bool = False) -> tuple[str, ...]:
        """`keys` plus the engine's experts where a MoE policy replays them (TrainEngineConfig.moe_routing;
        the program refuses a replay without them), and for the `loss` forward whenever the batch
        has them (it measures how often its own routing differs)."""
        moe_policy = self.model_config.moe is not None and MOE_ROUTING_KEY in micro.arrays
        wanted = loss or self.engine_config.moe_routing == "replay"
        return (*keys, MOE_ROUTING_KEY) if moe_policy and wanted else tuple(keys)

    def _moe_metrics(self, total: dict, n_valid: float) -> dict[str, float]:
        """A MoE policy's router metrics over the step: load-balancing loss and busiest expert's
        load over its fair share (token-weighted means), dropped assignments (always 0: dropless),
        and with the engine's record, the share of (valid token, sparse layer) pairs whose own
        top-k set differs from it."""
        if self.model_config.moe is None:
            return {}
        out = {"moe_aux_loss": float(total["moe_aux_loss_sum"]) / n_valid,
               "moe_load_max": float(total["moe_load_max_sum"]) / n_valid,
               "moe_dropped": float(total["moe_dropped"])}
        if float(total["moe_route_pairs"]) > 0:
            out["moe_route_mismatch"] = float(total["moe_route_mismatched"]) / float(total["moe_route_pairs"])
        return out

    def minibatch_gradients(self, microbatches: Sequence[PackedBatch], *,
                            minibatch_index: int = 0) -> tuple[Params, dict[str, jax.Array]]:
        """Summed gradients of one minibatch's loss and its summed stats (`programs.loss_stats_shapes`:
        the objective's metrics summed over valid tokens, "loss" the minibatch token-mean loss,
        "n_valid", "entropy_sum", ...).

        A micro-batch without `proximal_logprobs` gets the current weights' own log-probs
        (stop-gradient) from the loss forward, which is what a separate proximal forward computes
        when this minibatch is the step's first update. With LoRA dropout, micro-batch u draws its
        masks from (LoRAConfig.seed, the step counter, `minibatch_index`, u): the same on a resumed
        run, whose step counter is restored."""
        if not microbatches:
            raise ValueError("a minibatch needs at least one micro-batch")
        grads = self._zeros_like_params(self._trainable(self._params))
        stats = dict(self._zero_stats)
        with self._activation_rules():
            for u, micro in enumerate(microbatches):
                # Every [R, T] array the algorithm packed goes to the objective (the loss reads what it needs).
                keys = (*FORWARD_KEYS, "loss_mask",
                        *sorted(k for k in micro.arrays if k not in (*FORWARD_KEYS, "loss_mask", MOE_ROUTING_KEY)))
                batch = self._to_device(micro, self._with_routing(micro, keys, loss=True))
                denom = np.float32(micro.minibatch_valid_tokens)
                extra = ()
                if self.lora_config.enabled and self.lora_config.dropout:
                    extra = (np.array([self._step, minibatch_index, u], np.uint32),)
                grads, stats = self._grad_fn(self._params, grads, stats, batch, denom, *extra)
        return grads, stats

    def update(self, microbatches: Sequence[PackedBatch], *, minibatch_index: int = 0) -> dict[str, jax.Array]:
        """One optimizer update on one minibatch's gradients (`minibatch_gradients`); its stats, the
        gradient's "grad_norm" and whether it was "finite", left on the device (reading them waits
        for the step: SFT reads a window of steps at once)."""
        grads, stats = self.minibatch_gradients(microbatches, minibatch_index=minibatch_index)
        frozen, trainable = lora_lib.split_trainable(self._params)
        trainable, self._opt_state, grad_norm, finite = self._update_fn(trainable, self._opt_state, grads)
        self._params = lora_lib.join_trainable(frozen, trainable)
        return {**stats, "grad_norm": grad_norm, "finite": finite}

    def train_step(self, minibatches: Sequence[Sequence[PackedBatch]]) -> dict[str, Any]:
        """One training step: one optimizer update per minibatch.

        Args:
            minibatches: from `make_microbatches`, with whatever per-token arrays the objective
                reads beyond LOSS_KEYS (e.g. the algorithm's `proximal_logprobs`).
        Returns:
            The objective's metrics by name (token means over the step's valid tokens; a "_max"
            metric's max; a per-token vector metric as a NumPy array), and the engine's: loss
            (mean over minibatches), grad_norm (mean) and grad_norm_max, entropy, behav_logp_gap
            (the first minibatch's, whose forward runs on the pre-update weights) and fresh_logp_gap
            (the same over its tokens marked FRESH_KEY; NaN without), skipped_updates,
            trained_tokens, n_valid_tokens, lr, step, num_minibatches, num_microbatches, MoE
            router metrics, and timings (time_step_s).
        """
        if not minibatches or any(len(mb) == 0 for mb in minibatches):
            raise ValueError("train_step needs non-empty minibatches of micro-batches")
        t_start = time.perf_counter()
        total, first, skipped, trained_tokens, norms, losses, per_mb = None, None, 0, 0.0, [], [], []
        for m, mb in enumerate(minibatches):
            stats = self.update(mb, minibatch_index=m)
            grad_norm, finite = stats.pop("grad_norm"), bool(stats.pop("finite"))
            losses.append(float(stats["loss"]))
            norms.append(float(grad_norm))
            if finite or not self.engine_config.skip_nonfinite:
                trained_tokens += float(stats["n_valid"])
            else:
                skipped += 1
            per_mb.append({**_objective_metrics(stats), "loss": losses[-1], "grad_norm": norms[-1],
                           "skipped": float(not finite)})
            first = stats if total is None else first
            total = stats if total is None else accumulate_stats(total, stats)
        t_end = time.perf_counter()
        self._step += 1
        self.last_minibatch_metrics = per_mb

        n_valid = max(float(total["n_valid"]), 1.0)  # an all-padding step logs zeros
        metrics: dict[str, Any] = _objective_metrics(total)
        count = self.num_updates
        applied = len(minibatches) - skipped
        metrics.update(
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(norms)),
            grad_norm_max=float(np.max(norms)),
            entropy=float(total["entropy_sum"]) / n_valid,
            # The first minibatch's forward runs on the pre-update weights (with one minibatch: all tokens).
            behav_logp_gap=float(first["behav_logp_gap_sum"]) / max(float(first["n_valid"]), 1.0),
            # The same over the first minibatch's lag-0 tokens: the engine's numerics (e.g. its KV
            # cache dtype) against the trainer's at the same weights; NaN without such tokens.
            fresh_logp_gap=(float(first["fresh_logp_gap_sum"]) / float(first["n_fresh"])
                            if float(first["n_fresh"]) else math.nan),
            skipped_updates=float(skipped),
            trained_tokens=float(trained_tokens),
            n_valid_tokens=float(total["n_valid"]),
            lr=float(self._schedule(count - 1 if applied else count)),
            step=float(self._step),
            num_minibatches=float(len(minibatches)),
            num_microbatches=float(sum(len(mb) for mb in minibatches)),
            **self._moe_metrics(total, n_valid),
            time_step_s=t_end - t_start,
        )
        return metrics

    # ---- placement ------------------------------------------------------------------------------

    def _check_params(self, params: Params) -> None:
        want = jax.tree.structure(self._axes, is_leaf=lambda x: isinstance(x, tuple))
        got = jax.tree.structure(params)
        if got != want:
            raise ValueError(f"params layout {got} does not match param_axes(model_cfg) {want}")

    @staticmethod
    def _trainable(tree):
        """The part of a params-shaped tree the optimizer updates (all of it without LoRA)."""
        return lora_lib.split_trainable(tree)[1]

    def _make_param_shardings(self):
        return None if self.mesh is None else param_shardings(self.model_config, self.rules, self.mesh,
                                                              self.lora_config)

    def _make_opt_state_shardings(self):
        if self.mesh is None:
            return None
        return opt_state_shardings(self._optimizer, self._trainable(self._params),
                                   self._trainable(self._param_shardings), self.mesh)

    def _place_params(self, params: Params) -> Params:
        if self._param_shardings is not None:
            params = jax.device_put(params, self._param_shardings)
        # Trained weights fp32; a LoRA base stays in its (frozen) dtype.
        frozen, trainable = lora_lib.split_trainable(params)
        base_dtype = COMPUTE_DTYPES[self.lora_config.base_dtype]
        dtypes = lora_lib.join_trainable(
            None if frozen is None else lora_lib.attach(jax.tree.map(lambda _: base_dtype, lora_lib.detach(frozen)),
                                                        {lora_lib.SCALE: jnp.float32}),
            jax.tree.map(lambda _: jnp.float32, trainable))
        # A jitted cast always writes fresh buffers: updates donate ours, never the caller's.
        return jax.jit(lambda p: jax.tree.map(lambda x, d: jnp.asarray(x, d), p, dtypes),
                       out_shardings=self._param_shardings)(params)

    def _activation_rules(self):
        return contextlib.nullcontext() if self.mesh is None else activation_rules(self.rules, self.mesh)

    def _to_device(self, micro: PackedBatch, keys: Sequence[str]) -> dict[str, jax.Array]:
        out = {}
        for key in keys:
            x = micro.arrays[key]
            if isinstance(x, jax.Array):  # already on device (e.g. proximal log-probs)
                out[key] = x
            elif self.mesh is None:
                out[key] = jnp.asarray(x)
            else:
                x = np.asarray(x)
                global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
                sharding = sharding_for(("batch", "seq"), self.rules, self.mesh, global_shape)
                out[key] = (jax.device_put(x, sharding) if jax.process_count() == 1
                            else jax.make_array_from_process_local_data(sharding, x, global_shape))
        return out

    # ---- compiled programs ----------------------------------------------------------------------

    def _build_programs(self) -> None:
        programs = build_train_programs(self.model_config, self.engine_config, self.objective, self._optimizer,
                                        param_shardings=(None if self._param_shardings is None
                                                         else self._trainable(self._param_shardings)),
                                        opt_state_shardings=self._opt_state_shardings, counts=self.compile_counts,
                                        lora=self.lora_config)
        self._logprobs_fn = programs.logprobs
        self._grad_fn = programs.grad
        self._update_fn = programs.update
        self._zeros_like_params = programs.zeros_like


def _update_count(opt_state) -> int:
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return int(counts[0][1]) if counts else 0


def _copy_to(tree, shardings):
    if shardings is None:
        return jax.jit(lambda t: jax.tree.map(jnp.copy, t))(tree)
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(jax.device_put(tree, shardings))


def _objective_metrics(stats: Mapping[str, jax.Array]) -> dict[str, Any]:
    """The objective's accumulated metrics as logged numbers: token means over the valid tokens (a
    per-token vector's per component, a NumPy array), a "_max" metric's max."""
    n_valid = max(float(stats["n_valid"]), 1.0)
    out: dict[str, Any] = {}
    for name, value in stats.items():
        if name in ENGINE_STATS:
            continue
        value = np.asarray(value, np.float64)
        value = value if name.endswith("_max") else value / n_valid
        out[name] = float(value) if value.ndim == 0 else value
    return out


def __getattr__(name: str) -> Any:
    # The training engine's name before issue 38 ("Trainer" is the Python API's, aj.Trainer).
    if name == "PolicyTrainer":
        warnings.warn("areal_jax.trainer.train_step.PolicyTrainer is now JaxTrainEngine", DeprecationWarning,
                      stacklevel=2)
        return JaxTrainEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
