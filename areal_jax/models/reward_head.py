"""Scalar reward models: HF `*ForSequenceClassification` checkpoints (Llama, Qwen2, Qwen3).

Such a checkpoint is our decoder without `lm_head` plus a `score` head (`score.weight`
`[num_labels, D]`, no bias). Its score of a sequence is the head applied to the final-norm hidden
state of the sequence's last token that is not the pad token: transformers takes the rightmost
position whose id differs from `pad_token_id`, which is right for left and right padding alike.
We do the same within each row's non-padding tokens (`segment_ids > 0`), so a padded batch scores
each sequence as it scores alone, wherever the padding lies.

Params of a reward model: the decoder's dict (no "lm_head") plus "score" `[D, num_labels]`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models import hf_io
from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, forward

# Architectures read as reward models, by family (the causal-LM families without experts).
SEQUENCE_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
_SCORE = "score.weight"


@dataclasses.dataclass(frozen=True)
class ScoreHead:
    """The head's part of config.json: how many outputs, and which token id is padding (None: the
    sequence's last token counts, as transformers does for a batch of one)."""

    num_labels: int = 1
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 1:
            raise ValueError(f"ScoreHead.num_labels must be an int >= 1, got {self.num_labels!r}")
        if self.pad_token_id is not None and (isinstance(self.pad_token_id, bool)
                                              or not isinstance(self.pad_token_id, int) or self.pad_token_id < 0):
            raise ValueError(f"ScoreHead.pad_token_id must be None or an int >= 0, got {self.pad_token_id!r}")


def read_reward_config(path: str | pathlib.Path) -> tuple[ModelConfig, ScoreHead]:
    """The decoder config and the score head of a reward-model directory; ValueError (naming the
    file) when it is not a supported `*ForSequenceClassification` checkpoint."""
    cfg_file = pathlib.Path(path) / "config.json"
    cfg = hf_io.read_config(path)  # checks the file, the family and the decoder fields
    hf = json.loads(cfg_file.read_text())
    archs = hf.get("architectures") or []
    if not any(a in SEQUENCE_CLASSIFIERS for a in archs):
        raise ValueError(f"{cfg_file}: architectures {archs} name no reward model; supported: "
                         f"{sorted(SEQUENCE_CLASSIFIERS)}")
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default is 2
    pad = hf.get("pad_token_id")
    return cfg, ScoreHead(num_labels=int(labels), pad_token_id=None if pad is None else int(pad))


def load_reward_params(path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                       rules: shd.Rules | None = None) -> tuple[ModelConfig, ScoreHead, Params]:
    """Config, head and weights of a reward-model directory (laid out on `mesh` as `hf_io.load_params`
    does; the small score head is replicated)."""
    path = pathlib.Path(path)
    cfg, head = read_reward_config(path)
    _, params = hf_io.load_params(path, dtype=dtype, mesh=mesh, rules=rules, lm_head=False)
    tensor = hf_io.open_checkpoint(path).tensor(_SCORE)
    shape = tuple(tensor.get_shape())
    if shape != (head.num_labels, cfg.hidden_size):
        raise ValueError(f"{path}: tensor {_SCORE!r} has shape {shape}, expected "
                         f"{(head.num_labels, cfg.hidden_size)} for this config")
    score = np.asarray(tensor[:, :], dtype=jnp.dtype(dtype)).T  # [D, num_labels]
    sharding = NamedSharding(mesh, PartitionSpec()) if mesh is not None else jax.local_devices()[0]
    params["score"] = jax.device_put(score, sharding)
    return cfg, head, params


def last_scored_index(input_ids: jax.Array, segment_ids: jax.Array, pad_token_id: int | None) -> jax.Array:
    """`[B]`: the index of each row's rightmost real token that is not the pad token (0 if none)."""
    T = input_ids.shape[1]
    keep = segment_ids > 0
    if pad_token_id is not None:
        keep = keep & (input_ids != pad_token_id)
    return jnp.argmax(jnp.where(keep, jnp.arange(T), -1), axis=-1)


def sequence_scores(params: Params, cfg: ModelConfig, head: ScoreHead, input_ids: jax.Array,
                    segment_ids: jax.Array, *, compute_dtype=None) -> jax.Array:
    """Scores `[B, num_labels]` (fp32) of one sequence per row of `input_ids [B, T]`; `segment_ids`
    `[B, T]` is 1 on the sequence's tokens and 0 on padding (left or right). Positions count from
    each row's first real token, as the sequence alone would have them."""
    hidden, _ = forward(params, cfg, input_ids, segment_ids=segment_ids, compute_dtype=compute_dtype,
                        return_hidden=True)  # [B, T, D]
    last = last_scored_index(input_ids, segment_ids, head.pad_token_id)  # [B]
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    return jnp.dot(h, params["score"].astype(h.dtype), preferred_element_type=jnp.float32)


def scoring_program(cfg: ModelConfig, head: ScoreHead):
    """The jitted scorer `(params, input_ids [B, T], segment_ids [B, T]) -> [B, num_labels]` a
    `RewardModel` runs and the planner compiles for its target (reward/programs.py)."""
    return jax.jit(lambda params, input_ids, segment_ids: sequence_scores(params, cfg, head, input_ids, segment_ids))


def init_score_head(cfg: ModelConfig, head: ScoreHead, key: int, std: float = 0.02) -> np.ndarray:
    """A random score head `[D, num_labels]` (to put on a causal LM's backbone before training it)."""
    return np.random.default_rng(key).normal(0.0, std, size=(cfg.hidden_size, head.num_labels)).astype(np.float32)


def save_reward_params(params: Params, cfg: ModelConfig, head: ScoreHead, path: str | pathlib.Path, *,
                       dtype=None) -> None:
    """Writes a reward-model directory that transformers loads as `*ForSequenceClassification`:
    config.json and one model.safetensors (the decoder without lm_head, and `score.weight`)."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype) if dtype is not None else np.dtype(params["final_norm"].dtype)
    tensors = {}
    for leaf in hf_io.leaf_keys(cfg):
        if leaf == ("lm_head",):
            continue
        host = hf_io.to_host(params["layers"][leaf[1]] if leaf[0] == "layers" else params[leaf[0]])
        tensors.update(hf_io.leaf_to_hf(cfg, leaf, host, dtype))
    tensors[_SCORE] = np.ascontiguousarray(hf_io.to_host(params["score"]).T.astype(dtype))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    arch = {v: k for k, v in SEQUENCE_CLASSIFIERS.items()}.get(cfg.family)
    if arch is None:
        raise ValueError(f"no reward-model architecture for family {cfg.family!r}; supported: "
                         f"{sorted(set(SEQUENCE_CLASSIFIERS.values()))}")
    hf = cfg.to_hf() | {"architectures": [arch], "num_labels": head.num_labels,
                        "id2label": {str(i): f"LABEL_{i}" for i in range(head.num_labels)},
                        "label2id": {f"LABEL_{i}": i for i in range(head.num_labels)},
                        "pad_token_id": head.pad_token_id, "dtype": hf_io.dtype_name(dtype)}
    (path / "config.json").write_text(json.dumps(hf, indent=2))

