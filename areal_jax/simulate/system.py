"""The whole system on the simulated clock: per host a controller (the package's own
`StalenessManager`, `admission_version` and `TrajectoryChannel`, the age filter `is_too_stale`) and
an engine (simulate/generation.py); one trainer that takes each host's oldest groups, forms
minibatches and micro-batches with the trainer's own `microbatch_shapes_for_lengths`, steps, bumps the version
and transfers the weights.

Modes as `trainer/loop.py` runs them: "async" overlaps generation and training (eta bounds how far
generation runs ahead); "sync" is the colocated baseline (every device generates a batch, then
trains; eta 0; the next batch is admitted once the engine serves the new weights).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from areal_jax.rollout.channel import TrajectoryChannel
from areal_jax.rollout.filters import is_too_stale
from areal_jax.rollout.staleness import StalenessManager, admission_version
from areal_jax.api import Trajectory, TrajectoryGroup
from areal_jax.simulate.config import RowConfig, Workload
from areal_jax.simulate.events import EventQueue
from areal_jax.simulate.generation import SimEngine, SimGroup
from areal_jax.simulate.lengths import LengthSampler
from areal_jax.simulate.roofline import pipeline_roofline
from areal_jax.generation.timings import timings_delta
from areal_jax.trainer.batching import microbatch_shapes_for_lengths


@dataclasses.dataclass(frozen=True)
class RowResult:
    """Steady-state figures of one row (steps after the warm-up)."""

    mode: str
    eta: int
    generation_devices: int
    train_devices: int
    trained_tokens_per_s: float
    generation_busy: float
    train_busy: float
    slot_occupancy: float
    reprefill_per_trained_token: float
    staleness_max: int
    staleness_mean: float
    step_s: float
    preempted_per_step: float = 0.0  # paged: samples whose KV was dropped and recomputed, per step per host
    decode_read_over_live: float = 0.0  # paged: KV tokens the kernel reads / live tokens (1 = only live pages)
    decode_bytes_ratio: float = 0.0  # paged: decode bytes per step / (weights + live KV), when costs know both
    # Issue 40: what a user needs to judge the row (simulate/roofline.py).
    trained_tokens_per_s_per_device: float = 0.0  # over every device of the run, both roles
    padded_token_ratio: float = 0.0  # micro-batch slots / real tokens packed (prompt and completion)
    live_per_replica: float = 0.0  # sequences live per generation replica, mean over decode steps
    live_context: float = 0.0  # tokens a generated token attends over, mean over generated tokens
    train_flops_per_token: float = 0.0  # roofline costs: training FLOPs per trained token, no padding
    prefill_flops_per_token: float = 0.0  # roofline costs: the prompts' prefill FLOPs per trained token
    sustained_per_replica: float = 0.0  # the concurrency the roofline takes (async: live; sync: one batch)
    roofline: dict[str, Any] | None = None  # t_gen*, t_train*, R* (pipeline_roofline)
    roofline_fraction: float | None = None  # trained tokens/s per device over R*
    generation_s_per_step: float = 0.0  # engine busy seconds per step (mean over hosts)
    train_s_per_step: float = 0.0  # training and weight transfer seconds per step
    # Learned rewards' scoring seconds per step per host (simulate/costs.LearnedRewardCosts): in
    # generation_s_per_step where they share the generation devices.
    learned_reward_s_per_step: float = 0.0
    records: tuple[dict[str, Any], ...] = dataclasses.field(repr=False, default=())

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("records")
        return out


def _compact_group(group: SimGroup, host_index: int) -> TrajectoryGroup:
    """A TrajectoryGroup for the channel and the age filter: each sample's versions as one token
    per version it spans (what `oldest_version` reads), not one per generated token."""
    one = np.zeros(1, np.int32)
    trajectories = []
    for segs in group.segments:
        versions = np.asarray(sorted({v for v, _ in segs}) or [group.admitted_version], np.int32)
        zeros = np.zeros(versions.size, np.float32)
        trajectories.append(Trajectory(one, versions * 0, zeros, versions, 0.0))
    return TrajectoryGroup(query_id=f"h{host_index}-g{group.group_id}", trajectories=tuple(trajectories),
                           admitted_version=group.admitted_version, info={"sim": group})


class _Host:
    def __init__(self, index: int, sim: Simulation, engine_config, data: int, max_concurrent: int) -> None:
        wl, row = sim.workload, sim.row
        self.index = index
        self.sim = sim
        self.staleness = StalenessManager(row.eta, wl.local_batch, max_concurrent)
        self.channel = TrajectoryChannel(wl.channel_capacity)
        self.backlog: collections.deque[TrajectoryGroup] = collections.deque()  # accepted, channel full
        wl = sim.workload
        self.engine = SimEngine(engine_config, data, sim.costs, sim.clock, on_group_done=self._group_done,
                                on_swap=self._swapped, pool_pages=wl.kv_pool_pages * data, page_size=wl.page_size,
                                block_tokens=wl.block_tokens)
        self._ids = 0
        self.reward_free = 0.0  # when the learned rewards' devices finish the scoring queued so far

    def admit(self) -> None:
        """The controller's admission loop: start groups while capacity allows."""
        sim = self.sim
        while True:
            version = admission_version(sim.version, self.engine.version)
            if not self.staleness.try_submit(version):
                return
            prompt, lengths = sim.sampler.group(sim.workload.samples_per_group)
            self._ids += 1
            self.engine.submit(SimGroup(self._ids, version, prompt, lengths))

    def _swapped(self) -> None:
        self.admit()
        self.sim.engine_swapped()

    def _group_done(self, group: SimGroup) -> None:
        """The group's reward: the verifier's latency (`costs.reward_s`) after the learned rewards'
        scoring, which takes the generation devices (the engine waits) where they share them, or
        queues on the host's reward devices."""
        sim, delay = self.sim, 0.0
        learned = getattr(sim.costs, "learned_rewards", None)
        if learned is not None:  # one scoring call per group, one call at a time on their devices
            seconds = learned.group_s(group.n, group.prompt, group.lengths)
            sim.learned_reward_s += seconds
            self.reward_free = max(self.reward_free, sim.clock.now) + seconds
            delay = self.reward_free - sim.clock.now
            if learned.shared:
                self.engine.charge(seconds)
        sim.clock.after(delay + sim.costs.reward_s, lambda: self._accept(group))

    def _accept(self, group: SimGroup) -> None:
        sim = self.sim
        compact = _compact_group(group, self.index)
        age = sim.workload.max_group_age
        if age is not None and is_too_stale(compact, sim.version, age):
            self.staleness.on_reject()
            sim.rejected_groups += 1
        else:
            self.backlog.append(compact)
            self.fill_channel()
        self.admit()
        sim.maybe_train()

    def fill_channel(self) -> None:
        while self.backlog and self.channel.try_put(self.backlog[0]):
            self.backlog.popleft()
            self.staleness.on_accept()


class Simulation:
    """One row: `run()` simulates `row.steps` training steps and returns the row's figures.

    `scale_engine`: when the row's split differs from the config's, keep the slots per generation
    replica (and groups in flight per slot) rather than the host's slots; off for costs fitted to a
    run, which hold for that run's engine only.

    `share_devices` (default: a colocated async row with costs not fitted to a run): the trainer's
    programs take the devices the engine decodes on, one program at a time, as they do in the
    runtime. A training step starts once every host's engine reaches a chunk boundary (a step is
    one program over every host's devices) and the engines wait until it and the weight push end.
    Costs fitted to a colocated run already hold the sharing."""

    def __init__(self, workload: Workload, row: RowConfig, costs, sampler: LengthSampler, *,
                 scale_engine: bool = True, share_devices: bool | None = None) -> None:
        row.check(workload)
        self.workload, self.row, self.costs, self.sampler = workload, row, costs, sampler
        self.clock = EventQueue()
        self.version = 0
        self.rejected_groups = 0
        self.learned_reward_s = 0.0  # device seconds of learned-reward scoring, every host
        self.learned_at_step: list[float] = []
        generating = row.generating_devices(workload)
        engine_config, max_concurrent = workload.engine_for(row, scale=scale_engine)
        data = workload.generation_replicas(generating)
        if engine_config.num_slots % data:
            raise ValueError(f"EngineConfig.num_slots {engine_config.num_slots} is not a multiple of the "
                             f"{data} generation replicas per host")
        self.hosts = [_Host(h, self, engine_config, data, max_concurrent) for h in range(workload.hosts)]
        train_devices = row.train_devices(workload) * workload.hosts
        self.rows_per_process = max(train_devices // workload.train_tensor // workload.hosts, 1)
        self.share_devices = (row.colocated and row.mode == "async" and scale_engine if share_devices is None
                              else share_devices)
        for h in self.hosts:  # the trainer's hold then covers the weight push too
            h.engine.push_held = self.share_devices
        self.training = False
        self.waiting_for_swap = False
        self.steps_done = 0
        self.train_busy_s = 0.0
        self.step_ends: list[float] = []
        self.trained_tokens: list[int] = []
        self.packing: list[dict[str, float]] = []
        self.lag_hist: list[collections.Counter] = []
        self.snapshots: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self._timings_seen: dict | None = None

    # ---- trainer --------------------------------------------------------------------------------

    def maybe_train(self) -> None:
        wl = self.workload
        if self.training or self.waiting_for_swap or self.steps_done >= self.row.steps:
            return
        if any(h.channel.qsize() < wl.local_batch for h in self.hosts):
            return
        batches = [h.channel.get_batch(wl.local_batch) for h in self.hosts]
        for h in self.hosts:
            h.fill_channel()
        lags: collections.Counter = collections.Counter()
        tokens = 0
        step_s, host0_shapes = 0.0, None
        packing = {"padded": 0, "packed": 0, "flops": 0.0, "context": 0.0, "prefill_flops": 0.0}
        for batch in batches:
            groups = [g.info["sim"] for g in batch]
            lengths = [g.prompt + int(n) for g in groups for n in g.lengths]
            shapes = microbatch_shapes_for_lengths(
                lengths, max_tokens_per_microbatch=wl.max_tokens_per_microbatch,
                num_minibatches=min(wl.num_minibatches, len(lengths)), buckets=wl.row_buckets or None,
                row_multiple=self.rows_per_process, group_ids=[i for i, g in enumerate(groups) for _ in range(g.n)],
                shuffle_seed=(wl.minibatch_seed, self.steps_done))
            host0_shapes = host0_shapes or shapes
            # Processes step together: the slowest one's micro-batches bound the step.
            step_s = max(step_s, self.costs.train_step_s(shapes))
            packing["padded"] += sum(r * t for minibatch in shapes for r, t in minibatch)
            packing["packed"] += sum(lengths)
            if hasattr(self.costs, "train_flops"):  # each call counts every host's rows as this one's
                packing["flops"] += self.costs.train_flops(shapes) / wl.hosts
            for g in groups:
                tokens += g.completion_tokens
                if hasattr(self.costs, "decode_token_flops"):  # one prefill of the prompt per group, causal
                    packing["prefill_flops"] += g.prompt * self.costs.decode_token_flops((g.prompt + 1) / 2)
                # A generated token attends over its prompt and the tokens before it.
                packing["context"] += float(sum(int(n) * g.prompt + int(n) * (int(n) + 1) / 2 for n in g.lengths))
                for segs in g.segments:
                    for version, count in segs:
                        lags[self.version - version] += count
        self.training = True
        if self.row.mode == "sync":
            self.waiting_for_swap = True
        end = self.clock.now + step_s + self.costs.transfer_s
        if self.share_devices:
            free = [h.engine.devices_free_at() for h in self.hosts]
            end += max(free) - self.clock.now
            for h, at in zip(self.hosts, free):  # the step and the weight push hold the devices
                h.engine.hold(end - at)
        self.clock.at(end, lambda: self._step_done(step_s, tokens, lags, host0_shapes, packing))

    def _step_done(self, step_s: float, tokens: int, lags, shapes, packing) -> None:
        self.version += 1
        self.training = False
        self.steps_done += 1
        self.train_busy_s += step_s + self.costs.transfer_s
        self.step_ends.append(self.clock.now)
        self.trained_tokens.append(tokens)
        self.learned_at_step.append(self.learned_reward_s)
        self.packing.append(packing)
        self.lag_hist.append(lags)
        self.snapshots.append({"engine_busy": [h.engine.busy_s_at(self.clock.now) for h in self.hosts],
                               "decode_steps": sum(h.engine.counters.decode_steps for h in self.hosts),
                               "slot_steps": sum(h.engine.counters.slot_steps for h in self.hosts),
                               "reprefill": sum(h.engine.counters.reprefill_tokens for h in self.hosts),
                               "preemptions": sum(h.engine.counters.preemptions for h in self.hosts),
                               "live_tokens": sum(h.engine.counters.live_tokens for h in self.hosts),
                               "read_tokens": sum(h.engine.counters.read_tokens for h in self.hosts),
                               "train_busy": self.train_busy_s})
        self._record(step_s, shapes)
        for h in self.hosts:
            h.engine.deliver_weights(self.version)
        for h in self.hosts:
            h.admit()
        self.maybe_train()

    def engine_swapped(self) -> None:
        """Sync mode: the trainer goes on once every engine serves the new weights (applied.result())."""
        if self.waiting_for_swap and all(h.engine.version == self.version for h in self.hosts):
            self.waiting_for_swap = False
            self.maybe_train()

    def _record(self, step_s: float, shapes) -> None:
        """The step's metrics in the run's own format (trainer/step_metrics.py): host 0's engine calls."""
        now = self.hosts[0].engine.timings.snapshot()
        timings = timings_delta(now, self._timings_seen)
        self._timings_seen = now
        micro = [s for minibatch in shapes for s in minibatch]
        timings["train"] = {"s": step_s, "minibatches": len(shapes), "microbatches": len(micro),
                            "padded_tokens": sum(r * t for r, t in micro),
                            "attention": float(sum(r * t * t for r, t in micro))}
        self.records.append({"step": self.steps_done - 1, "time/train_step_s": step_s,
                             "time/weight_transfer_s": self.costs.transfer_s, "timings": timings})

    # ---- run ------------------------------------------------------------------------------------

    def run(self) -> RowResult:
        for h in self.hosts:
            h.admit()
        self.clock.run(lambda: self.steps_done >= self.row.steps)
        w = self.row.warmup_steps
        a, b = self.snapshots[w - 1] if w else None, self.snapshots[-1]
        start = self.step_ends[w - 1] if w else 0.0
        wall = self.step_ends[-1] - start

        def delta(key):
            return b[key] - (a[key] if a else 0)

        engine_busy = np.mean(np.asarray(b["engine_busy"]) - (np.asarray(a["engine_busy"]) if a else 0.0))
        tokens = sum(self.trained_tokens[w:])
        lags = sum(self.lag_hist[w:], collections.Counter())
        counted = sum(lags.values())
        num_slots = self.hosts[0].engine.config.num_slots
        live, read, steps = delta("live_tokens"), delta("read_tokens"), delta("decode_steps")
        weights, kv = getattr(self.costs, "generation_weight_bytes", 0.0), getattr(self.costs, "kv_bytes_per_token", 0.0)
        replicas = getattr(self.costs, "replicas", 1)
        bytes_ratio = ((steps * weights + read / replicas * kv) / (steps * weights + live / replicas * kv)
                       if live and weights and kv else 0.0)
        steps_measured = self.row.steps - w
        packing = {k: sum(p[k] for p in self.packing[w:]) for k in ("padded", "packed", "flops", "context", "prefill_flops")}
        devices = self.workload.hosts * self.workload.devices_per_host
        per_device = tokens / wall / devices if wall > 0 else 0.0
        engine_replicas = self.workload.generation_replicas(self.row.generating_devices(self.workload))
        live_per_replica = (delta("slot_steps") / delta("decode_steps") / engine_replicas
                            if delta("decode_steps") else 0.0)
        live_context = packing["context"] / tokens if tokens else 0.0
        flops_per_token = packing["flops"] / packing["padded"] * packing["packed"] / tokens if tokens and packing["padded"] else 0.0
        prefill_flops_per_token = packing["prefill_flops"] / tokens if tokens else 0.0
        # The concurrency the workload sustains: async's is what the row keeps live (Little's law:
        # group latency x groups per unit time); sync admits a whole batch at once, so its roofline
        # is at one batch's samples per replica, and its long tail counts against it.
        sustained = num_slots / engine_replicas if self.row.mode == "sync" else live_per_replica
        roofline = pipeline_roofline(self.costs, live_per_replica=sustained, live_context=live_context,
                                     train_flops_per_token=flops_per_token,
                                     prefill_flops_per_token=prefill_flops_per_token)
        return RowResult(
            preempted_per_step=delta("preemptions") / steps_measured / self.workload.hosts,
            decode_read_over_live=read / live if live else 0.0, decode_bytes_ratio=bytes_ratio,
            mode=self.row.mode, eta=self.row.eta, generation_devices=self.row.generating_devices(self.workload),
            train_devices=self.row.train_devices(self.workload),
            trained_tokens_per_s=tokens / wall if wall > 0 else 0.0,
            generation_busy=float(engine_busy / wall) if wall > 0 else 0.0,
            train_busy=delta("train_busy") / wall if wall > 0 else 0.0,
            slot_occupancy=delta("slot_steps") / (delta("decode_steps") * num_slots) if delta("decode_steps") else 0.0,
            reprefill_per_trained_token=delta("reprefill") / tokens if tokens else 0.0,
            staleness_max=max((lag for lag, c in lags.items() if c), default=0),
            staleness_mean=sum(lag * c for lag, c in lags.items()) / counted if counted else 0.0,
            step_s=wall / steps_measured, trained_tokens_per_s_per_device=per_device,
            padded_token_ratio=packing["padded"] / packing["packed"] if packing["packed"] else 0.0,
            live_per_replica=live_per_replica, live_context=live_context, train_flops_per_token=flops_per_token,
            prefill_flops_per_token=prefill_flops_per_token, sustained_per_replica=sustained,
            roofline=roofline,
            roofline_fraction=per_device / roofline["tokens_per_s_per_device"] if roofline else None,
            generation_s_per_step=float(engine_busy) / steps_measured,
            learned_reward_s_per_step=(self.learned_at_step[-1] - (self.learned_at_step[w - 1] if w else 0.0))
            / steps_measured / self.workload.hosts,
            train_s_per_step=delta("train_busy") / steps_measured, records=tuple(self.records))
