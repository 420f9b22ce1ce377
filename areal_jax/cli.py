"""`areal-jax`: the command line.

    areal-jax train --gin_file=configs/quickstart.gin [--gin_param='RLConfig.steps = 40'] --run_dir=runs/x
    areal-jax sft   ...same flags...          (the SFT stage alone)
    areal-jax eval --model=DIR --gin_param="DataConfig.paths = ('test.jsonl',)" \
                   --gin_param='EvalConfig.n_samples = 8' --gin_param='EvalConfig.ks = (1, 8)' --run_dir=runs/e
                   [--gin_param='EvalConfig.dtype = "bfloat16"'] [--gin_param='EvalConfig.tensor_parallel = 2']
                   (the weights load sharded over this host's devices: tensor_parallel per replica)
    areal-jax eval --run_dir_of=RUN   (the run's final model on its held-out files, with its reward and prompts)
    areal-jax generate --model=DIR --prompt='...' [--max_new_tokens=64] [--temperature=0.7 --top_p=0.9 --top_k=50]
                   [--system='...'] [--chat_template_kwargs='{"enable_thinking": false}'] [--dtype=bfloat16]
                   [--tensor_parallel=2]   (prompts encoded as the model's run encoded them: areal_jax_prompt.json)
    areal-jax config [--gin_file=...]   (every configurable field: value, type, one line of doc)
    areal-jax train --run_dir=RUN --resume [--gin_param=... --override_config]
                   (continues RUN with its config.gin; flags that change it need --override_config)
    areal-jax export --checkpoint=RUN/checkpoints[/STEP] --out=DIR [--dtype=bfloat16] [--adapter]
                   (a checkpoint as an HF model directory, tokenizer included; `eval --model=DIR` takes it;
                   a LoRA run's adapters merged in, or with --adapter alone in PEFT's format)
    areal-jax plan --gin_file=configs/qwen2_5_1_5b_gsm8k_tpu.gin [--target=v5e-16] [--json]
                   (compiles every program of the run for the target, without it; exit 1 if one does not fit)
    areal-jax simulate --gin_file=CONFIG [--target NAME | --calibrate RUN_DIR] [--lengths PATH | --length-dist SPEC]
                   [--sweep FIELD=v1,v2] [--seed S] [--json]
                   (a discrete-event simulation of the run: async vs sync, the split and eta; areal_jax/simulate/)

Every flag of the config dataclasses is bound gin-style; an unknown name, a wrong type or an
impossible device split is reported before any work starts. So are problems with the model, the data
or the run directory (`train` refuses a directory that holds a run unless `--overwrite` or
`--resume`): one line naming the file or field, exit code 2 (`--debug` shows the traceback).

SIGINT or SIGTERM ends a command cleanly (exit 130 / 143): the reward pool's workers, its fork
server and every sandboxed program are stopped and their directories removed before the process
exits; a second signal ends it at once. This holds even where SIGINT came in ignored (a command
started with `&` from a script inherits that): the command handles it. During `train`'s RL stage with a CheckpointConfig the first
signal is a preemption notice: the last completed step is checkpointed first (jobs/shutdown.py,
within CheckpointConfig.save_on_signal_s). A full, over-quota or read-only disk is one line naming
the path and the free space, exit code 74 (jobs/errors.py lists the codes).

Every command takes `--compile_cache=DIR` (default: $AREAL_JAX_COMPILE_CACHE, else off): XLA's
persistent compilation cache, so a rerun loads the programs a previous run compiled instead of
compiling them again (minutes for real models on TPU/GPU; ~1 minute of the CPU quickstart).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _add_distributed_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="start jax.distributed with the cluster auto-detected (TPU pod, SLURM, Open MPI); "
                        "the same as AREAL_DISTRIBUTED=1")
    p.add_argument("--coordinator", default=None, help="host:port for jax.distributed (multi-host)")
    p.add_argument("--num_processes", type=int, default=None)
    p.add_argument("--process_id", type=int, default=None)


def _wants_distributed(args) -> bool:
    # Opt-in: auto-detection on a machine that merely looks like a cluster (a Kubernetes pod, a
    # SLURM login shell) would try to join one.
    return bool(args.distributed or args.coordinator or os.environ.get("AREAL_DISTRIBUTED") == "1")


def _maybe_initialize_distributed(args) -> None:
    if _wants_distributed(args):
        from areal_jax.parallel.distributed import initialize_distributed

        initialize_distributed(args.coordinator, args.num_processes, args.process_id)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gin_file", action="append", default=[], help="a .gin config file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="one binding, e.g. 'RLConfig.steps = 40'")
    p.add_argument("--run_dir", default=None, help="where the run writes (default: runs/<timestamp>)")
    _add_distributed_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the run's CheckpointConfig directory "
                        "(an error if there is none)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a --run_dir that holds a run: its records and checkpoints are removed")
    p.add_argument("--override_config", action="store_true",
                   help="with --resume: apply --gin_file/--gin_param that change the run's own config (RUN/config.gin; "
                        "without this flag the changes are listed and the resume refused)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Shared by every command (argparse parents: the flag goes after the command name).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--compile_cache", default=os.environ.get("AREAL_JAX_COMPILE_CACHE") or None,
                        help="directory of XLA's persistent compilation cache (default: "
                             "$AREAL_JAX_COMPILE_CACHE, else no cache)")
    common.add_argument("--debug", action="store_true",
                        help="show the traceback of a configuration, model or data error")
    common.add_argument("--import_path", action="append", default=[], metavar="DIR",
                        help="a directory your reward functions and workflows import from (repeatable); the "
                             "working directory is always searched first, as `python -m` does")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "SFT warm start (optional) then asynchronous RL"),
                            ("sft", "the supervised warm start alone")):
        _add_config_flags(sub.add_parser(name, help=help_text, parents=[common]))
    ev = sub.add_parser("eval", help="pass@k / maj@k of a model directory on prompt files", parents=[common])
    ev.add_argument("--model", default=None, help="HF model directory (tokenizer files beside the weights; its "
                    "areal_jax_prompt.json, when there, sets the prompt encoding)")
    ev.add_argument("--run_dir_of", default=None, metavar="RUN",
                    help="evaluate the run RUN as it evaluated itself: its final_model (unless --model), reward, "
                         "held-out files, format, prompt encoding and completion budget; bindings still override")
    ev.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    ev.add_argument("--gin_file", action="append", default=[])
    ev.add_argument("--gin_param", action="append", default=[])
    ev.add_argument("--run_dir", default=None)
    ev.add_argument("--reward_workers", type=_positive_int, default=None,
                    help="reward worker processes per host (default: RewardPoolConfig.num_workers); a reward "
                         "declared in-process (arithmetic) needs none")
    _add_distributed_flags(ev)
    pl = sub.add_parser("plan", help="compile every program of a run for its target and check that it fits",
                        parents=[common])
    pl.add_argument("--gin_file", action="append", default=[])
    pl.add_argument("--gin_param", action="append", default=[])
    pl.add_argument("--target", default=None, help="e.g. v5e-16, v5p-128, 8xh100, 4x8xh100 (default: PlanConfig.target)")
    pl.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pl.add_argument("--only", default=None, help="plan only the programs whose name contains this")
    pl.add_argument("--all", action="store_true",
                    help="every program of every shape (default: the largest of each family, which bound the "
                         "peak, and those the throughput prediction reads)")
    pl.add_argument("--no_cache", action="store_true", help="recompile instead of reading the plan cache")
    pl.add_argument("--jobs", type=int, default=None,
                    help="compiles at once, on threads of this one process (default: as the cores and free "
                         "memory allow, 6 GiB each)")
    si = sub.add_parser("simulate", help="simulate the run's scheduling: trained tokens/s of async vs sync, "
                        "splits and eta, costs from a target's roofline or a recorded run", parents=[common])
    from areal_jax.simulate.driver import add_arguments as add_simulate_arguments

    add_simulate_arguments(si)
    co = sub.add_parser("config", help="every configurable field with its value, type and meaning", parents=[common])
    co.add_argument("--gin_file", action="append", default=[])
    co.add_argument("--gin_param", action="append", default=[])
    ex = sub.add_parser("export", help="a training checkpoint as a Hugging Face model directory", parents=[common])
    ex.add_argument("--checkpoint", required=True,
                    help="RUN/checkpoints (its latest finished step) or RUN/checkpoints/STEP; gs:// works")
    ex.add_argument("--out", required=True, help="the HF directory to write (must be empty unless --overwrite)")
    ex.add_argument("--dtype", default="float32", help="of the stored weights: float32, bfloat16 or float16")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ex.add_argument("--run_dir", default=None, help="the checkpoint's run (default: the checkpoint directory's parent)")
    ex.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the run's)")
    ex.add_argument("--adapter", action="store_true", help="a LoRA run: write only its adapters, in PEFT's format "
                    "(adapter_config.json + adapter_model.safetensors; default: the model with them merged in)")
    gen = sub.add_parser("generate", help="sample completions from a model directory", parents=[common])
    gen.add_argument("--model", required=True, help="HF model directory; its areal_jax_prompt.json (written by "
                     "train and export) sets the prompt encoding, which the flags below override")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max_new_tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top_p", type=float, default=1.0)
    gen.add_argument("--top_k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--system", default=None, help="a system turn before each prompt (chat template only)")
    gen.add_argument("--chat_template_kwargs", default=None, metavar="JSON",
                     help="variables of the chat template, e.g. '{\"enable_thinking\": false}'")
    gen.add_argument("--n", type=int, default=1)
    # The same split as EvalConfig.dtype / EvalConfig.tensor_parallel, as flags: generate has no gin config.
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="of the weights and KV cache (as EvalConfig.dtype; bfloat16 halves the memory)")
    gen.add_argument("--tensor_parallel", type=_positive_int, default=1,
                     help="devices per model replica, as EvalConfig.tensor_parallel: the weights load sharded "
                          "onto a mesh of every local device (tensor_parallel per replica, the rest data-parallel "
                          "over the samples); it must divide the device count and the model's heads, kv heads, "
                          "intermediate size and vocabulary")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt, so that every `finally`
    runs: a reward pool left to the default action would orphan its sandboxed programs."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    from areal_jax.platforms import choose_platforms

    choose_platforms()  # before jax loads: no CUDA / libtpu plugin noise on a machine without them
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    # Python keeps an inherited SIG_IGN for SIGINT (any command a script starts with `&`), and then
    # a SIGINT would be dropped while sandboxed reward programs run on: handle it as documented.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run_command(args)
    except KeyboardInterrupt as e:  # cleanup has run on the way out
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(f"areal-jax: stopped by {name}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _run_command(args) -> int:
    from areal_jax.user_code import add_import_paths

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    add_import_paths(args.import_path)  # user rewards and workflows: before any config names them
    from areal_jax.jobs.errors import quiet_storage_noise

    quiet_storage_noise()  # a full disk is reported once, as the last line
    if args.command in ("plan", "export", "simulate"):  # before jax starts: touch no accelerator
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    if args.command == "plan":
        return _plan(args)
    if args.command == "simulate":
        from areal_jax.simulate.command import main as simulate_main

        return simulate_main(args)
    if args.command == "config":
        return _config(args)
    try:
        return _train(args) if args.command in ("train", "sft") else \
            _eval(args) if args.command == "eval" else _export(args) if args.command == "export" else _generate(args)
    except Exception as e:
        from areal_jax.jobs.errors import user_error  # one line and an exit code (2, 74) for what is not a bug

        reported = user_error(e, getattr(args, "run_dir", None))
        if args.debug or reported is None:
            raise  # a bug, or --debug: the traceback
        print(f"areal-jax: {reported[0]}", file=sys.stderr)
        return reported[1]


def enable_compile_cache(directory: str) -> None:
    """Turns on XLA's persistent compilation cache in `directory` (created if missing)."""
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    # Keep every program: the many small ones of a CPU run add up to most of its compile time.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _eval(args) -> int:
    import json
    import time

    import jax

    from areal_jax import config_system as cs
    from areal_jax.data.pipeline import DataConfig
    from areal_jax.evaluation import EvalConfig
    from areal_jax.jobs.evaluate import evaluate_model
    from areal_jax.jobs.inputs import InputError
    from areal_jax.reward.pool import RewardPoolConfig
    from areal_jax.reward.sandbox import SandboxLimits

    if args.run_dir is None and _wants_distributed(args):
        print("areal-jax: a multi-process eval needs --run_dir (one directory all processes agree on)",
              file=sys.stderr)
        return 2
    from areal_jax import paths

    # Local or remote (gs://), as a train run's directory.
    run_dir = paths.as_path(args.run_dir or os.path.join("runs", "eval-" + time.strftime("%Y%m%d-%H%M%S")))
    for config_class in (EvalConfig, DataConfig, RewardPoolConfig, SandboxLimits):
        cs.register(config_class)
    cs.parse(args.gin_file, args.gin_param)
    from areal_jax.jobs import run_settings

    model_dir, eval_over, data_over = args.model, {}, {}
    if args.run_dir_of:  # the run's own evaluation, each field unless bound here
        run_model, eval_over, data_over = run_settings.eval_defaults(args.run_dir_of, held_out_dir=run_dir)
        model_dir = model_dir or run_model
    if model_dir is None:
        raise InputError("eval needs --model=DIR or --run_dir_of=RUN")
    data_over.update(run_settings.unbound_prompt_settings(run_settings.read_prompt_settings(model_dir),
                                                          cs.bindings(DataConfig)))
    cfg = cs.build(EvalConfig, **{k: v for k, v in eval_over.items() if k not in cs.bindings(EvalConfig)})
    data = cs.build(DataConfig, **{k: v for k, v in data_over.items() if k not in cs.bindings(DataConfig)})
    workers = {} if args.reward_workers is None else {"num_workers": args.reward_workers}
    report = evaluate_model(model_dir, data, cfg, pool_cfg=cs.build(RewardPoolConfig, **workers),
                            sandbox=cs.build(SandboxLimits), out_dir=run_dir, tokenizer_dir=args.tokenizer,
                            before_load=lambda: _maybe_initialize_distributed(args))
    if jax.process_index() == 0:
        print(json.dumps(report.overall, indent=2))
        print(f"[areal-jax] per-sample results: {run_dir / 'samples.jsonl'}; report: {run_dir / 'report.json'}")
    return 0


def _train(args) -> int:
    import time

    _maybe_initialize_distributed(args)
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.python_api import Trainer

    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    params, gin_files = list(args.gin_param), list(args.gin_file)
    if args.command == "sft":
        params.append("Stages.rl = False")
    if args.override_config and not args.resume:
        from areal_jax.jobs.inputs import InputError

        raise InputError("--override_config applies to --resume (a new run takes its flags as given)")
    import jax

    # Every cross-field check, the per-process shares included, before any work starts.
    if args.resume:  # the run's own bindings; flags that change them need --override_config
        from areal_jax.jobs.resume_config import resume_configs

        cfg = resume_configs(run_dir, gin_files, params, override=args.override_config,
                             num_processes=jax.process_count())
    else:
        cfg = load_job_configs(gin_files, params, run_dir=run_dir, num_processes=jax.process_count())
    Trainer(cfg, run_dir=run_dir)._train(progress=not args.quiet, resume=args.resume, overwrite=args.overwrite)
    return 0


def _export(args) -> int:
    from areal_jax.jobs.export import ExportConfig, run_export

    out, step = run_export(ExportConfig(checkpoint=args.checkpoint, out=args.out, dtype=args.dtype,
                                        overwrite=args.overwrite, run_dir=args.run_dir, tokenizer=args.tokenizer,
                                        adapter=args.adapter))
    print(f"[areal-jax] exported step {step} of {args.checkpoint} -> {out}")
    return 0


def _config(args) -> int:
    from areal_jax.config_system import ConfigError
    from areal_jax.jobs.describe import describe_configs

    try:
        print(describe_configs(args.gin_file, args.gin_param))
    except ConfigError as e:
        print(f"areal-jax: configuration error: {e}", file=sys.stderr)
        return 2
    return 0


def _plan(args) -> int:
    import json

    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.plan.config import PlanConfig
    from areal_jax.plan.job import PlanError, plan_job
    from areal_jax.plan.planner import compile_workers
    from areal_jax.plan.report import HEADER, format_plan, program_row, run_totals
    from areal_jax.plan.targets import LibtpuBusy, parse_target

    try:
        job = load_job_configs(args.gin_file, args.gin_param, run_dir="plan")
        plan_cfg = cs.build(PlanConfig)
        name = args.target or plan_cfg.target
        if not name:
            raise PlanError("no target: pass --target=NAME or bind PlanConfig.target")
        target = parse_target(name)
        if args.jobs is not None and args.jobs < 1:
            raise PlanError(f"--jobs must be >= 1, got {args.jobs}")
    except (cs.ConfigError, PlanError, ValueError) as e:
        print(f"areal-jax: configuration error: {e}", file=sys.stderr)
        return 2
    live = None
    if not args.only:  # generation at the concurrency the workload sustains, not the slots (issue 40)
        from areal_jax.simulate.driver import config_row

        try:
            live = config_row(args.gin_file, args.gin_param, target.name)
        except ValueError as e:
            print(f"areal-jax: plan: no simulated row ({' '.join(str(e).split())}); generation at full slots",
                  file=sys.stderr)
    if not args.json:
        print(HEADER, flush=True)
    try:
        plan = plan_job(job, plan_cfg, target, gin_files=args.gin_file, use_cache=not args.no_cache, only=args.only,
                        every_program=args.all, workers=compile_workers(args.jobs), live=live,
                        on_program=None if args.json else lambda p: print(program_row(p), flush=True))
    except (PlanError, ValueError) as e:
        print(f"areal-jax: configuration error: {e}", file=sys.stderr)
        return 2
    except LibtpuBusy as e:
        print(f"areal-jax: error: {e}", file=sys.stderr)
        return 3
    if args.json:
        out = plan.as_json()
        if "step_s" in plan.prediction:  # the run's hours, as the table states them
            out["run"] = run_totals(plan.prediction["step_s"], job.rl.steps, target.hosts * target.devices_per_host)
        print(json.dumps(out, indent=2))
    else:
        print("\n" + format_plan(plan, steps=job.rl.steps))
    return 0 if plan.fits else 1


def _generate(args) -> int:
    from areal_jax.evaluation import engine_mesh
    from areal_jax.generation import generate
    from areal_jax.jobs.inputs import InputError

    for flag, value, ok, want in (("--n", args.n, args.n >= 1, ">= 1"),
                                  ("--max_new_tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
                                  ("--temperature", args.temperature, 0 <= args.temperature < float("inf"),
                                   "finite and >= 0"),
                                  ("--top_p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
                                  ("--top_k", args.top_k, args.top_k >= 0, ">= 0 (0: no cut)")):
        if not ok:  # before the model loads
            raise InputError(f"{flag} must be {want}, got {value}")

    from areal_jax.jobs.evaluate import load_model
    from areal_jax.jobs.inputs import check_model_dir
    from areal_jax.models.hf_io import read_config

    check_model_dir(args.model, "--model")
    limit = read_config(args.model).max_position_embeddings
    if args.max_new_tokens >= limit:  # before the weights load: a cache of 100,000 positions is minutes
        raise InputError(f"--max_new_tokens = {args.max_new_tokens} leaves no position for the prompt within "
                         f"the model's max_position_embeddings = {limit} ({args.model}/config.json)")
    tok, model = load_model(args.model, dtype=args.dtype,
                            mesh_for=lambda model_cfg: engine_mesh(model_cfg, args.tensor_parallel,
                                                                   field="--tensor_parallel"))
    from areal_jax.jobs.run_settings import encode_prompts, generate_settings

    # The model's recorded prompt encoding (a base model with none continues the text as given).
    settings = generate_settings(args.model, system=args.system, chat_template_kwargs=args.chat_template_kwargs)
    prompts = encode_prompts(tok, list(args.prompt), settings)
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > limit:
        raise InputError(f"--max_new_tokens = {args.max_new_tokens} after the longest prompt ({longest} tokens) passes "
                         f"the model's max_position_embeddings = {limit}: at most {limit - longest} new tokens")
    out = generate(model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, n=args.n,
                   top_p=args.top_p, top_k=args.top_k, stop_token_ids=tok.stop_token_ids)
    for p, group in zip(args.prompt, out):
        for c in group:
            print(f"### {p}\n{tok.decode(c.tokens, skip_special_tokens=True)}\n[{c.stop_reason}, "
                  f"{len(c.tokens)} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
