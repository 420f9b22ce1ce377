"""`areal-jax simulate --tune [--write FILE.gin]`: the config's best point on its target.

    areal-jax simulate --gin_file=CONFIG --tune [--sweep eta=1,2,4] [--sweep split=2,4]
        [--sweep kv_dtype=bfloat16,float8_e4m3fn] [--write TUNED.gin]

Searches (simulate/tune.py) the split per host, the trainer's micro-batch budget, the engine's
slots and KV pool and the groups in flight, eta within `--sweep eta=...` (default: the config's
own eta: eta trades staleness for throughput, which the simulator cannot weigh) and the KV
cache's dtype within `--sweep kv_dtype=...` (default: the config's own, likewise: FP8 keys and
values hold twice the tokens per byte and change the behaviour policy's numerics).
Each point is bound as gin parameters after the config's own and simulated as `simulate` would
(the roofline costs of the target); only points whose programs fit the target with the plan's
headroom are simulated (plan/fit.py: the hand estimate of each program's peak, or the plan
cache's compiled peaks, from the best point down until one fits on them, where
`--tune_compiled_s` allows looking them up). Prints the best points,
each as the gin bindings that make it, with trained tokens/s per device; `--write` writes the
best's bindings, to pass after the config (`--gin_file=CONFIG --gin_file=TUNED.gin`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any

import jax.numpy as jnp

from areal_jax.simulate.driver import COLOCATED
from areal_jax.simulate.tune import Knobs, SearchResult, budget_candidates, distinct, search

BUDGET_FIELD = "max_tokens_per_microbatch"
TUNE_SWEEPS = ("eta", "split", "kv_dtype")  # what --sweep narrows under --tune
KV_DTYPE_SWEEP = "kv_dtype"  # a sweep --tune alone takes (each point is its own engine config)


class TuneError(ValueError):
    """A user error of --tune: one line."""


def config_owner(job, field: str) -> str:
    """The gin name of the job's config class holding `field` (e.g. "PPOConfig"): the budget's
    binding follows the class that owns it, wherever the trainer's configs keep it."""
    for f in dataclasses.fields(job):
        value = getattr(job, f.name)
        if dataclasses.is_dataclass(value) and any(g.name == field for g in dataclasses.fields(value)):
            return type(value).__name__
    raise TuneError(f"no config of the job has a field {field!r}")


def _field_of(job, field: str) -> str:
    """The job's attribute holding the config that has `field`."""
    owner = config_owner(job, field)
    return next(f.name for f in dataclasses.fields(job) if type(getattr(job, f.name)).__name__ == owner)


def budget_of(job) -> int:
    return getattr(getattr(job, _field_of(job, BUDGET_FIELD)), BUDGET_FIELD)


def row_buckets_for(buckets: tuple[int, ...], budget: int) -> tuple[int, ...]:
    """The config's row buckets below `budget`, then the budget: the largest bucket must hold a
    whole budget (trainer/batching.candidate_row_lengths), and rows past it are never built."""
    return tuple(b for b in buckets if b < budget) + (budget,)


def bindings(k: Knobs, *, budget_owner: str, paged: bool, buckets: tuple[int, ...] = ()) -> list[str]:
    """The gin parameters that make point `k` (bound after the config's own); `buckets`: the
    config's row buckets (none bound: the trainer's default, powers of two)."""
    out = (["MeshConfig.colocated = True", "MeshConfig.num_generation_devices_per_host = None"] if k.colocated else
           ["MeshConfig.colocated = False", f"MeshConfig.num_generation_devices_per_host = {k.generation_devices}"])
    out.append(f"{budget_owner}.{BUDGET_FIELD} = {k.budget}")
    if buckets:
        out.append(f"{budget_owner}.row_buckets = {row_buckets_for(buckets, k.budget)}")
    out.append(f"EngineConfig.num_slots = {k.slots}")
    if paged and k.pool_bytes:
        out.append(f"EngineConfig.kv_pool_bytes = {k.pool_bytes}")
    out += [f"RLConfig.max_staleness = {k.eta}", f"RLConfig.max_concurrent = {k.max_concurrent}"]
    if k.kv_dtype:
        out.append(f'EngineConfig.kv_dtype = "{k.kv_dtype}"')
    return out


def split_kv_dtype_sweep(specs: list[str]) -> tuple[list[str], list[str]]:
    """--sweep specs -> (the others, the kv_dtype values), each value checked against the engine's."""
    from areal_jax.generation.config import KV_DTYPES

    rest, dtypes = [], []
    for spec in specs:
        field, eq, values = spec.partition("=")
        if field.strip() != KV_DTYPE_SWEEP:
            rest.append(spec)
            continue
        items = [v.strip() for v in values.split(",") if v.strip()]
        bad = [v for v in items if v not in KV_DTYPES]
        if not eq or not items or bad:
            raise TuneError(f"--sweep {spec!r}: kv_dtype takes values of {KV_DTYPES}")
        dtypes += [v for v in items if v not in dtypes]
    return rest, dtypes


@dataclasses.dataclass(frozen=True)
class _Space:
    """What the candidates are built from: the config's own values and the host's shape."""

    devices_per_host: int
    replica_devices: int  # devices per generation replica
    train_group: int  # training devices must be a multiple of this (tensor x expert), over the hosts
    hosts: int
    local_batch: int
    samples: int
    config: Knobs
    config_replicas: int
    page_bytes: int  # one page of one replica (0: the engine does not page on this target)
    kv_dtype: str  # the config's stored key/value dtype (page_bytes' own: "bfloat16", "float8_e4m3fn", ...)
    page_size: int
    pages_per_sequence: int
    longest_row: int  # the row bucket holding the longest sequence: no budget below it trains one
    buckets: tuple[int, ...]

    def replicas(self, generation_devices: int) -> int:
        return max(1, generation_devices // self.replica_devices)

    def splits(self, wanted: list[int | str] | None) -> list[int | str]:
        """Generation devices per host of every split the mesh allows, and COLOCATED (both sides on
        every device) where a replica fits in a host."""
        out: list[int | str] = [g for g in range(1, self.devices_per_host)
                                if g % self.replica_devices == 0
                                and ((self.devices_per_host - g) * self.hosts) % self.train_group == 0]
        if self.devices_per_host % self.replica_devices == 0 \
                and (self.devices_per_host * self.hosts) % self.train_group == 0:
            out.append(COLOCATED)
        if wanted:
            bad = [g for g in wanted if g not in out]
            if bad:
                raise TuneError(f"--sweep split: {bad} is not a split of {self.devices_per_host} devices per host into "
                                f"generation replicas of {self.replica_devices} and training groups of "
                                f"{self.train_group} (valid: {out})")
            out = list(wanted)
        return out

    def at_split(self, g: int | str, budget: int) -> Knobs:
        """The config's engine at split `g` (or COLOCATED: every device generates), as `simulate
        --sweep split` scales it: slots per replica and groups in flight per replica kept."""
        colocated = g == COLOCATED
        g = self.devices_per_host if colocated else g
        r, r0 = self.replicas(g), self.config_replicas
        slots = self.config.slots // r0 * r
        concurrent = max(1, self.config.max_concurrent * r // r0)
        return dataclasses.replace(self.config, generation_devices=g, budget=budget, slots=slots,
                                   max_concurrent=concurrent, colocated=colocated)

    def page_bytes_of(self, kv_dtype: str) -> int:
        """One page's bytes with the cache in `kv_dtype` ("": the config's)."""
        if not kv_dtype or not self.page_bytes:
            return self.page_bytes
        return self.page_bytes // jnp.dtype(self.kv_dtype).itemsize * jnp.dtype(kv_dtype).itemsize

    def pools(self, largest: int, preempts: bool, kv_dtype: str = "") -> list[int]:
        """The config's pool, and where the leader's samples were preempted (the pool ran dry)
        larger ones up to `largest`: a pool that never runs dry gains nothing from growing. Bytes
        are kept across dtypes (FP8 pages hold twice the tokens)."""
        page = self.page_bytes_of(kv_dtype)
        if not page or not preempts:
            return [self.config.pool_bytes]
        p0 = self.config.pool_bytes
        floor = self.pages_per_sequence * page
        sizes = [p0, largest] if largest > 1.05 * p0 else [p0]
        return distinct([max(floor, s // page * page) for s in sizes])

    def refine(self, leader: Knobs, etas: list[int], largest_pool: int, preempts: bool,
               kv_dtypes: list[str] = ()) -> list[Knobs]:
        r = self.replicas(leader.generation_devices)
        eta0 = self.config.eta
        out = []
        # The config's own dtype is "" (no binding), so a point is never simulated twice.
        for kv_dtype in distinct(["" if kv == self.kv_dtype else kv for kv in kv_dtypes] or [leader.kv_dtype]):
            for eta in etas:
                scaled = max(1, leader.max_concurrent * (eta + 1) // (eta0 + 1))
                for concurrent in distinct([scaled, (eta + 1) * self.local_batch]):
                    demand = -(-concurrent * self.samples // r)  # sequences in flight per replica
                    for per_replica in distinct([leader.slots // r, demand]):
                        for pool in self.pools(largest_pool, preempts, kv_dtype):
                            out.append(dataclasses.replace(leader, eta=eta, max_concurrent=concurrent,
                                                           slots=max(1, per_replica) * r, pool_bytes=pool,
                                                           kv_dtype=kv_dtype))
        return out


def _space(p, model_cfg) -> _Space:
    from areal_jax.generation.paged import page_bytes as bytes_of_page
    from areal_jax.plan.job import gen_dtype

    job, wl = p.job, p.workload
    replica = job.mesh.generation_tensor * job.mesh.generation_expert
    # One page over every layer in the stored dtype (1 byte an element with kv_dtype float8_e4m3fn).
    page_bytes = (bytes_of_page(model_cfg, job.engine.page_size, job.engine.storage_dtype(gen_dtype(job)))
                  if wl.paged else 0)
    colocated = p.base.colocated
    config = Knobs(generation_devices=p.generation, budget=budget_of(job), slots=job.engine.num_slots,
                   pool_bytes=wl.kv_pool_pages * page_bytes, eta=job.rl.max_staleness,
                   max_concurrent=job.rl.max_concurrent, colocated=colocated)
    from areal_jax.plan.job import trained_row_length

    buckets = tuple(getattr(job, _field_of(job, "row_buckets")).row_buckets or ())
    return _Space(devices_per_host=wl.devices_per_host, replica_devices=replica,
                  train_group=job.mesh.train_tensor * job.mesh.train_expert, hosts=wl.hosts,
                  local_batch=wl.local_batch, samples=wl.samples_per_group, config=config,
                  config_replicas=wl.generation_replicas(p.generation), page_bytes=page_bytes,
                  kv_dtype=str(jnp.dtype(job.engine.storage_dtype(gen_dtype(job)))),
                  page_size=job.engine.page_size, pages_per_sequence=job.engine.pages_per_sequence,
                  longest_row=trained_row_length(job), buckets=buckets)


def run_tune(args) -> dict[str, Any]:
    """The search for the config of `args`; returns {"config", "best", "points", "refused", ...}."""
    from areal_jax.plan.fit import Fit, estimate_fit
    from areal_jax.plan.job import PlanError, model_config_for
    from areal_jax.simulate.driver import SimulateError, _parse_sweeps, prepare, run_row

    if args.calibrate:
        raise TuneError("--tune needs a target's roofline costs (--target or PlanConfig.target), not --calibrate: "
                        "fitted costs hold for the recorded run's split only")
    specs, kv_dtypes = split_kv_dtype_sweep(list(args.sweep or []))
    sweeps = dict(_parse_sweeps(specs))
    if set(sweeps) - set(TUNE_SWEEPS):
        raise TuneError(f"--tune searches {TUNE_SWEEPS} itself; --sweep {sorted(set(sweeps) - set(TUNE_SWEEPS))} "
                        "does not apply")
    base = prepare(args)
    if base.job.rl.mode != "async":
        raise TuneError("--tune tunes an async config (RLConfig.mode = 'async')")
    model_cfg = model_config_for(base.job, base.plan_cfg, args.gin_file)
    space = _space(base, model_cfg)
    owner = config_owner(base.job, BUDGET_FIELD)
    paged = bool(space.page_bytes)
    etas = list(sweeps.get("eta") or [space.config.eta])
    if kv_dtypes and not paged:
        raise TuneError(f"--sweep kv_dtype: the engine does not page its cache on {base.target.name} "
                        "(EngineConfig.kv_layout), and FP8 keys and values need pages")
    prepared: dict[Knobs, Any] = {}

    def job_at(k: Knobs):
        if k not in prepared:
            prepared[k] = prepare(args, gin_params=tuple(bindings(k, budget_owner=owner, paged=paged,
                                                                    buckets=space.buckets)))
        return prepared[k]

    unsplittable: dict[int, Any] = {}  # a split the mesh or the weights' shapes refuse, at any budget

    def fits(k: Knobs):
        if k.generation_devices in unsplittable:
            return unsplittable[k.generation_devices]
        try:
            p = job_at(k)
            return estimate_fit(p.job, p.plan_cfg, p.target, gin_files=args.gin_file, model_cfg=model_cfg)
        except (PlanError, SimulateError, ValueError) as e:  # a split the model's shapes refuse, a bad engine
            fit = Fit(fits=False, peak_fraction=math.nan, tightest="", source=f"refused: {' '.join(str(e).split())}")
            if str(e).startswith("MeshConfig"):
                unsplittable[k.generation_devices] = fit
            return fit

    devices = space.hosts * space.devices_per_host

    def evaluate(k: Knobs):
        p = job_at(k)
        result, _ = run_row(p, p.base, args)
        row = result.as_json()
        return result.trained_tokens_per_s, row

    config_fit = fits(space.config)
    largest_pool = space.config.pool_bytes
    if paged and config_fit.generation_fraction > 0:  # the pool the generation side's headroom allows
        spare = (1.0 - base.plan_cfg.headroom - 0.02 - config_fit.generation_fraction) \
            * base.target.capacity_bytes_per_device
        largest_pool = max(space.config.pool_bytes, int(space.config.pool_bytes + spare * space.replica_devices))
    budgets = budget_candidates(space.longest_row, space.config.budget)
    first = [space.config] + [space.at_split(g, b) for g in space.splits(sweeps.get("split")) for b in budgets]
    preempting: set[Knobs] = set()

    def refine(leader: Knobs):
        return space.refine(leader, etas, largest_pool, leader in preempting, kv_dtypes)

    def evaluate_noting_preemption(k: Knobs):
        score, row = evaluate(k)
        if row.get("preempted_per_step", 0) > 0:
            preempting.add(k)
        return score, row

    result: SearchResult = search(first, refine, fits=fits, evaluate=evaluate_noting_preemption, keep=2)
    result = _with_compiled_peaks(result, args, job_at, model_cfg)
    own = next((pt for pt in result.points if pt.knobs == space.config), None)
    own_rank = result.points.index(own) + 1 if own else None

    def point_json(pt):
        return {"bindings": bindings(pt.knobs, budget_owner=owner, paged=paged, buckets=space.buckets),
                "trained_tokens_per_s": pt.trained_tokens_per_s,
                "trained_tokens_per_s_per_device": pt.row.get("trained_tokens_per_s_per_device",
                                                              pt.trained_tokens_per_s / devices),
                "split": "colocated" if pt.knobs.colocated else
                f"{pt.knobs.generation_devices}:{space.devices_per_host - pt.knobs.generation_devices}",
                "knobs": dataclasses.asdict(pt.knobs), "stage": pt.stage,
                "memory": {"fits": pt.fit.fits, "peak_fraction": pt.fit.peak_fraction, "tightest": pt.fit.tightest,
                           "source": pt.fit.source},
                "vs_config": pt.trained_tokens_per_s / own.trained_tokens_per_s if own and own.trained_tokens_per_s
                else None,
                "row": pt.row}

    return {"config": " ".join(args.gin_file), "target": base.target.name, "devices": devices,
            "seconds": result.seconds, "simulated": len(result.points), "refused": len(result.refused),
            "own_rank": own_rank, "own": point_json(own) if own else {"memory": dataclasses.asdict(config_fit)},
            "points": [point_json(pt) for pt in result.points],
            "refused_points": [{"knobs": dataclasses.asdict(k), "memory": dataclasses.asdict(f)}
                               for k, f in result.refused],
            "assumptions": {
                "search": "stage 1: every split x micro-batch budget at the config's engine (slots and groups in "
                          "flight per replica kept, as --sweep split); stage 2: the 2 best with the engine's slots, "
                          "KV pool, groups in flight, eta and the cache's dtype varied",
                "eta": f"searched over {etas}" + ("" if "eta" in sweeps else " (the config's; widen with --sweep eta=...)"),
                "kv_dtype": (f"searched over {kv_dtypes}" if kv_dtypes else
                             "the config's (widen with --sweep kv_dtype=bfloat16,float8_e4m3fn)"),
                "memory": f"every program of the plan's bounding set within {1 - base.plan_cfg.headroom:.0%} of a "
                          f"device; the hand estimate (plan/estimate.py) unless a point says compiled (the plan "
                          f"cache's peaks, looked up from the best down until one fits, at most {args.tune_top}, within "
                          f"{args.tune_compiled_s:g} s)",
                "costs": f"analytic roofline on {base.target.name}, {args.steps} steps simulated "
                         f"({args.warmup} warm-up), seed {args.seed}"}}


def _with_compiled_peaks(result: SearchResult, args, job_at, model_cfg) -> SearchResult:
    """The best points' verdicts again, from the plan cache's compiled peaks where it holds them,
    walking down from the best until one fits on them (the points below it cannot change the
    answer), at most `--tune_top`, within `--tune_compiled_s` (plan/fit.py: the peak index names
    each point's cached peaks without lowering; programs it does not know are lowered while time
    allows). A point the compiled peaks refuse leaves the ranking."""
    from areal_jax.plan.fit import estimate_fit
    from areal_jax.plan.measure import cache_dir

    if args.tune_compiled_s <= 0 or not any(cache_dir().glob("*.json")):
        return result
    deadline = time.monotonic() + args.tune_compiled_s
    points, refused = list(result.points), list(result.refused)
    for pt in result.points[:args.tune_top]:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        p = job_at(pt.knobs)
        fit = estimate_fit(p.job, p.plan_cfg, p.target, gin_files=args.gin_file, model_cfg=model_cfg,
                           compiled_within_s=left)
        i = points.index(pt)
        if fit.fits:
            points[i] = dataclasses.replace(pt, fit=fit)
            break
        points.pop(i)
        refused.append((pt.knobs, fit))
    return dataclasses.replace(result, points=tuple(points), refused=tuple(refused))


_KV_SHORT = {"": "own", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}  # the table's kv column


def format_tune(report: dict[str, Any], top: int) -> str:
    lines = [f"simulate --tune {report['config']} on {report['target']}: {report['simulated']} points simulated, "
             f"{report['refused']} refused on memory, {report['seconds']:.0f} s",
             f"{'#':>2s} {'tok/s/device':>12s} {'trained tok/s':>13s} {'vs config':>9s} {'split':>9s} {'budget':>7s} "
             f"{'slots':>6s} {'pool GB':>7s} {'kv':>4s} {'conc':>5s} {'eta':>3s} {'peak':>5s}  memory"]
    own, own_rank = report["own"], report["own_rank"]
    ranks = list(range(1, min(top, len(report["points"])) + 1))
    if own_rank and own_rank not in ranks:
        ranks.append(own_rank)
    for rank in ranks:
        pt = report["points"][rank - 1]
        k = pt["knobs"]
        vs = f"{pt['vs_config']:.2f}x" if pt["vs_config"] is not None else "-"
        mem = pt["memory"]
        lines.append(f"{rank:>2d} {pt['trained_tokens_per_s_per_device']:12,.0f} {pt['trained_tokens_per_s']:13,.0f} "
                     f"{vs:>9s} {pt['split']:>9s} {k['budget']:7d} {k['slots']:6d} {k['pool_bytes'] / 1e9:7.1f} "
                     f"{_KV_SHORT.get(k.get('kv_dtype', ''), 'own'):>4s} {k['max_concurrent']:5d} {k['eta']:3d} {mem['peak_fraction']:5.0%}  {mem['source']}"
                     + ("  (the config)" if rank == own_rank else ""))
    if "knobs" not in own:
        lines.append(f"the config itself does not fit: {own['memory']['source']} "
                     f"({own['memory']['tightest']} at {own['memory']['peak_fraction']:.0%})")
    for i, pt in enumerate(report["points"][:top]):
        lines.append(f"\n# {i + 1}: {pt['trained_tokens_per_s_per_device']:,.0f} trained tokens/s per device "
                     f"({pt['trained_tokens_per_s']:,.0f} on {report['devices']}); tightest program "
                     f"{pt['memory']['tightest']} at {pt['memory']['peak_fraction']:.0%} ({pt['memory']['source']})")
        lines += pt["bindings"]
    lines.append("")
    lines += [f"{k}: {v}" for k, v in report["assumptions"].items()]
    return "\n".join(lines)


def write_best(report: dict[str, Any], path: str) -> None:
    best = report["points"][0]
    text = (f"# areal-jax simulate --tune of {report['config']} on {report['target']}: "
            f"{best['trained_tokens_per_s_per_device']:,.0f} trained tokens/s per device "
            f"({best['trained_tokens_per_s']:,.0f} on {report['devices']} devices"
            + (f", {best['vs_config']:.2f}x the config's" if best["vs_config"] else "") + ").\n"
            f"# Memory: tightest program {best['memory']['tightest']} at {best['memory']['peak_fraction']:.0%} of a "
            f"device ({best['memory']['source']}); confirm with areal-jax plan.\n"
            f"# Use after the config: --gin_file={report['config']} --gin_file={path}\n"
            + "\n".join(best["bindings"]) + "\n")
    pathlib.Path(path).write_text(text)
