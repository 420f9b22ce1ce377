"""A custom multi-turn rollout workflow, passed to the run as a Python class.

Each episode answers, and when the answer is wrong is told so once and answers again; the
second answer earns half the reward (one try is better than two). The feedback turn is context
the workflow inserted: its tokens carry loss mask 0, so only the model's own tokens are trained.
Runs the built-in arithmetic task with the tiny model (configs/quickstart.gin):

    python examples/custom_multi_turn_workflow.py --run_dir runs/example_multi_turn
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import zlib

import numpy as np

import areal_jax as aj

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "configs" / "quickstart.gin"
SMALL = ["ModelSource.hidden_size = 32", "ModelSource.num_layers = 1", "TaskSource.train_size = 300",
         "TaskSource.eval_size = 8", "Stages.sft = False", "RLConfig.steps = 2", "RLConfig.batch_size = 2",
         "RLConfig.max_concurrent = 4", "RLConfig.eval_every = 1", "RLVRConfig.n_samples = 2",
         "RLVRConfig.max_new_tokens = 8", "RLVRConfig.filter_all_equal_rewards = False",
         "EngineConfig.num_slots = 8", "EngineConfig.max_seq_len = 96", "TaskSource.validation_size = 0",
         "SFTConfig.eval_every = 0", "SFTConfig.stop_accuracy = 0.0", "RLConfig.dump_rollouts_every = 1"]
FEEDBACK = "<|user|>Wrong. Again.<|end|><|assistant|>"  # a user turn in the task tokenizer's chat format


class RetryOnceWorkflow(aj.RolloutWorkflow):
    """n two-turn episodes per prompt row (an `aj.RolloutWorkflow`: `arun` is the one method to write;
    the base class gives the defaults of `reject_reason`, `rollout` and `config_class`).

    Built by the run as `RetryOnceWorkflow(rollout, tokenizer)`: `rollout` is the job's RLVRConfig
    (samples per row, sampling, reward), `tokenizer` the policy's."""

    def __init__(self, rollout: aj.RLVRConfig, tokenizer):
        self.rollout = rollout  # the loop reads its temperature: the trainer's log-probs use the same
        self.feedback = np.asarray(tokenizer.encode(FEEDBACK, add_special_tokens=False), np.int32)

    async def arun(self, client: aj.RolloutClient, row, *, version: int) -> aj.TrajectoryGroup | None:
        example = aj.prompt_example(row)  # the row's prompt ids, query id and gold answer, typed
        seeds = [zlib.crc32(f"{example.query_id}:{version}:{i}".encode()) for i in range(self.rollout.n_samples)]
        episodes = await asyncio.gather(*(self._episode(client, example.prompt_ids, example.gold, seed)
                                          for seed in seeds))
        if any(e.stop_reason == "aborted" for e in episodes):
            return None  # the engine is stopping: the row is rejected (counted, never silent)
        return aj.TrajectoryGroup(query_id=example.query_id, trajectories=tuple(episodes),
                                  admitted_version=version)

    async def _episode(self, client, prompt, gold, seed: int) -> aj.Trajectory:
        cfg = self.rollout  # the seed follows from the row, version and sample: a run is reproducible
        first = (await client.generate(prompt, cfg.sampling, 1, seed=seed)).completions[0]
        if first.stop_reason == "aborted":
            return aj.Trajectory(prompt, first.tokens, first.logprobs, first.versions, 0.0, "aborted")
        reward = await client.reward(cfg.reward, client.decode(first.tokens), gold, timeout_s=cfg.reward_timeout_s)
        parts, second = [(first.tokens, first.logprobs, first.versions, 1)], None
        if reward < 1.0:  # one more turn, after the inserted feedback
            context = np.concatenate([prompt, first.tokens, self.feedback]).astype(np.int32)
            second = (await client.generate(context, cfg.sampling, 1, seed=seed + 1)).completions[0]
            reward = 0.5 * await client.reward(cfg.reward, client.decode(second.tokens), gold,
                                               timeout_s=cfg.reward_timeout_s)
            n = len(self.feedback)
            parts += [(self.feedback, np.zeros(n, np.float32), np.full(n, -1, np.int32), 0),
                      (second.tokens, second.logprobs, second.versions, 1)]
        return aj.Trajectory(
            prompt_ids=prompt, completion_ids=np.concatenate([p[0] for p in parts]).astype(np.int32),
            behavior_logprobs=np.concatenate([p[1] for p in parts]).astype(np.float32),
            versions=np.concatenate([p[2] for p in parts]).astype(np.int32), reward=float(reward),
            stop_reason=(second or first).stop_reason,
            loss_mask=np.concatenate([np.full(len(p[0]), p[3], np.float32) for p in parts]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", default="runs/example_multi_turn")
    parser.add_argument("--overwrite", action="store_true", help="replace a run already in --run_dir")
    args = parser.parse_args(argv)
    trainer = aj.Trainer(aj.load_config(QUICKSTART, overrides=SMALL), run_dir=args.run_dir,
                         workflow=RetryOnceWorkflow)
    summary = trainer.train(overwrite=args.overwrite, progress=False)
    print(f"{summary['steps']} RL steps with {RetryOnceWorkflow.__name__}; records in {args.run_dir}")
    return summary


if __name__ == "__main__":
    main()
