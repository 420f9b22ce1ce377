"""Train briefly, then evaluate the final model on held-out rows and export it for Hugging Face.

`Trainer.evaluate` samples the run's final model as `areal-jax eval --run_dir_of` does (the run's
reward, prompt encoding and completion budget) and reports pass@k; `Trainer.export` writes an HF
directory (weights, config, tokenizer, prompt settings) that `areal-jax generate --model` and
`transformers` read. The configs here are built in Python, without gin:

    python examples/evaluate_and_export.py --run_dir runs/example_eval --out runs/example_eval_hf
"""

from __future__ import annotations

import argparse
import json
import pathlib

import areal_jax as aj

HELD_OUT = [{"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a, b in ((2, 3), (4, 4), (7, 1), (6, 2))]


def configs() -> aj.JobConfigs:
    """A tiny run as dataclasses: the built-in model and arithmetic task, no SFT, 2 RL steps."""
    return aj.JobConfigs(
        model=aj.ModelSource(hidden_size=32, num_layers=1),
        task=aj.TaskSource(train_size=300, eval_size=8),
        stages=aj.Stages(sft=False, plot=False),
        rl=aj.RLConfig(steps=2, batch_size=2, max_concurrent=4),
        rollout=aj.RLVRConfig(n_samples=2, max_new_tokens=8, reward="arithmetic"),
        ppo=aj.PPOConfig(num_minibatches=1),
        train_engine=aj.TrainEngineConfig(max_tokens_per_microbatch=512, scan_layers=False),
        engine=aj.EngineConfig(num_slots=8, max_seq_len=64))


def main(argv: list[str] | None = None) -> tuple[dict, dict, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/example_eval")
    parser.add_argument("--out", default="runs/example_eval_hf")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in --run_dir")
    args = parser.parse_args(argv)
    trainer = aj.Trainer(configs(), run_dir=args.run_dir)
    summary = trainer.train(overwrite=args.overwrite, progress=False)
    # Two samples per held-out question at temperature 1: pass@1 and pass@2.
    report = trainer.evaluate(HELD_OUT, n_samples=2, temperature=1.0)
    out = trainer.export(args.out, overwrite=True)
    print(json.dumps(report, indent=2))
    print(f"exported to {out}: {sorted(p.name for p in pathlib.Path(out).iterdir())}")
    return summary, report, out


if __name__ == "__main__":
    main()
