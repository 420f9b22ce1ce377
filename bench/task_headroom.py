"""How much headroom does the arithmetic task leave for RL after a short SFT warm start?

Measures on this machine (CPU by default):
  1. short SFT (the quickstart's warm start): wall time, held-out greedy accuracy, and the
     share of held-out prompts with at least one correct answer among n samples at temperature 1
     (the RL signal) plus the mean sampled reward;
  2. longer SFT from the same start: greedy accuracy (does the model have the capacity?);
  3. a crude on-policy RL run from the short-SFT policy for a fixed wall time: n samples per
     prompt at temperature 1, group-normalized rewards, one decoupled-PPO step per batch
     (proximal = behavior: on-policy), weights pushed to the generation engine after each step.

Prints a table, the machine load (other jobs share these cores) and the command line.

    .venv/bin/python bench/task_headroom.py                      # defaults of the quickstart
    .venv/bin/python bench/task_headroom.py --rl-seconds 0       # SFT figures only
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams  # noqa: E402
from areal_jax.models.tokenizer import Tokenizer  # noqa: E402
from areal_jax.models.transformer import forward, init_params  # noqa: E402
from areal_jax.ppo import decoupled_ppo_loss, token_logprobs  # noqa: E402
from areal_jax.tasks import arithmetic as ar  # noqa: E402
from areal_jax.tasks.reward import arithmetic_reward  # noqa: E402
from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config  # noqa: E402
from areal_jax.evaluation.held_out import evaluate_accuracy, sample_rewards  # noqa: E402
from areal_jax.trainer.sft import SFTConfig, run_sft  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-operands", type=int, default=3)
    p.add_argument("--max-operands", type=int, default=4)
    p.add_argument("--max-digits", type=int, default=1)
    p.add_argument("--operators", default="+-")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--long-sft-steps", type=int, default=1000, help="total steps of the longer SFT (0: skip)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt at temperature 1")
    p.add_argument("--rl-seconds", type=float, default=240.0, help="wall time of the RL check (0: skip)")
    p.add_argument("--rl-prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--rl-lr", type=float, default=3e-5)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} on {os.cpu_count()} cores"


def rl_batch(groups, answers, tokenizer, T: int) -> tuple[dict[str, np.ndarray], list[float]]:
    """Padded on-policy batch `[G * n, T]` from sampled groups, with group-normalized advantages
    on the completion tokens; also each group's mean reward."""
    rows = sum(len(g.completions) for g in groups)
    batch = {k: np.zeros((rows, T), dt) for k, dt in (("input_ids", np.int32), ("targets", np.int32),
                                                      ("behavior", np.float32), ("advantages", np.float32),
                                                      ("mask", np.float32))}
    row, means = 0, []
    for group, answer in zip(groups, answers):
        r = np.array([arithmetic_reward(tokenizer.decode(c.tokens, skip_special_tokens=True), answer)
                      for c in group.completions])
        means.append(float(r.mean()))
        adv = (r - r.mean()) / (r.std() + 1e-6)  # GRPO-style group normalization
        prompt = list(group.prompt_ids)
        for c, a in zip(group.completions, adv):
            tokens = prompt + list(c.tokens)
            L = len(tokens) - 1
            completion = slice(len(prompt) - 1, L)  # targets that are generated tokens
            batch["input_ids"][row, :L] = tokens[:-1]
            batch["targets"][row, :L] = tokens[1:]
            batch["behavior"][row, completion] = c.logprobs
            batch["advantages"][row, completion] = a
            batch["mask"][row, completion] = 1.0
            row += 1
    return batch, means


def rl_check(mcfg, params, tokenizer, train_items, test_rows, args) -> tuple[object, dict]:
    """On-policy decoupled-PPO (proximal = behavior) for `args.rl_seconds` of wall time."""
    n, P = args.samples, args.rl_prompts
    T = args.max_len // 2  # one prompt + completion per padded row
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.rl_lr))
    params = jax.tree.map(jnp.array, params)
    opt_state = optimizer.init(params)

    def loss_fn(p, batch):
        logits, _ = forward(p, mcfg, batch["input_ids"])
        logp = token_logprobs(logits, batch["targets"])
        return decoupled_ppo_loss(logp, batch["behavior"], batch["behavior"], batch["advantages"], batch["mask"])

    @jax.jit
    def step(p, s, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    engine = GenerationEngine((mcfg, params), EngineConfig(num_slots=n * P, max_seq_len=T + 1, decode_chunk=8,
                                                           seed=args.seed))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                              stop_token_ids=tokenizer.stop_token_ids)
    rng = np.random.default_rng(args.seed + 1)
    steps, rewards_seen, t0 = 0, [], time.perf_counter()
    while time.perf_counter() - t0 < args.rl_seconds:
        items = [train_items[i] for i in rng.choice(len(train_items), P, replace=False)]
        handles = [engine.submit(ar.prompt_ids(tokenizer, it).tolist(), sampling, n=n) for it in items]
        engine.run_until_idle()
        groups = [h.result() for h in handles]
        batch, mean_rewards = rl_batch(groups, [it.answer for it in items], tokenizer, T)
        rewards_seen.extend(mean_rewards)
        params, opt_state, _ = step(params, opt_state, batch)
        engine.update_weights(params, steps + 1)
        steps += 1
    return params, {"rl_steps": steps, "rl_seconds": time.perf_counter() - t0,
                    "rl_train_reward_first": float(np.mean(rewards_seen[:P * 5])) if rewards_seen else float("nan"),
                    "rl_train_reward_last": float(np.mean(rewards_seen[-P * 5:])) if rewards_seen else float("nan")}


def evaluate(name, mcfg, params, tokenizer, test_rows, args, table, seconds, *, sampled=True):
    greedy = evaluate_accuracy(mcfg, params, test_rows, tokenizer, max_new_tokens=args.max_new_tokens, slots=64)
    entry = {"stage": name, "seconds": seconds, "greedy_acc": greedy}
    if sampled:
        r = sample_rewards(mcfg, params, test_rows, tokenizer, max_new_tokens=args.max_new_tokens, slots=128,
                           n=args.samples, temperature=1.0, seed=args.seed)
        entry.update(sample_acc=float(r.mean()), any_correct=float(np.mean(r.max(axis=1) >= 1.0)))
    table.append(entry)
    print(f"[{name}] {entry} ({load()})", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    print("start:", load(), "| devices:", jax.devices(), flush=True)
    acfg = ar.ArithmeticConfig(min_operands=args.min_operands, max_operands=args.max_operands,
                               max_digits=args.max_digits, operators=args.operators)
    tokenizer = Tokenizer.from_pretrained(build_tokenizer(pathlib.Path(tempfile.mkdtemp()) / "tokenizer"))
    t = time.perf_counter()
    train_items = ar.problems(acfg, "train", args.train_size, seed=args.seed)
    test_items = ar.problems(acfg, "test", args.test_size, seed=args.seed)
    examples = ar.sft_examples(tokenizer, train_items)
    test_rows = list(ar.prompt_rows(tokenizer, test_items))
    print(f"data: {len(examples)} train / {len(test_rows)} test in {time.perf_counter() - t:.1f}s", flush=True)

    mcfg = task_model_config(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden)
    print(f"model: {mcfg.num_params():,} parameters", flush=True)
    params0 = init_params(mcfg, jax.random.key(args.seed))
    table: list[dict] = []

    def sft(steps):
        cfg = SFTConfig(steps=steps, rows_per_step=args.batch_size, max_len=args.max_len, lr=args.lr,
                        warmup_steps=min(30, steps), seed=args.seed, log_every=50)
        t = time.perf_counter()
        p, metrics = run_sft(mcfg, params0, examples, cfg, progress=False)
        return p, time.perf_counter() - t, metrics[-1]["loss"]

    short, secs, loss = sft(args.sft_steps)
    print(f"short SFT: {args.sft_steps} steps in {secs:.0f}s, final loss {loss:.3f}", flush=True)
    evaluate(f"sft {args.sft_steps} steps", mcfg, short, tokenizer, test_rows, args, table, secs)

    if args.rl_seconds > 0:
        rl_params, info = rl_check(mcfg, short, tokenizer, train_items, test_rows, args)
        print(f"RL: {info}", flush=True)
        evaluate(f"sft + RL {info['rl_steps']} steps", mcfg, rl_params, tokenizer, test_rows, args, table,
                 secs + info["rl_seconds"])

    if args.long_sft_steps > 0:
        long, lsecs, lloss = sft(args.long_sft_steps)
        print(f"long SFT: {args.long_sft_steps} steps in {lsecs:.0f}s, final loss {lloss:.3f}", flush=True)
        evaluate(f"sft {args.long_sft_steps} steps", mcfg, long, tokenizer, test_rows, args, table, lsecs,
                 sampled=False)

    print(f"\nend: {load()}\n")
    print(f"{'stage':<28}{'wall s':>8}{'greedy acc':>12}{'sample acc':>12}{'any of n':>10}")
    for e in table:
        print(f"{e['stage']:<28}{e['seconds']:>8.0f}{e['greedy_acc']:>12.3f}"
              f"{e.get('sample_acc', float('nan')):>12.3f}{e.get('any_correct', float('nan')):>10.3f}")


if __name__ == "__main__":
    main()
