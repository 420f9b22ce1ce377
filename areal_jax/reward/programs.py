"""The learned rewards' programs at a config's shapes, for the planner (plan/job.py compiles them
for the target as it does the policy's).

- a reward model ("rm:<dir>" term): its scorer (`models.reward_head.scoring_program`) over one
  call's rows on one device, at the length bucket of the policy's longest sequence;
- a likelihood reward ("lm:<dir>"): its scorer (`reward.likelihood.likelihood_program`), the same
  rows and length;
- a logprob judge: its choices read (`reward.judge.choices_program`) over `JudgeConfig.batch_size`
  prompts at the bucket of `JudgeConfig.max_seq_len`;
- a regex judge: its own engine's programs (`generation.programs.engine_program_specs` of
  `judge_engine_config`), which never receive weights.

Every spec's role is "reward" and its name says whose it is: "reward/rm/score[rows=R,len=T]"
("rm1", "rm2" ... with several reward models), "reward/lm/loglik[...]", "reward/judge/choices[...]",
"reward/judge/decode[...]".
One "data" replica of the reward devices is compiled (each scores its share of the rows).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.aot import ProgramSpec
from areal_jax.reward.composite import JUDGE, LM_PREFIX, RM_PREFIX

__all__ = ["LearnedModel", "learned_models", "learned_reward_specs"]


@dataclasses.dataclass(frozen=True)
class LearnedModel:
    """One learned term's model, as the planner sees it: its label in program names, its
    config and the dtype of its weights."""

    term: str
    label: str  # "rm", "rm1", ..., "lm", "lm1", ..., "judge"
    config: Any  # ModelConfig
    dtype: Any  # numpy dtype of the weights
    reference: Any = None  # ModelConfig of a likelihood reward's reference LM (reward/likelihood.py), or None


def learned_models(terms: Sequence[tuple[str, float]], judge: Any = None, rm_dtype: str = "float32"
                   ) -> list[LearnedModel]:
    """The learned terms' models, read from their config.json (no weights)."""
    import ml_dtypes  # noqa: F401  names numpy's bfloat16

    from areal_jax.models.hf_io import read_config
    from areal_jax.models.reward_head import read_reward_config
    from areal_jax.reward.likelihood import reference_dir

    rms = [name for name, _ in terms if name.startswith(RM_PREFIX)]
    out = []
    for i, name in enumerate(rms):
        cfg, _ = read_reward_config(pathlib.Path(name[len(RM_PREFIX):]))
        out.append(LearnedModel(name, "rm" if len(rms) == 1 else f"rm{i + 1}", cfg, np.dtype(rm_dtype)))
    lms = [name for name, _ in terms if name.startswith(LM_PREFIX)]
    for i, name in enumerate(lms):
        path = pathlib.Path(name[len(LM_PREFIX):])
        ref = reference_dir(path)
        out.append(LearnedModel(name, "lm" if len(lms) == 1 else f"lm{i + 1}", read_config(path), np.dtype(rm_dtype),
                                reference=read_config(ref) if ref is not None else None))
    if judge is not None and any(name == JUDGE for name, _ in terms):
        out.append(LearnedModel(JUDGE, "judge", read_config(pathlib.Path(judge.model)), np.dtype(judge.dtype)))
    return out


def _rm_params(cfg: Any, mesh: Mesh, dtype: Any, num_labels: int) -> dict[str, Any]:
    from areal_jax.generation.programs import param_structs

    params = {k: v for k, v in param_structs(cfg, mesh, dtype, split=False).items() if k != "lm_head"}
    params["score"] = jax.ShapeDtypeStruct((cfg.hidden_size, num_labels), dtype,
                                           sharding=NamedSharding(mesh, PartitionSpec()))
    return params


def learned_reward_specs(models: Sequence[LearnedModel], judge: Any, mesh: Mesh, *, data: int, rm_batch: int,
                         longest_sequence: int, platform: str | None = None) -> list[ProgramSpec]:
    """The specs of every learned model's programs on `mesh` (one device of the reward devices,
    ("data", "expert", "tensor") = (1, 1, 1)); `data`: the reward devices' replicas (the rows
    each one scores); `rm_batch`: a reward model's rows per call (`RewardModel.batch_size`);
    `longest_sequence`: the longest (prompt + completion) the policy writes, in tokens."""
    from areal_jax.generation.program_specs import engine_program_specs
    from areal_jax.generation.programs import param_structs, program_name
    from areal_jax.models import sharding as shd
    from areal_jax.models.reward_head import read_reward_config, scoring_program
    from areal_jax.reward.judge import choices_program, judge_engine_config
    from areal_jax.reward.likelihood import likelihood_program
    from areal_jax.reward.reward_model import length_bucket, rows_per_device

    replicated = NamedSharding(mesh, PartitionSpec())

    def host(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    def context():
        return shd.activation_rules(shd.GENERATION_RULES, mesh)

    specs: list[ProgramSpec] = []
    for m in models:
        cfg = m.config
        if m.term.startswith(RM_PREFIX):
            _, head = read_reward_config(pathlib.Path(m.term[len(RM_PREFIX):]))
            R = rows_per_device(rm_batch, data)
            T = length_bucket(min(longest_sequence, cfg.max_position_embeddings))
            specs.append(ProgramSpec(
                f"reward/{m.label}/{program_name('score', rows=R, len=T)}", "reward", scoring_program(cfg, head),
                args=(_rm_params(cfg, mesh, m.dtype, head.num_labels), host((R, T)), host((R, T))),
                context=context, fields=("RLVRConfig.reward", "EngineConfig.max_seq_len")))
        elif m.term.startswith(LM_PREFIX):
            R = rows_per_device(rm_batch, data)
            T = length_bucket(min(longest_sequence, cfg.max_position_embeddings))
            ref = param_structs(m.reference, mesh, m.dtype, split=False) if m.reference is not None else None
            specs.append(ProgramSpec(
                f"reward/{m.label}/{program_name('loglik', rows=R, len=T)}", "reward",
                likelihood_program(cfg, m.reference),
                args=(param_structs(cfg, mesh, m.dtype, split=False), ref, host((R, T)), host((R, T)), host((R, T))),
                context=context, fields=("RLVRConfig.reward", "EngineConfig.max_seq_len")))
        elif judge.parse == "logprob":
            B, T = judge.batch_size, length_bucket(judge.max_seq_len)
            choices = np.arange(len(judge.choices), dtype=np.int32)  # ids do not change the program's shapes
            specs.append(ProgramSpec(
                f"reward/{m.label}/{program_name('choices', rows=B, len=T)}", "reward", choices_program(cfg, choices),
                args=(param_structs(cfg, mesh, m.dtype, split=False), host((B, T)), host((B, T)), host((B,))),
                context=context, fields=("JudgeConfig.batch_size", "JudgeConfig.max_seq_len")))
        else:
            engine = judge_engine_config(judge, data)
            engine = dataclasses.replace(engine, num_slots=engine.num_slots // data,
                                         max_prefill_batch=engine.max_prefill_batch // data)
            for s in engine_program_specs(cfg, engine, mesh=mesh, param_dtype=jnp.dtype(m.dtype), role="reward",
                                          platform=platform):
                if s.name.endswith("/split_weights"):
                    continue  # the judge's weights are loaded once, never swapped
                specs.append(dataclasses.replace(s, name=s.name.replace("reward/", f"reward/{m.label}/", 1),
                                                 fields=tuple(s.fields) + ("JudgeConfig.batch_size",
                                                                           "JudgeConfig.max_seq_len")))
    return specs
