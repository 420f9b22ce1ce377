"""The native RL loop built from configs: the job's, the Python API's, the benchmarks' and the tests'
way to an `RLLoop`.

`build_rl_loop` makes the native cluster (trainer and engine on their meshes, the weight path,
the rollout side connected to the workflow and rows), the PPO step (with the reference policy when
the KL penalty needs it), and the standard hooks in their order: at "update" the checkpoint's
resume point; at "metrics" rollout dumps, then held-out evaluation; at "record" the step's record
(`on_step`), then the checkpoint write; at "end" a stop's checkpoint; then `hooks`. With `resume`
and a checkpoint there, the loop continues from it (weights, optimizer, version, counters, data
position).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from areal_jax.api import Hook
from areal_jax.checkpoint import Checkpointer
from areal_jax.generation.config import EngineConfig
from areal_jax.job_config import training_temperature
from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.transformer import Params
from areal_jax.parallel.adapter_sync import AdapterSync
from areal_jax.parallel.meshes import MeshConfig
from areal_jax.parallel.weight_sync import WeightSync
from areal_jax.ppo.advantages import AdvantageConfig
from areal_jax.rollout.workflow import RLVRConfig, RLVRWorkflow
from areal_jax.trainer.algorithm import PPOStep
from areal_jax.trainer.checkpoint_hook import CheckpointHook
from areal_jax.trainer.cluster import RLCluster
from areal_jax.trainer.config import OptimizerConfig, PPOConfig, RLConfig, TrainEngineConfig
from areal_jax.trainer.hooks import EvaluationHook, record_hook, rollout_dump_hook
from areal_jax.trainer.loop import RLLoop
from areal_jax.trainer.reference import ReferencePolicy

__all__ = ["build_rl_loop"]


def build_rl_loop(model_cfg: ModelConfig, params: Params, *, tokenizer: Any, data_iter: Iterator[Any],
                  rl: RLConfig, ppo: PPOConfig, optimizer: OptimizerConfig, advantages: AdvantageConfig,
                  train_engine: TrainEngineConfig | None = None, workflow: RLVRConfig | Any, engine: EngineConfig, mesh: MeshConfig = MeshConfig(),
                  eval_rows: Sequence[Any] = (), reward_pool: Any = None,
                  on_step: Callable[[int, dict[str, Any]], None] | None = None,
                  on_rollouts: Callable[[int, list[dict[str, Any]]], None] | None = None,
                  devices: Sequence[jax.Device] | None = None, start_version: int = 0,
                  checkpointer: Checkpointer | None = None, resume: bool = False,
                  checkpoint_extra: Callable[[], dict[str, Any]] | None = None,
                  on_export: Callable[[Any], None] | None = None, donate_params: bool = False,
                  weight_sync: WeightSync | AdapterSync | None = None, should_stop: Callable[[], bool] | None = None,
                  lora: LoRAConfig = LoRAConfig(), hooks: Sequence[Hook] = ()) -> RLLoop:
    """The native loop (see the module docstring).

    `params`: the initial weights (any placement; the trainer keeps its own fp32 copy on the train
    mesh). With `donate_params` their buffers are deleted once the trainer holds its copy, so no
    initial copy stays on the devices whatever references the caller keeps (use them no more).
    `workflow`: an RLVRConfig (the RLVR workflow on it) or an `api.RolloutWorkflow` (its `rollout`
    RLVRConfig, when it has one, gives held-out evaluation its reward and stop tokens).
    `eval_rows`: held-out loader rows (`data.examples.prompt_example`), evaluated every
    RLConfig.eval_every steps. `on_step(step, metrics)`: each step's record; `on_rollouts(step,
    records)`: its trajectories every RLConfig.dump_rollouts_every steps. `weight_sync`: a
    `cluster.generation_weight_sync` of the same meshes to reuse (its programs compiled).
    `checkpoint_extra`: more metadata for each checkpoint; `on_export`: called on process 0 with each
    HF export's directory. `lora`: adapters trained on a frozen base (models/lora.py). `train_engine`:
    how the trainer packs and computes (TrainEngineConfig; default its defaults).
    """
    rollout = _rollout_config(workflow)
    ppo = ppo if rollout is None else training_temperature(ppo, rollout)  # as JobConfigs derives it
    cluster = RLCluster.build(model_cfg, params, rl=rl, ppo=ppo, optimizer=optimizer, engine=engine,
                              train_engine=train_engine, mesh=mesh,
                              devices=devices, start_version=start_version, donate_params=donate_params,
                              weight_sync=weight_sync, lora=lora)
    del params  # the trainer holds its own copy: nothing below may keep the initial one alive
    # A frozen copy of the initial policy, only when the KL penalty needs it (it costs a copy).
    reference = ReferencePolicy(cluster.trainer) if advantages.kl_coef > 0 else None
    algorithm = PPOStep(cluster.trainer, advantages, ppo, reference=reference,
                        rows_per_process=cluster.rows_per_process)
    runner = (RLVRWorkflow(workflow, learned_devices=cluster.meshes.learned_reward_devices)
              if isinstance(workflow, RLVRConfig) else workflow)
    data = cluster.connect(runner, data_iter, tokenizer=tokenizer, reward_pool=reward_pool)

    update, metrics, record, end = [], [], [], []
    if on_rollouts is not None and rl.dump_rollouts_every:
        metrics.append(rollout_dump_hook(on_rollouts, tokenizer, every=rl.dump_rollouts_every))
    evaluation = EvaluationHook(cluster.engine, eval_rows, tokenizer=tokenizer, rl=rl, rollout=rollout,
                                reward_pool=reward_pool, learned=getattr(runner, "learned", None))
    metrics.append(Hook(evaluation, stage="metrics"))
    if on_step is not None:
        record.append(record_hook(on_step))
    restored = None
    if checkpointer is not None:
        checkpoints = CheckpointHook(checkpointer, cluster, data=data, model_config=model_cfg, extra=checkpoint_extra,
                                     on_export=on_export, always_point=should_stop is not None)
        point, save, stop = checkpoints.hooks()
        update.append(point)
        record.append(save)
        end.append(stop)
        if resume and checkpointer.latest_step() is not None:
            restored = checkpoints.restore()
    return RLLoop(cluster, algorithm, rl=rl, hooks=[*update, *metrics, *record, *end, *hooks], resume=restored,
                  should_stop=should_stop)


def _rollout_config(workflow: Any) -> RLVRConfig | None:
    """The RLVRConfig the rollouts sample with: `workflow` itself, or a custom workflow's `rollout`."""
    rollout = workflow if isinstance(workflow, RLVRConfig) else workflow.rollout
    return rollout if isinstance(rollout, RLVRConfig) else None
