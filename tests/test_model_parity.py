"""Logits parity of areal_jax's decoder with transformers (fp32) on tiny random checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import load_pretrained, read_config, save_pretrained
from areal_jax.models import sharding as shd
from tests.model_fixtures import FAMILY_CONFIGS, TINY, models_with_logits

RNG = np.random.default_rng(0)
SEQS = [RNG.integers(0, TINY["vocab_size"], size=n).tolist() for n in (13, 5, 1, 9, 20)]

# Other configurations of the families, as config files in the wild may say.
VARIANT_CONFIGS = {
    "llama_mha_biases": ("llama", dict(TINY, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                                       tie_word_embeddings=True, rope_theta=10000.0)),
    "llama_linear_rope_head16": ("llama", dict(TINY, num_key_value_heads=1, head_dim=16, rope_scaling=dict(
        rope_type="linear", factor=2.0))),
    "qwen2_untied_mqa": ("qwen2", dict(TINY, num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen3_tied_bias": ("qwen3", dict(TINY, head_dim=8, num_attention_heads=8, attention_bias=True,
                                      tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    """name -> (directory, reference logits per sequence of SEQS)."""
    return models_with_logits(reference, tmp_path_factory.mktemp("hf"), {**FAMILY_CONFIGS, **VARIANT_CONFIGS}, SEQS)


def _tol(ref_logits) -> float:
    """Absolute tolerance for fp32 logits from two different programs: 1e-4 times the logit scale
    (about 800 fp32 ulps of it). Two implementations, or two processes of torch's threaded CPU
    kernels (whose reduction order is not fixed), agree to rounding, not bitwise."""
    scale = max(float(np.abs(r).max()) for r in ref_logits)
    return 1e-4 * max(scale, 1.0)


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS) + list(VARIANT_CONFIGS))
def test_unpadded_logits_match_transformers(checkpoints, name):
    path, refs = checkpoints[name]
    assert_each_sequence_matches(load_pretrained(path), refs)


def assert_each_sequence_matches(model, refs, seqs=SEQS):
    """The model's logits of each sequence alone (unpadded) against the reference's."""
    for seq, ref in zip(seqs, refs):
        out = np.asarray(model(jnp.asarray([seq])))[0]
        np.testing.assert_allclose(out, ref, atol=_tol(refs), rtol=0)


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_left_padded_batch_matches_per_sequence_reference(checkpoints, name):
    path, refs = checkpoints[name]
    model = load_pretrained(path)
    T = max(map(len, SEQS))
    ids = np.zeros((len(SEQS), T), np.int32)
    seg = np.zeros((len(SEQS), T), np.int32)
    for b, s in enumerate(SEQS):
        ids[b, T - len(s):] = s
        seg[b, T - len(s):] = 1
    out = np.asarray(model(ids, segment_ids=seg))
    assert np.isfinite(out).all()
    for b, (s, ref) in enumerate(zip(SEQS, refs)):
        np.testing.assert_allclose(out[b, T - len(s):], ref, atol=_tol(refs), rtol=0)


def packed_rows(seqs, rows=((0, 1, 2), (3, 4)), T=32):
    """Rows packing several of `seqs` (indices per row; row 1 also ends in padding) -> input ids,
    segment ids, positions `[R, T]` and each sequence's (row, start, length)."""
    ids, seg, pos = (np.zeros((len(rows), T), np.int32) for _ in range(3))
    spans = {}
    for r, members in enumerate(rows):
        start = 0
        for k, i in enumerate(members):
            n = len(seqs[i])
            ids[r, start:start + n] = seqs[i]
            seg[r, start:start + n] = k + 1
            pos[r, start:start + n] = np.arange(n)
            spans[i] = (r, start, n)
            start += n
    return ids, seg, pos, spans


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_packed_rows_match_per_sequence_reference(checkpoints, name):
    path, refs = checkpoints[name]
    model = load_pretrained(path)
    ids, seg, pos, spans = packed_rows(SEQS)
    out_default = np.asarray(model(ids, segment_ids=seg))
    out_explicit = np.asarray(model(ids, positions=pos, segment_ids=seg))
    np.testing.assert_array_equal(out_default, out_explicit)  # positions default to within-segment
    for i, (r, start, n) in spans.items():
        np.testing.assert_allclose(out_default[r, start:start + n], refs[i], atol=_tol(refs), rtol=0)


def assert_round_trip(path, refs, reference, out_dir, seqs=SEQS):
    """Saves the checkpoint at `path` through our writer (sharded), checks transformers' logits of
    the copy against `refs` and that it loads back bit for bit."""
    model = load_pretrained(path)
    save_pretrained(model, out_dir, max_shard_bytes=20_000)  # force a sharded checkpoint + index
    assert (out_dir / "model.safetensors.index.json").exists()
    reference.run("logits", model=str(out_dir), sequences=seqs, out=str(out_dir / "ref.npz"))
    again = np.load(out_dir / "ref.npz")
    for i in range(len(seqs)):
        # Two transformers processes: torch's CPU reductions may differ in the last bits between runs.
        np.testing.assert_allclose(again[f"logits_{i}"], refs[i], atol=_tol(refs), rtol=0)
    reloaded = load_pretrained(out_dir)
    assert read_config(out_dir) == model.config
    for a, b in zip(jax.tree.leaves(reloaded.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_round_trip_save_load_transformers(checkpoints, reference, tmp_path):
    for name in FAMILY_CONFIGS:
        path, refs = checkpoints[name]
        assert_round_trip(path, refs, reference, tmp_path / name)


@pytest.mark.parametrize("mesh_axes,rules", [
    (("data", "tensor"), shd.GENERATION_RULES),
    (("fsdp", "tensor"), shd.TRAIN_RULES),
])
def test_mesh_loading_gives_same_logits(checkpoints, mesh_axes, rules):
    path, refs = checkpoints["qwen3"]
    single = load_pretrained(path)
    mesh = jax.make_mesh((2, 2), mesh_axes, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    sharded = load_pretrained(path, mesh=mesh)
    wq = sharded.params["layers"]["wq"]
    assert len(wq.sharding.device_set) == 4 and not wq.sharding.is_fully_replicated
    assert wq.addressable_shards[0].data.shape[2] == single.config.num_heads // 2  # q heads split over tensor
    ids = np.asarray([SEQS[0][:8], SEQS[3][:8]], np.int32)
    with shd.activation_rules(rules, mesh):
        out = jax.jit(lambda m, x: m(x))(sharded, ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(single(ids)), atol=1e-5, rtol=0)


def test_bfloat16_loading_casts_weights(checkpoints):
    path, _ = checkpoints["qwen2"]
    m32 = load_pretrained(path)
    m16 = load_pretrained(path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(m32.params), jax.tree.leaves(m16.params)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_every_sharded_slice_reads_what_the_full_tensor_holds(tmp_path):
    """Each device reads only its slice straight from the file (here in bfloat16, with layers, heads
    and head_dim all split): the pieces must equal the full tensors."""
    from areal_jax.models import ModelConfig, init_params, load_params, save_params

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, family="qwen2", qkv_bias=True)
    params = init_params(cfg, 0, dtype=jnp.bfloat16, std=0.5)
    save_params(params, cfg, tmp_path)
    mesh = jax.make_mesh((2, 2, 2), ("fsdp", "tensor", "extra"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:8])
    rules = dict(shd.TRAIN_RULES, layers="extra", embed=None, head_dim="fsdp", norm="tensor")
    loaded_cfg, loaded = load_params(tmp_path, dtype=jnp.bfloat16, mesh=mesh, rules=rules)
    assert loaded_cfg == cfg
    assert loaded["layers"]["wq"].sharding.spec == jax.sharding.PartitionSpec("extra", None, "tensor", "fsdp")
    assert loaded["layers"]["wo"].sharding.spec == jax.sharding.PartitionSpec("extra", "tensor", "fsdp")
    assert loaded["layers"]["bq"].sharding.spec == jax.sharding.PartitionSpec("extra", "tensor", "fsdp")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- bad input --------------------------------------------------------------------------------


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_files_are_named(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_pretrained(tmp_path / "nope")
    d = _copy(path, tmp_path / "no_config")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_pretrained(d)
    d = _copy(path, tmp_path / "no_weights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(d)


def test_unsupported_architecture_is_named(checkpoints, tmp_path):
    d = _copy(checkpoints["qwen2"][0], tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        load_pretrained(d)


def test_wrong_tensor_shape_and_missing_tensor_are_named(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = checkpoints["llama3"][0]
    tensors = load_file(src / "model.safetensors")
    d = _copy(src, tmp_path / "shape")
    bad = dict(tensors)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((7, 32), np.float32)
    save_file(bad, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(7, 32\)"):
        load_pretrained(d)
    missing = dict(tensors)
    del missing["model.layers.0.self_attn.k_proj.weight"]
    save_file(missing, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_pretrained(d)


def test_unusable_dtypes_are_named(checkpoints, tmp_path):
    path, _ = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="int32"):
        load_pretrained(path, dtype=jnp.int32)
    # A checkpoint tensor stored as int8 (e.g. a quantized export) cannot be used as is.
    from safetensors.numpy import load_file, save_file

    d = _copy(path, tmp_path / "int8")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(tensors["model.norm.weight"].shape, np.int8)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*I8"):
        load_pretrained(d)
    # A file that is not safetensors at all is named.
    (d / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_pretrained(d)


def test_config_rejects_what_its_family_cannot_express():
    from areal_jax.models import ModelConfig

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4)
    with pytest.raises(ValueError, match="qwen2"):
        ModelConfig(**base, family="qwen2", qkv_bias=False)
    with pytest.raises(ValueError, match="llama"):
        ModelConfig(**base, family="llama", qk_norm=True)
    with pytest.raises(ValueError, match="qwen3"):
        ModelConfig(**base, family="qwen3", qk_norm=False)
    ModelConfig(**base, family="qwen3", qk_norm=True, qkv_bias=True, o_bias=True)
