"""The expert block (models/moe.py) against a dense-loop reference: values, gradients, routing
replay, the load-balancing loss and statistics, and the config's checks."""

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels.grouped_matmul import grouped_matmul
from areal_jax.models import moe
from areal_jax.models.config import ModelConfig, MoEConfig
from areal_jax.models.transformer import forward, init_params


def _cfg(family="qwen3_moe", layers=2, **moe_kw):
    kw = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=10, norm_topk_prob=True)
    kw.update(moe_kw)
    return ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=layers, num_heads=2,
                       num_kv_heads=1, head_dim=8, family=family, qk_norm=family == "qwen3_moe",
                       qkv_bias=family == "qwen2_moe", moe=MoEConfig(**kw))


def _block_params(cfg, seed):
    """One layer's expert-block weights, drawn larger than init so routing is far from uniform."""
    rng = np.random.default_rng(seed)
    shapes = {k: v[1:] for k, v in jax.tree.map(lambda a: a.shape, init_params(cfg, 0)["layers"]).items()
              if k in moe.layer_axes(cfg)}
    return {k: jnp.asarray(rng.normal(0, 0.5, s), jnp.float32) for k, s in shapes.items()}


def _dense_reference(cfg, h, p, forced=None):
    """Every expert on every token, then each token's chosen ones summed by weight (what HF does)."""
    m = cfg.moe
    x = h.reshape(-1, h.shape[-1])
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    if forced is None:
        _, experts = jax.lax.top_k(probs, m.num_experts_per_tok)
    else:
        experts = forced.reshape(x.shape[0], -1)
    w = jnp.take_along_axis(probs, experts, axis=-1)
    if m.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    outs = []
    for e in range(m.num_experts):
        outs.append((jax.nn.silu(x @ p["we_gate"][e]) * (x @ p["we_up"][e])) @ p["we_down"][e])
    all_out = jnp.stack(outs, 1)  # [M, E, D]
    chosen = jnp.take_along_axis(all_out, experts[:, :, None], axis=1)  # [M, k, D]
    out = (chosen * w[:, :, None]).sum(1)
    if m.shared_expert_intermediate_size:
        shared = (jax.nn.silu(x @ p["ws_gate"]) * (x @ p["ws_up"])) @ p["ws_down"]
        out = out + jax.nn.sigmoid(x @ p["ws_router"]) * shared
    return out.reshape(h.shape)


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen2_moe", False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_and_its_gradients_match_the_dense_loop(family, norm, seed):
    kw = dict(shared_expert_intermediate_size=12) if family == "qwen2_moe" else {}
    cfg = _cfg(family, norm_topk_prob=norm, **kw)
    p = _block_params(cfg, seed)
    h = jnp.asarray(np.random.default_rng(seed + 10).normal(size=(3, 7, 16)), jnp.float32)
    out, stats = moe.sparse_block(cfg, h, p, jnp.float32)
    np.testing.assert_allclose(out, _dense_reference(cfg, h, p), atol=1e-5, rtol=1e-5)
    assert int(stats.dropped) == 0
    np.testing.assert_allclose(stats.load.sum(), cfg.moe.num_experts_per_tok, rtol=1e-6)
    # Gradients of a random projection of the output, wrt the input and every weight.
    probe = jnp.asarray(np.random.default_rng(seed + 20).normal(size=out.shape), jnp.float32)
    ours = jax.grad(lambda h, p: jnp.sum(moe.sparse_block(cfg, h, p, jnp.float32)[0] * probe), (0, 1))(h, p)
    ref = jax.grad(lambda h, p: jnp.sum(_dense_reference(cfg, h, p) * probe), (0, 1))(h, p)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_grouped_matmul_matches_a_loop_over_groups():
    rng = np.random.default_rng(3)
    sizes = np.array([4, 0, 7, 1, 0, 3], np.int32)  # empty groups included
    x = rng.normal(size=(int(sizes.sum()), 5)).astype(np.float32)
    w = rng.normal(size=(len(sizes), 5, 3)).astype(np.float32)
    out = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), "ragged_dot"))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.concatenate([x[starts[g]:starts[g + 1]] @ w[g] for g in range(len(sizes))])
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_expert_shard_computes_only_its_experts():
    """expert_mlp over a slice of the experts gives exactly those experts' share; the slices sum up."""
    cfg = _cfg()
    p = _block_params(cfg, 5)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(11, 16)), jnp.float32)
    w, experts, _ = moe.route(cfg, x, p["router"])
    full, n = moe.expert_mlp(x, experts, w, p["we_gate"], p["we_up"], p["we_down"], "ragged_dot")
    parts = []
    for s in range(3):
        sl = slice(2 * s, 2 * s + 2)
        out, n_s = moe.expert_mlp(x, experts, w, p["we_gate"][sl], p["we_up"][sl], p["we_down"][sl], "ragged_dot", 2 * s)
        assert int(n_s) == int(jnp.sum((experts >= 2 * s) & (experts < 2 * s + 2)))
        parts.append(out)
    assert int(n) == experts.size
    np.testing.assert_allclose(sum(parts), full, atol=1e-5, rtol=1e-5)


def test_replay_of_own_routing_is_exact_and_other_routing_takes_current_probabilities():
    cfg = _cfg(layers=3, mlp_only_layers=(1,))
    params = init_params(cfg, 0, std=0.3)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 9)))
    logits, _, routing = forward(params, cfg, ids, return_routing=True)
    assert routing.experts.shape == (3, 2, 9, 2)
    assert not np.asarray(routing.experts[1]).any()  # the dense layer records nothing
    replayed, _ = forward(params, cfg, ids, moe_routing=routing.experts)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    # Forced experts: the block equals the dense loop told to use them.
    p = _block_params(cfg, 7)
    h = jnp.asarray(np.random.default_rng(7).normal(size=(2, 5, 16)), jnp.float32)
    forced = jnp.asarray(np.random.default_rng(8).permuted(np.tile(np.arange(6), (10, 1)), axis=1)[:, :2]
                         .reshape(2, 5, 2), jnp.int32)
    out, stats = moe.sparse_block(cfg, h, p, jnp.float32, forced=forced)
    np.testing.assert_array_equal(np.asarray(stats.experts), np.asarray(forced))
    np.testing.assert_allclose(out, _dense_reference(cfg, h, p, forced), atol=1e-5, rtol=1e-5)


def test_scan_unrolled_and_remat_forwards_agree_on_a_mixed_pattern():
    cfg = _cfg("qwen2_moe", layers=4, decoder_sparse_step=2, shared_expert_intermediate_size=12,
               norm_topk_prob=False)
    assert cfg.sparse_layers == (False, True, False, True)
    params = init_params(cfg, 1, std=0.3)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 50, (2, 6)))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    a, _, ra = forward(params, cfg, ids, segment_ids=seg, return_routing=True)
    b, _, rb = forward(params, cfg, ids, segment_ids=seg, scan_layers=False, return_routing=True)
    c, _, rc = forward(params, cfg, ids, segment_ids=seg, remat="full", return_routing=True)
    for other, r in ((b, rb), (c, rc)):
        np.testing.assert_allclose(np.asarray(other), np.asarray(a), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(r.experts), np.asarray(ra.experts))
        np.testing.assert_allclose(float(r.aux_loss), float(ra.aux_loss), rtol=1e-5)


def test_aux_loss_is_hf_load_balancing_over_valid_tokens_of_sparse_layers():
    """HF's load_balancing_loss_func with an attention mask: E * sum_e f_e * P_e, where f_e is the
    share of valid tokens routed to e (summed over the k choices) and P_e the mean router
    probability, each over the valid tokens of all sparse layers together."""
    cfg = _cfg(layers=3, mlp_only_layers=(0,), num_experts_per_tok=3)
    E, k = 6, 3
    rng = np.random.default_rng(2)
    valid = jnp.asarray(rng.random((2, 8)) < 0.7)
    per_layer, f, P = [], [], []
    for layer in range(3):
        if layer == 0:
            per_layer.append(moe.LayerRouting.none(cfg, 2, 8))
            continue
        p = _block_params(cfg, layer)
        h = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
        _, stats = moe.sparse_block(cfg, h, p, jnp.float32, valid=valid)
        per_layer.append(stats)
        x = np.asarray(h).reshape(-1, 16)[np.asarray(valid).reshape(-1)]
        logits = x @ np.asarray(p["router"])
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, -1)[:, :k]
        f.append(np.eye(E)[top].sum(1))
        P.append(probs)
    routing = moe.combine(cfg, jax.tree.map(lambda *a: jnp.stack(a), *per_layer))
    f, P = np.concatenate(f), np.concatenate(P)  # valid tokens of both sparse layers
    expect = E * np.sum(f.mean(0) * P.mean(0))
    np.testing.assert_allclose(float(routing.aux_loss), expect, rtol=1e-5)
    np.testing.assert_allclose(float(routing.load_max), f.mean(0).max() * E / k, rtol=1e-5)
    entropy = -np.mean(np.sum(P * np.log(P), -1))
    np.testing.assert_allclose(float(routing.entropy), entropy, rtol=1e-4)
    assert int(routing.dropped) == 0


@pytest.mark.parametrize("kw,field", [
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(grouped_matmul="dense"), "grouped_matmul"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
    (dict(mlp_only_layers=(-1,)), "mlp_only_layers"),
])
def test_moe_config_errors_name_the_field(kw, field):
    base = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    with pytest.raises(ValueError, match=f"MoEConfig.{field}") as e:
        MoEConfig(**{**base, **kw})
    assert "\n" not in str(e.value)


def test_model_config_checks_family_and_layers():
    with pytest.raises(ValueError, match="ModelConfig.moe must be set"):
        _cfg().__class__(**{**_cfg().__dict__, "family": "qwen3"})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        _cfg(layers=2, mlp_only_layers=(2,))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        _cfg("qwen3_moe", shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        _cfg("qwen2_moe")
    cfg = _cfg("qwen2_moe", shared_expert_intermediate_size=8, mlp_only_layers=(1,))
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def _sharded_run(cfg, params, ids, seg, mesh_shape):
    """Logits, routing and the gradient of a loss with the aux term, jitted on a
    ("fsdp", "expert", "tensor") mesh of the first devices with the train rules."""
    from areal_jax.models import sharding as shd
    from areal_jax.models.transformer import param_axes

    def loss(p):
        logits, _, routing = forward(p, cfg, ids, segment_ids=seg, return_routing=True)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + 0.1 * routing.aux_loss, (logits, routing)

    run = jax.jit(jax.value_and_grad(loss, has_aux=True))
    if mesh_shape is None:
        return run(params)
    n = int(np.prod(mesh_shape))
    mesh = jax.make_mesh(mesh_shape, ("fsdp", "expert", "tensor"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    shardings = jax.tree.map(lambda a, x: shd.sharding_for(a, shd.TRAIN_RULES, mesh, x.shape), param_axes(cfg), params,
                             is_leaf=lambda x: isinstance(x, tuple))
    placed = jax.device_put(params, shardings)
    with shd.activation_rules(shd.TRAIN_RULES, mesh):
        return run(placed)


@pytest.mark.parametrize("mesh_shape", [(2, 4, 1), pytest.param((1, 2, 2), marks=pytest.mark.slow)])
def test_expert_parallel_equals_single_device(mesh_shape):
    assert len(jax.devices()) >= 4  # tests/conftest.py asks for 8 CPU devices
    cfg = _cfg("qwen2_moe", layers=3, num_experts=8, mlp_only_layers=(1,), shared_expert_intermediate_size=12,
               norm_topk_prob=False)
    params = init_params(cfg, 4, std=0.3)
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, 50, (4, 10)))
    seg = jnp.asarray((rng.random((4, 10)) < 0.9).astype(np.int32))
    (loss1, (logits1, r1)), g1 = _sharded_run(cfg, params, ids, seg, None)
    (loss8, (logits8, r8)), g8 = _sharded_run(cfg, params, ids, seg, mesh_shape)
    assert g8["layers"]["we_up"].addressable_shards[0].data.shape[1] == 8 // mesh_shape[1]  # experts split
    np.testing.assert_allclose(np.asarray(logits8), np.asarray(logits1), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(r8.experts), np.asarray(r1.experts))
    assert int(r8.dropped) == 0
    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)


def test_experts_that_do_not_split_over_the_expert_axis_are_a_one_line_error():
    cfg = _cfg(num_experts=6)
    params = init_params(cfg, 0)
    ids = jnp.zeros((4, 3), jnp.int32)
    with pytest.raises(ValueError, match="6 experts do not split over expert=4") as e:
        _sharded_run(cfg, params, ids, None, (2, 4, 1))
    assert "\n" not in str(e.value)


_TPU_COMPILE = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from areal_jax.kernels.dispatch import target_platform
from areal_jax.models import moe
from areal_jax.models.config import ModelConfig, MoEConfig
dev = topologies.get_topology_desc("v5e:1x1", "tpu").devices[0]
cfg = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=128, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(8, 2, 256, norm_topk_prob=True, grouped_matmul="gmm"))
sh = jax.sharding.SingleDeviceSharding(dev)
shapes = {"router": (256, 8), "we_gate": (8, 256, 256), "we_up": (8, 256, 256), "we_down": (8, 256, 256)}
p = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16, sharding=sh) for k, v in shapes.items()}
h = jax.ShapeDtypeStruct((4, 100, 256), jnp.bfloat16, sharding=sh)
loss = lambda h, p: jnp.sum(moe.sparse_block(cfg, h, p, jnp.bfloat16)[0].astype(jnp.float32) ** 2)
with target_platform("tpu"):
    lowered = jax.jit(jax.grad(loss, (0, 1))).trace(h, p).lower(lowering_platforms=("tpu",))
    compiled = lowered.compile()
print("CUSTOM_CALLS", compiled.as_text().count("tpu_custom_call"))
from areal_jax.plan.measure import grouped_matmul_kernels
print("GROUPED", *grouped_matmul_kernels(lowered.as_text()))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed ([plan] extra)")
def test_megablox_gmm_compiles_for_tpu_forward_and_backward():
    out = subprocess.run([sys.executable, "-c", _TPU_COMPILE], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1"})
    if "in use by another process" in out.stderr or "lockfile" in out.stderr:
        pytest.skip("another process holds libtpu (one at a time)")
    assert out.returncode == 0, out.stderr[-3000:]
    calls = int(next(x for x in out.stdout.splitlines() if x.startswith("CUSTOM_CALLS")).split()[1])
    assert calls >= 3  # the three expert projections run as Pallas kernels (and their backward)
    # ... and `plan` names them: megablox's kernels only, no XLA ragged dot left beside them.
    assert next(x for x in out.stdout.splitlines() if x.startswith("GROUPED")).split()[1:] == ["megablox_gmm"]


def test_the_aux_loss_coefficient_follows_output_router_logits_as_in_transformers():
    """A config.json with output_router_logits false (or absent: transformers' default) adds no
    load-balancing loss whatever its router_aux_loss_coef; ours round-trips a nonzero coefficient."""
    hf = _cfg("qwen3_moe", router_aux_loss_coef=0.001).to_hf()
    assert hf["output_router_logits"] is True and ModelConfig.from_hf(hf).moe.router_aux_loss_coef == 0.001
    for off in ({"output_router_logits": False}, {}):
        config = {k: v for k, v in hf.items() if k != "output_router_logits"} | off
        assert ModelConfig.from_hf(config).moe.router_aux_loss_coef == 0.0
    assert _cfg("qwen3_moe").to_hf()["output_router_logits"] is False
