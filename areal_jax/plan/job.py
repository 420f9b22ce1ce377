"""The plan of one `areal-jax train` config: its programs on its target, and a verdict.

Reads the same gin bindings the run reads (JobConfigs) plus PlanConfig, and asks each module that
owns programs for their specs at the config's shapes.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from areal_jax.aot import ProgramSpec, bytes_per_device
from areal_jax.job_config import JobConfigs
from areal_jax.models.config import ModelConfig
from areal_jax.parallel.meshes import check_model_fits_mesh, split_local_devices
from areal_jax.plan import peak_index
from areal_jax.plan.config import PlanConfig
from areal_jax.plan.estimate import (EstimateContext, analytic_flops, estimate_peak, lower_bound_peak,
                                     weight_share_read)
from areal_jax.plan.planner import (Plan, ProgramPlan, measure_programs, paged_decode_figures, predict,
                                    read_model_config, role_meshes)
from areal_jax.plan.targets import Target



class PlanError(ValueError):
    """The config cannot be planned as written; the message names the field."""


def model_config_for(job: JobConfigs, plan_cfg: PlanConfig, gin_files: Sequence[str]) -> ModelConfig:
    path = plan_cfg.model_config or job.model.path
    if path is None:
        from areal_jax.tasks.tokenizer_builder import task_model_config

        return task_model_config(hidden_size=job.model.hidden_size, num_layers=job.model.num_layers,
                                 num_experts=job.model.num_experts, num_experts_per_tok=job.model.num_experts_per_tok)
    search = [pathlib.Path(f).resolve().parent for f in gin_files]
    try:
        return read_model_config(path, search=search)
    except FileNotFoundError as e:
        raise PlanError(f"PlanConfig.model_config / ModelSource.path: {e}") from None


def generation_lengths(job: JobConfigs, plan_cfg: PlanConfig) -> tuple[float, float, int]:
    """(mean prompt, mean completion, longest prompt) in tokens, as the prediction assumes them."""
    longest_prompt = (job.data.max_prompt_tokens if job.data is not None and job.data.max_prompt_tokens
                      else max(1, job.engine.max_seq_len - job.rollout.max_new_tokens))
    return (plan_cfg.mean_prompt_fraction * longest_prompt,
            plan_cfg.mean_completion_fraction * job.rollout.max_new_tokens, longest_prompt)


def replica_engine_config(engine, data: int, *, field: str = "EngineConfig.num_slots"):
    """The engine config one data replica of the generation mesh runs: its share of the slots."""
    if engine.num_slots % data:
        raise PlanError(f"{field} = {engine.num_slots} is not a multiple of the generation mesh's data size "
                        f"{data}: the KV cache would be replicated on every generation device")
    # The engine's calls hold data x (rows per replica) rows, at most ceil(max_prefill_batch / data)
    # per replica: one replica's share is an engine of its slots with that many rows.
    return dataclasses.replace(engine, num_slots=engine.num_slots // data,
                               max_prefill_batch=-(-engine.max_prefill_batch // data))


def eval_engine_config(job: JobConfigs, longest_prompt: int, data: int, hosts: int, model_cfg: ModelConfig):
    """One data replica's share of the run's held-out evaluation engine: the engine
    `GreedyAccuracy` builds for a host's shard of the rows (`prompts_engine_config`, capped at
    `JobConfigs.eval_engine_slots`), divided over the `data` replicas."""
    from areal_jax.generation.config import prompts_engine_config

    rows = max(1, -(-job.task.eval_size // hosts))  # each host evaluates its shard of the rows
    slots = job.eval_engine_slots(model_cfg, data)  # as jobs/train.py sizes the run's
    engine = prompts_engine_config(rows, longest_prompt, job.rl.eval_max_new_tokens, slots=slots, data=data)
    # The run's evaluation engine serves the RL engine's weights as they are (int8/int4 codes with
    # EngineConfig.weight_dtype: generation/engine.py), so its programs read that copy.
    # It runs scanned when the RL engine does, on the same stacked push.
    return dataclasses.replace(engine, num_slots=engine.num_slots // data, weight_dtype=job.engine.weight_dtype,
                               scan_layers=job.engine.scan_layers)


def gen_dtype(job: JobConfigs):
    return jnp.dtype(job.rl.generation_dtype or job.model.dtype)


def collect_specs(job: JobConfigs, model_cfg: ModelConfig, target: Target, meshes, *, longest_prompt: int
                  ) -> list[ProgramSpec]:
    from areal_jax.generation.program_specs import engine_program_specs
    from areal_jax.parallel.weight_sync import transfer_program_specs
    from areal_jax.trainer.algorithm import ppo_objective, proximal_keys
    from areal_jax.trainer.programs import train_program_specs

    data = meshes.generation_replicas_per_host
    longest_row = trained_row_length(job)
    specs = [s for s in train_program_specs(model_cfg, job.train_engine, ppo_objective(job.ppo), job.optimizer,
                                            meshes.train, extra_keys=proximal_keys(job.ppo),
                                            num_processes=target.hosts, lora=job.lora)
             if _dims(s.name).get("len", 0) <= longest_row]
    specs += transfer_program_specs(model_cfg, meshes.train, num_hosts=target.hosts,
                                    generation_tensor=job.mesh.generation_tensor,
                                    generation_expert=job.mesh.generation_expert, dtype=gen_dtype(job),
                                    group_bytes=job.rl.transfer_group_bytes, lora=job.lora,
                                    weight_dtype=job.engine.weight_dtype)
    # The engine's programs for the target's platform (its KV layout and attention kernel), where
    # the engine takes one (the paged engine of issue 25 does).
    on_target = ({"platform": "tpu" if target.platform == "tpu" else "gpu"}
                 if "platform" in inspect.signature(engine_program_specs).parameters else {})
    specs += engine_program_specs(model_cfg, replica_engine_config(job.engine, data), mesh=meshes.generation,
                                  param_dtype=gen_dtype(job), **on_target)
    if job.task.eval_size and (job.task.kind == "arithmetic" or job.task.eval_paths):
        specs += engine_program_specs(model_cfg, eval_engine_config(job, longest_prompt, data, target.hosts, model_cfg),
                                      mesh=meshes.generation, param_dtype=gen_dtype(job), role="eval", **on_target)
    if job.rollout.learned_terms:  # reward models and the judge, on one device of theirs
        from areal_jax.reward.programs import learned_models, learned_reward_specs
        from areal_jax.reward.reward_model import DEFAULT_BATCH

        specs += learned_reward_specs(learned_models(job.rollout.reward_terms, job.rollout.judge), job.rollout.judge,
                                      meshes.reward, data=max(1, job.mesh.reward_devices), rm_batch=DEFAULT_BATCH,
                                      longest_sequence=job.engine.max_seq_len, **on_target)
    # The run hands both engines their weights in the layout they hold (per layer, or stacked with
    # EngineConfig.scan_layers), which they install as given: the change of layout never runs in
    # `train`, except the stacking of LoRA and delta pushes, which arrive per layer.
    unchanged = ("/split_weights",) + (("/stack_weights",) if job.lora.rank == 0 and job.rl.transfer_mode != "delta"
                                       else ())
    return [s for s in specs if not s.name.endswith(unchanged)]


def trained_row_length(job: JobConfigs) -> int:
    """Longest micro-batch row an RL step can use: a trained sequence is at most the engine's
    max_seq_len tokens, so row lengths past its bucket are never built (whatever the budget)."""
    from areal_jax.trainer.batching import candidate_row_lengths

    rows = candidate_row_lengths(job.train_engine.max_tokens_per_microbatch, job.train_engine.row_buckets or None)
    return next((r for r in rows if r >= job.engine.max_seq_len), rows[-1])


def _dims(name: str) -> dict[str, int]:
    """"train/grad[rows=8,len=2048]" -> {"rows": 8, "len": 2048}."""
    inside = name[name.index("[") + 1:-1] if "[" in name else ""
    return {k: int(v) for k, v in (part.split("=") for part in inside.split(",") if "=" in part)}


def bounding_specs(specs: Sequence[ProgramSpec], keep: Callable[[ProgramSpec], bool] = lambda s: False
                   ) -> list[ProgramSpec]:
    """The member of each program family (same role, kind and other dimensions, such as a decode's
    re-prefill rows; rows, lengths and windows differing) with the largest shapes: memory grows
    with those within a family, so these bound the run's peak. `keep` adds others (the programs the
    throughput prediction reads)."""
    families: dict[tuple, ProgramSpec] = {}
    for s in specs:
        fixed = tuple(sorted((k, v) for k, v in _dims(s.name).items() if k not in _SHAPE_DIMS))
        family = (s.role, s.name.split("[")[0], fixed)
        best = families.get(family)
        if best is None or _bigger(_dims(s.name), _dims(best.name)):
            families[family] = s
    chosen = set(id(s) for s in families.values())
    return [s for s in specs if id(s) in chosen or keep(s)]


_SHAPE_DIMS = ("rows", "len", "window")  # what varies within a program family


def _bigger(a: dict[str, int], b: dict[str, int]) -> bool:
    """Compare shapes by their tokens (rows x len, windows), then by length."""
    def key(d):  # attention grows with the length (quadratically in training): longer rows first
        return (d.get("rows", 1) * d.get("len", 1) * d.get("window", 1), d.get("len", 0), d.get("window", 0),
                d.get("rows", 0))
    return key(a) > key(b)


def check_weight_layouts(model_cfg: ModelConfig, meshes) -> None:
    """A weight dimension that its mesh axis does not divide is replicated on that axis
    (models/sharding.py): at real sizes that is memory the config meant to shard. Refuse it,
    naming the field that sets the axis."""
    import jax

    from areal_jax.models.sharding import GENERATION_RULES, TRAIN_RULES, spec_for
    from areal_jax.models.transformer import param_axes, param_shapes

    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    axes, shapes = param_axes(model_cfg), param_shapes(model_cfg)
    for rules, mesh, role in ((TRAIN_RULES, meshes.train, "train"), (GENERATION_RULES, meshes.generation, "generation")):
        flat_axes = jax.tree_util.tree_leaves_with_path(axes, is_leaf=is_axes)
        flat_shapes = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
        for (path, names), shape in zip(flat_axes, flat_shapes):
            want, got = spec_for(names, rules, mesh), spec_for(names, rules, mesh, shape)
            if want == got:
                continue
            for i, (w, g) in enumerate(zip(tuple(want) + (None,) * len(shape), tuple(got) + (None,) * len(shape))):
                if w != g and i < len(shape):
                    names_w = (w,) if isinstance(w, str) else tuple(w)
                    axis, ways = "/".join(names_w), int(np.prod([mesh.shape[n] for n in names_w]))
                    field = {"tensor": f"MeshConfig.{role}_tensor", "expert": f"MeshConfig.{role}_expert",
                             "fsdp": "MeshConfig (the training devices)",
                             "fsdp/expert": f"MeshConfig (the training devices, with {role}_expert)",
                             "data": "MeshConfig (the generation devices)"}.get(axis, "MeshConfig")
                    raise PlanError(
                        f"{field}: the {role} mesh's {axis!r} axis ({ways}) "
                        f"does not divide dimension {names[i]!r} = {shape[i]} of weight "
                        f"{jax.tree_util.keystr(path)}: it would be replicated instead of sharded")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What `plan_job` compiles and how it counts memory: the programs (`specs`) on their meshes,
    the bytes each role keeps beside the other's programs (`extra_resident`) and the hand
    estimate's sizes (`ctx`). `simulate --tune` estimates candidate configs from the same."""

    model_cfg: ModelConfig
    split: Any  # DeviceSplit
    meshes: Any  # RoleMeshes
    specs: tuple[ProgramSpec, ...]
    ctx: EstimateContext
    extra_resident: Callable[[ProgramSpec], int]
    gen_weights: int
    mean_prompt: float
    mean_completion: float


def plan_inputs(job: JobConfigs, plan_cfg: PlanConfig, target: Target, *, gin_files: Sequence[str] = (),
                only: str | None = None, every_program: bool = False, model_cfg: ModelConfig | None = None,
                devices: Callable[..., list] | None = None) -> PlanInputs:
    """The programs a plan of `job` measures. `devices(target, n, hosts=1)`: the fake devices the
    meshes are built on (default plan/targets.topology_devices, the target's own kind)."""
    model_cfg = model_cfg or model_config_for(job, plan_cfg, gin_files)
    if job.mesh.num_slices != getattr(target, "slices", 1):
        raise PlanError(f"MeshConfig.num_slices = {job.mesh.num_slices}, but target {target.name} has "
                        f"{getattr(target, 'slices', 1)} slice(s): bind MeshConfig.num_slices to match")
    try:
        split = split_local_devices(job.mesh, target.devices_per_host)
    except ValueError as e:
        raise PlanError(f"MeshConfig on {target.name} ({target.devices_per_host} devices per host): {e}") from None
    try:
        check_model_fits_mesh(model_cfg, job.mesh)
        meshes = role_meshes(target, split, job.mesh.train_tensor, job.mesh.generation_tensor,
                             job.mesh.train_expert, job.mesh.generation_expert, devices=devices)
    except ValueError as e:
        raise PlanError(str(e)) from None
    check_weight_layouts(model_cfg, meshes)
    mean_prompt, mean_completion, longest_prompt = generation_lengths(job, plan_cfg)
    specs = collect_specs(job, model_cfg, target, meshes, longest_prompt=longest_prompt)
    typical_window = job.engine.decode_window(int(mean_prompt + mean_completion))
    typical_row = _row_for(job, int(mean_prompt + mean_completion))
    if not every_program:
        specs = bounding_specs(specs, keep=lambda s: s.name.endswith(f"decode[window={typical_window}]")
                               or (s.role == "train" and _dims(s.name).get("len") == typical_row))
    # What each side keeps resident comes from all of its programs, also under --only: a colocated
    # side's programs run beside the other side's state.
    persistent = {role: max((bytes_per_device(_persistent(s)) for s in specs if s.role == role), default=0)
                  for role in ("train", "generation")}
    # Each learned reward's weights (and a regex judge's KV cache) stay on its devices throughout:
    # by default the first generation device, beside the policy's engine (and, colocated, the
    # training state); with MeshConfig.reward_devices devices of their own.
    learned = {}
    for s in specs:
        if s.role == "reward":
            label = s.name.split("/")[1]
            learned[label] = max(learned.get(label, 0), bytes_per_device(_persistent(s)))
    shared = not job.mesh.reward_devices
    if only:
        matched = [s for s in specs if only in s.name]
        if not matched:
            raise PlanError(f"--only {only!r} matches none of the {len(specs)} programs planned "
                            f"({', '.join(sorted({s.name.split('[')[0] for s in specs}))}); --all plans every shape")
        specs = matched

    from areal_jax.generation.programs import param_structs

    # The served copy: int8 codes and scales with EngineConfig.weight_dtype "int8".
    gen_weights = bytes_per_device(param_structs(model_cfg, meshes.generation, gen_dtype(job), split=True,
                                                 weight_dtype=job.engine.weight_dtype))

    # LoRA: the generation devices keep the frozen base beside the merged weights they serve
    # (parallel/adapter_sync.py), one weight copy more than the engine's own programs hold.
    lora_base = gen_weights if job.lora.enabled else 0

    def extra_resident(spec: ProgramSpec) -> int:
        beside = sum(learned.values()) if shared else 0  # the learned rewards, where they share devices
        if spec.role == "reward":
            others = sum(v for k, v in learned.items() if k != spec.name.split("/")[1])
            if not shared:
                return others
            return others + persistent["generation"] + lora_base + (persistent["train"] if split.colocated else 0)
        # Colocated: each side's state stays on the devices while the other side's programs run.
        if split.colocated and spec.role in ("generation", "eval"):
            return persistent["train"] + lora_base + beside
        if split.colocated and spec.role in ("train", "transfer"):
            # weight_swap "evict": the engine drops its served weights before each update
            # (RLCluster.begin_update) and the push lands in their place; its KV pool stays.
            held = persistent["generation"] - (gen_weights if job.engine.weight_swap == "evict" else 0)
            return held + lora_base + beside
        return lora_base + beside if spec.role in ("generation", "eval") else 0

    ctx = EstimateContext(
        model=model_cfg, fsdp=meshes.train.shape["fsdp"], train_tensor=job.mesh.train_tensor,
        generation_tensor=job.mesh.generation_tensor, train_expert=job.mesh.train_expert,
        generation_expert=job.mesh.generation_expert, compute_bytes=2 if job.train_engine.compute_dtype == "bfloat16" else 4,
        cache_bytes=jnp.dtype(job.engine.cache_dtype or gen_dtype(job)).itemsize, remat=job.train_engine.remat,
        logit_chunk_tokens=job.train_engine.logit_chunk_tokens, decode_chunk=job.engine.decode_chunk,
        prefill_chunk=job.engine.prefill_chunk, learned=learned_contexts(job))
    return PlanInputs(model_cfg=model_cfg, split=split, meshes=meshes, specs=tuple(specs), ctx=ctx,
                      extra_resident=extra_resident, gen_weights=gen_weights, mean_prompt=mean_prompt,
                      mean_completion=mean_completion)


def learned_contexts(job: JobConfigs) -> tuple[tuple[str, EstimateContext], ...]:
    """The hand estimate's sizes of each learned reward's model (one device; a regex judge's
    engine chunks as `judge_engine_config`'s)."""
    if not job.rollout.learned_terms:
        return ()
    from areal_jax.reward.judge import judge_engine_config
    from areal_jax.reward.programs import learned_models

    out = []
    for m in learned_models(job.rollout.reward_terms, job.rollout.judge):
        engine = judge_engine_config(job.rollout.judge) if m.label == "judge" else job.engine
        for label, model in ((m.label, m.config), (f"{m.label}/reference", m.reference)):
            if model is not None:  # a likelihood reward's reference LM: its own sizes
                out.append((label, EstimateContext(model=model, cache_bytes=m.dtype.itemsize,
                                                   decode_chunk=engine.decode_chunk, prefill_chunk=engine.prefill_chunk)))
    return tuple(out)


def plan_job(job: JobConfigs, plan_cfg: PlanConfig, target: Target, *, gin_files: Sequence[str] = (),
             use_cache: bool = True, only: str | None = None, every_program: bool = False,
             on_program: Callable[[ProgramPlan], None] | None = None, workers: int = 1,
             live: dict[str, Any] | None = None) -> Plan:
    """Every program measured on `target`, and the throughput predicted from their rooflines.
    `workers`: compiles at once (plan/planner.measure_programs). `live`: the simulator's row of the
    config (`simulate.driver.config_row`), whose live concurrency the generation prediction uses,
    and whose step time it is compared with."""
    inputs = plan_inputs(job, plan_cfg, target, gin_files=gin_files, only=only, every_program=every_program)
    model_cfg, split, meshes, specs, ctx = inputs.model_cfg, inputs.split, inputs.meshes, inputs.specs, inputs.ctx
    extra_resident, gen_weights = inputs.extra_resident, inputs.gen_weights
    mean_prompt, mean_completion = inputs.mean_prompt, inputs.mean_completion
    cache_files: dict[str, str] = {}
    programs = measure_programs(specs, target, extra_resident=extra_resident, headroom=plan_cfg.headroom,
                                use_cache=use_cache, estimator=lambda s, kernels: estimate_peak(s, ctx, kernels),
                                lower_bound=lambda s: lower_bound_peak(s, ctx),
                                flop_counter=lambda s, n: analytic_flops(s, ctx, n), on_program=on_program,
                                workers=workers, cache_files=cache_files)
    # Where each compiled peak sits in the plan cache, so `simulate --tune` reads it unlowered.
    peak_index.add(peak_index.index_key(job, plan_cfg, target.name, model_cfg),
                   {p.name: {"file": cache_files[p.name], "resident": p.resident_bytes}
                    for p in programs if p.name in cache_files and not p.refused})
    replica_engine = replica_engine_config(job.engine, meshes.generation_replicas_per_host)
    cache_itemsize = job.engine.kv_itemsize(gen_dtype(job))  # 1 with kv_dtype float8_e4m3fn
    kv_bytes_per_token = (2 * model_cfg.num_layers * (model_cfg.num_kv_heads // job.mesh.generation_tensor)
                          * model_cfg.head_dim * cache_itemsize)  # k and v, every layer, on one device
    # A decode step of a MoE model reads only the experts its slots touch (plan/estimate.py).
    decode_weights = gen_weights * weight_share_read(model_cfg, replica_engine.num_slots)
    paged = None
    layout = getattr(job.engine, "layout", None)  # the paged engine's EngineConfig (issue 25)
    if layout is not None and layout(target.platform) == "paged":
        page_bytes = replica_engine.page_size * kv_bytes_per_token * job.mesh.generation_tensor  # whole replica
        paged = paged_decode_figures(
            slots=replica_engine.num_slots, pool_tokens=replica_engine.pool_pages(
                page_bytes, 1, job.engine.kv_scale_bytes(model_cfg.num_layers, model_cfg.num_kv_heads, gen_dtype(job)))
            * replica_engine.page_size,
            mean_prompt=mean_prompt, mean_completion=mean_completion, page_size=replica_engine.page_size,
            decode_chunk=job.engine.decode_chunk, block_tokens=max(replica_engine.page_size,
                                                                    256 if target.platform == "tpu" else 128),
            weight_bytes=decode_weights, kv_bytes_per_token=kv_bytes_per_token)
    prediction = predict(
        programs, target=target, meshes=meshes, model_cfg=model_cfg,
        slots_per_replica=paged["in_flight_per_replica"] if paged else replica_engine.num_slots,
        batch_groups=job.rl.batch_size, samples_per_group=job.rollout.n_samples, mean_prompt=mean_prompt,
        mean_completion=mean_completion, decode_chunk=job.engine.decode_chunk,
        decode_window=job.engine.decode_window, row_length=lambda n: _row_for(job, n), num_minibatches=job.ppo.num_minibatches,
        separate_proximal=job.ppo.decoupled and job.ppo.num_minibatches > 1, colocated=split.colocated,
        decode_bytes=(lambda window: paged["bytes_per_step"]) if paged else
        (lambda window: decode_weights + replica_engine.num_slots * window * kv_bytes_per_token), paged=paged,
        live=live, live_decode_bytes=lambda c, context: (gen_weights * weight_share_read(model_cfg, c)
                                                         + c * context * kv_bytes_per_token))
    prediction["model_params"] = model_cfg.num_params()
    if job.rollout.learned_terms:  # reward models and the judge: their bytes beside the policy's engine
        from areal_jax.reward.composite import learned_reward_memory

        prediction["learned_rewards"] = learned_reward_memory(job.rollout.reward_terms, job.rollout.judge)
        prediction["learned_rewards_devices"] = "own" if job.mesh.reward_devices else "first generation device"
        add_learned_reward_time(prediction, programs, job, colocated=split.colocated, live=live)
    # The bytes each step's weight swap moves: the model as served (the generation dtype; codes and
    # scales with EngineConfig.weight_dtype, quantized before the gathers: parallel/transfer_plan.py),
    # or with LoRA its adapters (parallel/adapter_sync.py).
    from areal_jax.models.quantize import served_bytes
    from areal_jax.parallel.adapter_sync import adapter_bytes

    prediction["transfer_bytes_per_step"] = (adapter_bytes(model_cfg, job.lora, gen_dtype(job)) if job.lora.enabled
                                             else served_bytes(model_cfg, gen_dtype(job).itemsize,
                                                               job.engine.weight_dtype))
    prediction.update(network_transfer(prediction["transfer_bytes_per_step"], target))
    return Plan(target=target, split=split, train_devices=split.num_train * target.hosts,
                generation_devices=split.num_generation * target.hosts, programs=tuple(programs),
                prediction=prediction, headroom=plan_cfg.headroom)


def learned_reward_step_s(programs: Sequence[ProgramPlan], job: JobConfigs) -> float:
    """Seconds the learned rewards take per step at their compiled programs' rooflines, every call
    at its largest shapes (a bound): a step's completions in calls of a reward model's 16 rows, or
    of the judge's batch_size (a regex judge: its prefill, then max_new_tokens greedy steps in
    decode chunks at its widest window)."""
    from areal_jax.reward.judge import judge_engine_config
    from areal_jax.reward.reward_model import DEFAULT_BATCH

    completions = job.rl.batch_size * job.rollout.n_samples
    largest: dict[tuple[str, str], float] = {}
    for p in programs:
        if p.role == "reward":
            label, kind = p.name.split("/")[1], p.name.split("/")[2].split("[")[0]
            largest[label, kind] = max(largest.get((label, kind), 0.0), p.roofline_s)
    total = 0.0
    for (label, kind), seconds in largest.items():
        batch = job.rollout.judge.batch_size if label == "judge" else DEFAULT_BATCH
        calls = -(-completions // batch)
        if kind in ("score", "loglik", "choices", "prefill_start"):
            total += calls * seconds
        elif kind == "decode":
            chunk = judge_engine_config(job.rollout.judge).decode_chunk
            total += calls * -(-job.rollout.judge.max_new_tokens // chunk) * seconds
    return total


def add_learned_reward_time(prediction: dict[str, Any], programs: Sequence[ProgramPlan], job: JobConfigs, *,
                            colocated: bool, live: dict[str, Any] | None = None) -> None:
    """`learned_reward_s_per_step`; where the learned rewards share the generation devices their time
    is generation's, and the step is predicted again with it."""
    seconds = learned_reward_step_s(programs, job)
    prediction["learned_reward_s_per_step"] = seconds
    if job.mesh.reward_devices or "step_generation_s" not in prediction:
        return
    t_gen = prediction["step_generation_s"] + seconds
    t_train = prediction["step_train_s"]
    t_step = t_gen + t_train if colocated else max(t_gen, t_train)
    tokens = prediction["trained_tokens_per_s"] * prediction["step_s"]
    prediction.update(step_generation_s=t_gen, step_s=t_step, trained_tokens_per_s=tokens / t_step,
                      bound="generation" if t_gen >= t_train else "training")
    if live is not None and live.get("step_s"):  # set beside the simulated step again
        from areal_jax.plan.planner import step_disagreement

        prediction["step_vs_simulate"] = t_step / live["step_s"]
        prediction.pop("step_disagreement", None)
        if not 0.85 <= t_step / live["step_s"] <= 1.15:
            prediction["step_disagreement"] = step_disagreement(t_step, live)


def network_transfer(weight_bytes: float, target: Target) -> dict[str, Any]:
    """What a push of `weight_bytes` costs over the slow network. The trained weights are sharded
    over "fsdp", which spans every host (and slice): each host gathers the share the others hold.
    Across TPU slices the other slices' share crosses DCN (a slice's hosts share its ICI); between
    GPU nodes, the other nodes' share crosses InfiniBand. Each host receives (parts - 1) / parts of the weights at its own network bandwidth (`Target.host_network_bandwidth`,
    published per chip, plan/targets.py), all hosts at once."""
    bandwidth = target.host_network_bandwidth
    # A TPU slice's hosts share its ICI: only the other slices' share crosses DCN.
    parts = getattr(target, "slices", 1) if target.platform == "tpu" else target.hosts
    if parts <= 1 or bandwidth is None:
        return {}
    share = (parts - 1) / parts
    return {"transfer_network_bytes_per_host": weight_bytes * share, "transfer_network_s": weight_bytes * share / bandwidth,
            "transfer_network": ("DCN between slices" if getattr(target, "slices", 1) > 1 else
                                 "the network between hosts") + f", {bandwidth / 1e9:g} GB/s per host"}


def _row_for(job: JobConfigs, tokens: int) -> int:
    from areal_jax.trainer.batching import candidate_row_lengths

    rows = candidate_row_lengths(job.train_engine.max_tokens_per_microbatch, job.train_engine.row_buckets or None)
    return next((r for r in rows if r >= tokens), rows[-1])


def _persistent(spec: ProgramSpec) -> Any:
    """What a role keeps between its programs: the arguments that are state (weights, optimizer
    state, KV cache) rather than per-call inputs, approximated by its largest arguments."""
    return (spec.args, spec.resident)
