"""What a simulated row is measured against: the pipeline roofline and the async bound (issue 40).

Pipeline roofline. A trained token costs generation and training device-seconds, whatever the
scheduler: R* = 1 / (t_gen* + t_prefill* + t_train*) trained tokens per device-second, with

    t_gen*     = max((weights read / c + KV bytes per token x L) / bandwidth, decode FLOPs per token / peak)
    t_prefill* = the prompts' prefill FLOPs per trained token / peak (one prefill per group)
    t_train*   = training FLOPs per trained token / peak

where c is the sequences live per generation replica (what the workload sustains: by Little's law
the groups in flight are group latency x groups per step / step time, not the slots), L the live
context a generated token attends over (prompt plus the tokens before it, averaged over generated
tokens), and training FLOPs those of the step's gradient (and proximal) programs per packed slot,
times the packed tokens (prompt and completion) per trained (completion) token: no padding. The
roofline's costs only (`RooflineCosts`): no kernel efficiency, collectives or host overhead.

Async bound. Per trained token, sync spends S device-seconds (every device, the whole step): G
generating (long tail included), T training (padding and the weight push included) and I idle
(S = G + T + I). No scheduler on the same hardware and programs spends less than
G* = t_gen*(c) + t_prefill* on generation, where the decode cost per token t_gen*(c) falls as more
sequences c share each step's weight read, or less than T* on training, the fewest training
device-seconds per trained token any compared row spends: the trainer's programs as they run
(weight gathers, the optimizer, rows rounded to the devices, the weight push), which no scheduler
changes. So with the shares g = G / S, t = T / S and sync's efficiencies e_s = G* / G (generation)
and e_t = T* / T (training),

    async / sync <= S / (G* + T*) = 1 / (g e_s + t e_t)     (async_bound)

With no idle time and training as cheap in sync as in any row (t = 1 - g, e_t = 1) this is the
issue's 1 + g' (1 / e_s - 1), g' = e_s G / (e_s G + T): async gains only on generation's tail and
idle devices. What makes it a bound is c: the issue took e_s as sync's slot occupancy, i.e.
generation at sync's own concurrency (one batch per replica), but async keeps up to (eta + 1)
batches in flight, so it can decode each token cheaper than any sync step does and exceeded that
bound (a 70B config by 19%). Here c is the most sequences per replica among the rows compared
(async's live sequences per replica, sync's one batch per replica), so the bound holds for every
row of the report. Training at its FLOPs (t_train*) would count as recoverable what the programs
themselves cost in every schedule (session 21 took it so: configs busy on both sides all step
came out at 0.79-0.87 of that bound with nothing left to schedule); that figure stays in the
roofline fraction.
"""

from __future__ import annotations

from typing import Any


def async_bound(generation_share: float, generation_efficiency: float, train_share: float | None = None,
                train_efficiency: float = 1.0) -> float:
    """1 / (g e_s + t e_t): the most any scheduler can gain over sync (module docstring); t defaults
    to 1 - g (no idle time)."""
    g, e = generation_share, generation_efficiency
    t = 1.0 - g if train_share is None else train_share
    if not (0.0 <= g <= 1.0 and 0.0 <= t <= 1.0 and g + t <= 1.0 + 1e-9):
        raise ValueError(f"async_bound needs shares 0 <= g, t and g + t <= 1, got g={g!r}, t={t!r}")
    if not (0.0 < e <= 1.0 and 0.0 < train_efficiency <= 1.0):
        raise ValueError(f"async_bound needs 0 < e_s, e_t <= 1, got e_s={e!r}, e_t={train_efficiency!r}")
    return 1.0 / (g * e + t * train_efficiency)


def sync_terms(sync_s: float, generation_s: float, train_s: float, ideal_generation_s: float,
               ideal_train_s: float) -> dict[str, float]:
    """g, t, e_s, e_t and the bound of a synchronous row that spends `sync_s` device-seconds per
    trained token, `generation_s` of them generating and `train_s` training, against the roofline's
    `ideal_generation_s` (G*) and `ideal_train_s` (T*) per trained token (module docstring)."""
    if not (sync_s > 0 and generation_s > 0 and train_s > 0 and ideal_generation_s > 0 and ideal_train_s > 0):
        raise ValueError("sync_terms needs positive device-seconds, got "
                         f"{(sync_s, generation_s, train_s, ideal_generation_s, ideal_train_s)!r}")
    busy = generation_s + train_s
    scale = sync_s / busy if busy > sync_s else 1.0  # busy seconds over the wall's (rounding): shares sum to <= 1
    g, t = generation_s * scale / sync_s, train_s * scale / sync_s
    e_s, e_t = min(1.0, ideal_generation_s / (generation_s * scale)), min(1.0, ideal_train_s / (train_s * scale))
    return {"generation_share": g, "train_share": t, "idle_share": max(0.0, 1.0 - g - t),
            "sync_generation_efficiency": e_s, "sync_train_efficiency": e_t,
            "async_bound": async_bound(g, e_s, t, e_t)}


def pipeline_roofline(costs, *, live_per_replica: float, live_context: float,
                      train_flops_per_token: float, prefill_flops_per_token: float = 0.0) -> dict[str, Any] | None:
    """t_gen*, t_prefill*, t_train* (device-seconds per trained token) and R* (trained tokens per device-second)
    from roofline costs; None for costs without a roofline (fitted to a run)."""
    target = getattr(costs, "target", None)
    if target is None or live_per_replica <= 0:
        return None
    peak, bandwidth = target.peak_flops_per_device, target.bandwidth_per_device
    c = live_per_replica
    decode_bytes = costs.weights_read(c) / c + costs.kv_bytes_per_token * live_context
    decode_flops = costs.decode_token_flops(live_context)
    t_gen = max(decode_bytes / bandwidth, decode_flops / peak)
    t_prefill = prefill_flops_per_token / peak
    t_train = train_flops_per_token / peak
    return {"t_gen_s": t_gen, "t_prefill_s": t_prefill, "t_train_s": t_train,
            "tokens_per_s_per_device": 1.0 / (t_gen + t_prefill + t_train),
            "live_per_replica": c, "live_context": live_context}
