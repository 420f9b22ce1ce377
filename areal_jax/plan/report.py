"""The plan as a table for people, and the verdict's message."""

from __future__ import annotations

from areal_jax.plan.planner import REFUSE_FACTOR, Plan, ProgramPlan

GiB = float(1 << 30)


def program_row(p: ProgramPlan) -> str:
    mark = "ok " if p.fits else "NO "
    return (f"{mark} {p.role:<10} {p.name:<46} {p.peak_bytes_per_device / GiB:8.2f} / {p.capacity_bytes_per_device / GiB:6.2f}"
            f" {p.estimate_bytes / GiB:8.2f}  {p.flops / 1e12:9.3f} {p.bytes_accessed / GiB:8.2f} {p.roofline_s * 1e3:9.2f}  {p.source:<8}"
            f" {p.attention}{'' if p.grouped_matmul == 'none' else ' / ' + p.grouped_matmul}")


HEADER = (f"{'fit':<3} {'role':<10} {'program':<46} {'peak/capacity GiB':>17} {'est. GiB':>8}  {'TFLOP':>9} {'GiB moved':>8} "
          f"{'roofline ms':>9}  {'source':<8} attention [/ MoE grouped matmul]")


# Why plan's step time and simulate's differ: said beside each one's figure.
STEP_TIME_NOTE = ("plan's step assumes every slot busy and every completion of the mean length "
                  "(PlanConfig.mean_completion_fraction); `areal-jax simulate` replays the length distribution's "
                  "tail, the slots it leaves idle and the staleness bound, so its step is longer")


def run_totals(step_s: float, steps: int, devices: int) -> dict[str, float]:
    """The run's wall time and device-hours at `step_s` a step for RLConfig.steps on `devices`."""
    hours = step_s * steps / 3600.0
    return {"steps": steps, "step_s": step_s, "wall_hours": hours, "devices": devices, "device_hours": hours * devices}


def run_totals_line(totals: dict[str, float]) -> str:
    return (f"the run: {totals['steps']} steps (RLConfig.steps) x {totals['step_s']:.1f} s = "
            f"{totals['wall_hours']:.2f} h wall time, {totals['device_hours']:,.1f} device-hours on "
            f"{totals['devices']} devices")


def format_plan(plan: Plan, steps: int | None = None) -> str:
    """The table, the prediction and the verdict; with `steps` (RLConfig.steps) the run's hours."""
    t = plan.target
    lines = [
        f"target {t.name}: {t.hosts} host(s) x {t.devices_per_host} {t.accelerator.name} devices, "
        f"{t.capacity_bytes_per_device / GiB:.1f} GiB each ({t.accelerator.source})",
        f"split per host: {plan.split.num_train} train, {plan.split.num_generation} generation"
        + (" (colocated)" if plan.split.colocated else "")
        + f"; a program fits when its peak leaves {plan.headroom:.0%} of the device free",
        "", HEADER,
    ]
    lines += [program_row(p) for p in plan.programs]
    pred = plan.prediction
    lines.append("")
    if "generation_tokens_per_s" in pred:
        a = pred["assumptions"]
        live = (f"{a['live_per_replica']:.1f} sequences live per replica, as simulated (full slots: "
                f"{pred['generation_tokens_per_s_full_slots']:,.0f} tokens/s)" if "live_per_replica" in a
                else "every slot busy")
        lines.append(f"generation: {pred['generation_tokens_per_s']:,.0f} tokens/s over all replicas "
                     f"(decode step {pred['decode_step_s'] * 1e3:.2f} ms at window {a['decode_window']}; {live})")
    if "paged" in pred:
        g = pred["paged"]
        lines.append(f"paged decode: {g['in_flight_per_replica']} sequences in flight per replica (bound by its "
                     f"{g['bound_by']}; pool {g['pool_bytes_per_device'] / GiB:.2f} GiB per device), "
                     f"{g['bytes_per_step'] / GiB:.2f} GiB read per step = {g['bytes_over_weights_and_live']:.3f}x "
                     "weights + live KV")
    if "trained_tokens_per_s_compute" in pred:
        lines.append(f"training: {pred['trained_tokens_per_s_compute']:,.0f} tokens/s of gradient micro-batches")
    if pred.get("learned_rewards"):
        parts = [f"{name} {m['weights_bytes'] / GiB:.2f} GiB" + (f" + KV {m['kv_bytes'] / GiB:.2f} GiB" if m["kv_bytes"] else "")
                 for name, m in pred["learned_rewards"].items()]
        lines.append(f"learned rewards ({pred['learned_rewards_devices']}; their reward/ programs above, their bytes in "
                     "the peaks of the programs sharing their devices): " + ", ".join(parts))
    if "transfer_bytes_per_step" in pred:
        lines.append(f"weight swap: {pred['transfer_bytes_per_step'] / 2**20:,.1f} MiB per step"
                     + (f" ({pred['transfer_s_per_step'] * 1e3:.2f} ms at the training devices' roofline, every "
                        "group)" if "transfer_s_per_step" in pred else "")
                     + (f"; {pred['transfer_network_bytes_per_host'] / 2**20:,.1f} MiB per host over "
                        f"{pred['transfer_network']}: {pred['transfer_network_s']:.2f} s"
                        if "transfer_network_s" in pred else ""))
    if "step_s" in pred:
        lines.append(f"one step: generation {pred['step_generation_s']:.1f} s, training {pred['step_train_s']:.1f} s "
                     f"-> {pred['step_s']:.1f} s, {pred['trained_tokens_per_s']:,.0f} trained tokens/s; "
                     f"bound by {pred['bound']}")
        if steps:
            lines.append(run_totals_line(run_totals(pred["step_s"], steps, t.hosts * t.devices_per_host)))
        if "simulated_step_s" in pred:
            lines.append(f"simulated step (areal-jax simulate, the config's row): {pred['simulated_step_s']:.1f} s; "
                         f"plan / simulate = {pred['step_vs_simulate']:.2f}"
                         + (f" -- {pred['step_disagreement']}" if "step_disagreement" in pred else " (within 15%)"))
        else:
            lines.append(f"({STEP_TIME_NOTE})")
    lines.append(verdict(plan))
    return "\n".join(lines)


def verdict(plan: Plan) -> str:
    if plan.fits:
        worst = max(plan.programs, key=lambda p: p.peak_bytes_per_device / p.capacity_bytes_per_device)
        return (f"FITS: every program leaves >= {plan.headroom:.0%} free; tightest {worst.name} at "
                f"{worst.peak_bytes_per_device / worst.capacity_bytes_per_device:.0%} of its device")
    lines = ["DOES NOT FIT:"]
    for p in plan.failures():
        if p.refused:
            lines.append(f"  {p.name} refused before compiling: its hand estimate, {p.peak_bytes_per_device / GiB:.2f} GiB, "
                         f"is over {REFUSE_FACTOR:g}x the {p.capacity_bytes_per_device / GiB:.2f} GiB of its device; change "
                         + (", ".join(p.fields) or "the mesh split"))
            continue
        lines.append(f"  {p.name} needs {p.peak_bytes_per_device / GiB:.2f} GiB of "
                     f"{p.capacity_bytes_per_device / GiB:.2f} GiB (with {plan.headroom:.0%} headroom: "
                     f"{(1 - plan.headroom) * p.capacity_bytes_per_device / GiB:.2f}); change "
                     + (", ".join(p.fields) or "the mesh split"))
    return "\n".join(lines)
