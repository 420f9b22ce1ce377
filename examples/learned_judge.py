"""RL on a generative judge's verdict: a tiny judge, `JudgeConfig(parse="logprob")`, rewards the quickstart policy.

1. SFT: the quickstart's SFT stage gives the policy (examples/learned_reward_model.py, step 1).
2. Judge: the SFT'd policy's weights learn to answer the judge's question. Its prompt is
   `JudgeConfig.template` about a right or a slipped answer, as a user turn
   (`reward.judge.judge_prompt_ids`), and the completion is "Yes" or "No", by the exact verifier.
   It is trained by SFT through the training engine's objective seam (the built-in "sft"
   objective) and saved as a causal LM with the policy's tokenizer.
3. RL: the quickstart's RL stage from the SFT'd policy, rewarded by the judge alone:
   `RLVRConfig.reward = (('judge', 1.0), ('arithmetic', 0.0))` with `JudgeConfig.parse = 'logprob'`
   and `JudgeConfig.choices = ('Yes', 'No')`: the reward is the judge's P(Yes) renormalized over the two.

    python examples/learned_judge.py --run_dir runs/example_judge --small     # a smoke run, ~3 min
    python examples/learned_judge.py --run_dir runs/example_judge             # the quickstart's sizes
"""

from __future__ import annotations

import pathlib
import shutil

from learned_reward_model import (label_examples, labelled_answers, parse_args, report, rl_on_reward, sft_policy,
                                  train_labeller)

CHOICES = ("Yes", "No")


def train_judge(policy_dir: pathlib.Path, out: pathlib.Path, *, n_problems: int, steps: int, seed: int,
                arithmetic) -> pathlib.Path:
    """A judge at `out` (a causal LM directory with the policy's tokenizer) that answers the default
    template's question "Is the answer correct? Reply Yes or No." about right and slipped answers."""
    import areal_jax as aj
    from areal_jax.models.hf_io import save_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.reward.judge import JudgeConfig, judge_prompt_ids

    tok = Tokenizer.from_pretrained(policy_dir)
    config = JudgeConfig(model=str(out), parse="logprob", choices=CHOICES)
    rows = labelled_answers(aj.TaskSource(), arithmetic, n_problems, seed)
    examples = label_examples(tok, rows, lambda q, a: judge_prompt_ids(tok, config, q, a), labels=CHOICES)
    cfg, params = train_labeller(policy_dir, examples, steps=steps, seed=seed)
    save_params(params, cfg, out)
    for f in policy_dir.iterdir():  # the tokenizer (and its chat template) travels with the judge
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, __doc__)
    policy, cfg = sft_policy(args.run_dir / "sft", args.overrides, overwrite=args.overwrite)
    judge_dir = train_judge(policy, args.run_dir / "judge", n_problems=args.label_problems, steps=args.label_steps,
                            seed=args.seed, arithmetic=cfg.arithmetic)
    overrides = args.overrides + [f"JudgeConfig.model = '{judge_dir}'", "JudgeConfig.parse = 'logprob'",
                                  f"JudgeConfig.choices = {CHOICES!r}"]
    summary = rl_on_reward(policy, args.run_dir / "rl", overrides, "(('judge', 1.0), ('arithmetic', 0.0))",
                           overwrite=args.overwrite)
    return report(args, summary, "the judge")


if __name__ == "__main__":
    main()
