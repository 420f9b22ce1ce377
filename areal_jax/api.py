"""The seams of the system: what the RL loop and the rollout side need of each part, as Protocols.

- `InferenceEngine`: a generation backend. Requests go in (`submit`, `abort`), completions come
  back with per-token behaviour log-probs and the policy version that sampled each token; new
  weights arrive with `update_weights(params, version)` and are swapped in between decode steps.
  The native one is `generation.engine.GenerationEngine`.
- `TrainEngine`: a policy trainer. `train_step` takes packed micro-batches
  (`trainer.batching.PackedBatch`) and updates the weights; `compute_logprobs` scores a
  micro-batch; `params` and `state_dict` / `load_state_dict` are what weight sync and checkpoints
  read. The native one is `trainer.train_step.PolicyTrainer`.
- `RolloutWorkflow`: one prompt row -> one `TrajectoryGroup`, `arun(client, row, *, version)`;
  `client` is a `rollout.workflow.RolloutClient` over an InferenceEngine.

The names follow AReaL's `api/engine_api.py` so its users find their way. The loop
(trainer/loop.py), the rollout controller and the workflows are typed against these, and a
test runs the loop on a second, independent implementation of both engines
(tests/test_api_seams.py). This module imports nothing heavy: `import areal_jax.api` loads no JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from areal_jax.generation.sampling import SamplingParams
    from areal_jax.rollout.types import TrajectoryGroup
    from areal_jax.rollout.workflow import RolloutClient
    from areal_jax.trainer.batching import PackedBatch
    from areal_jax.trainer.config import PPOConfig

__all__ = ["EngineStatsView", "InferenceEngine", "RolloutWorkflow", "TrainEngine"]


class EngineStatsView(Protocol):
    """What the rollout side reads of an engine's counters (generation.requests.EngineStats fits)."""

    tokens_per_s: float  # generation throughput since the engine started
    preempted_samples: int  # samples evicted and re-run (0 for an engine that never preempts)


@runtime_checkable
class InferenceEngine(Protocol):
    """A generation backend the rollout side drives from its own threads.

    Contract: any thread may call `submit`, `abort` and `update_weights`; the engine runs on its own
    thread between `start` and `stop`. `submit` returns a Future (with a `request_id` attribute) of a
    `generation.requests.GroupResult`: n Completions whose `tokens`, `logprobs` (behaviour, at
    `sampling.temperature`) and `versions` (per token) have equal lengths, and a `stop_reason`
    ("stop", "length" or "aborted"); for a MoE policy, `moe_routing` `[P + G, L_moe, k]` (the experts
    each input token was routed to; None where not recorded, and PPOConfig.moe_routing = "replay"
    then refuses the batch). `abort` ends a request's unfinished samples as "aborted"
    (tokens so far kept). `update_weights` returns a Future that resolves True once the weights
    serve (False if a newer push superseded them); tokens sampled after that carry `version`.
    `pause` stops scheduling (in-flight samples keep their state) until `resume`.
    """

    @property
    def version(self) -> int: ...

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1, *,
               seed: int | None = None) -> Future: ...

    def abort(self, request_id: str) -> None: ...

    def update_weights(self, params: Any, version: int) -> Future: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> EngineStatsView: ...

    def start(self) -> None: ...

    def stop(self, abort_pending: bool = True) -> None: ...


@runtime_checkable
class TrainEngine(Protocol):
    """A policy trainer the RL loop steps.

    Contract: `train_step(minibatches, current_version=v)` runs one optimizer update per
    minibatch (a sequence of PackedBatch micro-batches) and returns scalar metrics, at least
    "trained_tokens" and "time_step_s", and "version_lag_hist" ({lag: tokens}) when
    `current_version` is given. `compute_logprobs(microbatch, params=None)` gives per-token
    log-probs [R, T] of the micro-batch's targets at `ppo_config.logit_temperature` under `params`
    (default: the current weights). `params` are the current weights, the pytree weight sync
    moves to the InferenceEngine; `state_dict` / `load_state_dict` round-trip everything a
    checkpoint must restore (weights, optimizer state, step).
    """

    ppo_config: PPOConfig

    @property
    def params(self) -> Any: ...

    def train_step(self, minibatches: Sequence[Sequence[PackedBatch]], *,
                   current_version: int | None = None) -> dict[str, Any]: ...

    def compute_logprobs(self, microbatch: PackedBatch, params: Any = None) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class RolloutWorkflow(Protocol):
    """One prompt row -> one TrajectoryGroup (rollout/workflow.py states the full contract).

    `row` is a loader row {"prompt_ids": int32 [P], "row": PromptRow}; `version` the policy version
    at admission (the group's `admitted_version`). Return None to reject the row, raise to fail it.
    A workflow may also define `reject_reason(group) -> str | None`, its own filter of finished groups.
    """

    async def arun(self, client: RolloutClient, row: Any, *, version: int) -> TrajectoryGroup | None: ...
