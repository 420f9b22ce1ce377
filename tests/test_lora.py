"""LoRA adapters (models/lora.py): identity at B = 0, gradients against the closed form, merging,
the trainer's frozen base, and parity with PEFT on transformers (models/peft_io.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.peft_io import load_adapter, save_adapter
from areal_jax.models.transformer import KVCache, forward, init_params

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")


def _random_adapters(cfg, lora, seed):
    """Adapters with a and b both random (b = 0 would hide any error in b's layout)."""
    ad = lora_lib.init_adapters(cfg, lora)
    rng = np.random.default_rng(seed)
    return {k: v if k == lora_lib.SCALE else {n: jnp.asarray(rng.normal(0, 0.3, x.shape), jnp.float32)
                                              for n, x in v.items()} for k, v in ad.items()}


def _tokens(seed, B=2, T=7):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T)), jnp.int32)


@pytest.mark.parametrize("field,value", [("rank", -1), ("rank", 1.5), ("alpha", 0.0), ("dropout", 1.0),
                                         ("dropout", -0.1), ("dropout", True),
                                         ("targets", ("q", "x")), ("targets", ()), ("targets", ("q", "q")),
                                         ("base_dtype", "float16"), ("seed", -1)])
def test_config_rejects_bad_fields_naming_them(field, value):
    with pytest.raises(ValueError, match=f"LoRAConfig.{field}"):
        LoRAConfig(**{"rank": 4, field: value})


def test_rank_zero_is_full_fine_tuning():
    assert not LoRAConfig().enabled and LoRAConfig(rank=8, alpha=32).scale == 4.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_zero_b_gives_the_base_bit_for_bit(dtype, seed):
    lora = LoRAConfig(rank=4, seed=seed)
    base = init_params(CFG, seed, dtype=dtype)
    adapted = lora_lib.attach(base, lora_lib.init_adapters(CFG, lora))
    ids = _tokens(seed)
    want, _ = forward(base, CFG, ids)
    got, _ = forward(adapted, CFG, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Decode path (per-layer cache, unrolled layers) too.
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    cache = KVCache.zeros(CFG, ids.shape[0], 16, dtype).per_layer()
    want, _ = forward(base, CFG, ids, pos, cache=cache)
    got, _ = forward(adapted, CFG, ids, pos, cache=cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_weights_give_the_adapted_logits(seed):
    lora = LoRAConfig(rank=3, alpha=5.0, targets=("q", "v", "o", "down"))
    base = init_params(CFG, seed)
    adapted = lora_lib.attach(base, _random_adapters(CFG, lora, seed))
    ids = _tokens(seed)
    want, _ = forward(adapted, CFG, ids)
    base_logits, _ = forward(base, CFG, ids)
    got, _ = forward(lora_lib.merge(adapted), CFG, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want) - np.asarray(base_logits)).max() > 1e-2  # the adapters do something


@pytest.mark.parametrize("seed", [0, 1])
def test_adapter_gradients_are_the_projected_full_gradient(seed):
    """y = x W + s x A B depends on (W, A, B) through W' = W + s A B only, so with G = dL/dW'
    (the plain model's weight gradient at the merged weights): dL/dA = s G B^T, dL/dB = s A^T G."""
    lora = LoRAConfig(rank=3, alpha=6.0)
    base = init_params(CFG, seed)
    adapters = _random_adapters(CFG, lora, seed)
    ids, targets = _tokens(seed), _tokens(seed + 100)

    def loss(params):
        logits, _ = forward(params, CFG, ids)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    frozen, trainable = lora_lib.split_trainable(lora_lib.attach(base, adapters))
    grads = jax.grad(lambda t: loss(lora_lib.join_trainable(frozen, t)))(trainable)
    full = jax.grad(loss)(lora_lib.merge(lora_lib.attach(base, adapters)))["layers"]
    s = lora.scale
    for w in lora.weights:
        a, b = np.asarray(adapters[w]["a"], np.float64), np.asarray(adapters[w]["b"], np.float64)
        L, R = a.shape[0], a.shape[-1]
        G = np.asarray(full[w], np.float64).reshape(L, a.size // (L * R), -1)  # [L, in, out]
        a2, b2 = a.reshape(L, -1, R), b.reshape(L, R, -1)
        want_a = s * G @ b2.transpose(0, 2, 1)
        want_b = s * a2.transpose(0, 2, 1) @ G
        scale_a, scale_b = np.abs(want_a).max(), np.abs(want_b).max()
        np.testing.assert_allclose(np.asarray(grads[w]["a"]).reshape(want_a.shape), want_a, atol=2e-5 * scale_a)
        np.testing.assert_allclose(np.asarray(grads[w]["b"]).reshape(want_b.shape), want_b, atol=2e-5 * scale_b)
    assert set(grads) == set(lora.weights)  # scale and base weights get no gradient


# ---- adapter dropout ------------------------------------------------------------------------------


def test_zero_dropout_leaves_the_params_and_the_forward_as_they_are():
    lora = LoRAConfig(rank=3, alpha=5.0)
    adapted = lora_lib.attach(init_params(CFG, 0), _random_adapters(CFG, lora, 0))
    assert lora_lib.with_dropout(adapted, jax.random.key(1), 0.0) is adapted


@pytest.mark.parametrize("name,rate", [("wq", 0.3), ("wo", 0.5), ("w_down", 0.1)])
def test_dropout_drops_the_adapter_input_only_by_the_documented_mask(name, rate):
    """y = W x + scale * B A dropout(x): the mask of layer l and projection `name` is
    bernoulli(fold_in(fold_in(key, l), index of `name` in TARGETS), 1 - rate), kept inputs / (1 - rate)."""
    lora = LoRAConfig(rank=3, alpha=6.0)
    layer_index, key = 1, jax.random.key(7)
    adapters = _random_adapters(CFG, lora, 2)
    dropped = lora_lib.adapters_of(lora_lib.with_dropout(lora_lib.attach(init_params(CFG, 0), adapters), key, rate))
    layer = {lora_lib.LORA: jax.tree.map(lambda x: x[layer_index], dropped)}
    a = np.asarray(adapters[name]["a"][layer_index], np.float64)
    b = np.asarray(adapters[name]["b"][layer_index], np.float64)
    I, R = a.size // a.shape[-1], a.shape[-1]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, I)), jnp.float32)
    out = jnp.asarray(np.random.default_rng(4).normal(size=(2, 5, *b.shape[1:])), jnp.float32)
    got = np.asarray(lora_lib.adapt(out, x, layer, name), np.float64)

    index = [w for w, _ in lora_lib.TARGETS.values()].index(name)
    mask = np.asarray(jax.random.bernoulli(jax.random.fold_in(jax.random.fold_in(key, layer_index), index),
                                           1.0 - rate, x.shape))
    xd = np.where(mask, np.asarray(x, np.float64) / (1 - rate), 0.0).reshape(-1, I)
    want = np.asarray(out, np.float64) + (lora.scale * (xd @ a.reshape(I, R)) @ b.reshape(R, -1)).reshape(out.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert abs(1 - mask.mean() - rate) < 0.1  # about `rate` of the inputs dropped
    undropped = np.asarray(lora_lib.adapt(out, x, {lora_lib.LORA: jax.tree.map(lambda v: v[layer_index], adapters)},
                                          name))
    assert np.abs(undropped - got).max() > 1e-3


def test_dropout_leaves_the_frozen_base_output_as_it_is():
    """With B = 0 (a fresh adapter) the adapter path adds zeros whatever its input: the dropped
    forward is the base's, bit for bit. With random adapters it differs from the undropped one."""
    lora = LoRAConfig(rank=4, dropout=0.5)
    base = init_params(CFG, 1)
    ids = _tokens(1)
    want, _ = forward(base, CFG, ids)
    fresh = lora_lib.with_dropout(lora_lib.attach(base, lora_lib.init_adapters(CFG, lora)), jax.random.key(0), 0.5)
    got, _ = forward(fresh, CFG, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    adapted = lora_lib.attach(base, _random_adapters(CFG, lora, 1))
    plain, _ = forward(adapted, CFG, ids)
    dropped, _ = forward(lora_lib.with_dropout(adapted, jax.random.key(0), 0.5), CFG, ids)
    assert np.abs(np.asarray(dropped) - np.asarray(plain)).max() > 1e-3
    # Scanned (training) and unrolled layers draw the same masks.
    unrolled, _ = forward(lora_lib.with_dropout(adapted, jax.random.key(0), 0.5), CFG, ids, scan_layers=False)
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(dropped), rtol=1e-5, atol=1e-5)


def test_peft_files_round_trip(tmp_path):
    lora = LoRAConfig(rank=2, alpha=3.0, dropout=0.05, targets=("k", "gate", "o"))
    adapters = _random_adapters(CFG, lora, 0)
    save_adapter(adapters, CFG, lora, tmp_path)
    got_cfg, got = load_adapter(tmp_path, CFG)
    assert (got_cfg.rank, got_cfg.alpha, got_cfg.dropout, set(got_cfg.targets)) == (2, 3.0, 0.05, set(lora.targets))
    for w in lora.weights:
        for k in ("a", "b"):
            np.testing.assert_array_equal(got[w][k], np.asarray(adapters[w][k]))


@pytest.mark.parametrize("key, value", [("alpha_pattern", {"q_proj": 64}), ("rank_pattern", {"k_proj": 8}),
                                        ("modules_to_save", ["lm_head"]), ("layers_to_transform", [0])])
def test_peft_fields_that_change_the_adapter_are_refused_not_ignored(tmp_path, key, value):
    """Honouring them would compute another adapter; ignoring them silently (as before) too."""
    import json

    lora = LoRAConfig(rank=2, alpha=3.0, targets=("k", "o"))
    save_adapter(_random_adapters(CFG, lora, 0), CFG, lora, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, key: type(value)()}))
    assert load_adapter(tmp_path, CFG)[0].rank == 2  # empty, as PEFT writes them: the plain adapter
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=f"adapter_config.json: {key} = .* is not supported"):
        load_adapter(tmp_path, CFG)


def test_an_all_sparse_moe_model_refuses_dense_mlp_targets():
    """Every layer a mixture of experts: no w_gate / w_up / w_down to adapt (was KeyError 'w_down')."""
    from areal_jax.tasks.tokenizer_builder import task_model_config

    cfg = task_model_config(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, num_experts=4)
    assert all(cfg.sparse_layers)
    with pytest.raises(ValueError, match=r"this model has no gate, down projections .* set LoRAConfig.targets = "
                                         r"\('q', 'v'\)"):
        lora_lib.init_adapters(cfg, LoRAConfig(rank=2, targets=("q", "gate", "v", "down")))
    adapters = lora_lib.init_adapters(cfg, LoRAConfig(rank=2, targets=("q", "v")))
    assert set(adapters) == {"scale", "wq", "wv"}
