"""Workflows: how one prompt row becomes one group of scored trajectories.

A workflow is an object with `async def arun(client, row, *, version) -> TrajectoryGroup |
None` (AReaL-lite's idea: the episode logic is plain async Python, so multi-turn or tool-using
episodes are just more awaits). It talks to the system only through a `RolloutClient`:
`generate` (the generation engine, awaited without blocking the event loop), `reward` (the
reward pool, or an in-process call) and `decode` (the tokenizer). Returning None rejects the
row; raising fails it; both are counted by the controller, nothing is dropped silently.

`RLVRWorkflow` is the default (single-turn reasoning with a verifiable reward). Any other
workflow is named on the command line by import path, `RLConfig.workflow = "package.module:Class"`
(AReaL users' agentic and multi-turn workflows; `areal_jax/workflows/multi_turn_math.py` is a
documented example). The contract such a class meets:

- Construction: `Class(rollout, tokenizer)`, or `Class(rollout, tokenizer, config)` when the class
  sets `config_class` to a dataclass: `rollout` is the job's RLVRConfig (n_samples, `sampling`,
  reward, reward_timeout_s; its temperature is the trainer's), `tokenizer` the policy's
  (`areal_jax.models.tokenizer.Tokenizer`: encode, decode, apply_chat_template), `config` an
  instance of `config_class` built from the gin bindings (`<ConfigClass>.field = ...`), checked
  with every other config before any work starts. A constructor that takes a `prompt_encoder`
  keyword also gets the `areal_jax.data.templating.PromptEncoder` the rows' prompts were
  rendered with (DataConfig's: its `chat_template_kwargs`, or `prompt_template` for a base model),
  to render the turns it inserts as the prompts are (`chat_text`, `uses_chat_template`); None for
  the built-in arithmetic task, whose prompts are the chat template without variables.
- `async def arun(client, row, *, version) -> TrajectoryGroup | None`: `client` is a
  RolloutClient (`generate`: the engine, per-token behaviour log-probs and policy versions in each
  Completion; `reward`; `decode`), `row` a loader row {"prompt_ids": int32 [P], "row": PromptRow
  (query_id, task, answer or test_cases, source)}, `version` the admission version.
- Each returned Trajectory carries, per completion token, the behaviour log-prob and the version
  the engine reported, and a `loss_mask` with 0 on every token the workflow put into the context
  itself (feedback turns, tool output): those are context, never trained.

`resolve_workflow_class` checks a path against this contract when the configs load.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import importlib
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from areal_jax import api
from areal_jax.api import GroupResult, SamplingParams, Trajectory, TrajectoryGroup
from areal_jax.data.examples import gold_answer, prompt_example
from areal_jax.reward import composite
from areal_jax.reward.judge_config import JudgeConfig
from areal_jax.reward.registry import load_reward_function, resolve_reward_path, reward_value
from areal_jax.rollout.filters import equal_rewards_filter
from areal_jax.user_code import import_hint

__all__ = [
    "Detokenizer", "GenerationAborted", "RLVRConfig", "RLVRWorkflow", "RewardTimeout", "RolloutClient",
    "RewardError", "RolloutWorkflow", "gold_answer", "load_workflow", "make_workflow", "resolve_workflow_class", "row_source",
]


class Detokenizer(Protocol):
    """What workflows need from a tokenizer (areal_jax.models.tokenizer.Tokenizer fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class GenerationAborted(RuntimeError):
    """The engine ended a sample as 'aborted' (engine stopped or request aborted)."""


class RewardTimeout(TimeoutError):
    """An in-process reward call exceeded its deadline."""


class RewardError(RuntimeError):
    """An in-process reward call raised (the message names the reward and the error)."""


def row_source(row: Any) -> str:
    """Where a data row came from, for logs ("path:line" for loader rows)."""
    if isinstance(row, Mapping):
        inner = row.get("row")
        if getattr(inner, "source", None):
            return str(inner.source)
        if row.get("source"):
            return str(row["source"])
    return repr(row)[:120]


class RolloutClient:
    """A workflow's handle on the engine, the reward functions and the tokenizer.

    Rewards run in `reward_pool` (worker processes, per-call deadlines; an error, a value that is
    not a finite real number, or a timeout there yields 0.0, counted by the pool: its contract)
    when one is given; otherwise in this process, on a small thread pool so a slow reward does
    not stall the event loop. There the same outcomes fail the group instead (RewardError,
    TypeError/ValueError from `registry.reward_value`, RewardTimeout; each message names the
    reward), counted by the controller under its error type: no pool counts them as a scored 0,
    and a run whose every group fails stops with the first error (`RolloutController`). In-process
    is meant for cheap rewards; math-verify needs the main thread or a worker process, so use the
    pool for "math".
    """

    def __init__(self, engine: api.InferenceEngine, tokenizer: Detokenizer | None, reward_pool: Any = None,
                 *, reward_threads: int = 4) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool
        self._functions: dict[str, Any] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(reward_threads, thread_name_prefix="reward")

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, sampling: SamplingParams,
                       n: int = 1, *, seed: int | None = None) -> GroupResult:
        """Submit `prompt_ids` for `n` samples and await the engine's result.

        If the awaiting task is cancelled, the request is aborted in the engine. The engine's
        future itself is shielded: cancelling it would make the engine thread fail when it
        later sets the result.
        """
        handle = self.engine.submit(prompt_ids, sampling, n, seed=seed)
        try:
            return await asyncio.shield(asyncio.wrap_future(handle))
        except asyncio.CancelledError:
            self.engine.abort(handle.request_id)
            raise

    async def reward(self, fn: str, *args: Any, timeout_s: float) -> float:
        """Evaluate reward `fn` ("math", "code" or "module:function") on `args`."""
        if self.reward_pool is not None:
            future = self.reward_pool.submit_call(fn, args, timeout_s=timeout_s)
            return float(await asyncio.shield(asyncio.wrap_future(future)))
        function = self._functions.get(fn)
        if function is None:
            function = load_reward_function(resolve_reward_path(fn))
            self._functions[fn] = function
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._executor, lambda: function(*args))
        try:
            value = await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise RewardTimeout(f"reward {fn!r} took longer than {timeout_s} s") from None
        except Exception as exc:  # named here: the controller's log line shows only this message
            raise RewardError(f"reward {fn!r} raised {type(exc).__name__}: {exc}") from exc
        return reward_value(value, fn)  # None, a str or a NaN fails the group, naming the reward

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        """Completion text for the reward (special tokens such as EOS removed)."""
        if self.tokenizer is None:
            raise ValueError("this workflow decodes completions, so the controller needs a tokenizer")
        return self.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)

    def close(self) -> None:
        """Stop the in-process reward threads (calls still running finish in the background)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class RolloutWorkflow(api.RolloutWorkflow, abc.ABC):
    """A base class for `api.RolloutWorkflow` (one prompt row -> one TrajectoryGroup) with the
    defaults of its optional parts: no own filter (`reject_reason`), no RLVRConfig (`rollout`: set
    it to the one the workflow samples with), no config of its own (`config_class`). Subclass it, or
    define all of `api.RolloutWorkflow`'s members yourself."""

    rollout: Any = None
    config_class: ClassVar[type | None] = None

    @abc.abstractmethod
    async def arun(self, engine_client: RolloutClient, row: Any, *, version: int) -> TrajectoryGroup | None:
        """Run one episode for `row` (a loader example: {"prompt_ids", "row"}).

        `version` is the policy version at admission; put it in `admitted_version`. Return
        None to reject the row (counted under reason "workflow"), raise to fail it.
        """

    def reject_reason(self, group: TrajectoryGroup) -> str | None:
        """The workflow's own dynamic filter: a reason to reject a finished group, or None."""
        return None

    def close(self) -> None:
        """Release what the workflow started (e.g. the agent workflow's endpoint); the controller
        calls it at shutdown. Nothing by default."""


@dataclasses.dataclass(frozen=True)
class RLVRConfig:
    """Single-turn RL with verifiable rewards.

    reward: a registered name ("math", "code") or "package.module:function"; called as
        reward(completion_text, gold) where gold is the row's answer (math) or test cases (code).
        Or weighted terms, e.g. (("math", 1.0), ("rm:path/to/rm", 0.5), ("judge", 0.5)): the
        reward is their weighted sum (reward/composite.py; learned terms: "rm:<directory>", "judge").
    judge: the generative judge of a "judge" term.
    filter_all_equal_rewards: reject groups whose n rewards are all equal (no learning signal
        under group normalisation). Off by default, as in AReaL: under batch normalisation an
        all-equal group still carries a REINFORCE signal, which the filter would discard.
    """

    n_samples: int = 4
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    reward: str | tuple[tuple[str, float], ...] = "math"
    reward_timeout_s: float = 10.0
    filter_all_equal_rewards: bool = False
    stop_token_ids: tuple[int, ...] = ()
    judge: JudgeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"RLVRConfig.n_samples must be an int >= 1, got {self.n_samples!r}")
        object.__setattr__(self, "reward", composite.normalize_reward(self.reward))
        if self.judge is not None and not isinstance(self.judge, JudgeConfig):
            raise ValueError(f"RLVRConfig.judge must be a JudgeConfig, got {type(self.judge).__name__}")
        if composite.JUDGE in self.learned_terms and self.judge is None:
            raise ValueError("RLVRConfig.reward has a 'judge' term: set RLVRConfig.judge (a JudgeConfig)")
        if not (isinstance(self.reward_timeout_s, (int, float)) and 0 < self.reward_timeout_s < float("inf")):
            raise ValueError(f"RLVRConfig.reward_timeout_s must be a positive finite number, "
                             f"got {self.reward_timeout_s!r}")
        _ = self.sampling  # validates max_new_tokens, temperature, top_p, top_k, stop_token_ids

    @property
    def reward_terms(self) -> tuple[tuple[str, float], ...]:
        """The reward as weighted terms (a single reward is one term of weight 1)."""
        return ((self.reward, 1.0),) if isinstance(self.reward, str) else self.reward

    @property
    def verifier(self) -> str | None:
        """The verifier held-out accuracy is read from: the reward, or its first term that is not
        learned (None: a reward of learned terms alone has no accuracy, only its reward)."""
        return next((name for name, _ in self.reward_terms if not composite.is_learned(name)), None)

    @property
    def verifier_terms(self) -> tuple[str, ...]:
        """The terms run as reward functions (in the pool or in process), not learned."""
        return tuple(name for name, _ in self.reward_terms if not composite.is_learned(name))

    @property
    def learned_terms(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.reward_terms if composite.is_learned(name))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_token_ids=self.stop_token_ids)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` that is the same in every process and Python run."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RLVRWorkflow(RolloutWorkflow):
    """Sample n completions of the row's prompt, score each, return them as one group."""

    def __init__(self, config: RLVRConfig, *, learned: composite.LearnedRewards | None = None,
                 learned_devices: Sequence[Any] | None = None) -> None:
        """`learned`: the reward's learned terms, loaded (by default from the config, here, on
        `learned_devices`: `parallel.meshes.Meshes.learned_reward_devices`)."""
        if not isinstance(config, RLVRConfig):
            raise TypeError(f"RLVRWorkflow takes an RLVRConfig, got {type(config).__name__}")
        self.config = self.rollout = config
        if learned is None and config.learned_terms:
            learned = composite.LearnedRewards(config.learned_terms, judge=config.judge, devices=learned_devices)
        self.learned = learned

    def close(self) -> None:
        """Stops the learned terms' threads and the judge's engine."""
        if self.learned is not None:
            self.learned.close()

    async def arun(self, engine_client: RolloutClient, row: Any, *, version: int) -> TrajectoryGroup | None:
        cfg = self.config
        example = prompt_example(row)
        prompt = example.prompt_ids
        t0 = time.perf_counter()
        # The samples' randomness follows from the row and the admission version alone, so a run
        # is reproducible however the engine batches requests (and after a resume).
        seed = stable_seed(example.query_id, version)
        result = await engine_client.generate(prompt, cfg.sampling, cfg.n_samples, seed=seed)
        gen_s = time.perf_counter() - t0
        if any(c.stop_reason == "aborted" for c in result.completions):
            raise GenerationAborted(f"generation for {example.source} was aborted")
        info: dict[str, Any] = {}
        if isinstance(cfg.reward, str):
            # return_exceptions: wait for every call, so no failed call is left unobserved
            rewards = await asyncio.gather(*(
                engine_client.reward(cfg.reward, engine_client.decode(c.tokens), example.gold,
                                     timeout_s=cfg.reward_timeout_s)
                for c in result.completions), return_exceptions=True)
            for r in rewards:
                if isinstance(r, BaseException):
                    raise r
        else:
            texts = [engine_client.decode(c.tokens) for c in result.completions]
            rewards, info["reward_terms"] = await score_terms(engine_client, self.learned, cfg, example, texts)
        trajectories = tuple(
            Trajectory(prompt_ids=prompt, completion_ids=c.tokens, behavior_logprobs=c.logprobs, versions=c.versions,
                       reward=float(r), stop_reason=c.stop_reason, moe_routing=c.moe_routing)
            for c, r in zip(result.completions, rewards))
        return TrajectoryGroup(query_id=example.query_id, trajectories=trajectories, admitted_version=version,
                               info={"source": example.source, "task": example.row.task, "generation_s": gen_s,
                                     "reward_s": time.perf_counter() - t0 - gen_s, **info})

    def reject_reason(self, group: TrajectoryGroup) -> str | None:
        return equal_rewards_filter(group) if self.config.filter_all_equal_rewards else None


question_text = composite.question_text  # what a learned reward reads as the question


async def score_terms(client: RolloutClient, learned: composite.LearnedRewards | None, cfg: RLVRConfig,
                      example: Any, texts: Sequence[str]) -> tuple[list[float], dict[str, list]]:
    """The weighted reward of each completion text and, per term, [sum, count, failed]. Every term
    of every completion runs at once; a term that fails (past reward_timeout_s, raised,
    unparseable) counts 0.0 and is counted."""
    question = question_text(example)

    async def one(name: str, text: str) -> tuple[float, bool]:
        try:
            if composite.is_learned(name):
                if learned is None:
                    raise RuntimeError(f"reward term {name!r} has no learned scorer")
                future = learned.submit(name, question, text)
                score, failed = await asyncio.wait_for(asyncio.wrap_future(future),
                                                       learned.deadline_s(name, cfg.reward_timeout_s))
                return float(score), failed is not None
            return await client.reward(name, text, example.gold, timeout_s=cfg.reward_timeout_s), False
        except (TimeoutError, Exception):  # noqa: BLE001 - a failed term scores 0, counted below
            return 0.0, True

    names = [name for name, _ in cfg.reward_terms]
    calls = [one(name, text) for text in texts for name in names]
    results = await asyncio.gather(*calls)
    per_text = [dict(zip(names, results[i * len(names):(i + 1) * len(names)])) for i in range(len(texts))]
    rewards = [sum(w * scores[name][0] for name, w in cfg.reward_terms) for scores in per_text]
    terms = {name: [sum(s[name][0] for s in per_text), len(texts), sum(s[name][1] for s in per_text)]
             for name in names}
    return rewards, terms


def resolve_workflow_class(path: str, field: str = "RLConfig.workflow") -> type:
    """The workflow class at `path` ("package.module:Class"), checked against the contract in this
    module's docstring. Any problem is a ValueError of one line naming `field`, the path and what is
    wrong (no such module, no such class, not a workflow)."""
    where = f"{field} = {path!r}"
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"{where}: is not of the form 'package.module:Class'")
    module_name, attr_path = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"{where}: cannot import module {module_name!r}: no module named {exc.name!r}; "
                             f"{import_hint(exc.name)}") from None
        raise ValueError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's module itself is broken: say so, keep the cause
        raise ValueError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not inspect.isclass(obj):
        raise ValueError(f"{where}: is not a class (a {type(obj).__name__})")
    if not inspect.iscoroutinefunction(getattr(obj, "arun", None)):
        raise ValueError(f"{where}: not a workflow: the class has no `async def arun(self, client, row, *, version)`")
    missing = missing_workflow_members(obj)
    if missing:
        raise ValueError(f"{where}: the class lacks {', '.join(missing)} of api.RolloutWorkflow: subclass "
                         "areal_jax.RolloutWorkflow (it has their defaults) or define them")
    config_class = obj.config_class
    if config_class is not None and not (inspect.isclass(config_class) and dataclasses.is_dataclass(config_class)):
        raise ValueError(f"{where}: the class's config_class must be a dataclass, got {config_class!r}")
    return obj


def missing_workflow_members(obj: Any) -> list[str]:
    """The members of `api.RolloutWorkflow` that a workflow class or instance lacks (`rollout` only
    checked on an instance: a constructor may set it)."""
    names = ["arun", "reject_reason", "config_class"] + ([] if inspect.isclass(obj) else ["rollout"])
    return [name for name in names if not hasattr(obj, name)]


def make_workflow(cls: type, rollout: RLVRConfig, tokenizer: Any, config: Any = None, *,
                  prompt_encoder: Any = None) -> Any:
    """An instance of a workflow class that `resolve_workflow_class` accepted, constructed as the
    contract says (`config` only when the class has a config_class, `prompt_encoder` only when its
    constructor has a parameter of that name)."""
    try:
        takes_encoder = "prompt_encoder" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read: built as the contract's first form says
        takes_encoder = False
    extra = {"prompt_encoder": prompt_encoder} if takes_encoder else {}
    if cls.config_class is None:
        return cls(rollout, tokenizer, **extra)
    if not isinstance(config, cls.config_class):
        raise TypeError(f"{cls.__name__} takes a {cls.config_class.__name__}, got {type(config).__name__}")
    return cls(rollout, tokenizer, config, **extra)


def load_workflow(path: str, **kwargs: Any) -> Any:
    """Instantiate the workflow class at `path` ("package.module:Class") with `kwargs`."""
    try:
        cls = resolve_workflow_class(path, field="workflow")
    except ValueError as e:  # the wrong kind of object is a TypeError here, as before
        kind = TypeError if ": is not a class" in str(e) or ": not a workflow" in str(e) else ValueError
        raise kind(str(e)) from e.__cause__
    return cls(**kwargs)
