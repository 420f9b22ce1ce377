"""Decoder configuration: one frozen dataclass for the Llama 3 / Qwen2 / Qwen3 family and its
mixture-of-experts variants (Qwen2-MoE, Qwen3-MoE: `ModelConfig.moe`).

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict (both the older top-level
`rope_theta` + `rope_scaling` spelling and transformers 5's `rope_parameters`) and
`to_hf` writes one back that transformers loads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"]
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
GROUPED_MATMULS = ("auto", "ragged_dot", "gmm")
RopeType = Literal["default", "linear", "llama3"]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base frequency plus an optional context-extension rule."""

    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    def __post_init__(self):
        if self.type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {self.type!r} (supported: default, linear, llama3)")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive, got theta={self.theta}, factor={self.factor}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts decoder (models/moe.py). Letters: E experts,
    k experts per token, Fe one expert's hidden size, Fs the shared expert's.

    A layer is sparse unless listed in `mlp_only_layers` or `(layer + 1) % decoder_sparse_step != 0`
    (HF's rule); dense layers use ModelConfig.intermediate_size. Routing is dropless: every token
    reaches all k of its experts (no capacity factor, no dropped tokens).
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # renormalize the k chosen probabilities to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert with a sigmoid gate; 0 = none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Weight of the load-balancing loss (Switch-style, as HF's) added to the training loss; 0 = off.
    # From an HF config.json: its router_aux_loss_coef where output_router_logits is true, else 0
    # (transformers adds the loss only then); written back with output_router_logits = coef > 0.
    router_aux_loss_coef: float = 0.0
    # Grouped matmul over tokens sorted by expert: "ragged_dot" (jax.lax.ragged_dot), "gmm" (the
    # platform's Pallas kernel: megablox gmm on TPU, Mosaic GPU ragged dot on Hopper) or "auto" (the
    # kernel where it takes the shapes and dtypes, else ragged_dot).
    grouped_matmul: str = "auto"

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoEConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"MoEConfig.shared_expert_intermediate_size must be >= 0, "
                             f"got {self.shared_expert_intermediate_size}")
        if any(not isinstance(i, int) or i < 0 for i in self.mlp_only_layers):
            raise ValueError(f"MoEConfig.mlp_only_layers must hold layer indices >= 0, got {self.mlp_only_layers!r}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"MoEConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.grouped_matmul not in GROUPED_MATMULS:
            raise ValueError(f"MoEConfig.grouped_matmul must be one of {GROUPED_MATMULS}, got {self.grouped_matmul!r}")

    def sparse_layers(self, num_layers: int) -> tuple[bool, ...]:
        """Per layer: True where its MLP is the expert block."""
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder. Dimension letters used across models/:

    B batch, T query length, S key length, D hidden, N query heads, K key/value heads,
    H head dim, F MLP hidden, V vocab, L layers.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 when attention_bias
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over H on q and k before rotary
    max_position_embeddings: int = 4096
    family: Family = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    moe: MoEConfig | None = None  # the qwen2_moe / qwen3_moe families' experts

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.family not in FAMILIES.values():
            raise ValueError(f"unknown family {self.family!r}")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ValueError(f"ModelConfig.moe must be set exactly for the families {MOE_FAMILIES}, "
                             f"got family={self.family!r} with moe={'set' if self.moe else 'None'}")
        if self.moe is not None:
            if any(i >= self.num_layers for i in self.moe.mlp_only_layers):
                raise ValueError(f"MoEConfig.mlp_only_layers {self.moe.mlp_only_layers} names layers past "
                                 f"num_layers ({self.num_layers})")
            if self.mlp_bias:
                raise ValueError("ModelConfig.mlp_bias: the MoE families have no MLP biases")
            if (self.moe.shared_expert_intermediate_size > 0) != (self.family == "qwen2_moe"):
                raise ValueError(f"MoEConfig.shared_expert_intermediate_size: qwen2_moe has a shared expert "
                                 f"(> 0) and qwen3_moe none (0); got {self.moe.shared_expert_intermediate_size} "
                                 f"for {self.family!r}")
        # What each family's HF class can express, so a saved checkpoint loads back as it was.
        qwen2 = self.qkv_bias and not (self.o_bias or self.mlp_bias or self.qk_norm)
        qwen3 = self.qk_norm and not self.mlp_bias and self.qkv_bias == self.o_bias
        rules = {
            "qwen2": qwen2, "qwen2_moe": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3,
            "llama": not self.qk_norm and self.qkv_bias == self.o_bias,
        }
        if not rules[self.family]:
            raise ValueError(
                f"family {self.family!r} cannot express qkv_bias={self.qkv_bias}, o_bias={self.o_bias}, "
                f"mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm} (qwen2: qkv bias only; qwen3: q/k norm, "
                f"attention bias on all four projections or none; llama: no q/k norm, same)")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, n, k, h, v, l = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                               self.head_dim, self.vocab_size, self.num_layers)
        per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f + 2 * d
        per_layer += (n + 2 * k) * h * self.qkv_bias + d * self.o_bias + (2 * f + d) * self.mlp_bias
        per_layer += 2 * h * self.qk_norm
        total = l * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d
        if self.moe is not None:  # sparse layers: experts, router and shared expert instead of the MLP
            m = self.moe
            sparse = sum(m.sparse_layers(l))
            expert = 3 * d * m.moe_intermediate_size * m.num_experts + d * m.num_experts
            shared = 3 * d * m.shared_expert_intermediate_size + d if m.shared_expert_intermediate_size else 0
            total += sparse * (expert + shared - 3 * d * f)
        return total

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: True where its MLP is the expert block (all False for a dense model)."""
        return self.moe.sparse_layers(self.num_layers) if self.moe is not None else (False,) * self.num_layers

    # ---- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Builds a config from a Hugging Face config dict; `source` names the file in errors."""
        archs = hf.get("architectures") or []
        family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
        if family is None:
            family = {f: f for f in FAMILIES.values()}.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(FAMILIES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r} (only silu)")
        if hf.get("use_sliding_window", False):
            raise ValueError(f"{source}: sliding-window attention (use_sliding_window=true) is not supported")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            attention_bias = bool(hf.get("attention_bias", False))
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(hf, source),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=True if family in ("qwen2", "qwen2_moe") else attention_bias,
                o_bias=False if family in ("qwen2", "qwen2_moe") else attention_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                family=family,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
                moe=_moe_from_hf(hf, family) if family in MOE_FAMILIES else None,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers loads into the matching *ForCausalLM."""
        arch = {v: k for k, v in FAMILIES.items()}[self.family]
        rope: dict[str, Any] = {"rope_theta": self.rope.theta, "rope_type": self.rope.type}
        if self.rope.type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.type == "llama3":
            rope.update(low_freq_factor=self.rope.low_freq_factor, high_freq_factor=self.rope.high_freq_factor,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings)
        hf: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.family not in ("qwen2", "qwen2_moe"):
            hf["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.family != "llama":
            hf["use_sliding_window"] = False
        if self.moe is not None:
            m = self.moe
            hf.update(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                      moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob,
                      decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=list(m.mlp_only_layers),
                      router_aux_loss_coef=m.router_aux_loss_coef, output_router_logits=m.router_aux_loss_coef > 0)
            if self.family == "qwen2_moe":
                hf["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
        if self.rope.type != "default":
            hf["rope_scaling"] = rope
        return hf


def _moe_from_hf(hf: dict[str, Any], family: Family) -> MoEConfig:
    """The expert block of a qwen2_moe / qwen3_moe config (transformers names the expert count
    `num_experts` or `num_local_experts`); Qwen3-MoE has no shared expert."""
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared,
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        # transformers adds the load-balancing loss only where output_router_logits is true (its
        # default: false); a checkpoint that says false carries a coefficient nothing uses.
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0,
    )


def _rope_from_hf(hf: dict[str, Any], source: str) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    kwargs: dict[str, Any] = {"theta": theta, "type": rope_type}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        kwargs.update(
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    return RopeConfig(**kwargs)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> "list[float]":
    """Per-pair inverse frequencies `[H/2]` after the configured scaling rule."""
    inv = [1.0 / (rope.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    if rope.type == "linear":
        return [f / rope.factor for f in inv]
    if rope.type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rope.factor)
            else:
                smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        return out
    return inv
