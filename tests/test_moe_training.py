"""Training a MoE policy: the load-balancing loss in the PPO objective, routing replay
(TrainEngineConfig.moe_routing) and the trajectory field that carries the engine's experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from areal_jax.models.transformer import forward, init_params
from areal_jax.rollout.types import Trajectory
from areal_jax.tasks.tokenizer_builder import task_model_config
from areal_jax.trainer.algorithm import ppo_objective
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from areal_jax.trainer.programs import MOE_ROUTING_KEY, build_train_programs, zero_loss_stats

OBJECTIVE = ppo_objective(PPOConfig())

CFG = task_model_config(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, num_experts=4)


def _batch(seed=0, R=2, T=12):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, (R, T)).astype(np.int32)
    seg = np.ones((R, T), np.int32)
    seg[1, 8:] = 0  # padding
    pos = np.where(seg > 0, np.arange(T)[None], 0).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, 1), "segment_ids": seg, "positions": pos,
             "loss_mask": (seg > 0).astype(np.float32), "behavior_logprobs": rng.normal(-2, 0.1, (R, T)).astype(np.float32),
             "advantages": rng.normal(size=(R, T)).astype(np.float32), "versions": np.zeros((R, T), np.int32)}
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _programs(coef=0.0, **engine):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, router_aux_loss_coef=coef))
    return cfg, build_train_programs(cfg, TrainEngineConfig(**engine), OBJECTIVE, optax.sgd(0.1))


def test_aux_loss_enters_the_objective_with_its_coefficient_and_stats():
    params = init_params(CFG, 0, std=0.2)
    batch = _batch()
    denom = jnp.float32(40.0)
    out = {}
    for coef in (0.0, 0.5):
        cfg, programs = _programs(coef)
        _, stats = programs.grad(params, jax.tree.map(jnp.zeros_like, params), zero_loss_stats(OBJECTIVE, None), batch, denom)
        out[coef] = stats
    _, _, routing = forward(params, CFG, batch["input_ids"], batch["positions"], batch["segment_ids"],
                            return_routing=True)
    tokens = float(jnp.sum(batch["loss_mask"] > 0))
    np.testing.assert_allclose(float(out[0.5]["loss"] - out[0.0]["loss"]),
                               0.5 * float(routing.aux_loss) * tokens / 40.0, rtol=1e-4)
    np.testing.assert_allclose(float(out[0.0]["moe_aux_loss_sum"]) / tokens, float(routing.aux_loss), rtol=1e-5)
    assert float(out[0.0]["moe_load_max_sum"]) / tokens >= 1.0 and float(out[0.0]["moe_dropped"]) == 0.0


def test_replay_uses_the_given_experts_and_refuses_a_batch_without_them():
    params = init_params(CFG, 1, std=0.2)
    batch = _batch(1)
    _, recompute = _programs()
    _, replay = _programs(moe_routing="replay")
    _, _, routing = forward(params, CFG, batch["input_ids"], batch["positions"], batch["segment_ids"],
                            return_routing=True)
    own = jnp.moveaxis(routing.experts, 0, 2).astype(jnp.int8)  # [R, T, L, k], as trajectories carry it
    base = np.asarray(recompute.logprobs(params, batch))
    same = np.asarray(replay.logprobs(params, {**batch, MOE_ROUTING_KEY: own}))
    np.testing.assert_allclose(same, base, atol=1e-6)
    other = (own + 1) % CFG.moe.num_experts  # every token sent to other experts
    moved = np.asarray(replay.logprobs(params, {**batch, MOE_ROUTING_KEY: other}))
    assert np.abs(moved - base).max() > 1e-3
    with pytest.raises(ValueError, match="moe_routing='replay' needs the engine's experts"):
        replay.logprobs(params, batch)


def test_trajectory_carries_routing_per_input_token():
    routing = np.zeros((7, 2, 2), np.int8)
    t = Trajectory(np.array([1, 2, 3]), np.array([4, 5, 6, 7]), np.zeros(4, np.float32), np.zeros(4, np.int32), 1.0,
                   moe_routing=routing)
    assert t.training_row()["moe_routing"].shape == (7, 2, 2)
    with pytest.raises(ValueError, match="Trajectory.moe_routing must be"):
        Trajectory(np.array([1, 2, 3]), np.array([4]), np.zeros(1, np.float32), np.zeros(1, np.int32), 1.0,
                   moe_routing=routing)


def test_engine_config_refuses_an_unknown_routing_mode():
    with pytest.raises(ValueError, match="TrainEngineConfig.moe_routing"):
        TrainEngineConfig(moe_routing="sometimes")


@pytest.mark.parametrize("mode", ["recompute", "replay"])
def test_route_mismatch_counts_the_pairs_whose_expert_set_differs_from_the_record(mode):
    """The loss forward compares its own top-k SET with the record on valid tokens only: a record
    equal up to order counts 0; one with a known number of changed (valid token, layer) pairs
    counts exactly those, in either mode. The behaviour gap sums |log pi_behav - log pi_theta|."""
    params = init_params(CFG, 2, std=0.2)
    batch = _batch(2)
    _, programs = _programs(moe_routing=mode)
    _, _, routing = forward(params, CFG, batch["input_ids"], batch["positions"], batch["segment_ids"],
                            return_routing=True)
    own = np.moveaxis(np.asarray(routing.experts), 0, 2).astype(np.uint8)  # [R, T, L, k]
    record = own[..., ::-1].copy()  # the same sets in the other order: no mismatch
    changed = [(0, 0, 0), (0, 5, 1), (1, 3, 0), (1, 3, 1), (1, 10, 0)]  # (row, token, layer); the last is padding
    for r, t, l in changed:
        record[r, t, l, 0] = next(e for e in range(CFG.moe.num_experts) if e not in own[r, t, l])
    valid = np.asarray(batch["loss_mask"]) > 0
    stats = {}
    for name, rec in (("same", own[..., ::-1].copy()), ("changed", record)):
        grads = jax.tree.map(jnp.zeros_like, params)  # donated
        _, stats[name] = programs.grad(params, grads, zero_loss_stats(OBJECTIVE, None), {**batch, MOE_ROUTING_KEY: jnp.asarray(rec)},
                                       jnp.float32(20.0))
        assert float(stats[name]["moe_route_pairs"]) == valid.sum() * 2
    assert float(stats["same"]["moe_route_mismatched"]) == 0.0
    assert float(stats["changed"]["moe_route_mismatched"]) == sum(valid[r, t] for r, t, _ in changed) == 4
    logp = np.asarray(_programs()[1].logprobs(params, batch))
    gap = np.abs(np.asarray(batch["behavior_logprobs"]) - logp)[valid].sum()
    np.testing.assert_allclose(float(stats["same"]["behav_logp_gap_sum"]), gap, rtol=1e-5)


def test_without_a_record_nothing_is_compared():
    params = init_params(CFG, 3, std=0.2)
    _, programs = _programs()
    _, stats = programs.grad(params, jax.tree.map(jnp.zeros_like, params), zero_loss_stats(OBJECTIVE, None), _batch(3),
                             jnp.float32(20.0))
    assert float(stats["moe_route_pairs"]) == 0.0 and float(stats["moe_route_mismatched"]) == 0.0
