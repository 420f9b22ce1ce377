"""Generation engine: exactness against the training forward, swaps, batching, sampling rules."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams, allowed_mask, generate, sample_tokens
from areal_jax.models import ModelConfig, Transformer, init_params, load_pretrained
from areal_jax.ppo import token_logprobs
from tests.model_fixtures import FAMILY_CONFIGS, make_models

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, family="qwen2")


def _model(seed: int) -> Transformer:
    return Transformer(CFG, init_params(CFG, jax.random.key(seed), std=0.3))


def _teacher_forced(model: Transformer, prompt, tokens, temperature: float) -> np.ndarray:
    """log p(token_i | prompt, tokens_<i) from one full forward pass, as the trainer computes it."""
    seq = jnp.asarray([list(prompt) + list(tokens)])
    logits = model(seq)[:, len(prompt) - 1:-1]
    return np.asarray(token_logprobs(logits, jnp.asarray([tokens]), temperature=temperature))[0]


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [4]]


def test_greedy_equals_argmax_of_full_reforward():
    model = _model(0)
    out = generate(model, PROMPTS, max_new_tokens=10, temperature=0.0, decode_chunk=3)
    for prompt, (c,) in zip(PROMPTS, out):
        assert c.stop_reason == "length" and len(c.tokens) == 10
        seq = list(prompt)
        for tok in c.tokens:
            assert int(jnp.argmax(model(jnp.asarray([seq]))[0, -1])) == tok
            seq.append(int(tok))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_logprobs(temperature):
    model = _model(1)
    out = generate(model, PROMPTS, max_new_tokens=12, temperature=temperature, n=3, seed=3)
    for prompt, group in zip(PROMPTS, out):
        assert len(group) == 3
        for c in group:
            np.testing.assert_allclose(c.logprobs, _teacher_forced(model, prompt, c.tokens, temperature), atol=1e-4)
            assert (c.versions == 0).all()
        assert len({tuple(c.tokens) for c in group}) > 1  # samples of one group differ


def test_group_shares_one_prefill():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=4, max_seq_len=32, decode_chunk=4))
    handle = engine.submit([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=6), n=4)
    engine.run_until_idle()
    assert len(handle.result().completions) == 4
    assert engine.stats().prefill_tokens == 5


def test_group_larger_than_free_slots_reuses_its_prefill_for_later_samples():
    """A group of 5 on 2 slots: its prompt is prefilled once; samples started later come from the
    kept prefill, each exactly the policy's distribution and each its own sample."""
    model = _model(6)
    engine = GenerationEngine(model, EngineConfig(num_slots=2, max_seq_len=32, decode_chunk=4))
    prompt = [3, 1, 4, 1, 5, 9]
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=6, temperature=1.0), n=5, seed=11)
    other = engine.submit([2, 7], SamplingParams(max_new_tokens=3, temperature=1.0))
    engine.run_until_idle()
    completions = handle.result().completions
    assert len(completions) == 5 and len(other.result().completions) == 1
    assert engine.stats().prefill_tokens == len(prompt) + 2  # one prefill per request
    for c in completions:
        np.testing.assert_allclose(c.logprobs, _teacher_forced(model, prompt, c.tokens, 1.0), atol=1e-4)
    assert len({tuple(c.tokens) for c in completions}) > 1


def test_interruptible_swap_recomputes_cache_and_switches_versions():
    old, new = _model(2), _model(3)
    engine = GenerationEngine(old, EngineConfig(num_slots=2, max_seq_len=48, decode_chunk=4))
    sp = SamplingParams(max_new_tokens=20, temperature=1.0)
    handles = [engine.submit(p, sp) for p in PROMPTS[:2]]
    engine.step()  # first token from prefill + 4 decode steps
    engine.step()
    applied = engine.update_weights(new.params, version=7)
    engine.run_until_idle()
    assert applied.result() is True and engine.version == 7
    for prompt, h in zip(PROMPTS, handles):
        (c,) = h.result().completions
        assert len(c.tokens) == 20
        np.testing.assert_array_equal(c.versions, [0] * 9 + [7] * 11)  # switch exactly at the swap
        under_old = _teacher_forced(old, prompt, c.tokens, 1.0)
        under_new = _teacher_forced(new, prompt, c.tokens, 1.0)
        np.testing.assert_allclose(c.logprobs[:9], under_old[:9], atol=1e-4)
        np.testing.assert_allclose(c.logprobs[9:], under_new[9:], atol=1e-4)  # full prefix, new weights
        assert np.abs(under_old[9:] - under_new[9:]).max() > 1e-2  # the two policies do differ


@pytest.mark.parametrize(("pack_width", "prefill_chunk"), [(512, 512), (12, 512), (12, 8)])
def test_swap_recomputes_every_slot_from_packed_rows(pack_width, prefill_chunk):
    """Six in-flight samples of different lengths are re-prefilled after a swap: packed several to
    a row (width 512: all of them, in one call) or, past `reprefill_pack_width` (12), by length
    bucket (prefilled whole, or 8 tokens at a time). Either way each continues exactly as the new
    weights would from its full history."""
    old, new = _model(4), _model(5)
    engine = GenerationEngine(old, EngineConfig(num_slots=6, max_seq_len=64, decode_chunk=4,
                                                reprefill_pack_width=pack_width, prefill_chunk=prefill_chunk))
    prompts = [[1 + i] * n for i, n in enumerate([1, 3, 7, 11, 16, 21])]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0)
    handles = [engine.submit(p, sp) for p in prompts]
    engine.step()
    engine.step()
    engine.update_weights(new.params, version=1)
    engine.run_until_idle()
    assert engine.compile_counts["reprefill"] == 1
    assert engine.stats().reprefill_tokens == sum(len(p) + 8 for p in prompts)  # 9 tokens each, the last re-fed
    for prompt, h in zip(prompts, handles):
        (c,) = h.result().completions
        np.testing.assert_array_equal(c.versions, [0] * 9 + [1] * 7)
        np.testing.assert_allclose(c.logprobs[:9], _teacher_forced(old, prompt, c.tokens, 1.0)[:9], atol=1e-4)
        np.testing.assert_allclose(c.logprobs[9:], _teacher_forced(new, prompt, c.tokens, 1.0)[9:], atol=1e-4)


def test_non_interruptible_swap_drains_in_flight_samples_first():
    old, new = _model(2), _model(3)
    engine = GenerationEngine(old, EngineConfig(num_slots=2, max_seq_len=48, decode_chunk=4, interruptible=False))
    first = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=12))
    engine.step()
    engine.update_weights(new.params, version=1)
    later = engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=5))
    engine.run_until_idle()
    (c,) = first.result().completions
    assert (c.versions == 0).all()
    np.testing.assert_allclose(c.logprobs, _teacher_forced(old, PROMPTS[0], c.tokens, 1.0), atol=1e-4)
    (c2,) = later.result().completions
    assert (c2.versions == 1).all()
    np.testing.assert_allclose(c2.logprobs, _teacher_forced(new, PROMPTS[2], c2.tokens, 1.0), atol=1e-4)


def test_compilation_count_stays_bounded_across_prompt_lengths():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=4))
    rng = np.random.default_rng(0)
    handles = [engine.submit(rng.integers(0, 64, size=n).tolist(), SamplingParams(max_new_tokens=3), n=1 + n % 3)
               for n in range(1, 60)]
    engine.run_until_idle()
    assert all(len(h.result().completions) == 1 + i % 3 for i, h in enumerate(handles, start=1))
    counts = engine.compile_counts
    # A prefill call takes at most one prompt per free slot: 1 or 4 rows here.
    row_buckets = len(engine.config.prefill_row_counts(64))
    assert engine.config.prefill_row_counts(16) == engine.config.prefill_row_counts(64) == (1, 4)
    assert counts["decode"] == 1 and counts["first_tokens"] <= row_buckets
    assert counts["prefill"] <= len(engine.config.prefill_buckets) * row_buckets  # lengths 16, 32, 64
    assert counts["insert"] <= len(engine.config.prefill_buckets) * row_buckets


def test_continuous_batching_refills_freed_slots_at_next_chunk():
    occupancy = []

    class Recording(GenerationEngine):
        def _decode_chunk(self):
            outstanding = sum(s is not None for s in self._slot_sample) + sum(
                r.n - r.next_sample for r in self._queue)
            occupancy.append((sum(s is not None for s in self._slot_sample), outstanding))
            super()._decode_chunk()

    engine = Recording(_model(0), EngineConfig(num_slots=3, max_seq_len=64, decode_chunk=2))
    lengths = [2, 30, 3, 25, 4, 2, 20, 5, 3, 3]
    handles = [engine.submit([1 + i], SamplingParams(max_new_tokens=n)) for i, n in enumerate(lengths)]
    engine.run_until_idle()
    assert [len(h.result().completions[0].tokens) for h in handles] == lengths
    for busy, outstanding in occupancy:
        assert busy == min(3, outstanding)  # no slot idles while work is queued
    assert engine.stats().slot_occupancy > 2.0


def test_chunk_ends_early_to_refill_a_freed_slot():
    chunks = []  # (slots busy at start, requests waiting, steps run, busy slot-steps, samples finished)

    class Recording(GenerationEngine):
        def _decode_chunk(self):
            before = self.stats()
            busy = sum(s is not None for s in self._slot_sample)
            super()._decode_chunk()
            after = self.stats()
            chunks.append((busy, before.queued_requests, after.decode_steps - before.decode_steps,
                           after.busy_slot_steps - before.busy_slot_steps,
                           after.finished_samples - before.finished_samples))

    lengths = [3, 30, 5, 12, 2, 9, 20, 4, 7]
    sp = lambda n: SamplingParams(max_new_tokens=n, temperature=1.0)  # noqa: E731

    def run(refill_after):
        chunks.clear()
        engine = Recording(_model(0), EngineConfig(num_slots=3, max_seq_len=64, decode_chunk=8,
                                                   refill_after=refill_after))
        handles = [engine.submit([1 + i], sp(n), seed=i) for i, n in enumerate(lengths)]
        engine.run_until_idle()
        return [h.result().completions[0] for h in handles], list(chunks)

    early, early_chunks = run(1)
    full, full_chunks = run(0)
    assert [len(c.tokens) for c in early] == lengths
    for a, b in zip(early, full):  # where a chunk ends does not change what is sampled
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert all(steps == 8 for _, _, steps, _, _ in full_chunks[:-1])
    for busy, waiting, steps, busy_steps, finished in early_chunks:
        if waiting and busy == 3:
            assert busy_steps == 3 * steps  # no slot idled while a request waited
            assert steps == 8 or finished >= 1  # stopped early only because a slot freed
    assert any(steps < 8 for *_, steps, _, _ in early_chunks[:-1])
    occupancy = lambda cs: sum(c[3] for c in cs) / sum(c[2] for c in cs)  # noqa: E731
    assert occupancy(early_chunks) > occupancy(full_chunks)


def test_decode_windows_read_only_the_cache_in_use_and_change_nothing():
    model = _model(1)
    sp = SamplingParams(max_new_tokens=40, temperature=1.0)

    def run(windows):
        # One slot: each sequence grows through every window on its own.
        engine = GenerationEngine(model, EngineConfig(num_slots=1, max_seq_len=64, decode_chunk=4,
                                                      decode_windows=windows))
        handles = [engine.submit(p, sp, seed=i) for i, p in enumerate(PROMPTS)]
        engine.run_until_idle()
        return [h.result().completions[0] for h in handles], engine.compile_counts["decode"]

    windowed, programs = run((8, 16, 32))
    full, one = run((64,))
    assert (programs, one) == (4, 1)  # windows 8, 16, 32 and the whole cache were all used
    for prompt, a, b in zip(PROMPTS, windowed, full):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_allclose(a.logprobs, _teacher_forced(model, prompt, a.tokens, 1.0), atol=1e-4)
    assert EngineConfig(max_seq_len=600).decode_windows == (128, 256, 512, 600)
    with pytest.raises(ValueError, match="decode_windows"):
        EngineConfig(max_seq_len=64, decode_windows=(32, 100))


def _numpy_allowed(logits, temperature, top_p, top_k):
    scaled = logits / temperature
    order = np.argsort(-scaled)
    allowed = np.zeros_like(logits, bool)
    keep = order[:top_k] if top_k else order
    probs = np.exp(scaled[keep] - scaled[keep].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    allowed[keep[before < top_p]] = True
    return allowed


def test_top_p_top_k_never_leave_the_allowed_set():
    rng = np.random.default_rng(0)
    B, V = 6, 50
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    temperature = np.array([1.0, 0.5, 2.0, 1.0, 0.8, 1.0], np.float32)
    top_p = np.array([0.9, 1.0, 0.5, 0.3, 0.95, 1.0], np.float32)
    top_k = np.array([0, 5, 0, 10, 3, 1], np.int32)
    expected = np.stack([_numpy_allowed(logits[b], temperature[b], top_p[b], top_k[b]) for b in range(B)])
    mask = np.asarray(allowed_mask(jnp.asarray(logits), temperature, top_p, top_k))
    np.testing.assert_array_equal(mask, expected)
    seen = np.zeros((B, V), bool)
    draw = jax.jit(sample_tokens)
    for i in range(300):
        tokens, _ = draw(jnp.asarray(logits), jax.random.key(i), temperature, top_p, top_k)
        seen[np.arange(B), np.asarray(tokens)] = True
    assert not (seen & ~expected).any()
    several = expected.sum(1) > 1
    assert several.sum() >= 4 and (seen.sum(1) > 1)[several].all()  # it does sample, not just take the argmax


def test_engine_top_k_tokens_come_from_the_top_k():
    model = _model(4)
    (group,) = generate(model, [PROMPTS[1]], max_new_tokens=16, temperature=1.5, top_k=3, n=4, seed=1)
    for c in group:
        seq = jnp.asarray([PROMPTS[1] + c.tokens.tolist()])
        logits = np.asarray(model(seq))[0, len(PROMPTS[1]) - 1:-1]
        top3 = np.argsort(-logits, axis=-1)[:, :3]
        assert all(t in row for t, row in zip(c.tokens, top3))
        # Behavior logprobs are over the full vocabulary, not the truncated distribution.
        np.testing.assert_allclose(c.logprobs, _teacher_forced(model, PROMPTS[1], c.tokens, 1.5), atol=1e-4)


def test_stop_tokens_end_a_sample_and_are_kept():
    model = _model(0)
    (free,) = generate(model, [PROMPTS[0]], max_new_tokens=10, temperature=0.0)
    stop = int(free[0].tokens[4])
    first = int(np.flatnonzero(free[0].tokens == stop)[0])
    (stopped,) = generate(model, [PROMPTS[0]], max_new_tokens=10, temperature=0.0, stop_token_ids=[stop])
    c = stopped[0]
    assert c.stop_reason == "stop" and c.tokens[-1] == stop
    np.testing.assert_array_equal(c.tokens, free[0].tokens[:first + 1])


def test_bad_requests_fail_clearly_and_the_engine_keeps_serving():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=2, max_seq_len=16, decode_chunk=4))
    good = engine.submit([1, 2], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit([], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="does not fit"):
        engine.submit(list(range(16)), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        engine.submit([1, 99], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(max_new_tokens=4, top_k=-2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="n must be"):
        engine.submit([1], SamplingParams(max_new_tokens=4), n=0)
    also_good = engine.submit([3], SamplingParams(max_new_tokens=30))  # capped by max_seq_len
    engine.run_until_idle()
    assert len(good.result().completions[0].tokens) == 4
    c = also_good.result().completions[0]
    assert c.stop_reason == "length" and 1 + len(c.tokens) == 16


def test_abort_keeps_tokens_so_far():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=1, max_seq_len=64, decode_chunk=4))
    running = engine.submit([1, 2], SamplingParams(max_new_tokens=40), n=2)  # second sample still queued
    engine.step()
    engine.abort(running.request_id)
    engine.run_until_idle()
    first, second = running.result().completions
    assert first.stop_reason == second.stop_reason == "aborted"
    assert len(first.tokens) == 5 and len(second.tokens) == 0


def test_threaded_engine_with_concurrent_weight_updates():
    models = [_model(s) for s in (5, 6, 7)]
    engine = GenerationEngine(models[0], EngineConfig(num_slots=4, max_seq_len=64, decode_chunk=2))
    engine.start()
    try:
        handles = [engine.submit(p, SamplingParams(max_new_tokens=24), n=2) for p in PROMPTS]
        pusher = threading.Thread(target=lambda: [engine.update_weights(m.params, v).result()
                                                  for v, m in enumerate(models[1:], start=1)])
        pusher.start()
        pusher.join()
        results = [h.result(timeout=120) for h in handles]
    finally:
        engine.stop()
    by_version = {v: m for v, m in enumerate(models)}
    for prompt, res in zip(PROMPTS, results):
        for c in res.completions:
            assert (np.diff(c.versions) >= 0).all()  # versions never go back within a sample
            for v in np.unique(c.versions):
                idx = np.flatnonzero(c.versions == v)
                ref = _teacher_forced(by_version[int(v)], prompt, c.tokens, 1.0)
                np.testing.assert_allclose(c.logprobs[idx], ref[idx], atol=1e-4)


def test_greedy_matches_transformers_generate(reference, tmp_path):
    path = make_models(reference, tmp_path, {"qwen2": FAMILY_CONFIGS["qwen2"]})["qwen2"]
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38]]
    want = reference.run("generate", model=str(path), prompts=prompts, max_new_tokens=12)["tokens"]
    out = generate(load_pretrained(path), prompts, max_new_tokens=12, temperature=0.0)
    assert [g[0].tokens.tolist() for g in out] == want


def test_pause_holds_slots_and_resume_continues():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=2, max_seq_len=32, decode_chunk=2))
    handle = engine.submit([1, 2], SamplingParams(max_new_tokens=8, temperature=0.0))
    engine.step()
    engine.pause()
    generated = engine.stats().generated_tokens
    assert engine.step() is False and engine.stats().generated_tokens == generated
    engine.resume()
    engine.run_until_idle()
    (c,) = handle.result().completions
    (ref,) = generate(_model(0), [[1, 2]], max_new_tokens=8, temperature=0.0)
    np.testing.assert_array_equal(c.tokens, ref[0].tokens)


def test_cancelled_future_does_not_break_the_engine():
    engine = GenerationEngine(_model(0), EngineConfig(num_slots=2, max_seq_len=32, decode_chunk=2))
    dropped = engine.submit([1, 2], SamplingParams(max_new_tokens=4))
    kept = engine.submit([3], SamplingParams(max_new_tokens=4))
    assert dropped.cancel()
    engine.run_until_idle()
    assert len(kept.result().completions[0].tokens) == 4


def test_engine_runs_on_the_generation_mesh_of_its_weights():
    """Weights on a (data=2, tensor=2) mesh or on a non-default device: same tokens, cache placed alike."""
    from jax.sharding import AxisType

    from areal_jax.models import param_axes
    from areal_jax.models.sharding import GENERATION_RULES, sharding_for

    model = _model(1)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[4:8])
    placed = jax.tree.map(lambda a, axes: jax.device_put(a, sharding_for(axes, GENERATION_RULES, mesh, a.shape)),
                          model.params, param_axes(CFG), is_leaf=lambda x: isinstance(x, tuple))
    other_device = jax.device_put(model.params, jax.devices()[3])
    sp = SamplingParams(max_new_tokens=10, temperature=0.0)
    results = []
    for params in (model.params, placed, other_device):
        engine = GenerationEngine((CFG, params), EngineConfig(num_slots=4, max_seq_len=48, decode_chunk=4))
        handles = [engine.submit(p, sp) for p in PROMPTS]
        engine.run_until_idle()
        results.append([h.result().completions[0] for h in handles])
        devices = engine._cache.k[0].sharding.device_set
        assert devices == set(jax.tree.leaves(params)[0].sharding.device_set)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_sampling_depends_only_on_the_request_seed_not_on_batching():
    model = _model(2)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)

    def run(num_slots, chunk, others):
        engine = GenerationEngine(model, EngineConfig(num_slots=num_slots, max_seq_len=48, decode_chunk=chunk))
        noise = [engine.submit(p, sp, n=2) for p in others]
        target = engine.submit(PROMPTS[1], sp, n=3, seed=1234)
        engine.run_until_idle()
        assert all(h.done() for h in noise)
        return [c.tokens.tolist() for c in target.result().completions]

    alone = run(4, 4, [])
    assert run(8, 3, PROMPTS) == alone
    assert run(3, 5, PROMPTS[::-1] + PROMPTS) == alone
    assert len({tuple(t) for t in alone}) > 1  # the samples of the group still differ


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, 0.5]] * 1000, jnp.float32)
    draw = jax.jit(sample_tokens)
    counts = np.zeros(5)
    for temperature, top_p in ((0.7, 1.0), (0.7, 0.8)):
        counts[:] = 0
        for i in range(8):
            keys = jax.random.split(jax.random.key(100 + i), 1000)
            tokens, _ = draw(logits, keys, jnp.full(1000, temperature), jnp.full(1000, top_p), jnp.zeros(1000, jnp.int32))
            counts += np.bincount(np.asarray(tokens), minlength=5)
        probs = np.exp(np.asarray(logits[0]) / temperature)
        probs /= probs.sum()
        if top_p < 1.0:  # keep the smallest prefix by probability reaching top_p, renormalize
            order = np.argsort(-probs)
            keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
            kept = np.zeros(5)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        freq = counts / counts.sum()
        np.testing.assert_allclose(freq, probs, atol=0.015)  # 8000 draws: ~3.5 standard errors
