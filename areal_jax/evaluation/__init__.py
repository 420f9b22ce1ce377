"""Evaluation of a policy on prompt rows. `held_out` samples and scores: the one implementation
behind RL's held-out accuracy, SFT's stopping rule and the job's accuracy. `runner` is
``areal-jax eval`` (pass@k, maj@k) on top of it. Names are re-exported lazily (PEP 562), so the
trainer importing `held_out` does not load the runner's data pipeline."""

from __future__ import annotations

from areal_jax.lazy_exports import lazy_exports

_EXPORTS = {
    **{name: "areal_jax.evaluation.held_out" for name in (
        "GreedyAccuracy", "SampledGroup", "evaluate_accuracy", "greedy_correct", "rewards", "sample",
        "sample_rewards")},
    **{name: "areal_jax.evaluation.runner" for name in (
        "WEIGHT_DTYPES", "EvalConfig", "EvalReport", "dataset_of", "engine_mesh", "run_evaluation")},
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
