"""Why the calculator example's SFT warm start does not learn: can the task model learn to copy?

examples/agent_calculator.py's SFT traces (question, calculator call, tool result, boxed answer)
ask a from-scratch model to copy the question's operands into the tool call and the tool's result
into \\boxed{}. This trains the task model on those traces in a bare JAX loop (same model, same
tokenization and loss mask as SFTEncoder, one trace per row, AdamW with warmup and cosine decay)
and reports, teacher-forced on 200 held-out traces, the accuracy and loss of the digits the model
must copy: in the call turn and in the answer turn separately. Chance is 0.10 accuracy and
ln 10 = 2.30 nats per digit.

--fixed draws every operand with exactly --digits digits (from --low up), so each digit sits at
one fixed distance from its copy; by default operands have 1..--digits digits as the example's task
draws them, and the distance varies with the expression's length.

    .venv/bin/python bench/agent_copy_sft.py --steps 500                       # the example's task
    .venv/bin/python bench/agent_copy_sft.py --steps 500 --fixed --ops + --low 5000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--digits", type=int, default=4, help="operand digits (at most, or exactly with --fixed)")
    p.add_argument("--fixed", action="store_true", help="every operand exactly --digits digits")
    p.add_argument("--low", type=int, default=0, help="with --fixed: the smallest operand")
    p.add_argument("--ops", default="+-", help="operators drawn")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr (the example's SFTConfig.lr)")
    p.add_argument("--constant_lr", action="store_true", help="no cosine decay after warmup")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8, help="traces per step (the example packs one per row)")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--train_size", type=int, default=4000)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def problems(args: argparse.Namespace, split: str, n: int) -> list:
    from areal_jax.tasks import arithmetic as ar

    if not args.fixed:
        task = ar.ArithmeticConfig(min_operands=2, max_operands=2, max_digits=args.digits, operators=args.ops)
        return ar.problems(task, split, n, seed=args.seed)
    rng, out, seen = random.Random(f"{args.seed}/{split}"), [], set()
    low, high = max(args.low, 10 ** (args.digits - 1)), 10 ** args.digits - 1
    while len(out) < n:
        expression = f"{rng.randint(low, high)}{rng.choice(args.ops)}{rng.randint(low, high)}"
        if ar.split_of(expression, 10) == split and expression not in seen:
            seen.add(expression)
            out.append(ar.make_problem(expression))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from areal_jax.agents.calculator_agent import tool_trace, tools_preamble
    from areal_jax.data.pipeline import DataConfig
    from areal_jax.data.sft_data import SFTEncoder
    from areal_jax.models.tokenizer import Tokenizer
    from areal_jax.models.transformer import forward, init_params
    from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config

    tokenizer = Tokenizer.from_pretrained(build_tokenizer(tempfile.mkdtemp()))
    preamble = tools_preamble(tokenizer)
    encoder = SFTEncoder(DataConfig(paths=("traces",)), tokenizer)

    def examples(split: str, n: int) -> list:
        return [encoder.example(tool_trace(p.prompt_row().messages, p.expression, preamble), split)
                for p in problems(args, split, n)]

    train, test = examples("train", args.train_size), examples("test", 200)
    T = max(e.ids.size for e in train + test)

    def arrays(exs: list) -> tuple[np.ndarray, np.ndarray]:
        ids, trained = np.zeros((len(exs), T), np.int32), np.zeros((len(exs), T), np.float32)  # [N, T]
        for i, e in enumerate(exs):
            ids[i, :e.ids.size], trained[i, :e.ids.size] = e.ids, e.trained
        return ids, trained

    train_ids, train_mask = arrays(train)
    test_ids, test_mask = arrays(test)
    digits = [tokenizer.encode(str(d))[0] for d in range(10)]
    # Which turn each trained target belongs to: 1 the call, 2 the boxed answer ([N, T - 1]).
    target_mask = test_mask[:, 1:] > 0
    turn = np.cumsum(target_mask & ~np.pad(target_mask, ((0, 0), (1, 0)))[:, :-1], axis=1) * target_mask
    is_digit = np.isin(test_ids[:, 1:], digits) & target_mask

    cfg = task_model_config(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden)
    params = init_params(cfg, args.seed)
    decay = (optax.constant_schedule(args.lr) if args.constant_lr
             else optax.cosine_decay_schedule(args.lr, max(args.steps - args.warmup, 1), 0.1))
    schedule = optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup), decay], [args.warmup])
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.01))
    opt_state = optimizer.init(params)

    def loss_fn(p, ids, mask):
        logits, _ = forward(p, cfg, ids[:, :-1], scan_layers=False)  # [B, T - 1, V]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum(), (logits.argmax(-1) == ids[:, 1:], nll)

    @jax.jit
    def train_step(p, state, ids, mask):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, ids, mask)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    evaluate = jax.jit(loss_fn)
    rng = np.random.default_rng(args.seed)
    history, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = rng.integers(0, len(train), args.batch)
        params, opt_state, loss = train_step(params, opt_state, train_ids[batch], train_mask[batch])
        if step % args.eval_every == 0 or step == args.steps:
            _, (right, nll) = evaluate(params, test_ids, test_mask)
            right, nll = np.asarray(right), np.asarray(nll)
            point = {"step": step, "train_loss": round(float(loss), 4), "s": round(time.perf_counter() - t0, 1)}
            for name, which in (("call", 1), ("answer", 2)):
                sel = is_digit & (turn == which)
                point[f"{name}_digit_acc"] = round(float(right[sel].mean()), 3)
                point[f"{name}_digit_nll"] = round(float(nll[sel].mean()), 3)
            # Teacher-forced rows whose every trained token is right (greedy would reproduce them).
            point["rows_exact"] = round(float((right | ~target_mask).all(1).mean()), 3)
            history.append(point)
            print(json.dumps(point), flush=True)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "args": vars(args),
              "history": history}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
