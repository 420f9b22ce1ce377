"""The engine's programs: chunked prefill against the dense one, ahead-of-time specs on a mesh, sizes
that fit the mesh, and the weight copies a swap holds."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams, engine_program_specs
from areal_jax.generation.programs import EnginePrograms, param_shardings, placed_like
from areal_jax.models import KVCache, ModelConfig, forward, init_params
from areal_jax.models.decoding import prefill_block
from areal_jax.models.transformer import lm_head, split_layers

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")


def _mesh(data: int, tensor: int, first: int = 0):
    devices = jax.devices()[first:first + data * tensor]
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=devices)


def _dense_prefill(params, tokens, lengths):
    """The engine's prefill before chunking: the cached forward over the whole row at once."""
    R, P = tokens.shape
    idx = np.arange(P)[None, :]
    positions = np.where(idx < lengths[:, None], idx, -1)
    hidden, block = forward(params, CFG, jnp.asarray(tokens), jnp.asarray(positions),
                            cache=KVCache.zeros(CFG, R, P).per_layer(), return_hidden=True)
    last = jnp.take_along_axis(hidden, jnp.asarray(lengths - 1)[:, None, None], axis=1)
    return block, lm_head(params, CFG, last)[:, 0]


@pytest.mark.parametrize(("P", "chunk"), [(120, 32), (128, 16), (40, 64)])
def test_chunked_prefill_equals_the_dense_prefill(P, chunk):
    """Rows of different lengths in chunks (a scan of full chunks, then a shorter one when the
    chunk does not divide P; one chunk when it holds P): the same KV block, zeros past each row's
    length, and the same last-token logits as the dense cached forward."""
    params = split_layers(init_params(CFG, 1, std=0.3))
    rng = np.random.default_rng(P)
    lengths = np.array([P - 3, P // 2 + 1, 5, 1], np.int32)
    tokens = rng.integers(0, CFG.vocab_size, size=(4, P)).astype(np.int32)
    tokens[np.arange(P)[None, :] >= lengths[:, None]] = 0

    @jax.jit
    def chunked(tokens, lengths):
        block, last = prefill_block(params, CFG, tokens, lengths, chunk=chunk, cache_dtype=jnp.float32)
        return block, lm_head(params, CFG, last[:, None])[:, 0]

    got_block, got_logits = chunked(tokens, lengths)
    want_block, want_logits = jax.jit(lambda t: _dense_prefill(params, t, lengths))(tokens)
    for got, want in zip(got_block.k + got_block.v, want_block.k + want_block.v, strict=True):
        assert got.shape == (4, CFG.num_kv_heads, P, CFG.head_dim)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        for r, n in enumerate(lengths):
            assert not np.any(np.asarray(got)[r, :, n:])
    np.testing.assert_allclose(got_logits, want_logits, atol=5e-5, rtol=1e-5)


def test_long_prefill_holds_no_dense_scores():
    """A 4096-token prefill: the dense form's fp32 scores alone are [K, G*P, P] = 256 MiB; the
    chunked program's temporaries stay a small fraction of that."""
    params = split_layers(init_params(CFG, 0))
    P = 4096
    fn = jax.jit(lambda t, n: prefill_block(params, CFG, t, n, chunk=256, cache_dtype=jnp.float32))
    compiled = fn.lower(jax.ShapeDtypeStruct((1, P), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
    dense_scores = CFG.num_heads * P * P * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < dense_scores / 16, (temp, dense_scores)


# ---- sizes that fit the mesh --------------------------------------------------------------------------


def test_row_counts_are_multiples_of_the_data_size():
    ec = EngineConfig(num_slots=96, max_seq_len=2048, max_prefill_batch=32, max_prefill_tokens=4096,
                      reprefill_pack_width=256)
    for data in (1, 2, 3):
        for P in ec.prefill_buckets:
            most = ec.max_prefill_prompts(P, data)
            per_replica = max(1, min(-(-32 // data), 4096 // P))
            assert most == data * per_replica
            counts = ec.prefill_row_counts(P, data)
            assert all(R % data == 0 and R * P <= data * max(4096, P) for R in counts)
            for n in range(1, most + 1):  # every call has a row per prompt, and a replica's share
                R = ec.prefill_rows(n, P, data)
                assert R in counts and R >= n and R // data in (1, 4, 16, per_replica)
        assert all(R % data == 0 for R in ec.pack_row_counts(data))
        assert ec.pack_rows(1, data) == data
    # One device: powers of four up to max_prefill_batch for short prompts, fewer rows for long ones.
    assert ec.prefill_row_counts(16) == (1, 4, 16, 32)
    assert ec.prefill_row_counts(1024) == (1, 4)
    assert ec.prefill_row_counts(2048) == (1, 2)
    assert ec.prefill_row_counts(16, 3) == (3, 12, 33)  # 11 rows per replica at most
    assert ec.pack_row_counts(3) == (3, 6, 12, 24, 33)
    assert ec.long_history_buckets() == (512, 1024, 2048)
    with pytest.raises(ValueError, match="prompts"):
        ec.prefill_rows(13, 1024, 3)


def test_slots_and_kv_heads_must_fit_the_mesh():
    params = init_params(CFG, 0)
    for mesh, config, match in ((_mesh(2, 1), EngineConfig(num_slots=3, max_seq_len=32), "EngineConfig.num_slots"),
                                (_mesh(1, 4), EngineConfig(num_slots=4, max_seq_len=32),
                                 "MeshConfig.generation_tensor = 4")):
        with pytest.raises(ValueError, match=match):
            engine_program_specs(CFG, config, mesh=mesh, param_dtype=jnp.float32)
        placed = placed_like(params, param_shardings(CFG, mesh, split=False))
        with pytest.raises(ValueError, match=match):
            GenerationEngine((CFG, placed), config)


# ---- specs: every program, lowered and compiled ---------------------------------------------------------

MESH_CONFIG = EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=4, max_prefill_batch=8, reprefill_pack_width=16,
                           decode_windows=(16, 32), prefill_chunk=16)


def test_specs_cover_every_shape_and_compile_on_a_data_tensor_mesh():
    mesh = _mesh(2, 2)
    ec = MESH_CONFIG
    specs = engine_program_specs(CFG, ec, mesh=mesh, param_dtype=jnp.float32)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    want = set()
    for P in ec.prefill_buckets:  # 16, 32, 64
        for R in ec.prefill_row_counts(P, 2):
            want |= {f"generation/prefill_start[rows={R},len={P}]", f"generation/insert[rows={R},len={P}]",
                     f"generation/first_tokens[rows={R}]"}
    assert ec.prefill_row_counts(16, 2) == (2, 4)  # 1 or 2 rows per replica: at most 4 prompts (slots)
    for P in ec.long_history_buckets():  # histories of 17..62 tokens
        for R in ec.prefill_row_counts(P, 2):
            want |= {f"generation/prefill[rows={R},len={P}]", f"generation/insert[rows={R},len={P}]"}
    assert ec.long_history_buckets() == (32, 64)
    want |= {f"generation/reprefill_packed[rows={R}]" for R in ec.pack_row_counts(2)}
    assert ec.pack_row_counts(2) == (2, 4)
    want |= {f"generation/decode[window={W}]" for W in (16, 32, 64)}
    want.add("generation/split_weights")
    assert set(names) == want
    for spec in specs:
        assert spec.role == "generation" and spec.fields and all(f.split(".")[0] in ("EngineConfig", "MeshConfig")
                                                                    for f in spec.fields)
        assert len(spec.resident) >= 1  # at least the incoming weight copy a transfer may land
        compiled = spec.lower().compile()
        assert compiled.memory_analysis() is not None, spec.name
    decode = next(s for s in specs if s.name == "generation/decode[window=64]")
    cache = decode.args[1]
    assert cache.k[0].shape == (4, 2, 64, 8) and cache.k[0].sharding.spec[:2] == ("data", "tensor")
    assert isinstance(decode.args[0]["layers"], tuple)  # per-layer weights, as the engine holds them
    evals = engine_program_specs(CFG, ec, mesh=mesh, param_dtype=jnp.float32, role="eval")
    assert {s.name.replace("eval/", "generation/") for s in evals} == want
    assert all(s.role == "eval" for s in evals)
    resident = lambda specs: next(s for s in specs if "decode" in s.name).resident  # noqa: E731
    assert len(resident(specs)) == len(resident(evals)) + 1  # the incoming weights, in the run only


def run_with_swap(config: EngineConfig, placement, prompts, *, group: int, max_new_tokens: int):
    """The engine on `placement(weights)`, request `group` of `prompts` a group of four: two rounds,
    then version 1 pushed, then to the end. Returns it and each request's [(tokens, logprobs,
    versions)]."""
    old, new = init_params(CFG, 2, std=0.3), init_params(CFG, 3, std=0.3)
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    engine = GenerationEngine((CFG, placement(old)), config)
    handles = [engine.submit(p, sp, n=1 + (i == group) * 3, seed=i) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    engine.update_weights(placement(new), version=1)
    engine.run_until_idle()
    return engine, [[(c.tokens, c.logprobs, c.versions) for c in h.result().completions] for h in handles]


def mesh_run_matching_one_device(sharded_config: EngineConfig, single_config: EngineConfig, prompts):
    """`run_with_swap` (request 0 a group of four, 12 new tokens) of `sharded_config` on a (data=2,
    tensor=2) mesh and of `single_config` on one device, asserting the same tokens, log-probs and
    versions. Returns the sharded engine and the mesh."""
    mesh = _mesh(2, 2)
    sharded, got = run_with_swap(sharded_config, lambda p: placed_like(p, param_shardings(CFG, mesh, split=False)),
                                 prompts, group=0, max_new_tokens=12)
    _, want = run_with_swap(single_config, lambda p: p, prompts, group=0, max_new_tokens=12)
    for g, w in zip(got, want, strict=True):
        for (t1, l1, v1), (t2, l2, v2) in zip(g, w, strict=True):
            np.testing.assert_array_equal(t1, t2)
            np.testing.assert_allclose(l1, l2, atol=2e-5)
            np.testing.assert_array_equal(v1, v2)
    return sharded, mesh


def test_engine_on_a_mesh_runs_only_specced_programs_and_matches_one_device():
    """Admission, a group larger than the free slots, and a swap that re-prefills packed and long
    histories, on (data=2, tensor=2): every program the engine compiles has a spec, and the
    samples equal a single-device engine's."""
    mesh = _mesh(2, 2)
    prompts = [[1 + i] * n for i, n in enumerate([3, 9, 20, 5])]

    def run(placement):
        return run_with_swap(MESH_CONFIG, placement, prompts, group=1, max_new_tokens=24)

    sharded, got = run(lambda p: placed_like(p, param_shardings(CFG, mesh, split=False)))
    _, want = run(lambda p: p)
    spec_names = {s.name.removeprefix("generation/") for s in
                  engine_program_specs(CFG, MESH_CONFIG, mesh=mesh, param_dtype=jnp.float32)}
    traced = set(sharded._programs.traced)
    assert traced <= spec_names, traced - spec_names
    assert any(n.startswith("prefill[") for n in traced) and any(n.startswith("reprefill_packed") for n in traced)
    assert sharded._cache.k[0].sharding.spec[:2] == ("data", "tensor")
    for g, w in zip(got, want, strict=True):
        for (t1, l1, v1), (t2, l2, v2) in zip(g, w, strict=True):
            np.testing.assert_array_equal(t1, t2)
            np.testing.assert_allclose(l1, l2, atol=1e-5)
            np.testing.assert_array_equal(v1, v2)
            assert 1 in v1  # sampled partly under the new weights


# ---- weight copies during a swap ------------------------------------------------------------------------


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_a_swap_holds_the_old_weights_and_the_incoming_ones_never_more(layout):
    """Live array bytes at every program call of a swap (and at the split's output) stay within
    the cache + old + incoming weights; split weights are installed as they are."""
    big = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, family="llama")
    device = jax.devices()[0]
    make = lambda seed: jax.device_put(init_params(big, seed, std=0.3), device)  # noqa: E731
    engine = GenerationEngine((big, make(0)), EngineConfig(num_slots=2, max_seq_len=32, decode_chunk=4))
    weights = sum(a.nbytes for a in jax.tree.leaves(engine._params))
    cache = sum(a.nbytes for a in jax.tree.leaves(engine._cache))
    assert weights > 20 * cache
    handle = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=12, temperature=1.0))
    engine.step()
    base = _live_bytes()  # cache + one weight copy (+ a few small arrays)

    peaks = []

    def recorded(fn):
        def run(*args, **kwargs):
            peaks.append(_live_bytes())
            out = fn(*args, **kwargs)
            peaks.append(_live_bytes())
            return out
        return run

    engine._programs = EnginePrograms(**{
        f: (getattr(engine._programs, f) if f in ("counts", "traced") else recorded(getattr(engine._programs, f)))
        for f in EnginePrograms.__dataclass_fields__})
    incoming = make(1) if layout == "stacked" else jax.device_put(split_layers(make(1)), device)
    leaf = incoming["layers"][0]["wq"] if layout == "split" else None
    engine.update_weights(incoming, version=1)
    del incoming
    assert _live_bytes() <= base + weights + weights // 20  # old + incoming
    engine.step()  # the swap (and one chunk)
    assert peaks and max(peaks) <= base + weights + weights // 20, (max(peaks) - base, weights)
    assert _live_bytes() <= base + weights // 20  # back to one copy
    if leaf is not None:
        assert engine._params["layers"][0]["wq"] is leaf  # installed without a copy
    engine.run_until_idle()
    assert list(handle.result().completions[0].versions).count(1) > 0


def test_max_prompt_len_bounds_admission_programs_and_prompts():
    ec = EngineConfig(num_slots=2, max_seq_len=64, max_prompt_len=20, reprefill_pack_width=16, decode_windows=(64,))
    assert ec.admission_buckets() == (16, 32) and ec.long_history_buckets() == (32, 64)
    names = {s.name for s in engine_program_specs(CFG, ec, mesh=_mesh(1, 1), param_dtype=jnp.float32)}
    assert {n for n in names if n.startswith("generation/prefill_start")} == {
        f"generation/prefill_start[rows={R},len={P}]" for P in (16, 32) for R in (1, 2)}  # rows <= slots
    assert "generation/prefill[rows=1,len=64]" in names  # a long history after a swap
    engine = GenerationEngine((CFG, init_params(CFG, 0)), ec)
    with pytest.raises(ValueError, match="EngineConfig.max_prompt_len = 20"):
        engine.submit([1] * 21, SamplingParams(max_new_tokens=2))
    engine.submit([1] * 20, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_prompt_len"):
        EngineConfig(max_seq_len=64, max_prompt_len=64)


def test_weights_of_another_shape_or_dtype_are_refused_by_update_weights():
    engine = GenerationEngine((CFG, init_params(CFG, 0)), EngineConfig(num_slots=2, max_seq_len=32))
    with pytest.raises(ValueError, match=r"params\['embed'\] is bfloat16\[64, 32\] instead of float32\[64, 32\]"):
        engine.update_weights(init_params(CFG, 1, dtype=jnp.bfloat16), version=1)
    other = ModelConfig(**{**CFG.__dict__, "intermediate_size": 48})
    wrong = r"params\['layers'\]\[0\]\['w_down'\] is float32\[48, 32\] instead of float32\[64, 32\]"
    with pytest.raises(ValueError, match=wrong):
        engine.update_weights(split_layers(init_params(other, 1)), version=1)
    assert engine.update_weights(split_layers(init_params(CFG, 1)), version=1) is not None
