"""The simulator charges the learned rewards' scoring (issue 43): on the generation devices it
shares by default, on devices of their own with MeshConfig.reward_devices."""

import dataclasses
import types

import pytest

from areal_jax.simulate.config import RowConfig
from areal_jax.simulate.costs import LinearCosts
from tests.test_simulate import COSTS, WORKLOAD, simulate


class _WithLearned:
    """`costs` with a learned reward of a fixed cost per group."""

    def __init__(self, costs, seconds: float, shared: bool):
        self._costs = costs
        self.learned_rewards = types.SimpleNamespace(shared=shared, group_s=lambda n, prompt, lengths: seconds)

    def __getattr__(self, name):
        return getattr(self._costs, name)


def test_scoring_by_hand_on_an_equal_length_schedule():
    """eta 0 on a split, every sample L tokens: generation takes (L - 1) d, then the G groups are
    scored one call after another (G r), then the step trains (t0). Shared or not, the trainer waits
    for the last group's reward; shared, the engine's devices are busy for the scoring too."""
    L, d, t0, r = 100, 1e-3, 0.05, 0.004
    base = LinearCosts(decode_step=d, train_step=t0)
    workload = dataclasses.replace(WORKLOAD, max_concurrent=WORKLOAD.batch_groups)
    G, n = workload.batch_groups, workload.samples_per_group
    row = RowConfig(mode="async", eta=0, generation_devices=2, steps=10, warmup_steps=2)
    step = (L - 1) * d + G * r + t0
    for shared in (True, False):
        result = simulate(row, f"constant:length={L}", workload=workload, costs=_WithLearned(base, r, shared))
        assert result.step_s == pytest.approx(step, rel=1e-9)
        assert result.trained_tokens_per_s == pytest.approx(G * n * L / step, rel=1e-9)
        assert result.learned_reward_s_per_step == pytest.approx(G * r, rel=1e-9)
        busy = (L - 1) * d + (G * r if shared else 0.0)  # the scoring is the engine devices' time when shared
        assert result.generation_busy == pytest.approx(busy / step, rel=1e-9)


def test_shared_scoring_slows_generation_and_own_devices_hide_it():
    # Asynchronous and generation-bound: scoring on the generation devices takes their time from
    # decoding; on devices of their own it overlaps with generation (as long as it keeps up).
    row = RowConfig(mode="async", eta=2, generation_devices=2, steps=16, warmup_steps=4)
    plain = simulate(row)
    r = 0.02
    shared = simulate(row, costs=_WithLearned(COSTS, r, True))
    own = simulate(row, costs=_WithLearned(COSTS, r, False))
    assert plain.generation_s_per_step > plain.train_s_per_step  # generation-bound
    groups = WORKLOAD.batch_groups
    # About a step's groups are scored per step (those in flight at the window's ends differ).
    assert shared.learned_reward_s_per_step == pytest.approx(groups * r, rel=0.1)
    assert shared.step_s > plain.step_s + 0.5 * groups * r
    assert own.step_s < plain.step_s + 0.25 * (shared.step_s - plain.step_s)
