"""Built-in tasks. `arithmetic`: synthetic multi-step arithmetic with verifiable answers, its
character-level tokenizer and small model (`tokenizer_builder`) and its reward (`reward`).

Its reward is registered as "arithmetic" in areal_jax.reward.registry (declared cheap and safe to
run in-process). Names are re-exported lazily (PEP 562) so that a reward worker importing
`areal_jax.tasks.reward` does not pull in JAX.
"""

from __future__ import annotations

from areal_jax.lazy_exports import lazy_exports

REWARD_NAME = "arithmetic"

_EXPORTS = {
    **{name: "areal_jax.tasks.arithmetic" for name in (
        "ArithmeticConfig", "ArithmeticProblem", "iter_problems", "make_problem", "problems", "prompt_ids",
        "prompt_rows", "sft_examples", "solve", "split_of", "write_jsonl")},
    **{name: "areal_jax.tasks.reward" for name in ("REWARD_PATH", "arithmetic_reward", "parse_boxed_integer")},
    **{name: "areal_jax.tasks.tokenizer_builder" for name in (
        "build_task_model_dir", "build_tokenizer", "task_model_config", "vocabulary")},
}

__all__ = sorted([*_EXPORTS, "REWARD_NAME"])


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
