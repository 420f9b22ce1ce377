"""Overlapped host scheduling (EngineConfig.overlap, generation/slots.py): a decode chunk is
dispatched from the last one's final state on the device before the host reads that one back.
Tokens, log-probs and versions are those of overlap off across a swap, an abort and preemption;
pages stay exactly accounted; the exit checked every few steps and the host-static sampler change
nothing."""

import numpy as np

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.generation.sampling import sampler_kind
from areal_jax.models import init_params
from tests.test_live_slots import BASE, CFG, PROMPTS, _assert_same

OLD, NEW = init_params(CFG, 0, std=0.3), init_params(CFG, 1, std=0.3)


def _run(*, swap_after=None, abort_after=None, temperature=0.0, **config):
    """Every sample's (tokens, logprobs, versions, stop reason), driving the engine step by step:
    weights of version 1 pushed after `swap_after` steps, request 5 aborted after `abort_after`;
    the page accounting checked after every step."""
    engine = GenerationEngine((CFG, OLD), EngineConfig(**{**BASE, **config}))
    handles = [engine.submit(p, SamplingParams(max_new_tokens=3 * (i + 1), temperature=temperature), seed=i)
               for i, p in enumerate(PROMPTS)]
    steps = 0
    while engine.step():
        steps += 1
        if steps == swap_after:
            engine.update_weights(NEW, version=1)
        if steps == abort_after:
            engine.abort(handles[5].request_id)
        if engine._pages is not None:
            engine._pages.check()
    pages = engine._pages
    if pages is not None:
        assert all(pages.free_pages(r) == pages.pages_per_replica for r in range(pages.replicas))
    return engine, [(c.tokens, c.logprobs, c.versions, c.stop_reason) for h in handles for c in h.result().completions]


def test_overlap_keeps_tokens_logprobs_and_versions_across_a_swap_and_an_abort():
    kw = dict(swap_after=2, abort_after=3, decode_min_rows=1)
    off, want = _run(overlap=False, **kw)
    on, got = _run(overlap=True, **kw)
    _assert_same(got, want)
    assert on.stats().overlapped_chunks > 0 and off.stats().overlapped_chunks == 0
    assert on.stats().weight_swaps == 1 and on.stats().aborted_samples == off.stats().aborted_samples == 1
    assert {tuple(np.unique(v)) for _, _, v, _ in got} >= {(0, 1)}  # samples spanning the swap


def test_overlap_keeps_tokens_across_preemption_with_exact_pages():
    off, want = _run(overlap=False, kv_pool_pages=10, decode_min_rows=1)
    on, got = _run(overlap=True, kv_pool_pages=10, decode_min_rows=1)
    _assert_same(got, want)
    assert on.stats().preempted_samples > 0 and on.stats().overlapped_chunks > 0


def test_overlap_on_the_dense_cache_with_sampling():
    off, want = _run(overlap=False, kv_layout="dense", temperature=1.0, abort_after=2)
    on, got = _run(overlap=True, kv_layout="dense", temperature=1.0, abort_after=2)
    _assert_same(got, want)
    assert on.stats().overlapped_chunks > 0


def test_exit_checked_every_few_steps_changes_nothing():
    """A chunk checking its exit every 3 steps (a fixed-count loop masked after the exit) ends where
    one checking every step does, with requests waiting and refill_after set."""
    kw = dict(kv_layout="dense", num_slots=3, refill_after=1, decode_chunk=8, temperature=1.0)
    every, want = _run(decode_exit_every=1, **kw)
    blocks, got = _run(decode_exit_every=3, **kw)
    _assert_same(got, want)
    assert blocks.stats().decode_steps == every.stats().decode_steps


def test_sampler_kind_is_the_least_that_serves_the_rows():
    t, p, k = np.array([0.0, 0.0]), np.array([1.0, 0.5]), np.array([0, 3])
    assert sampler_kind(t, p, k) == "greedy"  # filters of greedy rows do not count
    assert sampler_kind(np.array([0.0, 1.0]), np.ones(2), np.zeros(2, int)) == "sample"
    assert sampler_kind(np.array([0.0, 1.0]), p, np.zeros(2, int)) == "filter"
    assert sampler_kind(np.array([1.0, 0.0]), np.ones(2), k) == "sample"  # row 1 filters, greedily
    assert sampler_kind(np.array([0.0, 1.0]), np.ones(2), k) == "filter"
