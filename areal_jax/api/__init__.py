"""The ground floor of the package: the types that cross the seams and the seams themselves.

Types (plain dataclasses over NumPy arrays):
- `SamplingParams` (sampling.py): how a workflow asks the engine to sample.
- `Completion`, `GroupResult` (completions.py): what the engine hands back.
- `Trajectory`, `TrajectoryGroup` (trajectories.py): what a workflow hands the trainer.
- `PackedBatch` (batches.py): a packed micro-batch, what the algorithm hands the training engine.
- `StepInfo`, `Hook` (steps.py): a finished RL step, what the loop hands its hooks; a hook and its stage.

Seams (protocols.py), named as in AReaL's `api/engine_api.py`:
- `InferenceEngine`: a generation backend (the native one: generation.engine.GenerationEngine).
- `TrainEngine`: a training engine (the native one: trainer.train_step.JaxTrainEngine).
- `RolloutWorkflow`: one prompt row -> one TrajectoryGroup, `arun(client, row, *, version)`.
- `RolloutClient`: what a workflow receives (rollout.workflow.RolloutClient is the native one).

This package imports nothing from the rest of areal_jax, and no JAX (tests/test_import_graph.py
checks the first): every other layer builds on it. A test runs the RL loop on a second,
independent implementation of both engines (tests/test_api_seams.py).
"""

from areal_jax.api.batches import PAD_VALUES, SEQUENCE_KEYS, PackedBatch
from areal_jax.api.completions import Completion, GroupResult, StopReason
from areal_jax.api.protocols import (
    CheckpointableIterator,
    EngineStatsView,
    InferenceEngine,
    RolloutClient,
    RolloutWorkflow,
    TrainEngine,
)
from areal_jax.api.sampling import MAX_STOP_IDS, SamplingParams
from areal_jax.api.steps import STAGES, Hook, Stage, StepInfo
from areal_jax.api.trajectories import Trajectory, TrajectoryGroup

__all__ = [
    "MAX_STOP_IDS", "PAD_VALUES", "SEQUENCE_KEYS", "STAGES", "CheckpointableIterator", "Completion",
    "EngineStatsView", "GroupResult", "Hook", "InferenceEngine", "PackedBatch", "RolloutClient", "RolloutWorkflow", "SamplingParams",
    "Stage", "StepInfo", "StopReason", "TrainEngine", "Trajectory", "TrajectoryGroup",
]
