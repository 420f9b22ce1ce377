"""LoRA adapters in PEFT's on-disk format (adapter_config.json + adapter_model.safetensors).

PEFT stores, per layer and target, `lora_A.weight [R, in]` and `lora_B.weight [out, R]` of the HF
linear layer (`weight [out, in]`) under `base_model.model.model.layers.{i}.{module}.`; the
update is `lora_alpha / r * B @ A`. Ours (models/lora.py) are `a [L, *I, R]`, `b [L, R, *O]` with
the same flattening order of the head axes as HF's projections, so each tensor is one
transpose of a reshape.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import SCALE, TARGETS, LoRAConfig, adapter_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
_MODULE = {weight: module for weight, module in TARGETS.values()}  # wq -> self_attn.q_proj
_TARGET_OF_MODULE = {module.split(".")[-1]: target for target, (_, module) in TARGETS.items()}  # q_proj -> q


def tensor_name(weight: str, layer: int, which: str) -> str:
    """PEFT's name of our adapter `which` ("a" or "b") of `weight` at `layer`."""
    return f"{_PREFIX}.{layer}.{_MODULE[weight]}.lora_{which.upper()}.weight"


def peft_config(lora: LoRAConfig, base_model: str | None = None) -> dict[str, Any]:
    """The adapter_config.json dict PEFT's LoraConfig reads."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
        "target_modules": sorted(TARGETS[t][1].split(".")[-1] for t in lora.targets),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None,
    }


def save_adapter(adapters: dict[str, Any], cfg: ModelConfig, lora: LoRAConfig, out: str | pathlib.Path, *,
                 base_model: str | None = None) -> pathlib.Path:
    """Writes stacked adapters (`params["layers"]["lora"]`, any array type) in PEFT's format."""
    from safetensors.numpy import save_file

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for weight in lora.weights:
        a, b = (np.asarray(adapters[weight][k], np.float32) for k in ("a", "b"))
        R = a.shape[-1]
        for layer in range(cfg.num_layers):
            tensors[tensor_name(weight, layer, "a")] = np.ascontiguousarray(a[layer].reshape(-1, R).T)
            tensors[tensor_name(weight, layer, "b")] = np.ascontiguousarray(b[layer].reshape(R, -1).T)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(lora, base_model), indent=2) + "\n")
    return out


def load_adapter(path: str | pathlib.Path, cfg: ModelConfig) -> tuple[LoRAConfig, dict[str, Any]]:
    """(LoRAConfig, stacked fp32 numpy adapters) of a PEFT LoRA adapter directory for `cfg`'s model."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    hf = json.loads((path / CONFIG_FILE).read_text())
    if hf.get("peft_type") != "LORA":
        raise ValueError(f"{path / CONFIG_FILE}: peft_type {hf.get('peft_type')!r} is not LORA")
    for key, plain in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if hf.get(key, plain) != plain:
            raise ValueError(f"{path / CONFIG_FILE}: {key} = {hf[key]!r} is not supported (only {plain!r})")
    # Per-module alphas or ranks, fully trained extra modules, a subset of layers: each changes what
    # the adapter computes, and this loader would silently compute something else.
    for key, meaning in (("alpha_pattern", "per-module lora_alpha"), ("rank_pattern", "per-module ranks"),
                         ("modules_to_save", "modules trained in full besides the adapters"),
                         ("layers_to_transform", "adapters on some layers only")):
        if hf.get(key):
            raise ValueError(f"{path / CONFIG_FILE}: {key} = {hf[key]!r} ({meaning}) is not supported: only "
                             "adapters of one rank and alpha on every layer's target_modules load")
    modules = hf["target_modules"]
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in _TARGET_OF_MODULE]
    if unknown:
        raise ValueError(f"{path / CONFIG_FILE}: target_modules {unknown} are not among {sorted(_TARGET_OF_MODULE)}")
    targets = tuple(t for t in TARGETS if TARGETS[t][1].split(".")[-1] in modules)
    lora = LoRAConfig(rank=int(hf["r"]), alpha=float(hf["lora_alpha"]),
                      dropout=float(hf.get("lora_dropout", 0.0)), targets=targets)
    tensors = load_file(str(path / WEIGHTS_FILE))
    shapes = adapter_shapes(cfg, lora)
    out: dict[str, Any] = {SCALE: np.full(shapes[SCALE], lora.scale, np.float32)}
    for weight in lora.weights:
        out[weight] = {}
        for which in ("a", "b"):
            per_layer = []
            for layer in range(cfg.num_layers):
                name = tensor_name(weight, layer, which)
                if name not in tensors:
                    raise ValueError(f"{path / WEIGHTS_FILE}: missing tensor {name}")
                per_layer.append(np.asarray(tensors[name], np.float32).T)  # a: [in, R]; b: [R, out]
            out[weight][which] = np.stack(per_layer).reshape(shapes[weight][which])
    return lora, out
