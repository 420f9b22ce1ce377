"""Hugging Face checkpoints <-> our params dict.

Loading builds each array with `jax.make_array_from_callback`, so every device reads only the
slice of the checkpoint it holds (through lazy memory-mapped views), never a full copy per
device. Saving writes config.json + safetensors (sharded with an index past `max_shard_bytes`)
that transformers loads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig
from areal_jax.models.safetensors_io import SafetensorsFile, write_safetensors
from areal_jax.models.transformer import Params, Transformer, param_axes, param_shapes

_USABLE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _TensorMap:
    """How one of our tensors relates to an HF tensor (per layer for stacked weights).

    `to_ours` turns the HF array into a *view* in our axis order (reshape/transpose of a memmap
    stay lazy); `to_hf` is its inverse, used when saving.
    """

    hf_name: str  # may contain {i} for the layer index
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]


_same = _TensorMap("", lambda a, c: a, lambda a, c: a)
_transpose = _TensorMap("", lambda a, c: a.T, lambda a, c: a.T)


def _heads_in(n_attr: str) -> _TensorMap:  # HF [n*H, D] <-> ours [D, n, H]
    return _TensorMap(
        "",
        lambda a, c: a.reshape(getattr(c, n_attr), c.head_dim, c.hidden_size).transpose(2, 0, 1),
        lambda a, c: a.transpose(1, 2, 0).reshape(-1, c.hidden_size),
    )


def _heads_bias(n_attr: str) -> _TensorMap:  # HF [n*H] <-> ours [n, H]
    return _TensorMap("", lambda a, c: a.reshape(getattr(c, n_attr), c.head_dim), lambda a, c: a.reshape(-1))


_heads_out = _TensorMap(  # HF o_proj [D, N*H] <-> ours [N, H, D]
    "",
    lambda a, c: a.reshape(c.hidden_size, c.num_heads, c.head_dim).transpose(1, 2, 0),
    lambda a, c: a.transpose(2, 0, 1).reshape(c.hidden_size, -1),
)

_LAYER_MAPS: dict[str, tuple[str, _TensorMap]] = {
    "attn_norm": ("input_layernorm.weight", _same),
    "mlp_norm": ("post_attention_layernorm.weight", _same),
    "wq": ("self_attn.q_proj.weight", _heads_in("num_heads")),
    "wk": ("self_attn.k_proj.weight", _heads_in("num_kv_heads")),
    "wv": ("self_attn.v_proj.weight", _heads_in("num_kv_heads")),
    "wo": ("self_attn.o_proj.weight", _heads_out),
    "bq": ("self_attn.q_proj.bias", _heads_bias("num_heads")),
    "bk": ("self_attn.k_proj.bias", _heads_bias("num_kv_heads")),
    "bv": ("self_attn.v_proj.bias", _heads_bias("num_kv_heads")),
    "bo": ("self_attn.o_proj.bias", _same),
    "q_norm": ("self_attn.q_norm.weight", _same),
    "k_norm": ("self_attn.k_norm.weight", _same),
    "w_gate": ("mlp.gate_proj.weight", _transpose),
    "w_up": ("mlp.up_proj.weight", _transpose),
    "w_down": ("mlp.down_proj.weight", _transpose),
    "b_gate": ("mlp.gate_proj.bias", _same),
    "b_up": ("mlp.up_proj.bias", _same),
    "b_down": ("mlp.down_proj.bias", _same),
}
_TOP_MAPS: dict[str, tuple[str, _TensorMap]] = {
    "embed": ("model.embed_tokens.weight", _same),
    "final_norm": ("model.norm.weight", _same),
    "lm_head": ("lm_head.weight", _transpose),
}


def hf_name(ours: str, layer: int | None = None) -> str:
    """HF tensor name of our parameter `ours` (a layer parameter needs `layer`)."""
    if layer is None:
        return _TOP_MAPS[ours][0]
    return f"model.layers.{layer}.{_LAYER_MAPS[ours][0]}"


# ---- reading ----------------------------------------------------------------------------------


class _Checkpoint:
    """All tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, path: pathlib.Path):
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: malformed index ({e})") from None
            files = {}
            for name, fname in weight_map.items():
                fpath = path / fname
                if not fpath.exists():
                    raise FileNotFoundError(f"{index} names {fname} (for {name!r}), which does not exist")
                files.setdefault(fname, None)
            self.files = {fname: SafetensorsFile(path / fname) for fname in files}
            self.where = {name: self.files[fname] for name, fname in weight_map.items()}
        elif single.exists():
            f = SafetensorsFile(single)
            self.files = {single.name: f}
            self.where = {name: f for name in f.keys()}
        else:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
            raise FileNotFoundError(
                f"{path}: no model.safetensors or model.safetensors.index.json"
                + (f" (found {others}; only safetensors checkpoints are supported)" if others else ""))

    def view(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        f = self.where[name]
        if name not in f.entries:
            raise ValueError(f"{f.path}: tensor {name!r} listed in the index is not in the file")
        return f.view(name)


def _leaf_reader(ckpt: _Checkpoint, cfg: ModelConfig, key: str, stacked: bool, shape: tuple[int, ...],
                 dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Returns a callback giving the slice `index` of our (possibly stacked) tensor `key`."""
    suffix, tmap = (_LAYER_MAPS if stacked else _TOP_MAPS)[key]
    per_layer_shape = shape[1:] if stacked else shape
    names = [hf_name(key, i) for i in range(cfg.num_layers)] if stacked else [_TOP_MAPS[key][0]]
    views = []
    for name in names:
        raw = ckpt.view(name)
        try:
            view = tmap.to_ours(raw, cfg)
        except ValueError:
            view = None
        if view is None or view.shape != per_layer_shape:
            expected = tmap.to_hf(np.empty(per_layer_shape, np.int8), cfg).shape
            raise ValueError(f"{ckpt.where[name].path.name}: tensor {name!r} has shape {tuple(raw.shape)}, "
                             f"expected {tuple(expected)} for this config")
        views.append(view)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return np.asarray(views[0][index], dtype=dtype)
        layers = range(cfg.num_layers)[index[0]]
        return np.stack([np.asarray(views[i][index[1:]], dtype=dtype) for i in layers])

    return read


def _default_rules(mesh: Mesh) -> shd.Rules:
    if "fsdp" in mesh.axis_names:
        return shd.TRAIN_RULES
    if "data" in mesh.axis_names:
        return shd.GENERATION_RULES
    raise ValueError(f"mesh axes {mesh.axis_names} match neither the train mesh ('fsdp', 'tensor') nor the "
                     "generation mesh ('data', 'tensor'); pass rules=")


def read_config(path: str | pathlib.Path) -> ModelConfig:
    """Reads `config.json` of an HF checkpoint directory."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found (is {path} a Hugging Face model directory?)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: malformed JSON ({e})") from None
    return ModelConfig.from_hf(hf, source=str(cfg_file))


def load_params(path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                rules: shd.Rules | None = None) -> tuple[ModelConfig, Params]:
    """Reads config and weights of an HF directory into our params dict.

    With `mesh`, each array is laid out by `rules` (default: by the mesh's axis names); without,
    it lands on this process's first device (its default device, also on a multi-host run).
    Each device's slice is read straight from the file.
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    dtype = jnp.dtype(dtype)
    if dtype not in [jnp.dtype(d) for d in _USABLE_DTYPES]:
        raise ValueError(f"dtype {dtype} cannot be used for weights (use float32, bfloat16 or float16)")
    cfg = read_config(path)
    ckpt = _Checkpoint(path)
    if mesh is not None and rules is None:
        rules = _default_rules(mesh)
    axes = param_axes(cfg)
    shapes = param_shapes(cfg)

    def build(key: str, stacked: bool, leaf_axes, shape):
        sharding = (shd.sharding_for(leaf_axes, rules, mesh, shape) if mesh is not None
                    else SingleDeviceSharding(jax.local_devices()[0]))
        read = _leaf_reader(ckpt, cfg, key, stacked, shape, dtype)
        return jax.make_array_from_callback(shape, sharding, read)

    params: Params = {k: build(k, False, axes[k], shapes[k]) for k in axes if k != "layers"}
    params["layers"] = {k: build(k, True, a, shapes["layers"][k]) for k, a in axes["layers"].items()}
    return cfg, params


def load_pretrained(path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: shd.Rules | None = None) -> Transformer:
    """Loads an HF directory (config.json + *.safetensors) as a `Transformer`.

    Supports LlamaForCausalLM (incl. llama3 rope scaling), Qwen2ForCausalLM and Qwen3ForCausalLM.
    """
    cfg, params = load_params(path, dtype=dtype, mesh=mesh, rules=rules)
    return Transformer(cfg, params)


# ---- writing ----------------------------------------------------------------------------------


def hf_state_dict(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our params as HF-named host arrays (gathers sharded arrays)."""
    out: dict[str, np.ndarray] = {}
    for key, value in params.items():
        if key == "layers":
            for lk, stacked in value.items():
                host = np.asarray(jax.device_get(stacked))
                for i in range(cfg.num_layers):
                    out[hf_name(lk, i)] = np.ascontiguousarray(_LAYER_MAPS[lk][1].to_hf(host[i], cfg))
        else:
            out[hf_name(key)] = np.ascontiguousarray(_TOP_MAPS[key][1].to_hf(np.asarray(jax.device_get(value)), cfg))
    return out


def save_pretrained(model: Transformer, path: str | pathlib.Path, *, max_shard_bytes: int = 4 << 30) -> None:
    """Writes `model` as an HF directory that transformers' from_pretrained loads."""
    save_params(model.params, model.config, path, max_shard_bytes=max_shard_bytes)


def save_params(params: Params, cfg: ModelConfig, path: str | pathlib.Path, *, max_shard_bytes: int = 4 << 30,
                ) -> None:
    """Writes config.json and safetensors (sharded with an index past `max_shard_bytes`)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(params, cfg)
    dtype_name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(
        next(iter(tensors.values())).dtype, "bfloat16")
    hf = cfg.to_hf() | {"dtype": dtype_name}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / fname, shard)
            weight_map.update({name: fname for name in shard})
        total = sum(a.nbytes for a in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(hf, indent=2))
