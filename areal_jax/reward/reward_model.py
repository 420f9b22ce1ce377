"""`RewardModel`: a scalar reward model (HF `*ForSequenceClassification`) scoring texts and chats.

    rm = RewardModel.from_pretrained("path/to/rm", dtype=jnp.bfloat16)
    rm.score(["text one", "text two"])             # np.ndarray [N] (fp32)
    rm.score_chats([[{"role": "user", ...}, {"role": "assistant", ...}]])

Sequences are batched `batch_size` rows at a time, each batch padded to a power-of-two length
(few compiled shapes); on a ("data", "expert", "tensor") mesh the rows split over "data" and the
weights by the generation rules. The scoring itself is models/reward_head.py.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig
from areal_jax.models.reward_head import ScoreHead, load_reward_params, scoring_program
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import Params

__all__ = ["DEFAULT_BATCH", "RewardModel", "check_scored_tokens", "length_bucket", "padded_rows", "rows_per_device"]

_MIN_LENGTH = 16
DEFAULT_BATCH = 16  # rows per scoring call (the learned-reward threads' RewardModel)


def length_bucket(n: int) -> int:
    """The padded length a sequence of `n` tokens is scored at (a power of two, at least 16)."""
    return max(_MIN_LENGTH, 1 << (max(n, 1) - 1).bit_length())


def rows_per_device(batch_size: int, data: int) -> int:
    """Rows of one scoring call on each "data" replica: `batch_size` rounded up to split evenly."""
    return -(-batch_size // data)


def check_scored_tokens(tokens: np.ndarray, cfg: ModelConfig, what: str) -> None:
    """ValueError naming `what` ("reward model X: sequence 3") unless the tokens fit the model:
    at most max_position_embeddings of them, every id inside the vocabulary."""
    if tokens.size > cfg.max_position_embeddings:
        raise ValueError(f"{what} has {tokens.size} tokens, more than max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"{what} has a token id outside [0, {cfg.vocab_size})")


def padded_rows(seqs: Sequence[np.ndarray], rows: int, length: int, *, pad: int, padding: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, segment ids), both `[rows, length]` int32: each sequence in its row, on the left or the
    right of it; segment ids are 1 on a sequence's tokens, and rows past `seqs` stay all padding."""
    ids = np.full((rows, length), pad, np.int32)
    seg = np.zeros((rows, length), np.int32)
    for b, s in enumerate(seqs):
        span = slice(0, s.size) if padding == "right" else slice(length - s.size, length)
        ids[b, span], seg[b, span] = s, 1
    return ids, seg


class RewardModel:
    """Scores sequences with a reward model's weights. `score*` return `[N]` for a one-label head,
    `[N, num_labels]` otherwise."""

    def __init__(self, cfg: ModelConfig, head: ScoreHead, params: Params, tokenizer: Tokenizer | None = None, *,
                 mesh: Mesh | None = None, batch_size: int = DEFAULT_BATCH, name: str = "<memory>") -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"RewardModel batch_size must be an int >= 1, got {batch_size!r}")
        self.config, self.head, self.params, self.tokenizer = cfg, head, params, tokenizer
        self.mesh, self.name = mesh, name
        data = mesh.shape["data"] if mesh is not None else 1
        self.batch_size = rows_per_device(batch_size, data) * data  # rows split evenly over "data"
        self._score = scoring_program(cfg, head)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                        tokenizer: str | pathlib.Path | Tokenizer | None = None, batch_size: int = DEFAULT_BATCH) -> "RewardModel":
        """Loads a reward-model directory (config.json, safetensors, and its tokenizer unless
        `tokenizer` names another directory or passes one)."""
        cfg, head, params = load_reward_params(path, dtype=dtype, mesh=mesh)
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer.from_pretrained(tokenizer if tokenizer is not None else path)
        return cls(cfg, head, params, tokenizer, mesh=mesh, batch_size=batch_size, name=str(path))

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"reward model {self.name}: no tokenizer to score text with; use score_ids")
        return self.tokenizer

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """Scores of texts tokenized as transformers' `tokenizer(text)` does (special tokens added)."""
        if isinstance(texts, str):
            raise TypeError("RewardModel.score takes a list of texts, got one str")
        return self.score_ids([self._tok().encode(t) for t in texts])

    def score_chats(self, chats: Sequence[Sequence[Mapping[str, Any]]], **template_kwargs) -> np.ndarray:
        """Scores of conversations rendered by the reward model's own chat template."""
        tok = self._tok()
        return self.score_ids([tok.apply_chat_template(m, tokenize=True, **template_kwargs) for m in chats])

    def score_ids(self, sequences: Sequence[Sequence[int]], *, padding: Literal["right", "left"] = "right"
                  ) -> np.ndarray:
        """Scores of token sequences (padding: which side of each row the padding goes on; the
        scores do not depend on it)."""
        if padding not in ("right", "left"):
            raise ValueError(f"padding must be 'right' or 'left', got {padding!r}")
        seqs = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
        for i, s in enumerate(seqs):
            if s.size == 0:
                raise ValueError(f"reward model {self.name}: sequence {i} is empty")
            check_scored_tokens(s, self.config, f"reward model {self.name}: sequence {i}")
        out = [self._batch(seqs[i:i + self.batch_size], padding) for i in range(0, len(seqs), self.batch_size)]
        labels = self.head.num_labels
        scores = np.concatenate(out) if out else np.zeros((0, labels), np.float32)
        return scores[:, 0] if labels == 1 else scores

    def warmup(self, max_tokens: int = 256) -> None:
        """Compiles the program of every length bucket up to `max_tokens` now, so that no scoring
        call under a deadline pays for a compile."""
        T = _MIN_LENGTH
        while T <= min(max_tokens, self.config.max_position_embeddings):
            self._batch([np.zeros(T, np.int32)], "right")
            T *= 2

    def _batch(self, seqs: list[np.ndarray], padding: str) -> np.ndarray:
        T = length_bucket(max(s.size for s in seqs))
        B = self.batch_size  # one row count: a length bucket is one compiled program (`warmup`)
        pad = self.head.pad_token_id if self.head.pad_token_id is not None else 0
        ids, seg = padded_rows(seqs, B, T, pad=pad, padding=padding)  # [B, T] each
        if self.mesh is None:
            scores = self._score(self.params, ids, seg)
        else:
            rows_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
            with shd.activation_rules(shd.GENERATION_RULES, self.mesh):
                scores = self._score(self.params, jax.device_put(ids, rows_sharding), jax.device_put(seg, rows_sharding))
        return np.asarray(jax.device_get(scores), np.float32)[:len(seqs)]
