"""The seams of the system as Protocols: what the RL loop and the rollout side use of each part.

Every attribute the rest of the package reads of an engine, trainer, workflow or rollout client
is a member here (nothing is probed with getattr / hasattr). The names follow AReaL's
`api/engine_api.py`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Protocol, runtime_checkable

from areal_jax.api.batches import PackedBatch
from areal_jax.api.completions import GroupResult
from areal_jax.api.sampling import SamplingParams
from areal_jax.api.trajectories import TrajectoryGroup

__all__ = ["CheckpointableIterator", "EngineStatsView", "InferenceEngine", "RolloutClient", "RolloutWorkflow",
           "TrainEngine"]


class EngineStatsView(Protocol):
    """What the rollout side reads of an engine's counters (generation.requests.EngineStats fits)."""

    tokens_per_s: float  # generation throughput since the engine started
    preempted_samples: int  # samples evicted and re-run (0 for an engine that never preempts)
    reprefill_tokens: int  # history tokens prefilled again (weight swaps, resumed preemptions) so far
    kv_pages_shared: int  # KV pages a group's samples shared instead of each taking them, so far (0: none)


@runtime_checkable
class InferenceEngine(Protocol):
    """A generation backend the rollout side drives from its own threads.

    Contract: any thread may call `submit`, `abort` and `update_weights`; the engine runs on its own
    thread between `start` and `stop`. `submit` returns a Future (with a `request_id` attribute) of a
    `GroupResult`: n Completions whose `tokens`, `logprobs` (behaviour, at `sampling.temperature`)
    and `versions` (per token) have equal lengths, and a `stop_reason` ("stop", "length" or
    "aborted"); for a MoE policy, `moe_routing` `[P + G, L_moe, k]` (the experts each input token
    was routed to; None where not recorded, and TrainEngineConfig.moe_routing = "replay" then refuses the
    batch). `abort` ends a request's unfinished samples as "aborted" (tokens so far kept).
    `update_weights` returns a Future that resolves True once the weights serve (False if a newer
    push superseded them); tokens sampled after that carry `version`. `pause` stops scheduling
    (in-flight samples keep their state) until `resume`. `timings` are the engine's cumulative
    program timings (generation/timings.py; {} for an engine that keeps none), which the run's
    records carry for `areal-jax simulate --calibrate`. `seed` is the base of its per-sample
    randomness, recorded with checkpoints (None: it has none of its own).
    """

    @property
    def version(self) -> int: ...

    @property
    def seed(self) -> int | None: ...

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1, *,
               seed: int | None = None) -> Future: ...

    def abort(self, request_id: str) -> None: ...

    def update_weights(self, params: Any, version: int) -> Future: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> EngineStatsView: ...

    def timings(self) -> dict[str, Any]: ...

    def start(self) -> None: ...

    def stop(self, abort_pending: bool = True) -> None: ...


@runtime_checkable
class TrainEngine(Protocol):
    """A policy trainer the RL loop steps, over the objective it was built with.

    Contract: `train_step(minibatches)` runs one optimizer update per minibatch (a sequence of
    PackedBatch micro-batches) of the objective's loss and returns scalar metrics: the objective's
    own by name (trainer/objectives.py: token means over the step's valid tokens), and at least
    "trained_tokens" and "time_step_s". A micro-batch without "proximal_logprobs" has the weights'
    own pre-update log-probs in their place. `compute_logprobs(microbatch, params=None)` gives
    per-token log-probs [R, T] of the micro-batch's targets at the objective's temperature under
    `params` (default: the current weights). `params` are the current weights, the pytree weight
    sync moves to the InferenceEngine; `state_dict` / `load_state_dict` round-trip everything a
    checkpoint must restore (weights, optimizer state, step). `engine_config` is how it packs
    (the algorithm reads `max_tokens_per_microbatch` and `row_buckets`:
    trainer.engine_config.TrainEngineConfig).
    """

    engine_config: Any

    @property
    def params(self) -> Any: ...

    def train_step(self, minibatches: Sequence[Sequence[PackedBatch]]) -> dict[str, Any]: ...

    def compute_logprobs(self, microbatch: PackedBatch, params: Any = None) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class RolloutClient(Protocol):
    """A workflow's handle on the system (rollout.workflow.RolloutClient is the native one).

    `generate`: n samples of `prompt_ids` from the InferenceEngine, awaited without blocking the
    event loop (a cancelled await aborts the request). `reward(fn, *args, timeout_s=)`: reward
    function `fn` ("math", "code" or "package.module:function") on `args`. `decode`: completion
    text (special tokens removed). `tokenizer`: the policy's tokenizer (None if the run has none).
    """

    tokenizer: Any

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, n: int = 1, *,
                       seed: int | None = None) -> GroupResult: ...

    async def reward(self, fn: str, *args: Any, timeout_s: float) -> float: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


@runtime_checkable
class RolloutWorkflow(Protocol):
    """One prompt row -> one TrajectoryGroup (rollout/workflow.py states the full contract; its
    `RolloutWorkflow` base class gives the defaults of `reject_reason` and `rollout`).

    `arun`: `row` is a loader row {"prompt_ids": int32 [P], "row": PromptRow}; `version` the policy
    version at admission (the group's `admitted_version`). Return None to reject the row, raise to
    fail it. `reject_reason(group)`: the workflow's own filter of finished groups (a reason, or
    None to keep it). `rollout`: the `rollout.workflow.RLVRConfig` it samples with (the trainer's
    log-probs take its temperature, held-out evaluation its reward and stop tokens), or None.
    `config_class`: the dataclass of the workflow's own settings (built from gin bindings and
    passed to its constructor), or None.
    """

    rollout: Any
    config_class: ClassVar[type | None]

    async def arun(self, client: RolloutClient, row: Any, *, version: int) -> TrajectoryGroup | None: ...

    def reject_reason(self, group: TrajectoryGroup) -> str | None: ...


@runtime_checkable
class CheckpointableIterator(Protocol):
    """A data iterator whose position a checkpoint records and a resume restores (grain's fit)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...
