"""`areal-jax simulate`: rows of simulated runs of a config, their costs from the target's roofline
or from a recorded run, printed as a table or JSON.

    areal-jax simulate --gin_file=CONFIG [--gin_param ...] [--target NAME | --calibrate RUN_DIR]
                       [--lengths PATH | --length-dist SPEC] [--sweep FIELD=v1,v2,...] [--seed S] [--json]

Rows: the config's own (mode, eta, split), or with `--sweep` a field's value replaced by each of
the listed ones (fields: mode, eta, split = generation devices per host; several --sweep flags
multiply), and always the synchronous colocated baseline that "vs sync" compares with. Each row
states its step time and the run's wall time and device-hours for RLConfig.steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
from typing import Any

# Imported by `areal-jax`'s parser: the modules that import jax load only when the command runs.
SWEEP_FIELDS = ("mode", "eta", "split")
COLOCATED = "colocated"  # a split value: both sides on every device (--sweep split=..., --tune)
DEFAULT_TRANSFER_BYTES_PER_S = 50e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gin_file", action="append", default=[])
    p.add_argument("--gin_param", action="append", default=[])
    costs = p.add_mutually_exclusive_group()
    costs.add_argument("--target", default=None, help="costs from the analytic roofline of this target "
                       "(v5e-16, 8xh100, 4x8xh100, ...; default PlanConfig.target)")
    costs.add_argument("--calibrate", default=None, metavar="RUN_DIR",
                       help="costs fitted to RUN_DIR/metrics.jsonl's recorded program timings")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument("--lengths", default=None, metavar="PATH",
                         help="completion (and prompt) lengths of a run directory's rollouts/step_*.jsonl")
    lengths.add_argument("--length-dist", "--length_dist", dest="length_dist", default=None, metavar="SPEC",
                         help="lognormal:mean=M,sigma=S | geometric:mean=M | constant:length=L | uniform:lo=A,hi=B; "
                              "each takes cap=N and prompt=N")
    p.add_argument("--sweep", action="append", default=[], metavar="FIELD=v1,v2",
                   help=f"rows for each value of FIELD in {SWEEP_FIELDS} (repeatable: the product); "
                        f"split takes generation devices per host or {COLOCATED!r}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20, help="training steps simulated per row")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the figures")
    p.add_argument("--devices_per_host", type=int, default=None,
                   help="devices of one host (default: the target's; with --calibrate the run's devices.json)")
    p.add_argument("--hosts", type=int, default=None, help="hosts (default: the target's, else 1)")
    p.add_argument("--calibrate_skip", type=int, default=None,
                   help="recorded steps left out of the fit (default: the first 40%%, which compile)")
    p.add_argument("--reward_s", type=float, default=0.0, help="reward latency per group, seconds")
    p.add_argument("--transfer_gbps", type=float, default=None,
                   help="roofline costs: GB/s at which one host receives the generation weights (default: "
                        f"{DEFAULT_TRANSFER_BYTES_PER_S / 1e9:g}; on a multi-slice TPU target its DCN per host "
                        "over the other slices' share, plan/targets.py)")
    p.add_argument("--transfer_changed", type=float, default=1.0,
                   help="roofline costs with RLConfig.transfer_mode = 'delta': share of the generation-dtype "
                        "weights whose bits change per step (the push sends them sparse when that is smaller)")
    p.add_argument("--json", action="store_true", help="one JSON object: rows and assumptions")
    p.add_argument("--tune", action="store_true",
                   help="search the split, micro-batch budget, engine slots / KV pool and eta (within --sweep eta=) "
                        "for the most trained tokens/s among points whose programs fit; print the best as gin bindings")
    p.add_argument("--tune_top", type=int, default=5, help="--tune: best points shown")
    p.add_argument("--tune_compiled_s", type=float, default=120.0,
                   help="--tune: seconds to spend looking up the best points' compiled peaks in the plan cache "
                        "(lowering their programs; 0: the hand estimate only)")
    p.add_argument("--write", default=None, metavar="FILE.gin", help="--tune: write the best point's bindings here")


class SimulateError(ValueError):
    """A user error: one line naming the flag, field or file."""


def _parse_sweeps(specs: list[str]) -> list[tuple[str, list[Any]]]:
    out = []
    for spec in specs:
        field, eq, values = spec.partition("=")
        field = field.strip()
        if field == "kv_dtype":
            raise SimulateError(f"--sweep {spec!r}: kv_dtype is swept by --tune (each dtype is its own engine); "
                                "without it, simulate one with --gin_param 'EngineConfig.kv_dtype=\"float8_e4m3fn\"'")
        if not eq or field not in SWEEP_FIELDS or not values.strip():
            raise SimulateError(f"--sweep {spec!r}: use FIELD=v1,v2 with FIELD one of {SWEEP_FIELDS}")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if field != "mode":
            try:  # a split may also be "colocated": both sides on every device
                items = [v if field == "split" and v == COLOCATED else int(v) for v in items]
            except ValueError:
                raise SimulateError(f"--sweep {spec!r}: {field} takes integers"
                                    + (f" (or {COLOCATED!r})" if field == "split" else "")) from None
        out.append((field, items))
    return out


def _run_devices(run_dir: str) -> dict[str, int]:
    path = pathlib.Path(run_dir) / "devices.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _ride_tokens_per_step(run_dir: str, job, workload) -> int:
    """Tokens each step of the recorded run's ride chunks computed over a host: its data replicas x
    EngineConfig.reprefill_in_decode_rows x _width, those of its config.json (else this config's)."""
    path = pathlib.Path(run_dir) / "config.json"
    recorded = (json.loads(path.read_text()).get("engine") or {}) if path.is_file() else {}
    rows = recorded.get("reprefill_in_decode_rows", job.engine.reprefill_in_decode_rows)
    width = recorded.get("reprefill_in_decode_width", job.engine.reprefill_in_decode_width)
    return workload.generation_replicas(workload.config_generation_devices) * int(rows) * int(width)


def build_workload(job, *, hosts: int, devices_per_host: int):
    """The Workload of a job's configs; also the config's generation devices per host and whether
    its sides share the devices (MeshConfig.colocated, or hosts too small to split)."""
    from areal_jax.parallel.meshes import split_local_devices
    from areal_jax.simulate.config import Workload

    try:
        split = split_local_devices(job.mesh, devices_per_host)
    except ValueError as e:
        raise SimulateError(f"MeshConfig on hosts of {devices_per_host} devices: {e}") from None
    generation = devices_per_host if split.colocated else split.num_generation
    rl = job.rl
    wl = Workload(
        hosts=hosts, devices_per_host=devices_per_host, batch_groups=rl.batch_size,
        samples_per_group=job.rollout.n_samples, max_concurrent=rl.max_concurrent,
        channel_capacity=rl.channel_capacity or 4 * (rl.batch_size // hosts), engine=job.engine,
        # Devices per replica: a replica's experts split over generation_expert x tensor devices.
        generation_tensor=job.mesh.generation_tensor * job.mesh.generation_expert, train_tensor=job.mesh.train_tensor,
        config_generation_devices=generation, max_tokens_per_microbatch=job.train_engine.max_tokens_per_microbatch,
        num_minibatches=job.ppo.num_minibatches, row_buckets=tuple(job.train_engine.row_buckets or ()),
        max_group_age=rl.max_group_age, max_new_tokens=job.rollout.max_new_tokens,
        minibatch_seed=job.ppo.minibatch_seed)
    return wl, generation, split.colocated


def paged_workload(job, plan_cfg, gin_files, target, workload):
    """The workload with the engine's paged KV pool where the engine pages on `target`
    (EngineConfig.kv_layout; "auto" pages on accelerators): pool pages per replica from
    EngineConfig.kv_pool_pages / kv_pool_bytes (default: the dense cache's bytes), and the decode
    kernel's block (kernels/paged_gpu.py reads 128 tokens at a time, kernels/paged_tpu.py 256)."""
    from areal_jax.plan.job import gen_dtype, model_config_for

    engine = job.engine
    layout = getattr(engine, "layout", None)
    if layout is None or layout(target.platform) != "paged":
        return workload
    model = model_config_for(job, plan_cfg, gin_files)
    cache_itemsize = engine.kv_itemsize(gen_dtype(job))  # 1 with kv_dtype float8_e4m3fn
    page_bytes = engine.page_size * 2 * model.num_layers * model.num_kv_heads * model.head_dim * cache_itemsize
    scale_bytes = engine.kv_scale_bytes(model.num_layers, model.num_kv_heads, gen_dtype(job))
    replicas = workload.generation_replicas(workload.config_generation_devices)
    block = 256 if target.platform == "tpu" else 128
    return dataclasses.replace(workload, kv_pool_pages=engine.pool_pages(page_bytes, replicas, scale_bytes),
                               page_size=engine.page_size, block_tokens=max(engine.page_size, block))


def roofline_costs(job, plan_cfg, gin_files, target, workload, row, *, transfer_bytes_per_s, reward_s,
                   transfer_changed: float = 1.0):
    """`RooflineCosts` of a row's split on `target` (plan/: the model's shapes, analytic FLOPs, published peaks)."""
    from areal_jax.plan.estimate import EstimateContext
    from areal_jax.models.quantize import served_bytes
    from areal_jax.plan.job import gen_dtype, model_config_for
    from areal_jax.simulate.costs import RooflineCosts

    model = model_config_for(job, plan_cfg, gin_files)
    generating = row.generating_devices(workload)
    engine, _ = workload.engine_for(row, scale=True)
    replicas = workload.generation_replicas(generating)
    weight_bytes = model.num_params() * gen_dtype(job).itemsize
    cache_itemsize = job.engine.kv_itemsize(gen_dtype(job))
    kv_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * cache_itemsize
    train_devices = row.train_devices(workload) * workload.hosts
    ctx = EstimateContext(model=model, fsdp=max(1, train_devices // (job.mesh.train_tensor * job.mesh.train_expert)),
                          train_tensor=job.mesh.train_tensor, generation_tensor=job.mesh.generation_tensor,
                          train_expert=job.mesh.train_expert, generation_expert=job.mesh.generation_expert,
                          compute_bytes=2 if job.train_engine.compute_dtype == "bfloat16" else 4,
                          remat=job.train_engine.remat, logit_chunk_tokens=job.train_engine.logit_chunk_tokens)
    sent = 1.0
    if getattr(job.rl, "transfer_mode", "full") == "delta":  # sparse bit-deltas where smaller (parallel/delta_sync.py)
        from areal_jax.parallel.delta_sync import sent_fraction

        sent = sent_fraction(transfer_changed, gen_dtype(job).itemsize)
    return RooflineCosts(learned_rewards=learned_reward_costs(job, target), model=model, target=target,
                         estimate_context=ctx, replicas=replicas,
                         generation_tensor=job.mesh.generation_tensor * job.mesh.generation_expert,
                         slots_per_replica=engine.num_slots // replicas,
                         train_devices=train_devices, hosts=workload.hosts, generation_weight_bytes=weight_bytes,
                         # The cache splits over "tensor" only: every expert group of a replica holds
                         # and reads all of it (generation_expert copies).
                         kv_bytes_per_token=kv_bytes * job.mesh.generation_expert,
                         separate_proximal=job.ppo.decoupled and job.ppo.num_minibatches > 1,
                         transfer_bytes_per_s=transfer_bytes_per_s, pack_width=engine.pack_width, reward_s=reward_s,
                         transfer_sent_fraction=sent,
                         served_weight_fraction=served_bytes(model, gen_dtype(job).itemsize, job.engine.weight_dtype)
                         / weight_bytes)


def learned_reward_costs(job, target):
    """`LearnedRewardCosts` of the job's reward models and judge on `target`, None without any."""
    if not job.rollout.learned_terms:
        return None
    from areal_jax.plan.job import learned_contexts
    from areal_jax.reward.composite import LM_PREFIX
    from areal_jax.reward.programs import learned_models
    from areal_jax.simulate.costs import LearnedModelCost, LearnedRewardCosts

    contexts, judge, entries = dict(learned_contexts(job)), job.rollout.judge, []
    for m in learned_models(job.rollout.reward_terms, judge):
        cfg, item = m.config, m.dtype.itemsize
        if m.term.startswith(LM_PREFIX):  # a likelihood reward: the whole LM, every position's logits
            entries.append(LearnedModelCost(m.label, "loglik", contexts[m.label], cfg.num_params() * item))
            if m.reference is not None:  # and its reference's forward, in the same call
                entries.append(LearnedModelCost(f"{m.label}/reference", "loglik", contexts[f"{m.label}/reference"],
                                                m.reference.num_params() * item))
        elif m.label != "judge":  # a reward model: no lm_head, a one-label score head
            params = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
            entries.append(LearnedModelCost(m.label, "score", contexts[m.label], params * item))
        else:
            entries.append(LearnedModelCost(
                m.label, "engine" if judge.parse == "regex" else "choices", contexts[m.label], cfg.num_params() * item,
                kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item,
                new_tokens=judge.max_new_tokens))
    return LearnedRewardCosts(target=target, models=tuple(entries), data=max(1, job.mesh.reward_devices),
                              shared=not job.mesh.reward_devices)


def _rows(base, sweeps, *, include_sync: bool) -> list:
    """The config's row, or the sweep's; with `include_sync` always a synchronous baseline too."""
    rows = [base] if not sweeps else _swept_rows(base, sweeps)
    if include_sync and not any(r.mode == "sync" for r in rows):  # "vs sync" needs its baseline
        rows.append(dataclasses.replace(base, mode="sync", eta=0, colocated=False))
    return rows


def _swept_rows(base, sweeps) -> list:
    rows = []
    names = [f for f, _ in sweeps]
    for values in itertools.product(*(v for _, v in sweeps)):
        change = dict(zip(names, values))
        if change.get("split") == COLOCATED:  # both sides on every device, one program at a time
            change.pop("split")
            change["colocated"] = True
        elif "split" in change:  # a split: the sides get their own devices
            change["generation_devices"] = change.pop("split")
            change["colocated"] = False
        mode = change.get("mode", base.mode)
        if mode == "sync":  # one baseline: every device does both, whatever split or eta was swept
            change.update(eta=0, colocated=False, generation_devices=base.generation_devices)
        row = dataclasses.replace(base, **change)
        if row not in rows:
            rows.append(row)
    return rows


def config_row(gin_files, gin_params, target_name: str, *, steps: int = 12, warmup: int = 3) -> dict[str, Any]:
    """The config's own row on `target_name`'s roofline (no sync baseline): what `plan` sets its
    prediction beside (live concurrency, step time)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([f"--target={target_name}", f"--steps={steps}", f"--warmup={warmup}"])
    args.gin_file, args.gin_param = list(gin_files), list(gin_params)
    return simulate_rows(args, include_sync=False)["rows"][0]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A config made ready to simulate: its job, costs' source, workload and lengths."""

    job: Any
    plan_cfg: Any
    target: Any  # plan.targets.Target; None with --calibrate
    fit: Any  # simulate.calibrate's fit; None on a target
    workload: Any
    generation: int  # the config's generation devices per host
    source: Any  # lengths: a dump or a spec
    cap: int
    mean_prompt: int
    base: Any  # RowConfig: the config's own row


def prepare(args, *, gin_params: tuple[str, ...] = (), adjust_workload=None) -> Prepared:
    """The config of `args` (with `gin_params` bound after its own) ready to simulate."""
    from areal_jax import config_system as cs
    from areal_jax.jobs.configs import load_job_configs
    from areal_jax.plan.config import PlanConfig
    from areal_jax.plan.targets import parse_target
    from areal_jax.simulate.calibrate import fit_run_dir
    from areal_jax.simulate.config import RowConfig
    from areal_jax.simulate.lengths import parse_length_spec, read_rollout_lengths

    job = load_job_configs(args.gin_file, [*args.gin_param, *gin_params], run_dir="simulate")
    plan_cfg = cs.build(PlanConfig)
    target = None
    fit = None
    if args.calibrate:
        recorded = _run_devices(args.calibrate)
        devices = args.devices_per_host or recorded.get("devices_per_host") or 1
        hosts = args.hosts or recorded.get("hosts") or 1
    else:
        name = args.target or plan_cfg.target
        if not name:
            raise SimulateError("no costs: pass --target NAME (or bind PlanConfig.target) or --calibrate RUN_DIR")
        target = parse_target(name)
        devices = args.devices_per_host or target.devices_per_host
        hosts = args.hosts or target.hosts
    workload, generation, colocated = build_workload(job, hosts=hosts, devices_per_host=devices)
    if args.calibrate:
        fit = fit_run_dir(args.calibrate, skip_steps=args.calibrate_skip, reward_s=args.reward_s,
                          ride_tokens_per_step=_ride_tokens_per_step(args.calibrate, job, workload))
    if target is not None:
        workload = paged_workload(job, plan_cfg, args.gin_file, target, workload)
    if adjust_workload is not None:
        workload = adjust_workload(workload)

    # Lengths: a dump, a spec, or the planner's assumption as a lognormal long tail.
    longest_prompt = (job.data.max_prompt_tokens if job.data is not None and job.data.max_prompt_tokens
                      else max(1, job.engine.prompt_limit - job.rollout.max_new_tokens))
    mean_prompt = max(1, int(round(plan_cfg.mean_prompt_fraction * longest_prompt)))
    if args.lengths:
        source = read_rollout_lengths(args.lengths)
    else:
        spec = args.length_dist or (f"lognormal:mean={plan_cfg.mean_completion_fraction * job.rollout.max_new_tokens:g},"
                                    "sigma=1")
        source = parse_length_spec(spec)
    cap = min(job.rollout.max_new_tokens, job.engine.max_seq_len - 1 - mean_prompt)
    base = RowConfig(mode=job.rl.mode, eta=job.rl.max_staleness, generation_devices=generation,
                     colocated=colocated and job.rl.mode == "async", steps=args.steps,
                     warmup_steps=args.warmup, seed=args.seed)
    return Prepared(job=job, plan_cfg=plan_cfg, target=target, fit=fit, workload=workload, generation=generation,
                    source=source, cap=cap, mean_prompt=mean_prompt, base=base)


def transfer_bytes_per_s(args, target) -> float:
    """The weight push's rate per host: --transfer_gbps, else on several TPU slices the host's DCN
    bandwidth over the share of the weights held on other slices (plan/job.network_transfer),
    else DEFAULT_TRANSFER_BYTES_PER_S."""
    if getattr(args, "transfer_gbps", None) is not None:
        return args.transfer_gbps * 1e9
    slices = getattr(target, "slices", 1) if target is not None else 1
    if slices > 1 and target.host_network_bandwidth:
        return target.host_network_bandwidth * slices / (slices - 1)
    return DEFAULT_TRANSFER_BYTES_PER_S


def row_costs(p: Prepared, row, args):
    """The costs a row is simulated with: fitted to a run, else the target's roofline at its split."""
    return p.fit.costs if p.fit is not None else roofline_costs(
        p.job, p.plan_cfg, args.gin_file, p.target, p.workload, row,
        transfer_bytes_per_s=transfer_bytes_per_s(args, p.target), reward_s=args.reward_s,
        transfer_changed=getattr(args, "transfer_changed", 1.0))


def train_seconds_per_token(result, train_devices: int) -> float:
    """Training device-seconds (steps and weight pushes, on every training device) per trained token."""
    tokens_per_step = result.trained_tokens_per_s * result.step_s
    return result.train_s_per_step * train_devices / tokens_per_step if tokens_per_step else math.inf


def bound_terms(p: Prepared, rows, results, args) -> dict[str, float] | None:
    """The sync row's g, t, e_s, e_t and async_bound (simulate/roofline.py) against the roofline at
    the most sequences per replica any compared row sustains; None without a sync row or a roofline."""
    from areal_jax.simulate.roofline import pipeline_roofline, sync_terms

    at = next((i for i, r in enumerate(results) if r.mode == "sync"), None)
    if at is None:
        return None
    sync, costs = results[at], row_costs(p, rows[at], args)
    # Colocated async rows count too: the trainer's programs hold the devices they share
    # (simulate/system.py `share_devices`), as a colocated run's fitted costs hold them.
    c = max(r.sustained_per_replica for r in results)
    ideal_gen = ideal_train = math.inf
    # Each row's own lengths (their samples differ): the cheapest, so the bound holds for all.
    for r in results:
        roof = pipeline_roofline(costs, live_per_replica=c, live_context=r.live_context,
                                 train_flops_per_token=r.train_flops_per_token,
                                 prefill_flops_per_token=r.prefill_flops_per_token)
        if roof is None or not r.trained_tokens_per_s:
            return None
        ideal_gen = min(ideal_gen, roof["t_gen_s"] + roof["t_prefill_s"])
        # Training as the trainer's programs run it (gathers, optimizer, rows rounded to the devices,
        # the weight push) at the cheapest any row packs it: no scheduler trains for less.
        ideal_train = min(ideal_train, train_seconds_per_token(r, r.train_devices * p.workload.hosts))
    devices = p.workload.hosts * p.workload.devices_per_host
    if not (sync.trained_tokens_per_s and sync.generation_s_per_step and sync.train_s_per_step):
        return None
    per_token = devices / sync.trained_tokens_per_s / sync.step_s  # device-seconds per trained token per step-second
    terms = sync_terms(devices / sync.trained_tokens_per_s, sync.generation_s_per_step * per_token,
                       sync.train_s_per_step * per_token, ideal_gen, ideal_train)
    terms["bound_live_per_replica"] = c
    return terms


def run_row(p: Prepared, row, args):
    """(RowResult, the lengths' description) of one row of a prepared config."""
    from areal_jax.simulate.lengths import LengthSampler
    from areal_jax.simulate.system import Simulation

    costs = row_costs(p, row, args)
    sampler = LengthSampler(p.source, cap=p.cap, prompt=p.mean_prompt, seed=row.seed)
    return Simulation(p.workload, row, costs, sampler, scale_engine=p.fit is None).run(), sampler.describe()


def simulate_rows(args, *, adjust_workload=None, include_sync: bool = True) -> dict[str, Any]:
    """Every row of the command; returns {"rows": [...], "assumptions": {...}}. `adjust_workload`
    (Python callers: bench/simulate_scale.py) maps the Workload built from the configs to the one
    simulated, e.g. a paged KV pool the configs do not state. `include_sync`: add the synchronous
    baseline when no row is one (what "vs sync" and the bound need)."""
    from areal_jax.plan.report import STEP_TIME_NOTE, run_totals
    p = prepare(args, adjust_workload=adjust_workload)
    job, workload, fit, target, generation = p.job, p.workload, p.fit, p.target, p.generation
    rows = _rows(p.base, _parse_sweeps(args.sweep), include_sync=include_sync)
    if fit is not None and any(r.mode == "async" and r.generation_devices != generation and not r.colocated
                               for r in rows):
        raise SimulateError("--sweep split with --calibrate: calibrated costs hold for the run's own split; "
                            "use --target to compare splits")
    results = []
    labels = []
    for row in rows:
        result, label = run_row(p, row, args)
        results.append(result)
        labels.append(label)
    sync = next((r for r in results if r.mode == "sync"), None)
    bound = bound_terms(p, rows, results, args)
    out_rows = []
    for r in results:
        d = r.as_json()
        d["split"] = f"{r.generation_devices}:{r.train_devices}" if r.mode == "async" and not (
            r.generation_devices == r.train_devices == workload.devices_per_host) else "colocated"
        d["vs_sync"] = r.trained_tokens_per_s / sync.trained_tokens_per_s if sync and sync.trained_tokens_per_s else None
        if r.mode == "sync" and bound:
            d.update(bound)
        elif bound and d["vs_sync"] is not None:  # how much of what any scheduler could gain this row gains
            d["async_bound"] = bound["async_bound"]
            d["vs_async_bound"] = d["vs_sync"] / bound["async_bound"]
        d["run"] = run_totals(r.step_s, job.rl.steps, workload.hosts * workload.devices_per_host)
        out_rows.append(d)
    assumptions = {
        "costs": (fit.costs.label + f" (steps used {fit.steps_used}, fit error per family "
                  + ", ".join(f"{k} {v:.1%}" for k, v in fit.residuals.items()) + ")") if fit is not None else
        f"analytic roofline on {target.name}: max(FLOPs / peak bf16, bytes / HBM bandwidth) per program from "
        "plan/estimate.analytic_flops and plan/targets.py's published figures; nothing compiled; a lower bound "
        "(no kernel efficiency, collectives or host overhead)",
        "cost_model": fit.costs.as_json() if fit is not None else None,
        "lengths": labels[0] if labels else "",
        "hosts": workload.hosts, "devices_per_host": workload.devices_per_host,
        "batch": f"{workload.batch_groups} groups x {workload.samples_per_group} samples per step",
        "engine": f"{workload.engine.num_slots} slots per host at the config's split, decode chunk "
                  f"{workload.engine.decode_chunk}, max_seq_len {workload.engine.max_seq_len}"
                  + (f"; paged KV: {workload.kv_pool_pages} pages of {workload.page_size} tokens per replica, "
                     f"decode by live tokens (kernel blocks of {workload.block_tokens})" if workload.paged
                     else "; dense KV cache, decode over the window of the longest sequence")
                  + (f"; swaps re-prefill beside decode, {workload.engine.reprefill_in_decode_rows} rows of "
                     f"{workload.engine.reprefill_in_decode_width} tokens per replica and step"
                     + (f", at most {workload.engine.reprefill_in_decode_tokens} history tokens per replica a "
                        "swap (the longest that fit; the rest packed)" if workload.engine.reprefill_in_decode_tokens
                        else "")
                     if workload.paged and workload.engine.reprefill_in_decode_rows else "")
                  + ("; slots per replica kept when the split changes, a sync row's slots capped at one "
                     "batch's samples per host" if fit is None else ""),
        "transfer": (f"{transfer_bytes_per_s(args, target) / 1e9:g} GB/s per host (generation weights"
                     + (f"; delta sync, {args.transfer_changed:g} of the elements changed per step)"
                        if getattr(job.rl, "transfer_mode", "full") == "delta" else ")") if fit is None
                     else f"{fit.costs.transfer_s:.3f} s per step (recorded)"),
        "reward_s": args.reward_s,
        "steps": f"{args.steps} simulated, first {args.warmup} left out; run h and device-h: the mean step "
                 f"times RLConfig.steps = {job.rl.steps} on {workload.hosts * workload.devices_per_host} devices",
        "step time": STEP_TIME_NOTE,
        "roofline": "roofline_fraction = trained tokens/s per device over R* = 1 / (t_gen* + t_prefill* + t_train*): "
                    "t_gen* the decode device-seconds per token at the row's live sequences per replica (weights / live "
                    "+ live KV), t_prefill* the prompts' prefill FLOPs per trained token / peak, t_train* training "
                    "FLOPs per trained token / peak, no padding (docs/scale.md)",
        "bound": "async_bound = 1 / (g e_s + t e_t) from the sync row: g, t its generation's and training's shares of "
                 "its device-seconds, e_s generation's efficiency against the roofline at the most sequences per "
                 "replica any row sustains, e_t training's against the cheapest training per token of the rows "
                 "(docs/scale.md); vs_async_bound = vs_sync / async_bound",
        "seed": args.seed,
    }
    return {"rows": out_rows, "assumptions": assumptions}


def format_rows(report: dict[str, Any]) -> str:
    head = (f"{'mode':6s} {'eta':>3s} {'split':>9s} {'trained tok/s':>14s} {'tok/s/dev':>9s} {'vs sync':>7s} "
            f"{'of bound':>8s} {'roofline':>8s} {'padded':>6s} {'gen busy':>8s} "
            f"{'train busy':>10s} {'slots':>6s} {'re-prefill':>10s} {'stale max/mean':>14s} {'step s':>8s} "
            f"{'run h':>7s} {'device-h':>9s}")
    paged = any(r.get("decode_bytes_ratio") for r in report["rows"])
    if paged:  # preempted samples per step and host; decode bytes over (weights + live KV)
        head += f" {'preempted':>9s} {'bytes/live':>10s}"
    lines = [head]
    for r in report["rows"]:
        vs = f"{r['vs_sync']:.2f}x" if r["vs_sync"] is not None else "-"
        of_bound = f"{r['vs_async_bound']:.0%}" if r.get("vs_async_bound") is not None else "-"
        roof = f"{r['roofline_fraction']:.1%}" if r.get("roofline_fraction") is not None else "-"
        lines.append(f"{r['mode']:6s} {r['eta']:3d} {r['split']:>9s} {r['trained_tokens_per_s']:14,.0f} "
                     f"{r['trained_tokens_per_s_per_device']:9,.0f} {vs:>7s} {of_bound:>8s} {roof:>8s} "
                     f"{r['padded_token_ratio']:5.2f}x "
                     f"{r['generation_busy']:8.0%} {r['train_busy']:10.0%} {r['slot_occupancy']:6.0%} "
                     f"{r['reprefill_per_trained_token']:10.2f} {r['staleness_max']:>6d} / {r['staleness_mean']:5.2f} "
                     f"{r['step_s']:8.2f} {r['run']['wall_hours']:7.2f} {r['run']['device_hours']:9,.1f}"
                     + (f" {r['preempted_per_step']:9.1f} {r['decode_bytes_ratio']:10.3f}" if paged else ""))
    sync = next((r for r in report["rows"] if "async_bound" in r and r["mode"] == "sync"), None)
    lines.append("")
    if any(r.get("learned_reward_s_per_step") for r in report["rows"]):
        lines.append("learned rewards' scoring per step and host (in gen busy where they share its devices): "
                     + ", ".join(f"{r['mode']} eta {r['eta']} {r['learned_reward_s_per_step']:.3f} s"
                                 for r in report["rows"]))
    if sync:
        lines.append(f"async bound: 1 / (g e_s + t e_t) = 1 / ({sync['generation_share']:.3f} x "
                     f"{sync['sync_generation_efficiency']:.3f} + {sync['train_share']:.3f} x "
                     f"{sync['sync_train_efficiency']:.3f}) = {sync['async_bound']:.2f}x (g, t: sync's generation "
                     f"and training shares of its device-seconds, idle {sync['idle_share']:.3f}; e_s, e_t: their "
                     f"efficiencies against the roofline at {sync['bound_live_per_replica']:.1f} sequences per replica and "
                     "the cheapest training per token of the rows)")
    lines += [f"{k}: {v}" for k, v in report["assumptions"].items() if k != "cost_model"]
    return "\n".join(lines)

