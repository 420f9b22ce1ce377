"""PolicyTrainer with LoRA: a frozen bf16 base, adapter-only gradients and optimizer state, and
exact resume from an Orbax checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.checkpoint import CheckpointConfig, Checkpointer
from areal_jax.models import lora as lora_lib
from areal_jax.models.lora import LoRAConfig
from areal_jax.trainer.batching import make_microbatches
from areal_jax.trainer.train_step import PolicyTrainer
from tests.test_train_step import BUCKETS, BUDGET, CFG, INIT, OPT, PPO, random_seqs, reference_loss_and_grads

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"), seed=3)


def _step(trainer, seed):
    minibatches = make_microbatches(random_seqs(seed), max_tokens_per_microbatch=BUDGET, num_minibatches=2,
                                    buckets=BUCKETS)
    return trainer.train_step(minibatches)


@pytest.fixture(scope="module")
def trainer():
    return PolicyTrainer(CFG, INIT, OPT, PPO, lora=LORA)


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


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    a = PolicyTrainer(CFG, INIT, OPT, PPO, lora=LORA)
    _step(a, 1)
    with Checkpointer(CheckpointConfig(directory=tmp_path / "ckpt", async_save=False)) as ckpt:
        ckpt.save(1, state=a.state_dict(), force=True)
        ckpt.wait()
        b = PolicyTrainer(CFG, INIT, OPT, PPO, lora=LoRAConfig(rank=4, alpha=8.0, targets=LORA.targets, seed=99))
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                if isinstance(x, jax.Array) else x, b.state_dict())
        state, _ = ckpt.restore(1, state_template=template)
    b.load_state_dict(state)
    assert b.step == 1 and b.num_updates == a.num_updates
    ma, mb = _step(a, 2), _step(b, 2)
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    for x, y in zip(jax.tree.leaves(a.state_dict()), jax.tree.leaves(b.state_dict())):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
