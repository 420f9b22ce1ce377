"""Driving a GenerationEngine through a fixed workload, shared by the engine tests."""

from __future__ import annotations


def serve(engine, prompts, sp, *, n: int = 1, swap=None, steps_before_swap: int = 2) -> list:
    """Submits every prompt (request i sampled with seed i, `n` samples each); with `swap`, hands
    the engine those weights as version 1 after `steps_before_swap` scheduling rounds; runs until
    idle. Each request's completions, in prompt order."""
    handles = [engine.submit(p, sp, n=n, seed=i) for i, p in enumerate(prompts)]
    if swap is not None:
        for _ in range(steps_before_swap):
            engine.step()
        engine.update_weights(swap, version=1)
    engine.run_until_idle()
    return [h.result().completions for h in handles]
