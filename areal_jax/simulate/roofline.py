"""What a simulated row is measured against: the pipeline roofline and the async bound (issue 40).

Pipeline roofline. A trained token costs generation and training device-seconds, whatever the
scheduler: R* = 1 / (t_gen* + t_train*) trained tokens per device-second, with

    t_gen*   = max((weights read / c + KV bytes per token x L) / bandwidth, decode FLOPs per token / peak)
    t_train* = training FLOPs per trained token / peak

where c is the sequences live per generation replica (what the workload sustains: by Little's law
the groups in flight are group latency x groups per step / step time, not the slots), L the live
context a generated token attends over (prompt plus the tokens before it, averaged over generated
tokens), and training FLOPs those of the step's gradient (and proximal) programs per packed slot,
times the packed tokens (prompt and completion) per trained (completion) token: no padding. The
roofline's costs only (`RooflineCosts`): no kernel efficiency, collectives or host overhead.

Async bound. A synchronous step spends G device-seconds generating (long tail included) and T
training. Were the tail free, generation would take e_s G (e_s: sync's generation efficiency, the
share of its decode steps' work that serves a live sequence); async, however it overlaps the
two, spends at least e_s G + T per step of the same work. So with g = e_s G / (e_s G + T),

    async / sync <= (G + T) / (e_s G + T) = 1 + g (1 / e_s - 1).
"""

from __future__ import annotations

import math
from typing import Any


def async_bound(generation_share: float, sync_generation_efficiency: float) -> float:
    """1 + g (1 / e_s - 1): the most any scheduler can gain over sync (module docstring)."""
    g, e = generation_share, sync_generation_efficiency
    if not (0.0 <= g <= 1.0 and 0.0 < e <= 1.0):
        raise ValueError(f"async_bound needs 0 <= g <= 1 and 0 < e_s <= 1, got g={g!r}, e_s={e!r}")
    return 1.0 + g * (1.0 / e - 1.0)


def sync_terms(generation_s: float, train_s: float, efficiency: float) -> dict[str, float]:
    """g, e_s and the bound of a synchronous row that spends `generation_s` generating and
    `train_s` training (per step or in total: only the ratio counts) at generation efficiency
    `efficiency` (its slot occupancy: live sequences over slots, averaged over decode steps)."""
    ideal = efficiency * generation_s
    g = ideal / (ideal + train_s) if ideal + train_s > 0 else 0.0
    return {"generation_share": g, "sync_generation_efficiency": efficiency,
            "async_bound": async_bound(g, efficiency) if efficiency > 0 else math.inf}


def pipeline_roofline(costs, *, live_per_replica: float, live_context: float,
                      train_flops_per_token: float) -> dict[str, Any] | None:
    """t_gen*, t_train* (device-seconds per trained token) and R* (trained tokens per device-second)
    from roofline costs; None for costs without a roofline (fitted to a run)."""
    target = getattr(costs, "target", None)
    if target is None or live_per_replica <= 0:
        return None
    peak, bandwidth = target.peak_flops_per_device, target.bandwidth_per_device
    c = live_per_replica
    decode_bytes = costs.weights_read(c) / c + costs.kv_bytes_per_token * live_context
    decode_flops = costs.decode_token_flops(live_context)
    t_gen = max(decode_bytes / bandwidth, decode_flops / peak)
    t_train = train_flops_per_token / peak
    return {"t_gen_s": t_gen, "t_train_s": t_train, "tokens_per_s_per_device": 1.0 / (t_gen + t_train),
            "live_per_replica": c, "live_context": live_context}
