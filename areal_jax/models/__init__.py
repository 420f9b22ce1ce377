"""Policy models: one NNX decoder for Llama 3 / Qwen2 / Qwen3 with HF checkpoint I/O."""

from areal_jax.models.config import ModelConfig, RopeConfig
from areal_jax.models.hf_io import load_params, load_pretrained, read_config, save_params, save_pretrained
from areal_jax.models.transformer import KVCache, Transformer, forward, init_params, param_axes, param_shapes

__all__ = [
    "KVCache", "ModelConfig", "RopeConfig", "Transformer", "forward", "init_params", "load_params",
    "load_pretrained", "param_axes", "param_shapes", "read_config", "save_params", "save_pretrained",
]
