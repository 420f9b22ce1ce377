"""RL on a learned reward alone: train a tiny reward model, then RL the quickstart policy on its score.

1. SFT: the quickstart's SFT stage (configs/quickstart.gin, RL off) gives the policy.
2. Reward model: the SFT'd policy's weights learn to tell right worked answers from wrong ones.
   The answers are the task's own solutions (right) and the same solutions with one slip
   (a step's result off by a little, carried on to the box; a wrong box; a copied value changed;
   no box). Their labels come from the exact verifier. The RM is trained by SFT through the
   training engine's objective seam (the built-in "sft" objective, `trainer/objectives.py`).
   The row's prompt is the chat the RM will score, [user: question, assistant: answer]
   (`reward.composite.rm_input_ids`), and its completion is one label token, "Y" or "N". The
   score head is then the difference of those two rows of the LM head, so the score
   logit(Y) - logit(N) is read from the last token's hidden state. That is exactly what a
   one-label `Qwen2ForSequenceClassification` computes, so the RM is saved as one
   (`models/reward_head.save_reward_params`) and loaded as any other `rm:` term.
3. RL: the quickstart's RL stage from the SFT'd policy, rewarded by the RM alone:
   `RLVRConfig.reward = (('rm:<dir>', 1.0), ('arithmetic', 0.0))`. The verifier's weight is 0:
   it is logged and used for held-out accuracy, never trained on.

    python examples/learned_reward_model.py --run_dir runs/example_rm             # the quickstart's sizes
    python examples/learned_reward_model.py --run_dir runs/example_rm --small     # a smoke run, ~2 min

The last line printed and RUN/summary.json give the held-out greedy accuracy (200 prompts,
exact verifier) after SFT and after RL on the RM's reward.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil

import areal_jax as aj

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"
# The quickstart shrunk to a smoke run: a 1-layer model, a few SFT steps, 2 RL steps.
SMALL = ["ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "SFTConfig.steps = 10",
         "SFTConfig.warmup_steps = 2", "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0",
         "TaskSource.validation_size = 0", "TaskSource.train_size = 300", "TaskSource.eval_size = 8",
         "RLConfig.steps = 2", "RLConfig.batch_size = 2", "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 0",
         "RLVRConfig.n_samples = 2", "RLVRConfig.max_new_tokens = 16", "RLVRConfig.filter_all_equal_rewards = False",
         "EngineConfig.num_slots = 8", "OptimizerConfig.warmup_steps = 1", "OptimizerConfig.total_steps = 2"]
LABELS = ("Y", "N")  # the label tokens: right, wrong


def _step(line: str) -> tuple[int, str, int]:
    """"-2+7=5" -> (-2, "+", 7): a step's left value, operator and right operand (never negative)."""
    lhs = line.split("=")[0]
    at = max(lhs.rfind("+", 1), lhs.rfind("-", 1))
    return int(lhs[:at]), lhs[at], int(lhs[at + 1:])


def _carry_on(steps: list[str], start: int, value: int) -> int:
    """Recomputes steps[start:] right from `value` (the result before them); the final value."""
    for j in range(start, len(steps)):
        _, op, rhs = _step(steps[j])
        new = value + rhs if op == "+" else value - rhs
        steps[j], value = f"{value}{op}{rhs}={new}", new
    return value


def slipped(solution: str, rng: random.Random) -> str:
    """The solution with one slip a small model makes: a step's result off by a little and carried
    on to the box, a changed copy of the previous result, a wrong box, or no box."""
    lines = solution.split("\n")
    steps, box = lines[:-1], lines[-1]
    kind = rng.choice(("carried", "copy", "box", "no_box"))
    delta = rng.choice((-10, -2, -1, 1, 2, 10))
    value = int(box[len("\\boxed{"):-1])
    if kind == "carried" and steps:
        i = rng.randrange(len(steps))
        lhs, result = steps[i].rsplit("=", 1)
        steps[i] = f"{lhs}={int(result) + delta}"
        value = _carry_on(steps, i + 1, int(result) + delta)  # the later steps compute right from it
    elif kind == "copy" and len(steps) > 1:
        i = rng.randrange(1, len(steps))
        left, op, rhs = _step(steps[i])
        value = _carry_on(steps, i, left + delta)
    elif kind == "no_box":
        return "\n".join(steps)
    else:
        value += delta
    return "\n".join(steps + [f"\\boxed{{{value}}}"])


def labelled_answers(task: aj.TaskSource, arithmetic, n: int, seed: int) -> list[tuple[str, str, bool]]:
    """(question, answer, right) for `n` training-split problems (never the held-out ones): each
    problem's solution and one slipped copy; `right` is the exact verifier's verdict."""
    from areal_jax.tasks.arithmetic import problems
    from areal_jax.tasks.reward import arithmetic_reward

    rng = random.Random(seed)
    out = []
    # Problems past the run's own training prompts' seed stream: a separate draw of the train split.
    for p in problems(arithmetic, "train", n, seed=10_000 + seed):
        for answer in (p.solution, slipped(p.solution, rng)):
            out.append((p.question, answer, arithmetic_reward(answer, p.answer) == 1.0))
    return out


def label_examples(tokenizer, rows, prompt_of, labels=LABELS) -> list[tuple[list[int], list[int]]]:
    """SFT pairs (prompt ids, [first token of the right or the wrong label]) of (question, answer, right) rows."""
    label_ids = [tokenizer.encode(t, add_special_tokens=False)[0] for t in labels]
    return [(prompt_of(q, a), [label_ids[0] if right else label_ids[1]]) for q, a, right in rows]


def train_labeller(policy_dir: pathlib.Path, examples, *, steps: int, seed: int, lr: float = 1e-3):
    """The policy's weights SFT'd on (prompt, label token) pairs, on the run's training engine."""
    import jax.numpy as jnp

    from areal_jax.models.hf_io import load_params
    from areal_jax.trainer.config import SFTConfig
    from areal_jax.trainer.engine_config import TrainEngineConfig
    from areal_jax.trainer.sft import run_sft

    cfg, params = load_params(policy_dir, dtype=jnp.float32)
    sft = SFTConfig(steps=steps, rows_per_step=16, lr=lr, warmup_steps=min(20, steps // 5), max_len=128, seed=seed,
                    log_every=max(1, steps // 5))
    params, metrics = run_sft(cfg, params, examples, sft, engine=TrainEngineConfig(scan_layers=False), progress=False)
    print(f"[example] labeller SFT: {steps} steps, loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}",
          flush=True)
    return cfg, params


def train_reward_model(policy_dir: pathlib.Path, out: pathlib.Path, *, n_problems: int, steps: int, seed: int,
                       arithmetic) -> pathlib.Path:
    """A one-label reward model at `out` (a Qwen2ForSequenceClassification directory with the
    policy's tokenizer), trained on right vs slipped answers (module docstring)."""
    import numpy as np

    from areal_jax.models.reward_head import ScoreHead, save_reward_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.reward.composite import rm_input_ids

    tok = Tokenizer.from_pretrained(policy_dir)
    rows = labelled_answers(aj.TaskSource(), arithmetic, n_problems, seed)
    cfg, params = train_labeller(policy_dir, label_examples(tok, rows, lambda q, a: rm_input_ids(tok, q, a)),
                                 steps=steps, seed=seed)
    yes, no = (tok.encode(t, add_special_tokens=False)[0] for t in LABELS)
    head = np.asarray(params["embed"] if cfg.tie_word_embeddings else params["lm_head"].T, np.float32)  # [V, D]
    rm_params = {k: v for k, v in params.items() if k != "lm_head"}
    rm_params["score"] = (head[yes] - head[no])[:, None]  # [D, 1]: logit(Y) - logit(N)
    save_reward_params(rm_params, cfg, ScoreHead(num_labels=1, pad_token_id=tok.pad_token_id), out)
    for f in policy_dir.iterdir():  # the tokenizer (and its chat template) travels with the RM
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def rm_accuracy(rm_dir: pathlib.Path, arithmetic, n: int = 200) -> float:
    """Share of held-out (test split) right and slipped answers the RM's score sign gets right."""
    from areal_jax.reward import RewardModel
    from areal_jax.tasks.arithmetic import problems
    from areal_jax.tasks.reward import arithmetic_reward

    rm = RewardModel.from_pretrained(rm_dir)
    rng = random.Random(1)
    pairs = [(p.question, a, arithmetic_reward(a, p.answer) == 1.0)
             for p in problems(arithmetic, "test", n, seed=1) for a in (p.solution, slipped(p.solution, rng))]
    scores = rm.score_chats([[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a, _ in pairs])
    return float(sum((s > 0) == right for s, (_, _, right) in zip(scores, pairs)) / len(pairs))


def sft_policy(run_dir: pathlib.Path, overrides: list[str], *, overwrite: bool) -> tuple[pathlib.Path, aj.JobConfigs]:
    """The quickstart's SFT stage alone; its final model. A finished one already in `run_dir` is
    kept unless `overwrite` (the stage is deterministic for its seed)."""
    cfg = aj.load_config(QUICKSTART, overrides=overrides + ["Stages.rl = False", "Stages.plot = False"])
    if not overwrite and (run_dir / "summary.json").is_file() and (run_dir / "final_model").is_dir():
        print(f"[example] reusing the SFT policy in {run_dir}", flush=True)
    else:
        aj.Trainer(cfg, run_dir=run_dir).train(overwrite=overwrite, progress=False)
    return run_dir / "final_model", cfg


def rl_on_reward(policy_dir: pathlib.Path, run_dir: pathlib.Path, overrides: list[str], reward: str, *,
                 overwrite: bool) -> dict:
    """The quickstart's RL stage from `policy_dir`, rewarded by `reward` (gin text of the terms)."""
    cfg = aj.load_config(QUICKSTART, overrides=overrides + [
        f"ModelSource.path = '{policy_dir}'", "Stages.sft = False", "Stages.plot = False",
        f"RLVRConfig.reward = {reward}"])
    return aj.Trainer(cfg, run_dir=run_dir).train(overwrite=overwrite, progress=False)


def parse_args(argv, doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--run_dir", required=True, help="holds sft/, the reward model and rl/")
    parser.add_argument("--seed", type=int, default=0, help="the quickstart's seed: ModelSource.init_seed and SFTConfig.seed")
    parser.add_argument("--small", action="store_true", help="a smoke run: a 1-layer model, a few steps")
    parser.add_argument("--label_steps", type=int, default=None, help="SFT steps of the reward model or judge (default 300; 10 small)")
    parser.add_argument("--label_problems", type=int, default=None, help="problems its right/slipped answers come from")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in --run_dir")
    args = parser.parse_args(argv)
    args.run_dir = pathlib.Path(args.run_dir).resolve()
    args.overrides = (SMALL if args.small else []) + [f"ModelSource.init_seed = {args.seed}", f"SFTConfig.seed = {args.seed}"]
    args.label_steps = args.label_steps or (10 if args.small else 300)
    args.label_problems = args.label_problems or (50 if args.small else 3000)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, __doc__)
    policy, cfg = sft_policy(args.run_dir / "sft", args.overrides, overwrite=args.overwrite)
    rm_dir = train_reward_model(policy, args.run_dir / "reward_model", n_problems=args.label_problems,
                                steps=args.label_steps, seed=args.seed, arithmetic=cfg.arithmetic)
    rm_acc = rm_accuracy(rm_dir, cfg.arithmetic, n=20 if args.small else 200)
    print(f"[example] reward model: sign right on {rm_acc:.3f} of held-out right/slipped answers", flush=True)
    summary = rl_on_reward(policy, args.run_dir / "rl", args.overrides, f"(('rm:{rm_dir}', 1.0), ('arithmetic', 0.0))",
                           overwrite=args.overwrite)
    return report(args, summary, "the reward model", rm_sign_accuracy=rm_acc)


def report(args: argparse.Namespace, summary: dict, reward: str, **extra) -> dict:
    """RUN/result.json and the line printed: held-out accuracy after SFT and after RL on `reward`."""
    result = {"seed": args.seed, **extra, "sft_accuracy": summary["sft_accuracy"],
              "final_accuracy": summary["final_accuracy"], "rl_steps": summary["steps"]}
    (args.run_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(f"held-out accuracy (exact verifier) after SFT {summary['sft_accuracy']:.3f} -> after RL on {reward} "
          f"alone {summary['final_accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
