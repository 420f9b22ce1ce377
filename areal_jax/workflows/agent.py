"""Train any agent written against the OpenAI API: one agent session per sample.

    RLConfig.workflow = "areal_jax.workflows.agent:AgentWorkflow"
    AgentConfig.agent = "my_package.my_agent:solve"      # async def solve(client, row) -> float

For each admitted row the workflow runs RLVRConfig.n_samples sessions of the agent (one group,
normalised together for the advantage). `client` is an `openai.AsyncOpenAI` pointed at the run's
OpenAI-compatible endpoint on localhost (areal_jax/agents/server.py; AgentConfig.transport =
"inprocess": an object with the same `chat.completions.create`, skipping HTTP); `row` the row's
PromptRow (messages, answer, test_cases, query_id); the return value the session's reward.

Every completion the session asked for is recorded token-exactly (areal_jax/agents/session.py):
the session's calls become training rows, calls that continue an earlier one merged into its
row, with loss mask, behaviour log-prob and version per token (0 / 0.0 / -1 on tokens the policy
did not sample). Each row gets the session's reward times turn_discount ** (calls - 1). A session
that raises, returns something other than a finite number, or runs past timeout_s scores 0 and is
counted (group info "failed_sessions", "timed_out_sessions"); its rows so far are trained with
that 0. A generation the engine aborted (the run stopping) fails the whole group, as for
single-turn samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import logging
import math
import threading
import time
import uuid
from typing import Any

from areal_jax.agents.chat import ChatService
from areal_jax.agents.inprocess import InProcessClient
from areal_jax.agents.server import Endpoint
from areal_jax.agents.session import Session, SessionRegistry
from areal_jax.agents.tool_calls import TOOL_FORMATS
from areal_jax.api import TrajectoryGroup
from areal_jax.data.examples import prompt_example
from areal_jax.rollout.filters import equal_rewards_filter
from areal_jax.rollout.workflow import GenerationAborted, RLVRConfig, RolloutWorkflow, stable_seed

__all__ = ["AgentConfig", "AgentWorkflow", "load_agent"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The agent workflow (RLConfig.workflow = "areal_jax.workflows.agent:AgentWorkflow").

    agent: "package.module:function", an `async def function(client, row) -> float`.
    transport: "http" (an openai.AsyncOpenAI at the endpoint; needs the [agents] extra) or
        "inprocess" (the same calls without HTTP).
    timeout_s: a session running longer scores 0 (its generation is aborted).
    turn_discount: the reward is multiplied by turn_discount ** (calls - 1).
    tool_format: how tool calls are read from replies: "auto" (from the chat template), "hermes"
        (Qwen2.5 / Qwen3 `<tool_call>`), "llama3" (Llama 3.1 JSON calls), "none".
    host, port: where the endpoint listens (port 0: a free one).
    """

    agent: str = ""
    transport: str = "http"
    timeout_s: float = 300.0
    turn_discount: float = 1.0
    tool_format: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.agent, str) or self.agent.count(":") != 1 or not all(self.agent.split(":")):
            raise ValueError(f"AgentConfig.agent must be 'package.module:function', got {self.agent!r}")
        if self.transport not in ("http", "inprocess"):
            raise ValueError(f"AgentConfig.transport must be 'http' or 'inprocess', got {self.transport!r}")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"AgentConfig.timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if not (isinstance(self.turn_discount, (int, float)) and 0 < self.turn_discount <= 1):
            raise ValueError(f"AgentConfig.turn_discount must be in (0, 1], got {self.turn_discount!r}")
        if self.tool_format not in ("auto", *TOOL_FORMATS):
            raise ValueError(f"AgentConfig.tool_format must be one of auto, {', '.join(TOOL_FORMATS)}, "
                             f"got {self.tool_format!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"AgentConfig.port must be an int in [0, 65535], got {self.port!r}")


def load_agent(path: str) -> Any:
    """The agent function at "package.module:function", checked to be an async function."""
    module_name, name = path.split(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"AgentConfig.agent = {path!r}: {type(exc).__name__}: {exc}") from None
    if not inspect.iscoroutinefunction(function):
        raise ValueError(f"AgentConfig.agent = {path!r}: not an `async def function(client, row) -> float`")
    return function


class AgentWorkflow(RolloutWorkflow):
    """RLVRConfig.n_samples sessions of AgentConfig.agent per row (see the module docstring)."""

    config_class = AgentConfig

    def __init__(self, rollout: RLVRConfig, tokenizer: Any, config: AgentConfig, *,
                 prompt_encoder: Any = None) -> None:
        if not isinstance(rollout, RLVRConfig):
            raise TypeError(f"AgentWorkflow takes an RLVRConfig, got {type(rollout).__name__}")
        if tokenizer is None:
            raise ValueError("AgentWorkflow needs the policy's tokenizer (its chat template renders the messages)")
        self.rollout, self.config, self.tokenizer = rollout, config, tokenizer
        self.agent = load_agent(config.agent)
        if config.transport == "http":  # fail at construction, naming the extra, not in the server's thread
            for module in ("openai", "aiohttp"):
                try:
                    __import__(module)
                except ImportError:
                    raise ImportError(f"AgentConfig.transport = 'http' needs {module}: pip install 'areal-jax[agents]' "
                                      "(or use transport 'inprocess')") from None
        self.template_kwargs = dict(prompt_encoder.chat_template_kwargs) if prompt_encoder is not None else {}
        self.sessions = SessionRegistry()
        self.service: ChatService | None = None
        self.endpoint: Endpoint | None = None
        self._lock = threading.Lock()
        self.counts = {"sessions": 0, "failed_sessions": 0, "timed_out_sessions": 0}

    def _service(self, client: Any) -> ChatService:
        with self._lock:
            if self.service is None:
                try:
                    limit = client.engine.config.prompt_limit  # the native engine's; others: unchecked here
                except AttributeError:
                    limit = None
                self.service = ChatService(client, self.tokenizer, self.rollout.sampling, prompt_limit=limit,
                                           tool_format=self.config.tool_format,
                                           chat_template_kwargs=self.template_kwargs)
                if self.config.transport == "http":
                    self.endpoint = Endpoint(self.service, self.sessions, host=self.config.host, port=self.config.port)
                    self.endpoint.start()
                    logger.info("agent endpoint listening at %s", self.endpoint.base_url)
            return self.service

    def close(self) -> None:
        """Stop the endpoint (the controller calls it at shutdown)."""
        with self._lock:
            if self.endpoint is not None:
                self.endpoint.stop()
                self.endpoint = None

    def client_for(self, session: Session) -> Any:
        if self.config.transport == "inprocess":
            return InProcessClient(self.service, session)
        import openai

        return openai.AsyncOpenAI(base_url=self.endpoint.base_url, api_key=session.id, max_retries=0,
                                  timeout=self.config.timeout_s)

    async def arun(self, engine_client: Any, row: Any, *, version: int) -> TrajectoryGroup | None:
        example = prompt_example(row)
        self._service(engine_client)
        t0 = time.perf_counter()
        # The id is the session's API key: unique even when a row is in flight twice at one version.
        sessions = [Session(f"{example.query_id}-v{version}-s{i}-{uuid.uuid4().hex}",
                            seed=stable_seed(example.query_id, version, i)) for i in range(self.rollout.n_samples)]
        outcomes = await asyncio.gather(*(self._session(s, example.row) for s in sessions))
        if any(s.aborted for s in sessions):
            raise GenerationAborted(f"generation for {example.source} was aborted")
        trajectories, session_of, failed, timed_out = [], [], 0, 0
        for index, (session, (reward, outcome)) in enumerate(zip(sessions, outcomes)):
            failed += outcome == "failed"
            timed_out += outcome == "timed_out"
            rows = session.trajectories(reward * self.config.turn_discount ** max(session.calls - 1, 0))
            trajectories += rows
            session_of += [index] * len(rows)
        with self._lock:
            self.counts["sessions"] += len(sessions)
            self.counts["failed_sessions"] += failed
            self.counts["timed_out_sessions"] += timed_out
        if not trajectories:
            return None
        return TrajectoryGroup(query_id=example.query_id, trajectories=tuple(trajectories), admitted_version=version,
                               info={"source": example.source, "task": example.row.task, "session_of": session_of,
                                     "turns": [s.calls for s in sessions], "failed_sessions": failed,
                                     "timed_out_sessions": timed_out, "messages": [s.messages for s in sessions],
                                     "episode_s": time.perf_counter() - t0})

    async def _session(self, session: Session, row: Any) -> tuple[float, str]:
        """(reward, "ok" | "failed" | "timed_out") of one session."""
        self.sessions.open(session)
        client = self.client_for(session)
        try:
            reward = await asyncio.wait_for(self.agent(client, row), self.config.timeout_s)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise TypeError(f"the agent returned {reward!r}, not a finite number")
            return float(reward), "ok"
        except TimeoutError:
            logger.warning("agent session %s passed timeout_s = %s; it scores 0", session.id, self.config.timeout_s)
            return 0.0, "timed_out"
        except Exception as exc:  # noqa: BLE001 - the agent's failure scores 0, counted
            logger.warning("agent session %s raised %s: %s; it scores 0", session.id, type(exc).__name__, exc)
            return 0.0, "failed"
        finally:
            self.sessions.close(session.id)
            if self.config.transport == "http":
                await client.close()

    def reject_reason(self, group: TrajectoryGroup) -> str | None:
        return equal_rewards_filter(group) if self.rollout.filter_all_equal_rewards else None
