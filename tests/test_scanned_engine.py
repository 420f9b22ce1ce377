"""EngineConfig.scan_layers: the engine on stacked weights and one stacked page pool, every program
scanning its layers, gives the unrolled paged engine's tokens, log-probs, versions and routing in
every situation the engine meets (sampled groups, swaps with packed and long-history re-prefill,
preemption, FP8 pages, MoE, int8 weights, data x tensor meshes), and its programs have specs that
compile, with one layer body whatever the depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams, engine_program_specs
from areal_jax.generation.programs import param_shardings, placed_like
from areal_jax.kernels.paged_attention import PagePool, stacked_page
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.config import MoEConfig
from areal_jax.models.transformer import split_layers
from tests.engine_fixtures import serve

DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=8, qkv_bias=True, family="qwen2")
# Layers 0 and 2 sparse, layer 1 dense: the scan picks the MLP per layer.
MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,)))
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [4], [9, 8, 7, 6, 5]]
BASE = dict(num_slots=4, max_seq_len=64, decode_chunk=4, prefill_buckets=(8, 16, 32, 64), reprefill_pack_width=24,
            kv_layout="paged")


def _run(cfg, params, *, sp, n=1, swap=None, steps_before_swap=2, **config):
    """Every sample's (tokens, logprobs, versions, stop reason, routing) and the engine."""
    engine = GenerationEngine((cfg, params), EngineConfig(**{**BASE, **config}))
    done = serve(engine, PROMPTS, sp, n=n, swap=swap, steps_before_swap=steps_before_swap)
    return engine, [[(c.tokens, c.logprobs, c.versions, c.stop_reason, c.moe_routing) for c in request]
                    for request in done]


def _assert_same(got, want, atol=2e-5):
    for g, w in zip(got, want, strict=True):
        for (t1, l1, v1, r1, m1), (t2, l2, v2, r2, m2) in zip(g, w, strict=True):
            np.testing.assert_array_equal(t1, t2)
            np.testing.assert_allclose(l1, l2, atol=atol)  # fp32 sums in another order
            np.testing.assert_array_equal(v1, v2)
            assert r1 == r2
            if m2 is not None:
                np.testing.assert_array_equal(m1, m2)


def _both(cfg, params, **kwargs):
    """(scanned engine, its outputs, the unrolled engine's outputs)."""
    _, want = _run(cfg, params, **kwargs)
    engine, got = _run(cfg, params, scan_layers=True, **kwargs)
    assert engine._programs.scan_layers and isinstance(engine._cache, PagePool)
    assert not isinstance(engine._params["layers"], tuple)  # served stacked
    return engine, got, want


def _all_free(engine):
    pages = engine._pages
    pages.check()
    assert all(pages.free_pages(r) == pages.pages_per_replica for r in range(pages.replicas))


SAMPLED = SamplingParams(max_new_tokens=40, temperature=1.0)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0)


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize(("case", "config"), [
    ("groups", dict(page_size=3, n=3)),
    ("swap", dict(page_size=5, swap=True)),  # width 24: packed and long-history re-prefill
    ("preempt", dict(page_size=8, kv_pool_pages=8, swap=True, steps_before_swap=4)),
    ("fp8", dict(page_size=4, n=2, kv_dtype="float8_e4m3fn", swap=True)),
    ("keep", dict(page_size=4, swap=True, on_swap="keep")),
])
def test_scanned_engine_matches_the_unrolled_one(cfg, case, config):
    old, new = init_params(cfg, 1, std=0.3), init_params(cfg, 2, std=0.3)
    config = dict(config)
    swap = new if config.pop("swap", False) else None
    engine, got, want = _both(cfg, old, sp=SAMPLED, swap=swap, **config)
    # FP8 pages: a key the two programs round an ulp apart before it is cast to e4m3 (3 mantissa
    # bits) can land one FP8 step apart, which moves a log-prob by ~1e-4 (seen on some CPUs).
    _assert_same(got, want, atol=1e-3 if case == "fp8" else 2e-5)
    if case == "preempt":
        assert engine.stats().preempted_samples > 0
    if case == "swap":
        assert engine.stats().reprefill_tokens > 0
        assert any(n.startswith("prefill[") for n in engine._programs.traced)  # a history past the packed row
    if case == "fp8":  # every layer's scales were calibrated by the first prefill
        assert engine._cache.k_scale.shape == (cfg.num_layers, cfg.num_kv_heads)
        assert (np.asarray(engine._cache.k_scale) > 0).all()
    if cfg.moe is not None:
        assert all(m is not None for g in got for *_, m in g)
    _all_free(engine)


def test_int8_weights_and_a_split_push_are_served_stacked():
    """int8 serving scans over stacked QuantizedWeights; a push of split weights is stacked once."""
    old, new = init_params(DENSE, 3, std=0.3), init_params(DENSE, 4, std=0.3)
    engine, got, want = _both(DENSE, old, sp=SAMPLED, swap=split_layers(new), page_size=4, weight_dtype="int8")
    _assert_same(got, want)
    assert "stack_weights" in engine._programs.traced


def _mesh(data: int, tensor: int):
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * tensor])


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_data_replicas_keep_their_pages_in_their_share_of_the_stacked_pool(kv_dtype):
    """(data=2, tensor=2): the stacked pool's pages lie over "data" by replica (each replica's
    block holds its pages of every layer), with a pool small enough to preempt and a swap: the
    outputs equal the unrolled engine's, every program compiled has a spec."""
    mesh = _mesh(2, 2)
    old, new = init_params(DENSE, 5, std=0.3), init_params(DENSE, 6, std=0.3)
    placed = lambda p: placed_like(p, param_shardings(DENSE, mesh, split=False))  # noqa: E731
    config = dict(page_size=4, kv_pool_pages=18, reprefill_pack_width=16, kv_dtype=kv_dtype)
    engine, got, want = _both(DENSE, placed(old), sp=SAMPLED, n=2, swap=placed(new), **config)
    _assert_same(got, want)
    pool = engine._cache
    assert pool.k.shape[1] == DENSE.num_layers * 36 and pool.k.sharding.spec[:2] == ("tensor", "data")
    assert engine.stats().preempted_samples > 0
    _all_free(engine)
    specs = {s.name.removeprefix("generation/") for s in engine_program_specs(
        DENSE, EngineConfig(**{**BASE, **config, "scan_layers": True}), mesh=mesh, param_dtype=jnp.float32)}
    assert set(engine._programs.traced) <= specs, set(engine._programs.traced) - specs


def test_stacked_page_orders_pages_by_replica_then_layer():
    """Replica r's block of the page axis holds its pages of every layer, layer after layer."""
    L, per_replica, replicas = 3, 5, 2
    pages = np.arange(replicas * per_replica)
    flat = np.stack([np.asarray(stacked_page(jnp.asarray(pages), layer, L, per_replica)) for layer in range(L)])
    assert sorted(flat.ravel().tolist()) == list(range(L * replicas * per_replica))  # a bijection
    for r in range(replicas):
        mine = flat[:, r * per_replica:(r + 1) * per_replica]
        assert (mine // (L * per_replica) == r).all()  # in replica r's block
        assert (mine % (L * per_replica) // per_replica == np.arange(L)[:, None]).all()  # layer after layer


def test_scanned_specs_hold_one_stacked_pool_and_compile_one_layer_body():
    """The specs of a scanned engine: the stacked pool and blocks, stacked weights; the decode and
    prefill programs compile, and their HLO holds the layer body once (a while loop over layers),
    where the unrolled engine's repeats it per layer."""
    mesh = _mesh(2, 2)
    deep = dataclasses.replace(DENSE, num_layers=6)
    ec = EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=4, prefill_buckets=(16, 32, 64),
                      decode_windows=(32,), reprefill_pack_width=16, kv_layout="paged", page_size=8,
                      kv_pool_pages=10, scan_layers=True)
    specs = {s.name: s for s in engine_program_specs(deep, ec, mesh=mesh, param_dtype=jnp.float32)}
    unrolled = {s.name: s for s in engine_program_specs(deep, dataclasses.replace(ec, scan_layers=False), mesh=mesh,
                                                        param_dtype=jnp.float32)}
    assert set(specs) - {"generation/stack_weights"} == set(unrolled) - {"generation/split_weights"}
    decode = specs["generation/decode[window=32]"]
    params, pool = decode.args[:2]
    assert pool.k.shape == (2, 6 * 20, 8, 8) and params["layers"]["wq"].shape[0] == 6
    for name in ("generation/decode[window=32]", "generation/reprefill_packed[rows=2]"):
        def wq_dots(spec):  # matmuls reading a [D, N, H] query projection: one per compiled layer body
            text = spec.lower().as_text()
            return text.count("stablehlo.dot_general") if spec else 0
        scanned, plain = wq_dots(specs[name]), wq_dots(unrolled[name])
        assert scanned * 3 <= plain, (name, scanned, plain)
        assert specs[name].lower().compile().memory_analysis() is not None


def test_a_run_pushes_stacked_weights_that_the_scanned_engine_serves_as_they_land():
    """The run's transfer for a scanned engine delivers stacked weights (generation_weight_sync),
    installed with no change of layout, push after push; the tokens equal the unrolled engine's
    on the same pushed weights."""
    from areal_jax.models.sharding import TRAIN_RULES
    from areal_jax.parallel import MeshConfig, build_meshes
    from areal_jax.trainer.cluster import generation_weight_sync
    from areal_jax.trainer.config import RLConfig
    from areal_jax.trainer.train_step import param_shardings as train_shardings

    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=2))
    ec = EngineConfig(**{**BASE, "page_size": 4, "scan_layers": True})
    sync = generation_weight_sync(DENSE, meshes, RLConfig(), stacked=ec.serves_stacked("cpu"))
    assert sync.layout == "stacked"
    on_train = train_shardings(DENSE, TRAIN_RULES, meshes.train)
    pushes = [sync.transfer(jax.device_put(init_params(DENSE, seed, std=0.3), on_train)) for seed in (7, 8)]
    assert all(not isinstance(p["layers"], tuple) for p in pushes)
    scanned = GenerationEngine((DENSE, pushes[0]), ec)
    unrolled = GenerationEngine((DENSE, split_layers(pushes[0])), dataclasses.replace(ec, scan_layers=False))
    outputs = []
    for engine in (scanned, unrolled):
        first = [engine.submit(p, GREEDY, seed=i) for i, p in enumerate(PROMPTS)]
        engine.run_until_idle()
        engine.update_weights(pushes[1] if engine is scanned else split_layers(pushes[1]), version=1)
        second = [engine.submit(p, GREEDY, seed=i) for i, p in enumerate(PROMPTS)]
        engine.run_until_idle()
        outputs.append([h.result().completions[0].tokens for h in first + second])
    for got, want in zip(*outputs, strict=True):
        np.testing.assert_array_equal(got, want)
    assert "stack_weights" not in scanned._programs.traced  # installed as they landed
    assert scanned.version == 1


def test_scan_layers_is_validated_and_applies_to_the_paged_layout_only():
    with pytest.raises(ValueError, match="EngineConfig.scan_layers must be a bool"):
        EngineConfig(scan_layers="yes")
    assert EngineConfig(scan_layers=True, kv_layout="paged").serves_stacked("cpu")
    assert not EngineConfig(scan_layers=True).serves_stacked("cpu")  # "auto" is dense on CPU: unrolled
    assert EngineConfig(scan_layers=True).serves_stacked("gpu") and not EngineConfig().serves_stacked("tpu")
    engine = GenerationEngine((DENSE, init_params(DENSE, 0)), EngineConfig(**{**BASE, "kv_layout": "dense",
                                                                                 "scan_layers": True}))
    assert not engine._programs.scan_layers and isinstance(engine._params["layers"], tuple)
