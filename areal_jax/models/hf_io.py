"""Hugging Face checkpoints <-> our params dict.

Loading builds each array with `jax.make_array_from_callback`, so every device reads only the
slice of the checkpoint it holds, never a full copy per device. Files are read through the
`safetensors` package: `safe_open(path, framework="numpy").get_slice(name)[...]` reads just the
requested ranges from a memory map and returns bfloat16 tensors as `ml_dtypes.bfloat16` arrays
(measured for safetensors 0.4.5, 0.5.3 and 0.8.0; 0.4.0 fails with "numpy has no attribute
bfloat16"; ml_dtypes must be imported first, else "data type 'bfloat16' not understood"). Saving
writes config.json + safetensors (sharded with an index past `max_shard_bytes`) that
transformers loads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers numpy's "bfloat16", which safetensors' numpy reader needs
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save, save_file

from areal_jax.models import moe
from areal_jax.models import sharding as shd
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import Params, Transformer, param_axes, param_shapes

_USABLE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_FLOAT_TENSORS = ("F64", "F32", "F16", "BF16")  # checkpoint dtypes we read (and cast)
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _TensorMap:
    """How one of our tensors relates to an HF tensor (per layer for stacked weights).

    The HF array's axis `split` (if any) is split into (`heads` attribute of the config,
    head_dim), giving an intermediate array whose axes `perm` orders into ours:
    ours = intermediate.transpose(perm).
    """

    split: int | None = None
    heads: str = ""
    perm: tuple[int, ...] | None = None

    def inter_shape(self, hf_shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...] | None:
        """The intermediate shape, or None when the split axis does not hold whole heads."""
        if self.split is None:
            return tuple(hf_shape)
        n, h = getattr(cfg, self.heads), cfg.head_dim
        if self.split >= len(hf_shape) or hf_shape[self.split] != n * h:
            return None
        return (*hf_shape[:self.split], n, h, *hf_shape[self.split + 1:])

    def our_shape(self, hf_shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...] | None:
        inter = self.inter_shape(hf_shape, cfg)
        if inter is None or (self.perm is not None and len(inter) != len(self.perm)):
            return None
        return inter if self.perm is None else tuple(inter[p] for p in self.perm)

    def hf_shape(self, our_shape: tuple[int, ...]) -> tuple[int, ...]:
        inter = list(our_shape) if self.perm is None else [0] * len(our_shape)
        if self.perm is not None:
            for i, p in enumerate(self.perm):
                inter[p] = our_shape[i]
        if self.split is not None:
            inter[self.split:self.split + 2] = [inter[self.split] * inter[self.split + 1]]
        return tuple(inter)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        inter = ours if self.perm is None else ours.transpose(np.argsort(self.perm))
        return inter.reshape(self.hf_shape(ours.shape))

    def read(self, tensor, index: tuple[slice, ...], our_shape: tuple[int, ...], cfg: ModelConfig) -> np.ndarray:
        """Our slice `index` read from the lazy HF `tensor` (reads only whole heads it touches)."""
        ranges = [s.indices(d)[:2] for s, d in zip(index, our_shape)]
        inter = list(ranges) if self.perm is None else [None] * len(ranges)
        if self.perm is not None:
            for i, p in enumerate(self.perm):
                inter[p] = ranges[i]
        hf_index = [slice(a, b) for a, b in inter]
        if self.split is not None:
            (a, b), (c, d) = inter[self.split], inter[self.split + 1]
            hf_index[self.split:self.split + 2] = [slice(a * cfg.head_dim, b * cfg.head_dim)]
        arr = tensor[tuple(hf_index)]
        if self.split is not None:
            arr = arr.reshape(*arr.shape[:self.split], b - a, cfg.head_dim, *arr.shape[self.split + 1:])
            arr = arr[(slice(None),) * (self.split + 1) + (slice(c, d),)]
        return arr if self.perm is None else arr.transpose(self.perm)


_same = _TensorMap()
_transpose = _TensorMap(perm=(1, 0))


def _heads_in(n_attr: str) -> _TensorMap:  # HF [n*H, D] -> [n, H, D] -> ours [D, n, H]
    return _TensorMap(split=0, heads=n_attr, perm=(2, 0, 1))


def _heads_bias(n_attr: str) -> _TensorMap:  # HF [n*H] <-> ours [n, H]
    return _TensorMap(split=0, heads=n_attr)


_heads_out = _TensorMap(split=1, heads="num_heads", perm=(1, 2, 0))  # HF [D, N*H] -> [D, N, H] -> ours [N, H, D]


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
    # Expert blocks (Qwen2-MoE, Qwen3-MoE): "{e}" tensors are one per expert, stacked on our axis 1.
    "router": ("mlp.gate.weight", _transpose),
    "we_gate": ("mlp.experts.{e}.gate_proj.weight", _transpose),
    "we_up": ("mlp.experts.{e}.up_proj.weight", _transpose),
    "we_down": ("mlp.experts.{e}.down_proj.weight", _transpose),
    "ws_gate": ("mlp.shared_expert.gate_proj.weight", _transpose),
    "ws_up": ("mlp.shared_expert.up_proj.weight", _transpose),
    "ws_down": ("mlp.shared_expert.down_proj.weight", _transpose),
    "ws_router": ("mlp.shared_expert_gate.weight", _transpose),
}
_DENSE_MLP = ("w_gate", "w_up", "w_down")
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


def _is_expert(key: str) -> bool:
    return "{e}" in _LAYER_MAPS[key][0]


def layer_hf_names(cfg: ModelConfig, key: str, layer: int) -> list[str]:
    """HF tensors holding layer `layer` of our stacked parameter `key`: one, one per expert, or
    none where a MoE model's layer does not use it (a dense MLP in a sparse layer or the experts
    of a dense one: our stacked slice is unused and loads as zeros)."""
    if cfg.moe is not None:
        sparse = cfg.sparse_layers[layer]
        if (key in _DENSE_MLP and sparse) or (not sparse and key not in _DENSE_MLP and key in moe_keys(cfg)):
            return []
        if _is_expert(key):
            return [f"model.layers.{layer}.{_LAYER_MAPS[key][0].format(e=e)}" for e in range(cfg.moe.num_experts)]
    return [hf_name(key, layer)]


def moe_keys(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple(moe.layer_axes(cfg)) if cfg.moe is not None else ()


# ---- reading ----------------------------------------------------------------------------------


def _open(path: pathlib.Path):
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


class _Checkpoint:
    """All tensors of an HF directory (single file or sharded with an index), opened lazily."""

    def __init__(self, path: pathlib.Path):
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.exists():
            weight_map = self._weight_map(index)
            self.files = {fname: _open(path / fname) for fname in sorted(set(weight_map.values()))}
            self.where = {name: (path / fname, self.files[fname]) for name, fname in weight_map.items()}
        elif single.exists():
            f = _open(single)
            self.files = {single.name: f}
            self.where = {name: (single, f) for name in f.keys()}
        else:
            others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
            raise FileNotFoundError(
                f"{path}: no model.safetensors or model.safetensors.index.json"
                + (f" (found {others}; only safetensors checkpoints are supported)" if others else ""))

    @staticmethod
    def _weight_map(index: pathlib.Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed index ({e})") from None
        for name, fname in weight_map.items():
            if not (index.parent / fname).exists():
                raise FileNotFoundError(f"{index} names {fname} (for {name!r}), which does not exist")
        return weight_map

    def file_of(self, name: str) -> pathlib.Path:
        return self.where[name][0]

    def tensor(self, name: str):
        """A lazy slice handle of tensor `name` (indexing it reads only those ranges)."""
        if name not in self.where:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        fpath, f = self.where[name]
        if name not in f.keys():
            raise ValueError(f"{fpath}: tensor {name!r} listed in the index is not in the file")
        handle = f.get_slice(name)
        if handle.get_dtype() not in _FLOAT_TENSORS:
            raise ValueError(f"{fpath}: tensor {name!r} has dtype {handle.get_dtype()} "
                             f"(supported: {', '.join(_FLOAT_TENSORS)})")
        return handle


def open_checkpoint(path: str | pathlib.Path) -> _Checkpoint:
    """The tensors of an HF directory, opened lazily (`.tensor(name)` gives a slice handle)."""
    return _Checkpoint(pathlib.Path(path))


def _leaf_reader(ckpt: _Checkpoint, cfg: ModelConfig, key: str, stacked: bool, shape: tuple[int, ...],
                 dtype) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Returns a callback giving the slice `index` of our (possibly stacked) tensor `key`."""
    _, tmap = (_LAYER_MAPS if stacked else _TOP_MAPS)[key]
    per_layer_shape = shape[1:] if stacked else shape
    expert = stacked and _is_expert(key)
    tensor_shape = per_layer_shape[1:] if expert else per_layer_shape  # of one HF tensor, in our layout
    groups = ([layer_hf_names(cfg, key, i) for i in range(cfg.num_layers)] if stacked else [[hf_name(key)]])
    tensors = []
    for names in groups:
        tensors.append([])
        for name in names:
            tensor = ckpt.tensor(name)
            hf_shape = tuple(tensor.get_shape())
            if tmap.our_shape(hf_shape, cfg) != tensor_shape:
                raise ValueError(f"{ckpt.file_of(name).name}: tensor {name!r} has shape {hf_shape}, "
                                 f"expected {tmap.hf_shape(tensor_shape)} for this config")
            tensors[-1].append(tensor)

    def read_layer(layer_tensors, index: tuple[slice, ...]) -> np.ndarray:
        if not layer_tensors:  # a slice this layer does not use
            return np.zeros([len(range(*s.indices(d))) for s, d in zip(index, per_layer_shape)], dtype)
        if expert:
            return np.stack([np.asarray(tmap.read(layer_tensors[e], index[1:], tensor_shape, cfg), dtype=dtype)
                             for e in range(per_layer_shape[0])[index[0]]])
        return np.asarray(tmap.read(layer_tensors[0], index, tensor_shape, cfg), dtype=dtype)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return read_layer(tensors[0], index)
        layers = range(cfg.num_layers)[index[0]]
        return np.stack([read_layer(tensors[i], index[1:]) for i in layers])

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
                rules: shd.Rules | None = None, lm_head: bool = True) -> tuple[ModelConfig, Params]:
    """Reads config and weights of an HF directory into our params dict.

    lm_head=False leaves the output head out (a reward model's checkpoint has none: models/reward_head.py).

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

    params: Params = {k: build(k, False, axes[k], shapes[k]) for k in axes
                      if k != "layers" and (lm_head or k != "lm_head")}
    params["layers"] = {k: build(k, True, a, shapes["layers"][k]) for k, a in axes["layers"].items()}
    return cfg, params


def load_pretrained(path: str | pathlib.Path, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: shd.Rules | None = None) -> Transformer:
    """Loads an HF directory (config.json + *.safetensors) as a `Transformer`.

    Supports LlamaForCausalLM (incl. llama3 rope scaling), Qwen2ForCausalLM, Qwen3ForCausalLM,
    Qwen2MoeForCausalLM and Qwen3MoeForCausalLM.
    """
    cfg, params = load_params(path, dtype=dtype, mesh=mesh, rules=rules)
    return Transformer(cfg, params)


# ---- writing ----------------------------------------------------------------------------------

# Our params dict leaf -> its position: (key,) for a top-level tensor, ("layers", key) for a stacked one.
LeafKey = tuple[str, ...]
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def leaf_keys(cfg: ModelConfig) -> list[LeafKey]:
    """Every leaf of the params dict, in the order the writer stores them."""
    axes = param_axes(cfg)
    return [(k,) for k in axes if k != "layers"] + [("layers", k) for k in axes["layers"]]


def _leaf_hf(cfg: ModelConfig, leaf: LeafKey) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of the tensors one leaf becomes (one per layer for a stacked leaf)."""
    shapes = param_shapes(cfg)
    if leaf[0] == "layers":
        key = leaf[1]
        tmap = _LAYER_MAPS[key][1]
        ours = shapes["layers"][key][2 if _is_expert(key) else 1:]
        return [(name, tmap.hf_shape(ours)) for i in range(cfg.num_layers) for name in layer_hf_names(cfg, key, i)]
    return [(hf_name(leaf[0]), _TOP_MAPS[leaf[0]][1].hf_shape(shapes[leaf[0]]))]


def dtype_name(dtype) -> str:
    """config.json's name of a stored dtype ("float32", "bfloat16", "float16")."""
    return _DTYPE_NAMES[np.dtype(dtype)]


def leaf_to_hf(cfg: ModelConfig, leaf: LeafKey, host: np.ndarray, dtype) -> list[tuple[str, np.ndarray]]:
    """(HF name, host array in `dtype`) of each tensor one leaf of our params becomes."""
    if leaf[0] == "layers":
        key = leaf[1]
        tmap = _LAYER_MAPS[key][1]
        out = []
        for i in range(cfg.num_layers):
            names = layer_hf_names(cfg, key, i)
            parts = host[i] if _is_expert(key) else [host[i]] * len(names)  # one tensor per expert
            out += [(name, np.ascontiguousarray(tmap.to_hf(part).astype(dtype, copy=False)))
                    for name, part in zip(names, parts)]
        return out
    return [(hf_name(leaf[0]), np.ascontiguousarray(_TOP_MAPS[leaf[0]][1].to_hf(host).astype(dtype, copy=False)))]


def to_host(x) -> np.ndarray:
    """One tensor in host memory: its shards fetched as they lie, and a tensor spanning processes
    all-gathered alone (a collective: every process calls it for the same tensors, in order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def hf_state_dict(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our params as HF-named host arrays (gathers sharded arrays)."""
    out: dict[str, np.ndarray] = {}
    for leaf in leaf_keys(cfg):
        host = np.asarray(jax.device_get(_get(params, leaf)))
        out.update(leaf_to_hf(cfg, leaf, host, host.dtype))
    return out


def _get(params: Params, leaf: LeafKey):
    return params["layers"][leaf[1]] if leaf[0] == "layers" else params[leaf[0]]


def save_pretrained(model: Transformer, path: str | pathlib.Path, *, max_shard_bytes: int = 4 << 30) -> None:
    """Writes `model` as an HF directory that transformers' from_pretrained loads."""
    save_params(model.params, model.config, path, max_shard_bytes=max_shard_bytes)


def save_params(params: Params, cfg: ModelConfig, path: str | pathlib.Path, *, max_shard_bytes: int = 4 << 30,
                dtype=None, write: bool = True) -> None:
    """Writes config.json and safetensors (sharded with an index past `max_shard_bytes`), fetching
    one tensor at a time to host memory (`to_host`). dtype: of the stored tensors (default: the params').

    Multi-host: every process calls it (a tensor spanning processes is gathered alone), and only the
    one with `write` writes; the others take part in the gathers.
    """
    dtype = np.dtype(dtype) if dtype is not None else np.dtype(params["final_norm"].dtype)
    fetch = lambda leaf: to_host(_get(params, leaf))  # noqa: E731
    if not write:
        for leaf in leaf_keys(cfg):
            fetch(leaf)
        return
    write_params(fetch, cfg, path, max_shard_bytes=max_shard_bytes, dtype=dtype)


# Files of a tokenizer directory that travel with a model (tokenizer.json and its config, special
# tokens, the chat template, the generation config).
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens", "generation_config", "chat_template")


def copy_tokenizer_files(src, dst) -> list[str]:
    """Copies the tokenizer files of directory `src` into `dst` (local or remote); returns their names."""
    from areal_jax import paths

    src = paths.as_path(src)
    names = sorted(f.name for f in src.iterdir() if f.name.startswith(TOKENIZER_FILE_PREFIXES) and not f.is_dir())
    paths.copy_files(src, dst, names)
    return names


def write_params(fetch: Callable[[LeafKey], np.ndarray], cfg: ModelConfig, path, *, dtype,
                 max_shard_bytes: int = 4 << 30) -> None:
    """Writes config.json and safetensors to `path` (local or remote: areal_jax.paths), asking
    `fetch(leaf)` for one leaf of the params dict at a time (`leaf_keys` order) as a host array.

    The shards are planned from the shapes before anything is read, and each is written as soon as
    it is complete: host memory holds one leaf and one shard, never the whole model.
    """
    from areal_jax import paths

    path = paths.as_path(path)
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored (use float32, bfloat16 or float16)")
    path.mkdir(parents=True, exist_ok=True)
    leaves = leaf_keys(cfg)
    shard_of: dict[str, int] = {}
    sizes = [0]
    for leaf in leaves:
        for name, shape in _leaf_hf(cfg, leaf):
            nbytes = int(np.prod(shape)) * dtype.itemsize
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                sizes.append(0)
            shard_of[name] = len(sizes) - 1
            sizes[-1] += nbytes
    n = len(sizes)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    pending: dict[str, np.ndarray] = {}
    current = 0
    for j, leaf in enumerate(leaves):
        tensors = leaf_to_hf(cfg, leaf, np.asarray(fetch(leaf)), dtype)
        pending.update(tensors)
        # Shards are filled in order: those before the one this leaf ends in are complete.
        complete = n if j == len(leaves) - 1 else shard_of[tensors[-1][0]]
        for i in range(current, complete):
            _write_file(path / fnames[i], {k: pending.pop(k) for k in [k for k in pending if shard_of[k] == i]})
        current = max(current, complete)
    if n > 1:
        weight_map = {name: fnames[i] for name, i in shard_of.items()}
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(cfg.to_hf() | {"dtype": _DTYPE_NAMES[dtype]}, indent=2))


def _write_file(path, tensors: dict[str, np.ndarray]) -> None:
    """Writes one safetensors file whole: locally a temporary file renamed into place; an object
    store's upload is all-or-nothing already."""
    from areal_jax import paths

    if paths.is_remote(path):
        paths.as_path(path).write_bytes(save(tensors, metadata={"format": "pt"}))
        return
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path)
