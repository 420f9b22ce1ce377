"""Low-rank adapters (LoRA) on the decoder's projections, laid out so PEFT's tensors map 1:1.

A targeted projection `w [*I, *O]` (I its input axes, O its output axes, as in param_axes)
gains `a [*I, R]` and `b [R, *O]`; the layer computes `x @ w + scale * (x @ a) @ b` with
`scale = alpha / R` (PEFT's `lora_alpha / r`). `b` starts at zeros, so a fresh adapter leaves
the model unchanged; `a` starts uniform in +-1/sqrt(fan_in), PEFT's default draw.

Adapters live in the params dict as `params["layers"]["lora"]`, stacked on `L` like every layer
weight: `{"scale": [L], "wq": {"a": [L, D, R], "b": [L, R, N, H]}, ...}`. The forward pass
(models/transformer.py) adds an adapter's update wherever a layer holds one, so the same
`forward`, scan and per-layer decode paths serve adapted and plain weights. `scale` is a frozen
leaf (one value repeated per layer) so the scanned layer body sees it without a config argument;
training differentiates only the `a` and `b` leaves (`split_trainable`).

Adapter dropout (`LoRAConfig.dropout`) exists only in the training loss forward: `with_dropout`
adds a `dropout` entry (per-layer keys and the rate) beside the adapters for that forward alone,
and `adapt` drops the adapter's input wherever the entry is present. Stored params never hold it.

Dimension letters as in models/config.py, plus R (adapter rank).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import ModelConfig

Params = dict[str, Any]
LORA = "lora"  # key of the adapters inside params["layers"]
SCALE = "scale"
DROPOUT = "dropout"  # {"key": [L] PRNG keys, "rate": [L]}: present only inside the loss forward
# Target name -> (our weight, PEFT / HF module name under the layer).
TARGETS: dict[str, tuple[str, str]] = {
    "q": ("wq", "self_attn.q_proj"),
    "k": ("wk", "self_attn.k_proj"),
    "v": ("wv", "self_attn.v_proj"),
    "o": ("wo", "self_attn.o_proj"),
    "gate": ("w_gate", "mlp.gate_proj"),
    "up": ("w_up", "mlp.up_proj"),
    "down": ("w_down", "mlp.down_proj"),
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters for RL (or SFT) on a frozen base.

    Attributes:
        rank: R, the adapters' rank. 0 (the default) = full fine-tuning, no adapters; > 0
            trains adapters only, on a base frozen in `base_dtype`, with optimizer state for
            the adapters alone.
        alpha: the update is scaled by alpha / rank (PEFT's lora_alpha).
        dropout: probability of zeroing an element of an adapter's input in the training loss
            forward (PEFT's lora_dropout: `y = W x + scale * B A dropout(x)`, the base path
            undropped), in [0, 1). Log-prob forwards, the engine, evaluation and export never
            drop (`with_dropout`).
        targets: projections that get adapters, among q, k, v, o, gate, up, down.
        base_dtype: dtype the frozen base is held in by the trainer ("bfloat16" or "float32").
        seed: seeds the draw of the `a` matrices (`b` starts at zeros) and the dropout masks.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    base_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"LoRAConfig.rank must be an int >= 0, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if not isinstance(self.targets, tuple) or not self.targets or len(set(self.targets)) != len(self.targets) \
                or any(t not in TARGETS for t in self.targets):
            raise ValueError(f"LoRAConfig.targets must be a non-empty tuple of distinct names among "
                             f"{tuple(TARGETS)}, got {self.targets!r}")
        if self.base_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"LoRAConfig.base_dtype must be 'bfloat16' or 'float32', got {self.base_dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LoRAConfig.seed must be an int >= 0, got {self.seed!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def weights(self) -> tuple[str, ...]:
        """Our names of the targeted weights (wq, ..., w_down), in `targets` order."""
        return tuple(TARGETS[t][0] for t in self.targets)


def check_targets(cfg: ModelConfig, lora: LoRAConfig) -> None:
    """ValueError (one line) for targets the model does not have: a model whose every layer is a
    mixture of experts has no dense MLP (gate, up, down); adapters on experts are not supported."""
    if not lora.enabled or cfg.moe is None or not all(cfg.sparse_layers):
        return
    missing = [t for t in lora.targets if t in ("gate", "up", "down")]
    if missing:
        kept = tuple(t for t in lora.targets if t not in missing)
        hint = f"set LoRAConfig.targets = {kept or ('q', 'k', 'v', 'o')}"
        raise ValueError(f"LoRAConfig.targets = {lora.targets}: this model has no {', '.join(missing)} projections "
                         f"(every layer is a mixture of experts, with no dense MLP, and adapters on experts are not "
                         f"supported); {hint}")


def _io_axes() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """(input axes, output axes) of every projection, the logical names of param_axes."""
    return {"wq": (("embed",), ("q_heads", "head_dim")), "wk": (("embed",), ("kv_heads", "head_dim")),
            "wv": (("embed",), ("kv_heads", "head_dim")), "wo": (("q_heads", "head_dim"), ("embed",)),
            "w_gate": (("embed",), ("mlp",)), "w_up": (("embed",), ("mlp",)), "w_down": (("mlp",), ("embed",))}


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"layers": cfg.num_layers, "embed": cfg.hidden_size, "q_heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}


def adapter_axes(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, Any]:
    """Logical axes of `params["layers"]["lora"]` (the rank axis is never sharded)."""
    io = _io_axes()
    out: dict[str, Any] = {SCALE: ("layers",)}
    for w in lora.weights:
        ins, outs = io[w]
        out[w] = {"a": ("layers", *ins, "lora_rank"), "b": ("layers", "lora_rank", *outs)}
    return out


def adapter_shapes(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, Any]:
    sizes = {**_sizes(cfg), "lora_rank": lora.rank}
    return jax.tree.map(lambda axes: tuple(sizes[a] for a in axes), adapter_axes(cfg, lora),
                        is_leaf=lambda x: isinstance(x, tuple))


def adapter_param_count(cfg: ModelConfig, lora: LoRAConfig) -> int:
    """Trainable parameters of the adapters (a and b of every target and layer)."""
    shapes = adapter_shapes(cfg, lora)
    return sum(math.prod(s) for w in lora.weights for s in shapes[w].values())


def init_adapters(cfg: ModelConfig, lora: LoRAConfig) -> dict[str, Any]:
    """Fresh fp32 adapters: a ~ U(+-1/sqrt(fan_in)), b = 0, scale = alpha / rank."""
    if not lora.enabled:
        raise ValueError("init_adapters needs LoRAConfig.rank > 0")
    check_targets(cfg, lora)
    rng = np.random.default_rng(lora.seed)
    shapes = adapter_shapes(cfg, lora)
    out: dict[str, Any] = {SCALE: jnp.full(shapes[SCALE], lora.scale, jnp.float32)}
    for w in lora.weights:
        a_shape = shapes[w]["a"]
        bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
        out[w] = {"a": jnp.asarray(rng.uniform(-bound, bound, a_shape).astype(np.float32)),
                  "b": jnp.zeros(shapes[w]["b"], jnp.float32)}
    return out


# ---- params with and without adapters ------------------------------------------------------------


def adapters_of(params: Params) -> dict[str, Any] | None:
    """`params["layers"]["lora"]` (stacked layout), or None for plain weights."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        raise ValueError("adapters_of takes the stacked layout")
    return layers.get(LORA)


def attach(params: Params, adapters: dict[str, Any]) -> Params:
    """`params` with `adapters` as its layers' "lora" entry (replacing any there)."""
    return {**params, "layers": {**params["layers"], LORA: adapters}}


def detach(params: Params) -> Params:
    """`params` without adapters (the frozen base)."""
    return {**params, "layers": {k: v for k, v in params["layers"].items() if k != LORA}}


def split_trainable(params: Params) -> tuple[Params | None, Any]:
    """(frozen, trainable): with adapters, the trainable part is their `a`/`b` leaves and the
    frozen part everything else; without, everything is trainable (frozen = None)."""
    adapters = adapters_of(params)
    if adapters is None:
        return None, params
    trainable = {k: v for k, v in adapters.items() if k != SCALE}
    return attach(params, {SCALE: adapters[SCALE]}), trainable


def join_trainable(frozen: Params | None, trainable: Any) -> Params:
    """Inverse of `split_trainable`."""
    if frozen is None:
        return trainable
    return attach(frozen, {**adapters_of(frozen), **trainable})


# ---- the forward hook and merging -----------------------------------------------------------------


def with_dropout(params: Params, key: jax.Array, rate: float) -> Params:
    """Adapted params whose forward drops each adapter's input with probability `rate` (the
    training loss forward only): layer l draws from `fold_in(key, l)`, its projection `name` from
    `fold_in` of that with the projection's index in TARGETS (`dropout_mask`). Rate 0: `params`
    unchanged (the forward is the deterministic one, bit for bit)."""
    adapters = adapters_of(params)
    if adapters is None:
        raise ValueError("with_dropout needs params with adapters")
    if not rate:
        return params
    L = adapters[SCALE].shape[0]
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(L, dtype=jnp.uint32))
    return attach(params, {**adapters, DROPOUT: {"key": keys, "rate": jnp.full((L,), rate, jnp.float32)}})


_WEIGHT_INDEX = {w: i for i, (w, _) in enumerate(TARGETS.values())}


def dropout_mask(layer_key: jax.Array, name: str, rate: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The keep mask (True = kept) of projection `name`'s adapter input in one layer."""
    return jax.random.bernoulli(jax.random.fold_in(layer_key, _WEIGHT_INDEX[name]), 1.0 - rate, shape)


def adapt(out: jax.Array, x: jax.Array, layer: dict[str, Any], name: str) -> jax.Array:
    """`out [B, T, *O]` (the projection `name` of `x [B, T, I]`) plus the layer's adapter update,
    if it has one for `name`; `out` unchanged otherwise (so B = 0 gives the base bit for bit).
    With a `dropout` entry (`with_dropout`) the adapter reads `x` dropped (kept elements scaled by
    1 / (1 - rate), as torch's dropout); `out`, the base's projection, is never dropped."""
    adapters = layer.get(LORA)
    if adapters is None or name not in adapters:
        return out
    a, b = adapters[name]["a"], adapters[name]["b"]
    if DROPOUT in adapters:
        drop = adapters[DROPOUT]
        keep = dropout_mask(drop["key"], name, drop["rate"], x.shape)
        x = jnp.where(keep, x / (1.0 - drop["rate"]).astype(x.dtype), jnp.zeros((), x.dtype))
    B, T, I = x.shape
    R = a.shape[-1]
    low = jnp.dot(x.reshape(B * T, I), a.reshape(I, R).astype(x.dtype))  # [B*T, R]
    low = low * adapters[SCALE].astype(x.dtype)
    delta = jnp.dot(low, b.reshape(R, -1).astype(x.dtype))
    return out + delta.reshape(out.shape).astype(out.dtype)


def _merge_layer(layer: dict[str, Any]) -> dict[str, Any]:
    """One layer's weights (no `L` axis) with its adapters folded in, computed in fp32."""
    adapters = layer.get(LORA)
    if adapters is None:
        return layer
    out = {k: v for k, v in layer.items() if k != LORA}
    for name, ab in adapters.items():
        if name in (SCALE, DROPOUT):
            continue
        w = layer[name]
        R = ab["a"].shape[-1]
        delta = jnp.dot(ab["a"].reshape(-1, R).astype(jnp.float32), ab["b"].reshape(R, -1).astype(jnp.float32))
        out[name] = (w.astype(jnp.float32) + adapters[SCALE].astype(jnp.float32) * delta.reshape(w.shape)
                     ).astype(w.dtype)
    return out


def merge(params: Params) -> Params:
    """The plain weights `W + scale * a @ b` of adapted params (stacked or per-layer layout)."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        return {**params, "layers": tuple(_merge_layer(p) for p in layers)}
    if LORA not in layers:
        return params
    return {**params, "layers": jax.vmap(_merge_layer)(layers)}


def plain_weights(params: Any) -> Any:
    """The weights a model without adapters runs: adapted params merged (`merge`, in the base's
    dtype); plain ones, or another trainer's pytree, as given."""
    native = isinstance(params, dict) and isinstance(params.get("layers"), dict)
    return merge(params) if native and adapters_of(params) is not None else params


def merge_split(base: Params, adapters: dict[str, Any], scale: float) -> Params:
    """Per-layer base weights (`split_layers` layout) with per-layer trainable adapters
    (`{"layers": ({weight: {"a", "b"}}, ...)}`, what an adapter transfer delivers) merged in."""
    layers = tuple(_merge_layer({**p, LORA: {**ad, SCALE: jnp.float32(scale)}})
                   for p, ad in zip(base["layers"], adapters["layers"], strict=True))
    return {**base, "layers": layers}
