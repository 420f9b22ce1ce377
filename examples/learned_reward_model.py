"""RL on a learned reward alone: train a tiny reward model, then RL the quickstart policy on its score.

1. SFT: the quickstart's SFT stage (configs/quickstart.gin, RL off) gives the policy.
2. Reward model: the SFT'd policy's weights (so it starts with whatever arithmetic the policy
   knows), trained on the policy's OWN answers: 8 samples per training problem at RL's
   temperature, labelled by the exact verifier (an RM trained on right vs slipped copies of the
   task's solutions learned their format instead, docs/benchmarks.md).
   - By default (`--rm_loss likelihood`) the LM is tuned as an implicit reward model on each
     distinct answer of a problem: the logit of "right" is beta x the sum over the answer's tokens
     of log pi(token) - log pi_SFT(token), plus a bias, under binary cross-entropy. It is saved as
     a causal LM and rewards as an "lm:" term (reward/likelihood.py): the tuned LM's mean
     log-likelihood of the answer. Every written token gets a gradient through its own log-prob,
     so the LM learns which tokens are the slips.
   - `--rm_loss label`: a scalar head. Each distinct answer is one row, as many wrong as right,
     SFT'd through the training engine's objective seam (the built-in "sft" objective) on one label
     token, "Y" or "N", after the chat it will score, [user: question, assistant: answer]
     (`reward.composite.rm_input_ids`); the score head is then logit(Y) - logit(N) read from the
     last token. `--rm_loss pairwise` puts a fresh score head on the policy's backbone under the
     Bradley-Terry loss -log sigmoid(score(right) - score(wrong)) on pairs of one problem's answers.
     Either is saved as a one-label `Qwen2ForSequenceClassification`, an "rm:" term. On this task a
     head reading the last position ranks answers barely above chance (docs/benchmarks.md).
   Its ranking is measured on held-out (test-split) problems' samples: the share of (right, wrong)
   pairs of one problem it orders right ("pairwise": all that group-normalised advantages use) and
   the AUC over all samples, before RL and again on the RL'd policy's samples (reward hacking
   shows as a drop there).
3. RL: the quickstart's RL stage from the SFT'd policy, rewarded by the RM alone:
   `RLVRConfig.reward = (('lm:<dir>', 1.0), ('arithmetic', 0.0))` (or 'rm:<dir>'). The verifier's
   weight is 0: it is logged and used for held-out accuracy, never trained on. With a likelihood
   RM the RL stage adds a KL penalty to the SFT policy (`AdvantageConfig.kl_coef = 0.05`, k3):
   without it RL went on raising the reward after accuracy had peaked, by making the policy's
   answers likelier whether right or wrong (docs/benchmarks.md).

    python examples/learned_reward_model.py --run_dir runs/example_rm             # the quickstart's sizes
    python examples/learned_reward_model.py --run_dir runs/example_rm --small     # a smoke run, minutes

The last line printed and RUN/result.json give the held-out greedy accuracy (200 prompts,
exact verifier) after SFT and after RL on the RM's reward, and the RM's ranking figures.
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


def policy_samples(policy_dir: pathlib.Path, items, *, k: int, temperature: float, seed: int,
                   max_new_tokens: int = 48) -> list[tuple[str, list[str], list[bool]]]:
    """(question, k sampled answers, each right by the exact verifier) per problem in `items`: the
    policy at `policy_dir` sampled on the run's prompts (chat-templated, as RL samples them)."""
    import jax.numpy as jnp

    from areal_jax.api import SamplingParams
    from areal_jax.data.examples import prompt_example
    from areal_jax.evaluation.held_out import rewards, sample
    from areal_jax.generation.config import prompts_engine_config
    from areal_jax.generation.engine import GenerationEngine
    from areal_jax.models.hf_io import load_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.tasks.arithmetic import prompt_rows
    from areal_jax.tasks.reward import arithmetic_reward

    cfg, params = load_params(policy_dir, dtype=jnp.float32)
    tok = Tokenizer.from_pretrained(policy_dir)
    examples = [prompt_example(r) for r in prompt_rows(tok, items)]
    engine = GenerationEngine((cfg, params), prompts_engine_config(
        len(examples) * k, max(len(e.prompt_ids) for e in examples), max_new_tokens, slots=64, seed=seed))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              stop_token_ids=tuple(tok.stop_token_ids))
    groups = sample(engine, examples, sampling, arithmetic_reward, tok, n=k)
    return [(p.question, list(g.texts), [r >= 1.0 for r in rs])
            for p, g, rs in zip(items, groups, rewards(groups, arithmetic_reward))]


def ranking_quality(rm_dir: pathlib.Path, samples, *, likelihood: bool = False) -> dict[str, float]:
    """How the RM at `rm_dir` (with `likelihood`, a causal LM scored as an "lm:" term) orders
    `policy_samples`' answers: `pairwise` is the share of (right, wrong) pairs of one problem's
    samples scored right > wrong (ties count half; what group-normalised advantages use), `auc`
    the same over all pairs of all problems, `sign` the share whose score's sign matches the
    verifier (a scalar head's; a log-likelihood is never positive), with the pair and sample counts."""
    import numpy as np

    from areal_jax.reward import RewardModel
    from areal_jax.reward.composite import rm_input_ids
    from areal_jax.reward.likelihood import LikelihoodReward

    flat = [(q, t, ok) for q, texts, oks in samples for t, ok in zip(texts, oks)]
    if likelihood:
        scores = LikelihoodReward.from_pretrained(rm_dir, batch_size=64).score([(q, t) for q, t, _ in flat])
    else:
        rm = RewardModel.from_pretrained(rm_dir, batch_size=64)
        scores = rm.score_ids([rm_input_ids(rm.tokenizer, q, t) for q, t, _ in flat])
    oks = np.array([ok for _, _, ok in flat])

    def ordered(pos, neg) -> tuple[float, int]:
        if not len(pos) or not len(neg):
            return 0.0, 0
        d = pos[:, None] - neg[None, :]
        return float((d > 0).sum() + 0.5 * (d == 0).sum()), d.size

    won = pairs = 0.0
    at = 0
    for _, texts, group_oks in samples:
        s, g = scores[at:at + len(texts)], np.array(group_oks)
        at += len(texts)
        w, n = ordered(s[g], s[~g])
        won, pairs = won + w, pairs + n
    w_all, n_all = ordered(scores[oks], scores[~oks])
    return {"pairwise": won / pairs if pairs else float("nan"), "pairs": int(pairs),
            "auc": w_all / n_all if n_all else float("nan"), "sign": float(((scores > 0) == oks).mean()),
            "samples": len(flat), "right_share": float(oks.mean())}


def balanced_rows(samples, items, seed: int) -> list[tuple[str, str, bool]]:
    """(question, answer, right) rows of `policy_samples` of `items`: each distinct answer of a
    problem once, the problem's own solution among them (a right answer even where the policy
    found none), as many wrong as right ones (the larger class subsampled), shuffled."""
    rng = random.Random(seed)
    right, wrong = [], []
    for (question, texts, oks), item in zip(samples, items):
        for text, ok in dict(zip(texts + [item.solution], oks + [True])).items():
            (right if ok else wrong).append((question, text, ok))
    n = min(len(right), len(wrong))
    rows = rng.sample(right, n) + rng.sample(wrong, n)
    rng.shuffle(rows)
    return rows


def train_label_rm(policy_dir: pathlib.Path, out: pathlib.Path, rows, *, steps: int, seed: int, lr: float
                   ) -> pathlib.Path:
    """A one-label reward model at `out` from the policy's weights, SFT'd on one label token ("Y"
    right, "N" wrong) after the chat it will score (`balanced_rows`); its score head is then
    logit(Y) - logit(N) read from the last token, which is what a one-label
    Qwen2ForSequenceClassification computes."""
    import numpy as np

    from areal_jax.models.reward_head import ScoreHead, save_reward_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.reward.composite import rm_input_ids

    tok = Tokenizer.from_pretrained(policy_dir)
    cfg, params = train_labeller(policy_dir, label_examples(tok, rows, lambda q, a: rm_input_ids(tok, q, a)),
                                 steps=steps, seed=seed, lr=lr)
    yes, no = (tok.encode(t, add_special_tokens=False)[0] for t in LABELS)
    head = np.asarray(params["embed"] if cfg.tie_word_embeddings else params["lm_head"].T, np.float32)  # [V, D]
    rm_params = {k: v for k, v in params.items() if k != "lm_head"}
    rm_params["score"] = (head[yes] - head[no])[:, None]  # [D, 1]: logit(Y) - logit(N)
    save_reward_params(rm_params, cfg, ScoreHead(num_labels=1, pad_token_id=tok.pad_token_id), out)
    _copy_tokenizer(policy_dir, out)
    return out


def _copy_tokenizer(policy_dir: pathlib.Path, out: pathlib.Path) -> None:
    for f in policy_dir.iterdir():  # the tokenizer (and its chat template) travels with the RM
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)


def ranked_pairs(samples, items, seed: int) -> list[tuple[str, str, str]]:
    """(question, right answer, wrong answer) pairs of one problem each, from `policy_samples` of
    `items`: every distinct wrong answer of a problem against one of its right ones (the policy's,
    or the problem's own solution where the policy found none), shuffled."""
    rng = random.Random(seed)
    pairs = []
    for (question, texts, oks), item in zip(samples, items):
        right = sorted({t for t, ok in zip(texts, oks) if ok} | {item.solution})
        for wrong in sorted({t for t, ok in zip(texts, oks) if not ok}):
            pairs.append((question, rng.choice(right), wrong))
    rng.shuffle(pairs)
    return pairs


def train_pairwise_rm(policy_dir: pathlib.Path, out: pathlib.Path, pairs, *, steps: int, seed: int, lr: float,
                      pairs_per_step: int = 32) -> pathlib.Path:
    """A one-label reward model at `out`: the policy's backbone (so it starts with the policy's
    arithmetic) under a fresh score head, trained on `ranked_pairs` by the Bradley-Terry loss
    -log sigmoid(score(right) - score(wrong)): what group-normalised advantages use is the order
    of one problem's answers, so that is what it learns (not which problems are hard)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from areal_jax.models.hf_io import load_params
    from areal_jax.models.reward_head import ScoreHead, init_score_head, save_reward_params, sequence_scores
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.reward.composite import rm_input_ids
    from areal_jax.reward.reward_model import length_bucket

    cfg, params = load_params(policy_dir, dtype=jnp.float32)
    tok = Tokenizer.from_pretrained(policy_dir)
    head = ScoreHead(num_labels=1, pad_token_id=tok.pad_token_id)
    params = {k: v for k, v in params.items() if k != "lm_head"}
    params["score"] = jnp.asarray(init_score_head(cfg, head, seed))
    ids = [(rm_input_ids(tok, q, r), rm_input_ids(tok, q, w)) for q, r, w in pairs]
    T = length_bucket(max(len(x) for pair in ids for x in pair))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(20, steps // 5), steps, lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    state = opt.init(params)

    def loss_fn(p, tokens, seg):  # rows 0..P-1 right, P..2P-1 their wrong answers
        s = sequence_scores(p, cfg, head, tokens, seg)[:, 0]
        margin = s[:pairs_per_step] - s[pairs_per_step:]
        return jnp.mean(jax.nn.softplus(-margin)), jnp.mean(margin > 0)

    @jax.jit
    def step(p, st, tokens, seg):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, tokens, seg)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss, acc

    rng = np.random.default_rng(seed)
    pad = head.pad_token_id if head.pad_token_id is not None else 0
    log = []
    for i in range(steps):
        pick = rng.choice(len(ids), pairs_per_step, replace=len(ids) < pairs_per_step)
        rows = [ids[j][0] for j in pick] + [ids[j][1] for j in pick]
        tokens, seg = np.full((len(rows), T), pad, np.int32), np.zeros((len(rows), T), np.int32)
        for b, r in enumerate(rows):
            tokens[b, :len(r)], seg[b, :len(r)] = r, 1
        params, state, loss, acc = step(params, state, tokens, seg)
        log.append((float(loss), float(acc)))
        if (i + 1) % max(1, steps // 5) == 0:
            recent = log[-max(1, steps // 5):]
            print(f"[example] reward model step {i + 1}/{steps}: pairwise loss {np.mean([x for x, _ in recent]):.3f}, "
                  f"ordered {np.mean([a for _, a in recent]):.3f}", flush=True)
    save_reward_params(jax.device_get(params), cfg, head, out)
    _copy_tokenizer(policy_dir, out)
    return out


def distinct_answers(samples) -> list[tuple[str, str, bool]]:
    """(question, answer, right) rows of `policy_samples`: each distinct answer of a problem once,
    in the proportions the policy writes them (no balancing, no reference solution)."""
    rows = []
    for question, texts, oks in samples:
        rows += [(question, text, ok) for text, ok in dict(zip(texts, oks)).items()]
    return rows


def train_likelihood_rm(policy_dir: pathlib.Path, out: pathlib.Path, rows, *, steps: int, seed: int, lr: float,
                        beta: float, reference: bool, rows_per_step: int = 32) -> pathlib.Path:
    """A causal LM at `out`, scored as an "lm:" term (reward/likelihood.py): the policy's weights
    tuned as an implicit reward model. Its logit of "right" is beta * sum over the answer's tokens
    of log pi(token) - log pi_SFT(token), plus a learned bias, trained by binary cross-entropy on
    the verifier's labels of the policy's own answers (`distinct_answers`). Every answer token gets
    a gradient through its own log-prob, so the LM learns which written tokens are the slips; a
    scalar head would have to gather that at the last position. The reward it gives is the tuned
    LM's mean log-likelihood of an answer, which keeps the SFT policy's own ranking (better than
    chance before any tuning) and adds what the tuning learned; with `reference`, the SFT policy is
    saved beside it (`out/reference`) and the reward is the mean log-ratio to it, what the tuning
    learned alone (reward/likelihood.py)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from areal_jax.models.hf_io import load_params, save_params
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.reward.likelihood import likelihood_input, token_logprobs
    from areal_jax.reward.reward_model import length_bucket, padded_rows

    cfg, sft = load_params(policy_dir, dtype=jnp.float32)
    tok = Tokenizer.from_pretrained(policy_dir)
    inputs = [likelihood_input(tok, q, a) for q, a, _ in rows]
    T = length_bucket(max(len(ids) for ids, _ in inputs))
    tokens, seg = padded_rows([np.asarray(ids, np.int32) for ids, _ in inputs], len(inputs), T, pad=0, padding="right")
    answer = np.zeros((len(inputs), T - 1), np.float32)  # [N, T-1]: 1 where position t predicts an answer token
    for b, (ids, start) in enumerate(inputs):
        answer[b, start - 1:len(ids) - 1] = 1
    right = np.array([ok for _, _, ok in rows], np.float32)

    reference = jax.jit(lambda p, tk, sg: token_logprobs(p, cfg, tk, sg))
    ref = np.concatenate([np.asarray(reference(sft, tokens[i:i + 256], seg[i:i + 256]))
                          for i in range(0, len(inputs), 256)])
    params = {"lm": sft, "bias": jnp.zeros(())}
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(20, steps // 5), steps, lr * 0.1)
    opt = optax.adamw(schedule, weight_decay=0.0)
    state = opt.init(params)

    def loss_fn(p, tk, sg, mask, ref_lp, y):
        logit = beta * jnp.sum((token_logprobs(p["lm"], cfg, tk, sg) - ref_lp) * mask, axis=1) + p["bias"]
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, y))

    @jax.jit
    def step(p, st, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss

    rng = np.random.default_rng(seed)
    log = []
    for i in range(steps):
        pick = rng.integers(0, len(inputs), rows_per_step)
        params, state, loss = step(params, state, tokens[pick], seg[pick], answer[pick], ref[pick], right[pick])
        log.append(float(loss))
        if (i + 1) % max(1, steps // 5) == 0:
            print(f"[example] likelihood reward model step {i + 1}/{steps}: loss "
                  f"{np.mean(log[-max(1, steps // 5):]):.3f}", flush=True)
    save_params(jax.device_get(params["lm"]), cfg, out)
    _copy_tokenizer(policy_dir, out)
    if reference:
        shutil.copytree(policy_dir, out / "reference", dirs_exist_ok=True)
    return out


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
    parser.add_argument("--label_problems", type=int, default=None, help="training problems its labelled answers come from")
    parser.add_argument("--label_lr", type=float, default=1e-3, help="the reward model's or judge's SFT learning rate")
    parser.add_argument("--rm_loss", choices=("likelihood", "label", "pairwise"), default="likelihood",
                        help="reward model: a causal LM tuned as an implicit reward model and scored by its likelihood "
                             "of the answer (an 'lm:' term), or a scalar head: SFT on a right/wrong label token "
                             "(balanced rows), or Bradley-Terry on right/wrong pairs")
    parser.add_argument("--beta", type=float, default=0.5, help="likelihood reward model: the scale of its log-ratio")
    parser.add_argument("--kl_coef", type=float, default=None,
                        help="RL's KL penalty to the SFT policy (AdvantageConfig.kl_coef, k3 estimator; default 0.05 "
                             "with a likelihood reward model, which RL otherwise over-optimises, else 0)")
    parser.add_argument("--reward", choices=("likelihood", "ratio"), default="likelihood",
                        help="likelihood reward model: reward the tuned LM's own mean log-likelihood, or the mean "
                             "log-ratio to the SFT policy (saved as its reference/; RL hacked it within 20 steps, "
                             "docs/benchmarks.md)")
    parser.add_argument("--samples", type=int, default=8, help="reward model: the policy's samples per problem")
    parser.add_argument("--check_problems", type=int, default=None, help="reward model: held-out problems its ranking is measured on")
    parser.add_argument("--rl_steps", type=int, default=None, help="RL steps (default the quickstart's 120)")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in --run_dir")
    args = parser.parse_args(argv)
    args.run_dir = pathlib.Path(args.run_dir).resolve()
    args.overrides = (SMALL if args.small else []) + [f"ModelSource.init_seed = {args.seed}", f"SFTConfig.seed = {args.seed}"]
    if args.rl_steps:
        args.overrides += [f"RLConfig.steps = {args.rl_steps}", f"OptimizerConfig.total_steps = {args.rl_steps}"]
    args.label_steps = args.label_steps or (10 if args.small else 1000 if args.rm_loss == "likelihood" else 300)
    if args.rm_loss == "likelihood" and args.label_lr == parser.get_default("label_lr"):
        args.label_lr = 1e-4  # the tuned LM's head is live from the start: a tenth of a fresh head's rate
    if args.kl_coef is None:
        args.kl_coef = 0.05 if args.rm_loss == "likelihood" else 0.0
    args.label_problems = args.label_problems or (50 if args.small else 1500 if args.rm_loss == "likelihood" else 3000)
    args.check_problems = args.check_problems or (8 if args.small else 200)
    return args


def main(argv: list[str] | None = None) -> dict:
    from areal_jax.tasks.arithmetic import problems

    args = parse_args(argv, __doc__)
    policy, cfg = sft_policy(args.run_dir / "sft", args.overrides, overwrite=args.overwrite)
    temperature = cfg.rollout.temperature  # RL's own sampling: the answers the RM will rank
    # Training-split problems past the run's own prompts (a separate draw), and test-split ones
    # the RM never trains on for its held-out ranking.
    train_items = problems(cfg.arithmetic, "train", args.label_problems, seed=10_000 + args.seed)
    check_items = problems(cfg.arithmetic, "test", args.check_problems, seed=20_000 + args.seed)

    def sampled(model_dir, items, seed):
        return policy_samples(model_dir, items, k=args.samples, temperature=temperature, seed=seed,
                              max_new_tokens=cfg.rollout.max_new_tokens)

    samples = sampled(policy, train_items, args.seed)
    likelihood = args.rm_loss == "likelihood"
    if likelihood:
        data = distinct_answers(samples)
        rm_dir = train_likelihood_rm(policy, args.run_dir / "reward_model", data, steps=args.label_steps,
                                     seed=args.seed, lr=args.label_lr, beta=args.beta,
                                     reference=args.reward == "ratio")
    elif args.rm_loss == "pairwise":
        data = ranked_pairs(samples, train_items, args.seed)
        rm_dir = train_pairwise_rm(policy, args.run_dir / "reward_model", data, steps=args.label_steps,
                                   seed=args.seed, lr=args.label_lr)
    else:
        data = balanced_rows(samples, train_items, args.seed)
        rm_dir = train_label_rm(policy, args.run_dir / "reward_model", data, steps=args.label_steps, seed=args.seed,
                                lr=args.label_lr)
    before = ranking_quality(rm_dir, sampled(policy, check_items, 1_000 + args.seed), likelihood=likelihood)
    print(f"[example] reward model ({args.rm_loss} loss, {len(data)} rows of the policy's own answers): held-out "
          f"within-problem pairwise {before['pairwise']:.3f}, AUC {before['auc']:.3f}", flush=True)
    term = f"{'lm' if likelihood else 'rm'}:{rm_dir}"
    kl = [f"AdvantageConfig.kl_coef = {args.kl_coef}", "AdvantageConfig.kl_estimator = 'k3'"] if args.kl_coef else []
    summary = rl_on_reward(policy, args.run_dir / "rl", args.overrides + kl,
                           f"(('{term}', 1.0), ('arithmetic', 0.0))", overwrite=args.overwrite)
    # Reward hacking shows as the RM ranking the RL'd policy's answers worse than the SFT policy's.
    after = ranking_quality(rm_dir, sampled(args.run_dir / "rl" / "final_model", check_items, 1_000 + args.seed),
                            likelihood=likelihood)
    print(f"[example] reward model on the RL'd policy's answers: pairwise {after['pairwise']:.3f}, "
          f"AUC {after['auc']:.3f}", flush=True)
    return report(args, summary, "the reward model", rm_loss=args.rm_loss,
                  rm_reward=args.reward if likelihood else "head", kl_coef=args.kl_coef, rm_rows=len(data),
                  rm_before_rl=before,
                  rm_after_rl=after)


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
