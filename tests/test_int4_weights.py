"""EngineConfig.weight_dtype = "int4": int4 generation weights, one bf16 scale per 128 inputs.

The quantizer's round trip is within half a step per group and bit-equal to a NumPy quantizer;
a small model's logits under int4 weights stay near bf16's (looser than int8's: a step of amax / 7
per group); the engine's tokens and log-probs are the int4 weights' own and start near bf16's; a
push (WeightSync on 8 fake CPU devices) lands exactly the reference codes and scales with the
generation shardings, and a split that would cut a group is refused by name; jnp.int4 counts half
a byte, as XLA's compiled programs count it, and the 235B copy fits a v5p chip at tensor 2. The
refusals, the plan's count and the simulator's charge: tests/test_int8_weights.py, for both."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from areal_jax.aot import bytes_per_device, dtype_bits
from areal_jax.config_system import ConfigError
from areal_jax.generation import EngineConfig, GenerationEngine, engine_program_specs
from areal_jax.generation.programs import param_shardings as generation_shardings
from areal_jax.generation.programs import param_structs
from areal_jax.models import ModelConfig, init_params
from areal_jax.models import quantize
from areal_jax.models.config import MoEConfig
from areal_jax.models.sharding import TRAIN_RULES
from areal_jax.models.transformer import forward
from areal_jax.parallel import WeightSync
from areal_jax.parallel.delta_sync import DeltaSync
from areal_jax.trainer.config import RLConfig, weight_dtype_conflict
from areal_jax.trainer.train_step import param_shardings
from tests.test_int8_weights import BASE, PROMPTS, check_landed, push_setup
from tests.test_int8_weights import _generate as _generate_on

# Contracted dims of 256 (two groups of 128), 384 (three) and head_dim 64 (one group, under 128).
DENSE = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=64, qkv_bias=True, family="qwen2")
MOE = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256))
BIG = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                  num_kv_heads=4, head_dim=128, family="qwen3_moe", qk_norm=True,
                  moe=MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536))  # Qwen3-235B-A22B


def _codes(q) -> np.ndarray:
    return np.asarray(q).astype(np.int8)


def _bits(scale) -> np.ndarray:
    return np.asarray(scale).astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("shape,axes", [((256, 4, 8), (0,)), ((4, 256, 16), (0, 1)), ((4, 384, 16), (1,)),
                                        ((32, 4, 8), (0,))])
def test_round_trip_is_within_half_a_step_per_group_and_bit_equal_to_numpy(shape, axes):
    w = np.random.default_rng(0).normal(0, 0.05, size=shape).astype(np.float32)
    a = quantize.group_axis(axes)
    g = quantize.group_size(shape[a])
    assert g == min(128, shape[a])
    sel = [slice(None)] * len(shape)
    sel[a], sel[len(shape) - 1 if a != len(shape) - 1 else 0] = slice(0, g), 0
    w[tuple(sel)] = 0.0  # some all-zero groups: the first along the group axis, at index 0 of another axis
    qw = quantize.quantize(jnp.asarray(w), axes, "int4")
    assert qw.q.dtype == jnp.int4 and qw.scale.dtype == jnp.bfloat16 and qw.q.shape == shape
    assert qw.scale.shape == quantize.scale_shape(shape, axes, "int4")
    assert qw.scale.shape[a] == shape[a] // g and sum(s != n for s, n in zip(qw.scale.shape, shape)) == 1
    q, scale = quantize.quantize_reference(w, axes, "int4")
    np.testing.assert_array_equal(_codes(qw.q), _codes(q))
    np.testing.assert_array_equal(_bits(qw.scale), _bits(scale))
    codes = _codes(q)
    assert codes.min() >= -7 and codes.max() <= 7

    # Each nonzero group's absmax maps to the end code; an all-zero group has codes 0 and scale 1.
    def per_group(x):
        return np.abs(x.reshape(shape[:a] + (shape[a] // g, g) + shape[a + 1:])).max(axis=a + 1)

    zero = per_group(w) == 0
    assert zero.any() and not zero.all()
    np.testing.assert_array_equal(per_group(codes)[zero], 0)
    np.testing.assert_array_equal(np.asarray(scale, np.float32)[zero], 1.0)
    np.testing.assert_array_equal(per_group(codes)[~zero], 7)
    # Within half a step of its own group's scale: the dequantized weight against the input.
    step = np.repeat(np.asarray(qw.scale, np.float32), g, axis=a)
    err = np.abs(np.asarray(qw.astype(jnp.float32)) - w)
    assert np.all(err <= step / 2 * (1 + 1e-6)), float(np.max(err / step))
    assert float(np.max(err / step)) > 0.4  # and not vacuously: rounding errors reach near half a step


def test_group_size_refuses_a_dimension_the_groups_do_not_tile():
    assert quantize.group_size(1536) == 128 and quantize.group_size(96) == 96
    with pytest.raises(ValueError, match="multiple of INT4_GROUP = 128"):
        quantize.quantize(jnp.zeros((200, 8)), (0,), "int4")


def _params(cfg, std=0.05):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_params(cfg, 1, std=std))


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_int4_logits_stay_close_to_bf16(cfg):
    params = _params(cfg, std=0.02)
    q4, q8 = quantize.quantize_params(params, "int4"), quantize.quantize_params(params, "int8")
    assert quantize.weight_dtype_of(q4) == "int4" and quantize.weight_dtype_of(q8) == "int8"
    layer = q4["layers"]
    assert {k for k, v in layer.items() if isinstance(v, quantize.QuantizedWeight)} == set(layer) & set(
        quantize.QUANTIZED)
    assert all(v.q.dtype == jnp.int4 for v in layer.values() if isinstance(v, quantize.QuantizedWeight))
    assert not isinstance(q4["embed"], quantize.QuantizedWeight)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(4, 16)), jnp.int32)

    def logits(p):
        return np.asarray(forward(p, cfg, tokens, compute_dtype=jnp.float32)[0])

    full, l4, l8 = logits(params), logits(q4), logits(q8)
    spread = np.std(full)
    err4, err8 = np.abs(l4 - full), np.abs(l8 - full)
    # Stated tolerances for 4 bits on random weights (measured 2026-12-04: mean error 17% (dense) and
    # 19% (MoE) of the logits' spread, at most 0.87 and 0.94 of it, 83% and 75% of argmaxes kept):
    # mean under 30%, max under 1.5 spreads, 60% of argmaxes. Random weights are the hard case: no
    # outliers for the groups to isolate, every rounding error of the same size.
    assert np.mean(err4) < 0.3 * spread and np.max(err4) < 1.5 * spread, (np.mean(err4) / spread,
                                                                          np.max(err4) / spread)
    assert np.mean(np.argmax(l4, -1) == np.argmax(full, -1)) >= 0.6
    # The error scales with the step: int4's (amax / 7 per 128 inputs) is ~17x int8's (amax / 127 per
    # channel); measured 16x (dense) and 13x (MoE) the mean logit error.
    assert 8 < np.mean(err4) / np.mean(err8) < 30, np.mean(err4) / np.mean(err8)


def _generate(params, **config):
    return _generate_on(params, DENSE, **config)


def test_an_int4_engine_samples_the_int4_policy_and_starts_near_bf16():
    params = _params(DENSE, std=0.05)
    engine, q4 = _generate(params, weight_dtype="int4")
    _, full = _generate(params)
    served = engine.params["layers"]
    assert isinstance(served["wq"], quantize.QuantizedWeight) and served["wq"].q.dtype == jnp.int4
    q, scale = quantize.quantize_reference(np.asarray(params["layers"]["w_down"].astype(jnp.float32)), (1,), "int4")
    np.testing.assert_array_equal(_codes(served["w_down"].q), _codes(q))
    np.testing.assert_array_equal(_bits(served["w_down"].scale), _bits(scale))
    # The behaviour tokens and log-probs are the int4 weights' own: a full forward on the same int4
    # weights, teacher-forced on the engine's tokens, gives them back (bf16 compute both ways).
    q4params = quantize.quantize_params(params, "int4")
    agree = []
    for prompt, c in zip(PROMPTS, q4):
        seq = list(prompt) + list(c.tokens)
        logits = forward(q4params, DENSE, jnp.asarray([seq], jnp.int32), compute_dtype=jnp.bfloat16)[0][0]
        lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))[len(prompt) - 1:len(seq) - 1]
        np.testing.assert_allclose(c.logprobs, lp[np.arange(len(c.tokens)), c.tokens], atol=0.1)
        agree.append(np.mean(np.argmax(lp, -1) == np.asarray(c.tokens)))
    assert np.mean(agree) >= 0.9, agree
    # Against bf16 (random weights: a greedy path that flips once diverges for the rest of the
    # sample, so only the first token is compared): the first tokens mostly equal, their log-probs
    # within 0.5 (measured 0.30 at most on 2026-12-04).
    first_tokens = np.array([c.tokens[0] for c in q4]), np.array([c.tokens[0] for c in full])
    assert np.mean(first_tokens[0] == first_tokens[1]) >= 0.5, first_tokens
    first = np.array([c.logprobs[0] for c in q4]), np.array([c.logprobs[0] for c in full])
    np.testing.assert_allclose(*first, atol=0.5)
    new = _params(DENSE, std=0.06)
    assert engine.update_weights(new, version=1) is not None
    engine.run_until_idle()
    assert engine.update_weights(quantize.quantize_params(new, "int4"), version=2) is not None
    engine.run_until_idle()
    assert engine.version == 2
    with pytest.raises(ValueError, match="do not match the served ones"):  # int8 codes into an int4 engine
        engine.update_weights(quantize.quantize_params(new, "int8"), version=3)
    # An engine handed int4 weights (evaluation on the run's served copy) serves them as int4.
    evaluation = GenerationEngine((DENSE, q4params), EngineConfig(**BASE))
    assert evaluation.config.weight_dtype == "int4"


def test_a_push_lands_the_reference_codes_and_scales_with_the_generation_shardings():
    model = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=64, qkv_bias=True, family="qwen2")
    meshes, sync, shardings, gen_shardings = push_setup(model, "int4", group_bytes=64 << 10)
    # w_down's 256 inputs are split over tensor=2: one whole group per shard, so its scales split too.
    assert gen_shardings["layers"][0]["w_down"].scale.spec[0] == "tensor"
    for push in range(2):
        host = init_params(model, push, std=0.1 + 0.05 * push)
        out = sync.transfer(jax.device_put(host, shardings))
        check_landed(model, host, out, gen_shardings, "int4", f"push {push}")
        assert {d for x in jax.tree.leaves(out) for d in x.devices()} <= set(meshes.generation.devices.flat)
    engine = GenerationEngine((model, out), EngineConfig(**BASE, weight_dtype="int4"))  # served as pushed
    assert engine.params["layers"]["w_up"].q.dtype == jnp.int4
    # 384 inputs are 3 groups: split over tensor=2 a shard would hold half a group (its dequantize would
    # gather the weight), so such a split is refused by name.
    odd = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=384, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=64, qkv_bias=True, family="qwen2")
    with pytest.raises(ValueError, match="leave part of a group on a shard"):
        WeightSync.for_model(odd, meshes, jnp.bfloat16, weight_dtype="int4").transfer(
            jax.device_put(init_params(odd, 0), param_shardings(odd, TRAIN_RULES, meshes.train)))
    with pytest.raises(ValueError, match="leave part of a group on a shard"):
        generation_shardings(odd, meshes.generation, split=True, weight_dtype="int4")


def test_int4_counts_half_a_byte_and_the_235b_copy_fits_a_v5p_chip():
    from tests.test_engine_programs import _mesh

    # jnp.int4 counts half a byte, as XLA's compiled programs do (packed two codes a byte).
    assert dtype_bits(jnp.int4) == 4 and dtype_bits(jnp.bfloat16) == 16
    struct = jax.ShapeDtypeStruct((1024, 512), jnp.int4)
    compiled = jax.jit(lambda c: c.astype(jnp.int8)).lower(struct).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == bytes_per_device(struct) == 1024 * 256
    mesh = _mesh(1, 2)
    bf16 = bytes_per_device(param_structs(BIG, mesh, jnp.bfloat16, split=True))
    int4 = bytes_per_device(param_structs(BIG, mesh, jnp.bfloat16, split=True, weight_dtype="int4"))
    # Codes are 0.25 of bf16, the bf16 scales 1/128 of that again, the embedding and LM head the rest.
    assert 0.25 < int4 / bf16 < 0.27, int4 / bf16
    assert int4 == pytest.approx(quantize.served_bytes(BIG, 2, "int4") / 2, rel=0.01)  # over tensor 2
    assert int4 < 0.61 * 95 * 2**30  # 57.4 GiB: one replica's copy per v5p chip of 95 at tensor 2
    pushed = 2 * BIG.num_params()  # the simulator's decode reads (served_weight_fraction) against the bf16 push
    assert 0.26 < quantize.served_bytes(BIG, 2, "int4") / pushed < 0.265


def test_the_shipped_v5p_config_fits_by_the_planners_estimate(tmp_path):
    # configs/qwen3_235b_a22b_math_tpu.gin: every bounding program within 90% of a v5p chip by the
    # hand estimate (the compiled plan needs libtpu: docs/scale.md, where train/grad compiled 16 GiB
    # above its estimate); its evaluation engine serves the run's int4 copy, so the eval programs
    # read int4 weights too (bf16 ones would be 2.4 chips).
    import pathlib

    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.plan.config import PlanConfig
    from areal_jax.plan.fit import estimate_fit
    from areal_jax.plan.targets import parse_target

    gin = pathlib.Path(__file__).resolve().parents[1] / "configs" / "qwen3_235b_a22b_math_tpu.gin"
    job = load_job_configs([gin], run_dir=str(tmp_path))
    plan_cfg = cs.build(PlanConfig)
    target = parse_target(plan_cfg.target)
    assert target.name == "2xv5p-256" and job.mesh.num_slices == 2 and job.engine.weight_dtype == "int4"
    fit = estimate_fit(job, plan_cfg, target, gin_files=[str(gin)])
    assert fit.fits, fit
    assert fit.generation_fraction < 0.8, fit  # the eval programs included
