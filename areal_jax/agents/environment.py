"""Gym-style environments driven through the chat endpoint.

An `Environment` has `reset(row) -> observation` and `step(action) -> (observation, reward, done)`,
all text: the observation is the next user turn, the action the model's reply. `environment_agent
(make_env)` turns one into an agent function for the AgentWorkflow (`async def agent(client, row)
-> float`): the conversation is the observations as user turns and the model's replies as
assistant turns, and the session's reward is the sum of the step rewards.

`ArithmeticEnv` is the example: the row's question; a reply whose last \\boxed{...} equals the
row's answer earns 1 and ends the episode, a wrong one is told so, up to `max_steps` replies.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["ArithmeticEnv", "Environment", "environment_agent"]


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Any) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool]: ...


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class ArithmeticEnv:
    """The arithmetic task as an environment (see the module docstring)."""

    def __init__(self, max_steps: int = 2) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"ArithmeticEnv.max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self._answer: str | None = None
        self._steps = 0

    def reset(self, row: Any) -> str:
        self._answer, self._steps = str(row.answer).strip(), 0
        return row.messages[-1]["content"]

    def step(self, action: str) -> tuple[str, float, bool]:
        if self._answer is None:
            raise RuntimeError("ArithmeticEnv.step before reset")
        self._steps += 1
        found = _BOXED.findall(action or "")
        if found and found[-1].strip() == self._answer:
            return "Correct.", 1.0, True
        return "Wrong. Check the arithmetic and answer in \\boxed{}.", 0.0, self._steps >= self.max_steps


def environment_agent(make_env: Callable[[], Environment], **create_kwargs: Any):
    """An agent function that plays `make_env()` on each row through the chat client."""

    async def agent(client: Any, row: Any) -> float:
        env = make_env()
        messages: list[dict[str, Any]] = [{"role": "user", "content": env.reset(row)}]
        total, done = 0.0, False
        while not done:
            reply = await client.chat.completions.create(model="policy", messages=messages, **create_kwargs)
            action = reply.choices[0].message.content or ""
            observation, reward, done = env.step(action)
            total += float(reward)
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        return total

    return agent
