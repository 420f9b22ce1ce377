"""JaxTrainEngine with LoRA: a frozen bf16 base, adapter-only gradients and optimizer state, and
exact resume from an Orbax checkpoint."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.checkpoint import CheckpointConfig, Checkpointer
from areal_jax.models import lora as lora_lib
from areal_jax.models.lora import LoRAConfig
from areal_jax.trainer.batching import make_microbatches
from areal_jax.trainer.algorithm import PPOStep, ppo_trainer
from areal_jax.models.transformer import forward
from areal_jax.ppo import decoupled_ppo_loss, token_logprobs
from areal_jax.trainer.programs import dropout_key
from areal_jax.ppo import AdvantageConfig
from tests.test_train_step import (BUCKETS, BUDGET, CFG, ENGINE, INIT, OPT, PPO, random_seqs, recomputed,
                                   reference_loss_and_grads)

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"), seed=3)


def _step(trainer, seed):
    minibatches = make_microbatches(random_seqs(seed), max_tokens_per_microbatch=BUDGET, num_minibatches=2,
                                    buckets=BUCKETS)
    return PPOStep(trainer, AdvantageConfig(), dataclasses.replace(PPO, num_minibatches=2)).train(minibatches, 0)


@pytest.fixture(scope="module")
def trainer():
    return ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE, lora=LORA)


def test_base_is_frozen_in_bf16_and_only_adapters_have_optimizer_state(trainer):
    base_before = jax.tree.map(np.asarray, lora_lib.detach(trainer.params))
    adapters_before = jax.tree.map(np.asarray, lora_lib.adapters_of(trainer.params))
    assert {x.dtype for x in jax.tree.leaves(base_before)} == {np.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(adapters_before["wq"]["b"], 0)
    for _ in range(2):
        metrics = _step(trainer, 5)
    assert metrics["skipped_updates"] == 0
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(lora_lib.detach(trainer.params))):
        np.testing.assert_array_equal(np.asarray(y), x)
    after = lora_lib.adapters_of(trainer.params)
    np.testing.assert_array_equal(np.asarray(after["scale"]), adapters_before["scale"])
    assert all(np.abs(np.asarray(after[w]["b"])).max() > 0 for w in LORA.weights)
    state_floats = sum(x.size for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0)
    assert state_floats == 2 * lora_lib.adapter_param_count(CFG, LORA)  # Adam's two moments, adapters only


def test_trainer_gradient_equals_the_reference_loss_gradient_over_adapters(trainer):
    seqs = random_seqs(9, proximal=True)
    [mb] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    grads, _ = trainer.minibatch_gradients(mb)
    # The reference forward computes in its weights' dtype: the bf16 base exactly, in fp32, as the trainer does.
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainer.params)
    frozen, trainable = lora_lib.split_trainable(params)
    _, want = reference_loss_and_grads_over(frozen, trainable, seqs)
    assert set(grads) == set(LORA.weights)
    for (path, x), y in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5 * max(np.abs(np.asarray(x)).max(), 1e-3),
                                   err_msg=str(path))


def reference_loss_and_grads_over(frozen, trainable, seqs):
    loss = lambda t: reference_loss_and_grads(lora_lib.join_trainable(frozen, t), seqs, PPO)[0]  # noqa: E731
    return jax.value_and_grad(loss)(trainable)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_resume_from_a_checkpoint_is_exact(tmp_path, dropout):
    lora = dataclasses.replace(LORA, dropout=dropout)
    a = ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE, lora=lora)
    _step(a, 1)
    with Checkpointer(CheckpointConfig(directory=tmp_path / "ckpt", async_save=False)) as ckpt:
        ckpt.save(1, state=a.state_dict(), force=True)
        ckpt.wait()
        # The adapters come from the checkpoint, whatever the seed; dropout masks from the
        # run's seed (its config.gin on resume) and the restored step counter.
        seed = 99 if not dropout else lora.seed
        b = ppo_trainer(CFG, INIT, OPT, PPO, engine=ENGINE, lora=dataclasses.replace(lora, seed=seed))
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if isinstance(x, jax.Array) else x, b.state_dict())
        state, _ = ckpt.restore(1, state_template=template)
    b.load_state_dict(state)
    assert b.step == 1 and b.num_updates == a.num_updates
    ma, mb = _step(a, 2), _step(b, 2)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for x, y in zip(jax.tree.leaves(a.state_dict()), jax.tree.leaves(b.state_dict())):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_kl_reference_shares_the_frozen_base_and_keeps_its_adapters(trainer):
    from areal_jax.trainer.reference import ReferencePolicy

    ref = ReferencePolicy(trainer)
    before = jax.tree.map(np.asarray, lora_lib.adapters_of(ref.params))
    assert lora_lib.detach(ref.params)["layers"]["wq"] is lora_lib.detach(trainer.params)["layers"]["wq"]
    _step(trainer, 11)  # donates the trainer's adapters, not the reference's copy
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(lora_lib.adapters_of(ref.params))):
        np.testing.assert_array_equal(np.asarray(y), x)
    assert not np.array_equal(np.asarray(lora_lib.adapters_of(trainer.params)["wq"]["b"]), before["wq"]["b"])


# ---- adapter dropout ------------------------------------------------------------------------------

DROPOUT = dataclasses.replace(LORA, dropout=0.5)


def _adapted_init(seed=4):
    """INIT with random a and b: a fresh adapter (b = 0) would make dropout invisible."""
    rng = np.random.default_rng(seed)
    adapters = lora_lib.init_adapters(CFG, LORA)
    adapters = {k: v if k == lora_lib.SCALE else {n: jnp.asarray(rng.normal(0, 0.3, x.shape), jnp.float32)
                                                  for n, x in v.items()} for k, v in adapters.items()}
    return lora_lib.attach(INIT, adapters)


def _hand_loss(params, micro, key):
    """A micro-batch's loss over packed rows, the adapters' inputs dropped with `key`."""
    x = {k: jnp.asarray(v) for k, v in micro.arrays.items()}
    logits, _ = forward(lora_lib.with_dropout(params, key, DROPOUT.dropout), CFG, x["input_ids"], x["positions"],
                        x["segment_ids"])
    logp = token_logprobs(logits, x["targets"], PPO.logit_temperature)
    loss, _ = decoupled_ppo_loss(logp, x["proximal_logprobs"], x["behavior_logprobs"], x["advantages"],
                                 x["loss_mask"], eps_clip=PPO.eps_clip, behav_imp_weight_cap=PPO.behav_imp_weight_cap,
                                 c_clip=PPO.c_clip, behav_imp_weight_mode=PPO.behav_imp_weight_mode,
                                 importance_sampling_level=PPO.importance_sampling_level,
                                 denominator=micro.minibatch_valid_tokens, segment_ids=x["segment_ids"])
    return loss


def test_dropout_acts_in_the_loss_forward_only():
    params = _adapted_init()
    drop = ppo_trainer(CFG, params, OPT, PPO, engine=ENGINE, lora=DROPOUT)
    plain = ppo_trainer(CFG, params, OPT, PPO, engine=ENGINE, lora=LORA)
    [mb] = make_microbatches(random_seqs(9, proximal=True), max_tokens_per_microbatch=BUDGET, num_minibatches=1,
                             buckets=BUCKETS)
    assert len(mb) > 1  # several micro-batches: each draws its own masks
    for micro in mb:  # the log-prob forward never drops
        np.testing.assert_array_equal(np.asarray(drop.compute_logprobs(micro)), np.asarray(plain.compute_logprobs(micro)))
    got, _ = drop.minibatch_gradients(mb, minibatch_index=1)
    undropped, _ = plain.minibatch_gradients(mb)
    # The hand loss: micro-batch u dropped with the key of (seed, step 0, minibatch 1, u).
    frozen, trainable = lora_lib.split_trainable(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), drop.params))
    want = jax.tree.map(jnp.zeros_like, trainable)
    for u, micro in enumerate(mb):
        key = dropout_key(DROPOUT.seed, jnp.array([0, 1, u], jnp.uint32))
        g = jax.grad(lambda t: _hand_loss(lora_lib.join_trainable(frozen, t), micro, key))(trainable)
        want = jax.tree.map(jnp.add, want, g)
    for (path, x), y, z in zip(jax.tree.leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(undropped)):
        scale = max(np.abs(np.asarray(x)).max(), 1e-3)
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5 * scale, err_msg=str(path))
        assert np.abs(np.asarray(y) - np.asarray(z)).max() > 1e-3 * scale, path  # dropout did act


def test_with_dropout_the_own_proximal_log_probs_stay_deterministic():
    """One minibatch without pi_prox: the loss takes pi_prox from a forward of its own, undropped,
    so the gradient equals the one given the log-prob program's pi_prox."""
    trainer = ppo_trainer(CFG, _adapted_init(), OPT, PPO, engine=ENGINE, lora=DROPOUT)
    [mb] = make_microbatches(random_seqs(3), max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS)
    own, _ = trainer.minibatch_gradients(mb)
    given, _ = trainer.minibatch_gradients(recomputed(trainer, [mb])[0])
    for (path, x), y in zip(jax.tree.leaves_with_path(given), jax.tree.leaves(own)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5 * max(np.abs(np.asarray(x)).max(), 1e-3),
                                   err_msg=str(path))
