"""`areal-jax`: the command line.

    areal-jax train --gin_file=configs/quickstart.gin [--gin_param='RLConfig.steps = 40'] --run_dir=runs/x
    areal-jax sft   ...same flags...          (the SFT stage alone)
    areal-jax generate --model=DIR --prompt='...' [--max_new_tokens=64]

Every flag of the config dataclasses is bound gin-style; an unknown name, a wrong type or an
impossible device split is reported before any work starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gin_file", action="append", default=[], help="a .gin config file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="one binding, e.g. 'RLConfig.steps = 40'")
    p.add_argument("--run_dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    p.add_argument("--coordinator", default=None, help="host:port for jax.distributed (multi-host)")
    p.add_argument("--num_processes", type=int, default=None)
    p.add_argument("--process_id", type=int, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the run's CheckpointConfig directory")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "SFT warm start (optional) then asynchronous RL"),
                            ("sft", "the supervised warm start alone")):
        _add_config_flags(sub.add_parser(name, help=help_text))
    gen = sub.add_parser("generate", help="sample completions from a model directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max_new_tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("train", "sft"):
        return _train(args)
    return _generate(args)


def _train(args) -> int:
    import time

    from areal_jax.config_system import ConfigError

    if args.coordinator or os.environ.get("AREAL_DISTRIBUTED") == "1":
        from areal_jax.parallel.distributed import initialize_distributed

        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.jobs.train import run_train

    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    params = list(args.gin_param)
    if args.command == "sft":
        params.append("Stages.rl = False")
    try:
        cfg = load_job_configs(args.gin_file, params, run_dir=run_dir)
        run_train(cfg, run_dir, progress=not args.quiet, resume=args.resume)
    except ConfigError as e:
        print(f"areal-jax: configuration error: {e}", file=sys.stderr)
        return 2
    return 0


def _generate(args) -> int:
    from areal_jax.generation import generate
    from areal_jax.models import load_pretrained
    from areal_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    model = load_pretrained(args.model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in args.prompt]
    out = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, n=args.n,
                   stop_token_ids=tok.stop_token_ids)
    for p, group in zip(args.prompt, out):
        for c in group:
            print(f"### {p}\n{tok.decode(c.tokens, skip_special_tokens=True)}\n[{c.stop_reason}, "
                  f"{len(c.tokens)} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
