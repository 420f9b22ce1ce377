"""areal_jax: fully asynchronous RL for LLM reasoning, native to JAX.

The Python API (areal_jax/python_api.py; README.md and docs/user_guide.md show it):

    import areal_jax as aj
    cfg = aj.load_config("configs/quickstart.gin", overrides=["RLConfig.steps = 20"])
    trainer = aj.Trainer(cfg, run_dir="runs/nb", reward_fn=my_reward, train_data=rows, eval_data=held_out)
    summary = trainer.train(); trainer.evaluate(); trainer.export("hf/out")

Names load on first use: `import areal_jax` imports no JAX.
"""

from areal_jax.lazy_exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    # running a job
    "load_config": "areal_jax.python_api",
    "Trainer": "areal_jax.python_api",
    # its configs (plain frozen dataclasses; gin is one front end)
    "JobConfigs": "areal_jax.job_config",
    "ModelSource": "areal_jax.job_config",
    "TaskSource": "areal_jax.job_config",
    "Stages": "areal_jax.job_config",
    "ArithmeticConfig": "areal_jax.tasks.arithmetic",
    "DataConfig": "areal_jax.data.pipeline",
    "SFTConfig": "areal_jax.trainer.config",
    "RLConfig": "areal_jax.trainer.config",
    "PPOConfig": "areal_jax.trainer.config",
    "OptimizerConfig": "areal_jax.trainer.config",
    "TrainEngineConfig": "areal_jax.trainer.config",
    "AdvantageConfig": "areal_jax.ppo.advantages",
    "RLVRConfig": "areal_jax.rollout.workflow",
    "EngineConfig": "areal_jax.generation.config",
    "MeshConfig": "areal_jax.parallel.meshes",
    "CheckpointConfig": "areal_jax.checkpoint",
    "MetricsConfig": "areal_jax.metrics",
    "LoRAConfig": "areal_jax.models.lora",
    "ConfigError": "areal_jax.config_system",
    # the seams (Protocols) and what a custom workflow builds
    "InferenceEngine": "areal_jax.api",
    "TrainEngine": "areal_jax.api",
    "RolloutWorkflow": "areal_jax.rollout.workflow",  # the base class (api.RolloutWorkflow's defaults)
    "RolloutClient": "areal_jax.api",
    "StepInfo": "areal_jax.api",
    "Hook": "areal_jax.api",
    "PromptExample": "areal_jax.data.examples",
    "prompt_example": "areal_jax.data.examples",
    "Trajectory": "areal_jax.api",
    "TrajectoryGroup": "areal_jax.api",
    "SamplingParams": "areal_jax.api",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
