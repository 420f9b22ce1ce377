"""An agent session's record: every call's tokens as the engine fed and sampled them, as rows.

Each completion the engine returns for a session becomes a node: the tokens of its row so far
(`[L]`: what the engine was fed, then what it sampled), with per-token loss mask (1 = sampled by
the policy), behaviour log-prob and version (0.0 and -1 where not sampled). A call whose prompt
starts with an existing node's tokens extends that node (the prompt's remainder, e.g. a tool
result and the template's glue, is inserted with mask 0); any other prompt starts a new row.
The rows to train are the nodes nothing extended (`trajectories`). Nothing is re-tokenized here:
the endpoint builds each prompt from the earlier nodes' exact tokens (agents/chat.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from areal_jax.api import Completion, Trajectory

__all__ = ["Node", "Session", "SessionRegistry"]


@dataclasses.dataclass(frozen=True)
class Node:
    """One row so far: `tokens [L]`, `loss_mask [L]`, `logprobs [L]`, `versions [L]` (aligned to
    tokens: entry i describes token i), `prompt_len` (the row's first prompt), stop_reason of its
    last completion, `parent` (index of the node it extends, or -1)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    prompt_len: int
    stop_reason: str
    parent: int

    def trajectory(self, reward: float) -> Trajectory:
        p = self.prompt_len
        return Trajectory(prompt_ids=self.tokens[:p], completion_ids=self.tokens[p:],
                          behavior_logprobs=self.logprobs[p:], versions=self.versions[p:], reward=float(reward),
                          stop_reason=self.stop_reason, loss_mask=self.loss_mask[p:])


class Session:
    """The calls of one agent session (one sample of a row). Thread-safe: the HTTP endpoint may
    record from its own thread while the workflow reads."""

    def __init__(self, session_id: str, *, seed: int = 0) -> None:
        self.id = session_id
        self.seed = seed  # base of the per-call seeds: a session's samples are reproducible
        self.calls = 0
        self.aborted = False  # the engine aborted one of its generations (the group then fails)
        self.nodes: list[Node] = []
        self.messages: list[Any] = []  # the conversations the agent sent, with the replies (for dumps)
        self.turns: list[dict[str, Any]] = []  # chat turns the endpoint may extend (agents/chat.py)
        self._lock = threading.Lock()

    def parent_of(self, prompt_ids: Sequence[int]) -> int:
        """The node the prompt extends: the longest whose tokens start `prompt_ids`, or -1."""
        prompt = np.asarray(prompt_ids)
        best, best_len = -1, 0
        with self._lock:
            for i, node in enumerate(self.nodes):
                n = len(node.tokens)
                if best_len < n <= len(prompt) and np.array_equal(node.tokens, prompt[:n]):
                    best, best_len = i, n
        return best

    def record(self, prompt_ids: Sequence[int], completion: Completion) -> int:
        """Add one completion of a call with `prompt_ids`; returns its node's index."""
        prompt = np.asarray(prompt_ids, np.int32)
        parent = self.parent_of(prompt)
        g = len(completion.tokens)
        with self._lock:
            if parent >= 0:
                base = self.nodes[parent]
                k = len(base.tokens)
                inserted = len(prompt) - k
                tokens = np.concatenate([prompt, np.asarray(completion.tokens, np.int32)])
                mask = np.concatenate([base.loss_mask, np.zeros(inserted, np.float32), np.ones(g, np.float32)])
                logprobs = np.concatenate([base.logprobs, np.zeros(inserted, np.float32),
                                           np.asarray(completion.logprobs, np.float32)])
                versions = np.concatenate([base.versions, np.full(inserted, -1, np.int32),
                                           np.asarray(completion.versions, np.int32)])
                prompt_len = base.prompt_len
            else:
                p = len(prompt)
                tokens = np.concatenate([prompt, np.asarray(completion.tokens, np.int32)])
                mask = np.concatenate([np.zeros(p, np.float32), np.ones(g, np.float32)])
                logprobs = np.concatenate([np.zeros(p, np.float32), np.asarray(completion.logprobs, np.float32)])
                versions = np.concatenate([np.full(p, -1, np.int32), np.asarray(completion.versions, np.int32)])
                prompt_len = p
            self.nodes.append(Node(tokens, mask, logprobs, versions, prompt_len, completion.stop_reason, parent))
            return len(self.nodes) - 1

    def next_seed(self) -> int:
        with self._lock:
            self.calls += 1
            return self.seed + self.calls

    def leaves(self) -> list[Node]:
        """The rows to train: nodes no later call extended, in the order they were made."""
        with self._lock:
            extended = {node.parent for node in self.nodes}
            return [node for i, node in enumerate(self.nodes) if i not in extended]

    def trajectories(self, reward: float) -> list[Trajectory]:
        """Each row as a Trajectory with the session's reward (rows without a sampled token dropped)."""
        return [leaf.trajectory(reward) for leaf in self.leaves() if leaf.loss_mask.any()]


class SessionRegistry:
    """Live sessions by id: the endpoint looks up the session a request names."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session: Session) -> Session:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"agent session {session.id!r} is already open")
            self._sessions[session.id] = session
        return session

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
