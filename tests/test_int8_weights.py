"""EngineConfig.weight_dtype = "int8": weight-only int8 generation weights (models/quantize.py).

The quantizer's round-trip error is at most half a step per output channel; a tiny model's logits
under int8 weights stay close to full precision and greedy decoding mostly picks the same tokens;
a push (WeightSync on 8 fake CPU devices) lands exactly the codes and scales a NumPy quantizer
gives, push after push; the combinations that write into served weights are refused by name; and
the plan counts the int8 copy: about half the generation weights' bytes of bf16. The refusals, the
plan's count and the simulator's charge are checked for int4 too (its own: tests/test_int4_weights.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.aot import bytes_per_device
from areal_jax.config_system import ConfigError
from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams, engine_program_specs
from areal_jax.generation.programs import param_shardings as generation_shardings
from areal_jax.generation.programs import param_structs
from areal_jax.models import ModelConfig, init_params
from areal_jax.models import quantize
from areal_jax.models.config import MoEConfig
from areal_jax.models.sharding import TRAIN_RULES
from areal_jax.models.transformer import forward
from areal_jax.parallel import MeshConfig, WeightSync, build_meshes
from areal_jax.parallel.delta_sync import DeltaSync
from areal_jax.trainer.config import RLConfig, weight_dtype_conflict
from areal_jax.trainer.train_step import param_shardings

DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, qkv_bias=True, family="qwen2")
MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16))


@pytest.mark.parametrize("shape,axes", [((64, 4, 8), (0,)), ((4, 8, 64), (0, 1)), ((4, 32, 16), (1,))])
def test_round_trip_error_is_at_most_half_a_step_per_output_channel(shape, axes):
    w = np.random.default_rng(0).normal(0, 0.05, size=shape).astype(np.float32)
    w[..., 0] = 0.0 if axes == (0,) else w[..., 0]  # an all-zero channel: scale 1, codes 0
    qw = quantize.quantize(jnp.asarray(w), axes)
    assert qw.q.dtype == jnp.int8 and qw.scale.dtype == jnp.float32
    assert qw.scale.shape == quantize.scale_shape(shape, axes)
    assert int(jnp.max(jnp.abs(qw.q.astype(jnp.int32)))) == quantize.QMAX  # absmax maps to the end code
    err = np.abs(np.asarray(qw.astype(jnp.float32)) - w)
    assert np.all(err <= np.asarray(qw.scale) / 2 * (1 + 1e-5) + 1e-12)
    q, scale = quantize.quantize_reference(w, axes)  # the NumPy quantizer agrees bit for bit
    np.testing.assert_array_equal(np.asarray(qw.q), q)
    np.testing.assert_array_equal(np.asarray(qw.scale).view(np.int32), scale.view(np.int32))
    if axes == (0,):
        np.testing.assert_array_equal(q[..., 0], 0)


def _params(cfg, std=0.2):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_params(cfg, 1, std=std))


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_int8_logits_stay_close_to_bf16(cfg):
    params = _params(cfg)
    qparams = quantize.quantize_params(params)
    assert quantize.is_quantized(qparams) and not quantize.is_quantized(params)
    # Every large matmul weight is quantized; embedding, norms, biases and the router are not.
    layer = qparams["layers"]
    assert {k for k, v in layer.items() if isinstance(v, quantize.QuantizedWeight)} == set(layer) & set(
        quantize.QUANTIZED)
    assert not isinstance(qparams["embed"], quantize.QuantizedWeight)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 12)), jnp.int32)

    def logits(p):
        return np.asarray(forward(p, cfg, tokens, compute_dtype=jnp.float32)[0])

    full, q8 = logits(params), logits(qparams)
    # Stated tolerance: the int8 logits differ from bf16's by under 5% of the logits' spread.
    assert np.max(np.abs(q8 - full)) < 0.05 * np.std(full) * 10
    assert np.mean(np.abs(q8 - full)) < 0.02 * np.std(full) * 5
    assert np.mean(np.argmax(q8, -1) == np.argmax(full, -1)) >= 0.8


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 8, 7, 6, 5], [3, 3], [7, 1, 2, 9]]
BASE = dict(num_slots=8, max_seq_len=32, decode_chunk=4, prefill_buckets=(8, 32), reprefill_pack_width=32,
            kv_layout="paged", page_size=4)


def _generate(params, model=DENSE, **config):
    engine = GenerationEngine((model, params), EngineConfig(**BASE, **config))
    handles = [engine.submit(p, SamplingParams(max_new_tokens=8, temperature=0.0), seed=i)
               for i, p in enumerate(PROMPTS)]
    engine.run_until_idle()
    return engine, [c for h in handles for c in h.result().completions]


def test_an_int8_engine_serves_quantized_weights_and_mostly_picks_the_bf16_tokens():
    params = _params(DENSE)
    engine, q8 = _generate(params, weight_dtype="int8")
    _, full = _generate(params)
    served = engine.params["layers"]
    assert isinstance(served["wq"], quantize.QuantizedWeight) and served["wq"].q.dtype == jnp.int8
    # The engine quantized on install what the reference quantizer gives.
    q, scale = quantize.quantize_reference(np.asarray(params["layers"]["w_up"].astype(jnp.float32)), (1,))
    np.testing.assert_array_equal(np.asarray(served["w_up"].q), q)
    np.testing.assert_array_equal(np.asarray(served["w_up"].scale), scale)
    same = np.mean([np.mean(np.asarray(a.tokens) == np.asarray(b.tokens)) for a, b in zip(q8, full)])
    assert same >= 0.75, same
    first = np.array([c.logprobs[0] for c in q8]), np.array([c.logprobs[0] for c in full])
    np.testing.assert_allclose(*first, atol=0.1)  # the behaviour log-probs are the int8 policy's, close to bf16's
    # A later swap takes bf16 weights (quantized on install) and already quantized ones alike.
    new = _params(DENSE, std=0.21)
    assert engine.update_weights(new, version=1) is not None
    engine.run_until_idle()
    assert engine.update_weights(quantize.quantize_params(new), version=2) is not None
    engine.run_until_idle()
    assert engine.version == 2


def push_setup(model, weight_dtype: str, *, group_bytes: int):
    """4 generation + 4 training devices at tensor 2: the meshes, a quantizing WeightSync, and the
    training and generation shardings a push goes between."""
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=2))
    sync = WeightSync.for_model(model, meshes, jnp.bfloat16, group_bytes=group_bytes, weight_dtype=weight_dtype)
    shardings = param_shardings(model, TRAIN_RULES, meshes.train)
    gen_shardings = generation_shardings(model, meshes.generation, split=True, weight_dtype=weight_dtype)
    return meshes, sync, shardings, gen_shardings


def test_a_push_lands_the_reference_quantizers_codes_and_scales_push_after_push():
    model = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, qkv_bias=True, family="qwen2")
    meshes, sync, shardings, gen_shardings = push_setup(model, "int8", group_bytes=8 << 10)
    for push in range(3):
        host = init_params(model, push, std=0.1 + 0.05 * push)
        out = sync.transfer(jax.device_put(host, shardings))
        assert isinstance(out["layers"], tuple) and len(out["layers"]) == model.num_layers
        check_landed(model, host, out, gen_shardings, "int8", f"push {push}")
        # Only the generation devices hold the served weights, as int8 codes beside bf16 rest.
        assert {d for x in jax.tree.leaves(out) for d in x.devices()} <= set(meshes.generation.devices.flat)
        np.testing.assert_array_equal(np.asarray(out["embed"].astype(jnp.float32)),
                                      np.asarray(jnp.asarray(host["embed"]).astype(jnp.bfloat16).astype(jnp.float32)))
    engine = GenerationEngine((model, out), EngineConfig(**BASE, weight_dtype="int8"))  # served as pushed
    assert engine.params["layers"]["wq"].q.dtype == jnp.int8


def check_landed(model, host, out, gen_shardings, weight_dtype, where):
    """Every layer weight of the pushed `out` is the reference quantizer's codes and scales of the
    bf16-rounded `host` weight (bit for bit) with the generation shardings; the rest is bf16 as sent."""
    for layer in range(model.num_layers):
        for name, got in out["layers"][layer].items():
            want = np.asarray(jnp.asarray(host["layers"][name][layer]).astype(jnp.bfloat16).astype(jnp.float32))
            axes = quantize.contracted_axes(name)
            if axes is None:
                assert got.dtype == jnp.bfloat16
                np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
                continue
            q, scale = quantize.quantize_reference(want, axes, weight_dtype)
            assert got.q.dtype == quantize.CODE_DTYPES[weight_dtype]
            assert got.scale.dtype == quantize.SCALE_DTYPES[weight_dtype]
            np.testing.assert_array_equal(np.asarray(got.q).astype(np.int8), q.astype(np.int8),
                                          err_msg=f"{where} layer {layer} {name}")
            np.testing.assert_array_equal(np.asarray(got.scale).astype(np.float32).view(np.int32),
                                          scale.astype(np.float32).view(np.int32))
            wanted = gen_shardings["layers"][layer][name]
            assert got.q.sharding.is_equivalent_to(wanted.q, got.q.ndim)
            assert got.scale.sharding.is_equivalent_to(wanted.scale, got.scale.ndim)


@pytest.mark.parametrize("kind", ["int8", "int4"])  # int4's own tests: tests/test_int4_weights.py
def test_the_combinations_that_write_into_served_weights_are_refused_by_name(kind):
    with pytest.raises(ValueError, match="EngineConfig.weight_dtype must be None"):
        EngineConfig(weight_dtype="int2")
    assert weight_dtype_conflict(None, RLConfig(transfer_mode="delta"), lora_rank=8) is None
    assert weight_dtype_conflict(kind, RLConfig(), lora_rank=0) is None
    assert "LoRAConfig.rank" in weight_dtype_conflict(kind, RLConfig(), 8)
    assert "transfer_mode = 'delta'" in weight_dtype_conflict(kind, RLConfig(transfer_mode="delta"), 0)
    from tests.test_config_system import _load

    assert _load(f'EngineConfig.weight_dtype = "{kind}"').engine.weight_dtype == kind
    with pytest.raises(ConfigError, match=f"weight_dtype = '{kind}' with RLConfig.transfer_mode = 'delta'"):
        _load(f'EngineConfig.weight_dtype = "{kind}"', 'RLConfig.transfer_mode = "delta"')
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=4))
    with pytest.raises(ValueError, match="DeltaSync writes changed elements"):
        DeltaSync(WeightSync.for_model(DENSE, meshes, jnp.bfloat16, weight_dtype=kind))
    # An engine handed quantized weights (evaluation on the run's served copy) serves them as they are.
    served = GenerationEngine((DENSE, quantize.quantize_params(_params(DENSE), kind)), EngineConfig(**BASE))
    assert served.config.weight_dtype == kind
    with pytest.raises(ValueError, match="do not match the served ones"):
        served.update_weights(jax.tree.map(lambda a: a.astype(jnp.float32), _params(DENSE)), version=1)


# Per weight_dtype: the served copy's share of bf16's bytes at the 235B's shapes, and the most of bf16's
# weight bytes the small model's decode program may take (its embedding and LM head stay bf16).
PLAN_SHARES = {"int8": ((0.5, 0.505), 0.75), "int4": ((0.25, 0.27), 0.45)}


@pytest.mark.parametrize("kind", sorted(PLAN_SHARES))
def test_the_plan_counts_the_quantized_generation_weight_bytes(kind):
    from tests.test_engine_programs import MESH_CONFIG, _mesh

    (low, high), decode_share = PLAN_SHARES[kind]
    mesh = _mesh(2, 2)
    # Qwen3-235B-A22B's shapes (configs/models/qwen3-235b-a22b.json), as ShapeDtypeStructs only.
    big = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                      num_kv_heads=4, head_dim=128, family="qwen3_moe", qk_norm=True,
                      moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536))
    bf16 = bytes_per_device(param_structs(big, mesh, jnp.bfloat16, split=True))
    served = bytes_per_device(param_structs(big, mesh, jnp.bfloat16, split=True, weight_dtype=kind))
    assert low < served / bf16 < high, served / bf16  # the embedding and LM head (bf16) and the scales: the rest
    specs = engine_program_specs(DENSE, MESH_CONFIG, mesh=mesh, param_dtype=jnp.bfloat16)
    q_specs = engine_program_specs(DENSE, EngineConfig(**{**vars(MESH_CONFIG), "weight_dtype": kind}), mesh=mesh,
                                   param_dtype=jnp.bfloat16)
    decode, q_decode = (next(s for s in ss if s.name.startswith("generation/decode")) for ss in (specs, q_specs))
    assert bytes_per_device(q_decode.args[0]) < decode_share * bytes_per_device(decode.args[0])
    q_decode.lower().compile()  # the engine's decode compiles on quantized weights


@pytest.mark.parametrize("kind, low, high", [("int8", 0.5, 0.52), ("int4", 0.25, 0.3)])
def test_the_simulator_costs_quantized_decode_reads_but_a_full_push(kind, low, high):
    from areal_jax.plan import estimate as est
    from areal_jax.plan.targets import parse_target
    from areal_jax.simulate.costs import RooflineCosts

    a3b = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                      num_kv_heads=4, head_dim=128, family="qwen3_moe", qk_norm=True,
                      moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768))
    pushed = 2 * a3b.num_params()
    served = quantize.served_bytes(a3b, 2, kind)
    assert quantize.served_bytes(a3b, 2, None) == pushed and low < served / pushed < high, served / pushed
    common = dict(model=a3b, target=parse_target("4x8xh100"), estimate_context=est.EstimateContext(model=a3b),
                  replicas=2, generation_tensor=2, slots_per_replica=48, train_devices=16, hosts=4,
                  generation_weight_bytes=pushed, kv_bytes_per_token=0.0, separate_proximal=False,
                  transfer_bytes_per_s=1e10)
    bf16, q = RooflineCosts(**common), RooflineCosts(**common, served_weight_fraction=served / pushed)
    assert q.weights_read(48) == pytest.approx(bf16.weights_read(48) * served / pushed)
    assert q.decode_step_s(1024) == pytest.approx(bf16.decode_step_s(1024) * served / pushed)  # bandwidth-bound
    # The training devices quantize each piece before it crosses: the push sends the served bytes.
    assert q.transfer_s == pytest.approx(bf16.transfer_s * served / pushed)
