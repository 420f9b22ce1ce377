"""GSM8K-style rows and a reward written in Python, trained from a script.

The rows are plain dicts in GSM8K's format (a question; an answer whose last line is "#### N"),
the reward any Python callable (completion text, gold answer) -> float. The tiny built-in model
(configs/quickstart.gin) keeps this to about a minute on a laptop CPU:

    python examples/gsm8k_python_reward.py --run_dir runs/example_gsm8k
"""

from __future__ import annotations

import argparse
import pathlib
import random
import re

import areal_jax as aj

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"
# The quickstart, shrunk: a 1-layer model, a few SFT steps on the rows' worked answers, 2 RL steps.
SMALL = ["ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "SFTConfig.steps = 10", "SFTConfig.warmup_steps = 2",
         "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0", "RLConfig.steps = 2", "RLConfig.batch_size = 2",
         "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 1", "RLVRConfig.n_samples = 2",
         "RLVRConfig.max_new_tokens = 12", "RLVRConfig.filter_all_equal_rewards = False", "EngineConfig.num_slots = 8",
         "EngineConfig.max_seq_len = 96"]


def word_problems(n: int, seed: int) -> list[dict[str, str]]:
    """Short GSM8K-style problems: {"question", "answer"} with the final answer after "####"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                     "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def last_number_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's last number equals the gold answer, else 0.0."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and numbers[-1] == str(gold).strip())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/example_gsm8k")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in --run_dir")
    args = parser.parse_args(argv)
    cfg = aj.load_config(QUICKSTART, overrides=SMALL)
    trainer = aj.Trainer(cfg, run_dir=args.run_dir, reward_fn=last_number_reward,
                         train_data=word_problems(200, seed=0), eval_data=word_problems(8, seed=1))
    # A hook on every RL step, once its metrics are final (trainer/hooks.py: "update", "metrics", "record").
    trainer.add_hook(lambda info: print(f"step {info.step}: reward {info.metrics['reward/mean']:.3f}, "
                                        f"policy version {info.metrics['version']}", flush=True), stage="record")
    summary = trainer.train(overwrite=args.overwrite, progress=False)
    print(f"held-out accuracy {summary['sft_accuracy']} -> {summary['final_accuracy']} after {summary['steps']} "
          f"RL steps; records in {args.run_dir}")
    return summary


if __name__ == "__main__":
    main()
