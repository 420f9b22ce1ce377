"""What each program of the run costs, in seconds: fitted to a run (`LinearCosts`) or from the
planner's roofline of the target's published figures (`roofline_costs`).

One interface, per host engine and for the whole trainer:
    decode_chunk_s(steps, slot_steps, window, live_tokens=None, rows=None, live_rows=None,
                   ride_rows=0, ride_width=0, ride_window=0)
                                                a decode chunk (slot_steps: active slots summed over its
                                                steps; live_tokens: with a paged KV cache, the cached
                                                tokens its steps read, summed over steps and slots;
                                                None: the dense cache, every slot read up to `window`;
                                                paged: rows, the decode batch per replica, and
                                                live_rows, the live slots of the busiest replica; and
                                                with re-prefill beside decode, ride_rows history rows
                                                of ride_width tokens per step over the host, each
                                                attending over the chunk's ride_window positions)
    prefill_s(rows, length)                     an admission prefill call (rows of one length bucket)
    insert_s()                                  later samples of a group started from its kept block
    reprefill_s(calls, tokens)                  the packed re-prefill of a weight swap
    reprefill_long_s(rows, length)              a long history's prefill call after a swap
    train_step_s(shapes)                        a training step; shapes [minibatch][micro-batch] = (rows, row length)
    transfer_s, reward_s                        weight transfer per step; reward latency per group
    learned_rewards                             roofline costs only, None without learned reward terms:
                                                `LearnedRewardCosts`, their scoring per group
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

Shapes = Sequence[Sequence[tuple[int, int]]]


@dataclasses.dataclass(frozen=True)
class LinearCosts:
    """Costs linear in what each program processes (the form the calibration fits).

    decode chunk  = steps x decode_step + slot_steps x decode_slot + steps x window x decode_window
                    (dense; paged: + live tokens x decode_token instead of the window term)
                    + steps x ride_rows x (ride_width x ride_token + ride_window x decode_token)
                    (re-prefill beside decode: its tokens at a prefill token's cost, padding
                    included, and each row reading the window as a decode row reads its cache;
                    additive, so no idle compute is recovered: an upper bound on the rides' cost)
    prefill call  = prefill_call + rows x length x prefill_token
    re-prefill    = reprefill_call x calls + reprefill_token x tokens
    train step    = train_step + minibatches x train_minibatch + micro-batches x train_microbatch
                    + padded tokens x train_token + sum(rows x length^2) x train_attention
    """

    decode_step: float = 0.0
    decode_slot: float = 0.0
    decode_window: float = 0.0
    decode_token: float = 0.0  # per cached token a paged decode step reads (not fitted: 0 on dense runs)
    prefill_call: float = 0.0
    prefill_token: float = 0.0
    insert_call: float = 0.0
    reprefill_call: float = 0.0
    reprefill_token: float = 0.0
    ride_token: float | None = None  # per token of a ride row (fitted on ride chunks); None: reprefill_token
    train_step: float = 0.0
    train_minibatch: float = 0.0
    train_microbatch: float = 0.0
    train_token: float = 0.0
    train_attention: float = 0.0
    transfer_s: float = 0.0
    reward_s: float = 0.0
    label: str = "linear"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "label" or (f.name == "ride_token" and value is None):
                continue
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"LinearCosts.{f.name} must be a number >= 0, got {value!r}")

    def decode_chunk_s(self, steps: int, slot_steps: int, window: int, live_tokens=None, rows=None,
                       live_rows=None, ride_rows=0, ride_width=0, ride_window=0) -> float:
        if live_tokens is not None:  # rows: fitted to the run's own batches (decode_step per step)
            seconds = steps * self.decode_step + slot_steps * self.decode_slot + live_tokens * self.decode_token
            if ride_rows:  # rides need the paged cache
                token = self.reprefill_token if self.ride_token is None else self.ride_token
                seconds = seconds + steps * ride_rows * (ride_width * token + ride_window * self.decode_token)
            return seconds
        return steps * (self.decode_step + window * self.decode_window) + slot_steps * self.decode_slot

    def prefill_s(self, rows: int, length: int) -> float:
        return self.prefill_call + rows * length * self.prefill_token

    def insert_s(self) -> float:
        return self.insert_call

    def reprefill_s(self, calls: int, tokens: int) -> float:
        return calls * self.reprefill_call + tokens * self.reprefill_token

    def reprefill_long_s(self, rows: int, length: int) -> float:
        return self.prefill_s(rows, length) + self.insert_call

    def train_step_s(self, shapes: Shapes) -> float:
        micro = [s for minibatch in shapes for s in minibatch]
        return (self.train_step + len(shapes) * self.train_minibatch + len(micro) * self.train_microbatch
                + sum(r * t for r, t in micro) * self.train_token
                + sum(r * t * t for r, t in micro) * self.train_attention)

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RooflineCosts:
    """Each program at max(FLOPs / peak, bytes / bandwidth) on one device of its role (the planner's
    `roofline_s`), FLOPs from `plan/estimate.analytic_flops` at the program's shape. Nothing is
    compiled: this is the analytic roofline, a lower bound on time (no kernel efficiency, no
    collectives, no host overhead).

    Per host: the engine has `replicas` data replicas of `generation_tensor` devices; the trainer
    spans `train_devices` devices over every host, and a micro-batch's rows are every host's rows.
    """

    model: object  # ModelConfig
    target: object  # plan.targets.Target
    estimate_context: object  # plan.estimate.EstimateContext
    replicas: int
    generation_tensor: int
    slots_per_replica: int
    train_devices: int
    hosts: int
    generation_weight_bytes: float  # one replica's copy (every expert of a MoE model)
    kv_bytes_per_token: float  # keys and values of every layer, one token, whole replica
    separate_proximal: bool
    transfer_bytes_per_s: float
    pack_width: int = 512  # EngineConfig.pack_width
    # Share of the generation weights' bytes a push sends (RLConfig.transfer_mode "delta":
    # parallel/delta_sync.sent_fraction of the changed share; 1.0: the full push).
    transfer_sent_fraction: float = 1.0
    # Bytes of the served copy over the generation dtype's (EngineConfig.weight_dtype "int8": about
    # 0.5, "int4": about 0.26 of bf16; models/quantize.served_bytes): what decode and prefill read, and
    # what a full push sends (the training devices quantize each piece before it crosses).
    served_weight_fraction: float = 1.0
    reward_s: float = 0.0
    label: str = "roofline"
    learned_rewards: "LearnedRewardCosts | None" = None

    @property
    def transfer_s(self) -> float:
        # At most one factor is below 1: a delta push never quantizes (parallel/delta_sync.py refuses it).
        sent = self.transfer_sent_fraction * self.served_weight_fraction
        return self.generation_weight_bytes * sent / self.transfer_bytes_per_s

    def _time(self, flops: float, accessed: float) -> float:
        from areal_jax.plan.planner import roofline_s

        return roofline_s(flops, accessed, self.target)

    def _flops(self, name: str, role: str, devices: int) -> float:
        from areal_jax.aot import ProgramSpec
        from areal_jax.plan.estimate import analytic_flops

        key = (name, role, devices)  # a run asks for the same few shapes thousands of times
        if key not in self._flops_seen:
            self._flops_seen[key] = analytic_flops(ProgramSpec(name=name, role=role, fn=None), self.estimate_context,
                                                   devices)
        return self._flops_seen[key]

    @functools.cached_property
    def _flops_seen(self) -> dict[tuple[str, str, int], float]:
        return {}

    def weights_read(self, tokens):
        """Bytes of one replica's weights a forward over `tokens` tokens (a number, or an array of
        them) reads: a MoE model's routed experts only as many as those tokens touch
        (plan/estimate.weight_share_read); FLOPs count the active experts (analytic_flops)."""
        from areal_jax.plan.estimate import weight_share_read

        return self.generation_weight_bytes * self.served_weight_fraction * weight_share_read(self.model, tokens)

    def decode_step_s(self, window: int) -> float:
        """One decode step of every slot of a replica (the program computes every slot, active or not)."""
        m, slots = self.model, self.slots_per_replica
        # Weights and head per token as a one-token prefill; attention over the window on top.
        flops = self._flops(f"generation/prefill[rows={slots},len=1]", "generation", self.generation_tensor)
        flops += 4.0 * m.num_layers * m.num_heads * m.head_dim * slots * window / self.generation_tensor
        accessed = (self.weights_read(slots) + slots * window * self.kv_bytes_per_token) / self.generation_tensor
        return self._time(flops, accessed)

    def decode_chunk_s(self, steps: int, slot_steps: int, window: int, live_tokens=None, rows=None,
                       live_rows=None, ride_rows=0, ride_width=0, ride_window=0) -> float:
        if live_tokens is None:
            return steps * self.decode_step_s(window)
        return self.paged_decode_s(steps, live_tokens, rows=rows, live_rows=live_rows, ride_rows=ride_rows,
                                   ride_width=ride_width, ride_window=ride_window)

    def paged_decode_s(self, steps, live_tokens, *, rows=None, live_rows=None, ride_rows=0, ride_width=0,
                       ride_window=0):
        """`steps` decode steps of a replica that read `live_tokens` cached tokens over the host
        (summed over steps and slots): the weights once per step plus the live keys and values,
        each replica its share. The engine decodes by live slots (generation/live_slots.py): each
        step computes `rows` rows per replica (EngineConfig.decode_rows of the busiest replica's
        live slots; None: every slot), and a MoE model's step reads the experts its `live_rows`
        live tokens touch (the padding rows repeat a live slot's token; None: `rows`). Arrays
        (one entry per chunk) work too.

        Re-prefill beside decode: each step also runs `ride_rows` rows (over the host) of
        `ride_width` history tokens through the layers (no head: they get no logits), each row's
        queries attending over `ride_window` positions of its slot's keys and values, which it
        reads (generation/paged.py's ride attention gathers each row's pages once); the step's one
        read of the weights serves both (a MoE model's: the experts both sets of tokens touch)."""
        m = self.model
        rows = self.slots_per_replica if rows is None else rows
        live_rows = rows if live_rows is None else live_rows
        attention = 4.0 * m.num_layers * m.num_heads * m.head_dim  # FLOPs per query and key
        flops = self._row_flops * rows * steps
        flops = flops + attention * live_tokens / self.replicas / self.generation_tensor
        touched, cached = np.maximum(live_rows, 1), live_tokens / self.replicas  # per replica
        if ride_rows:
            ride_tokens = ride_rows / self.replicas * ride_width  # per replica and step
            flops = flops + steps * ride_tokens * (self._ride_token_flops
                                                   + attention * ride_window / self.generation_tensor)
            cached = cached + steps * ride_rows / self.replicas * ride_window
            touched = touched + ride_tokens
        weights = self.weights_read(touched)
        accessed = (weights * steps + cached * self.kv_bytes_per_token) / self.generation_tensor
        return np.maximum(flops / self.target.peak_flops_per_device, accessed / self.target.bandwidth_per_device)

    @functools.cached_property
    def _row_flops(self) -> float:
        """FLOPs per device of one decode row (weights and head of one token): a one-token
        prefill's FLOPs are linear in its rows."""
        return self._flops("generation/prefill[rows=1,len=1]", "generation", self.generation_tensor)

    @functools.cached_property
    def _ride_token_flops(self) -> float:
        """FLOPs per device of one ride token through the layers: a one-token score (a prefill
        without the head) less its attention over half a key (plan/estimate.analytic_flops)."""
        m = self.model
        score = self._flops("generation/score[rows=1,len=1]", "generation", self.generation_tensor)
        return score - 2.0 * m.num_layers * m.num_heads * m.head_dim / self.generation_tensor

    def prefill_s(self, rows: int, length: int) -> float:
        flops = self._flops(f"generation/prefill[rows={rows},len={length}]", "generation",
                            self.replicas * self.generation_tensor)
        accessed = (self.weights_read(rows / self.replicas * length)
                    + rows / self.replicas * length * self.kv_bytes_per_token) / self.generation_tensor
        return self._time(flops, accessed)

    def insert_s(self) -> float:
        return 0.0

    def reprefill_s(self, calls: int, tokens: int) -> float:
        # Packed rows are full: as a prefill of `tokens` over the replicas, rows of the pack width.
        if not tokens:
            return 0.0
        return self.prefill_s(max(1, -(-tokens // self.pack_width)), self.pack_width)

    def reprefill_long_s(self, rows: int, length: int) -> float:
        return self.prefill_s(rows, length)

    def _micro_flops(self, rows: int, length: int) -> float:
        """FLOPs per training device of one micro-batch: gradient, and the proximal forward when
        the step recomputes it."""
        global_rows = rows * self.hosts
        flops = self._flops(f"train/grad[rows={global_rows},len={length}]", "train", self.train_devices)
        if self.separate_proximal:
            flops += self._flops(f"train/logprobs[rows={global_rows},len={length}]", "train", self.train_devices)
        return flops

    def train_flops(self, shapes: Shapes) -> float:
        """FLOPs of a step's micro-batches over every training device (each host's rows `shapes`)."""
        return sum(self._micro_flops(r, t) for minibatch in shapes for r, t in minibatch) * self.train_devices

    def decode_token_flops(self, context: float) -> float:
        """FLOPs of one generated token over its replica: weights and head, attention over `context`."""
        m = self.model
        return (self._flops("generation/prefill[rows=1,len=1]", "generation", 1)
                + 4.0 * m.num_layers * m.num_heads * m.head_dim * context)

    def train_step_s(self, shapes: Shapes) -> float:
        total = 0.0
        params = self.model.num_params()
        # Every micro-batch reads the (gathered) weights, every expert of a MoE model (its tokens
        # touch them all), and accumulates fp32 gradients; FLOPs count the active experts only.
        micro_bytes = 3 * 4 * params / self.train_devices
        for minibatch in shapes:
            for rows, length in minibatch:
                total += self._time(self._micro_flops(rows, length), micro_bytes)
            # AdamW: weights, two moments and the gradient read, three written, fp32.
            total += self._time(0.0, 7 * 4 * params / self.train_devices)
        return total

    def as_json(self) -> dict:
        return {"label": self.label, "target": self.target.name, "replicas_per_host": self.replicas,
                "generation_tensor": self.generation_tensor, "slots_per_replica": self.slots_per_replica,
                "train_devices": self.train_devices, "transfer_s": self.transfer_s,
                "transfer_bytes_per_s": self.transfer_bytes_per_s,
                "transfer_sent_fraction": self.transfer_sent_fraction, "reward_s": self.reward_s,
                **({"learned_rewards": self.learned_rewards.as_json()} if self.learned_rewards else {})}


@dataclasses.dataclass(frozen=True)
class LearnedModelCost:
    """One learned reward's model as its scoring costs it: `kind` "score" (a reward model's
    forward), "loglik" (a likelihood reward's forward and every position's logits), "choices" (a
    logprob judge's forward and the last position's logits) or "engine"
    (a regex judge: a prefill, then `new_tokens` greedy decode steps); `ctx` its sizes
    (plan/job.learned_contexts)."""

    label: str
    kind: str
    ctx: object  # plan.estimate.EstimateContext of its model
    weight_bytes: float
    kv_bytes_per_token: float = 0.0
    new_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class LearnedRewardCosts:
    """The learned rewards' scoring of one group at the roofline of one device of theirs: each
    model reads its weights once per call, and its FLOPs are `plan/estimate.analytic_flops` of the
    call's rows x the length bucket of the group's longest sample (prompt + completion; a judge's
    template is not counted). `data`: the reward devices' replicas a group's rows split over (1
    beside the engine). `shared`: they run on the generation devices (the engine waits for them)
    rather than on MeshConfig.reward_devices of their own."""

    target: object
    models: tuple[LearnedModelCost, ...]
    data: int = 1
    shared: bool = True

    def _time(self, flops: float, accessed: float) -> float:
        from areal_jax.plan.planner import roofline_s

        return roofline_s(flops, accessed, self.target)

    def group_s(self, n: int, prompt: int, lengths) -> float:
        from areal_jax.aot import ProgramSpec
        from areal_jax.plan.estimate import analytic_flops
        from areal_jax.reward.reward_model import length_bucket

        T = length_bucket(int(prompt + max(int(x) for x in lengths)))
        R = -(-n // self.data)

        def flops(m, kind, rows, length):  # the forward of its own model (role "generation": no lookup)
            return analytic_flops(ProgramSpec(f"generation/{kind}[rows={rows},len={length}]", "generation", None),
                                  m.ctx, 1)

        total = 0.0
        for m in self.models:
            if m.kind != "engine":
                total += self._time(flops(m, m.kind, R, T), m.weight_bytes)
                continue
            cfg = m.ctx.model  # the judge's prompt prefill, then each greedy step over its context
            total += self._time(flops(m, "prefill", R, T), m.weight_bytes + R * T * m.kv_bytes_per_token)
            step = flops(m, "prefill", R, 1) + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * R * T
            total += m.new_tokens * self._time(step, m.weight_bytes + R * T * m.kv_bytes_per_token)
        return total

    def as_json(self) -> dict:
        return {"models": [m.label for m in self.models], "data": self.data,
                "devices": "shared with generation" if self.shared else "own"}
