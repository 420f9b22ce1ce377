"""Train -> generation weights of a LoRA policy: the frozen base once, then only the adapters.

The generation engine runs merged weights (`W + scale * a @ b` per targeted projection): a decode
step then costs what the base model's does (bench/lora_decode.py measured the unmerged form
slower, docs/benchmarks.md). At the first transfer `AdapterSync` moves the base (a `WeightSync`
of the model) and keeps it on the generation devices; every later transfer moves the adapters'
`a` and `b` leaves alone (a second `WeightSync` over their specs, same groups, casts and
placement) and merges them into a fresh copy of the base there, in one jitted program. So a
swap moves the adapters' bytes (rank 16 on a 7B shape: ~0.5% of the model,
tests/test_adapter_sync.py) and the engine receives full weights in its usual layout: its
swap (interruptible or not) is unchanged. The generation devices hold the base beside the
served weights: one weight copy more than full fine-tuning.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.models import lora as lora_lib
from areal_jax.parallel.meshes import Meshes
from areal_jax.parallel.transfer_plan import LAYERS, model_partition_specs
from areal_jax.parallel.weight_sync import DEFAULT_GROUP_BYTES, TransferStats, WeightSync

PyTree = Any


class AdapterSync:
    """`WeightSync`'s interface for a LoRA trainer's params (base + `params["layers"]["lora"]`).

    `transfer(train_params)` returns merged generation weights (split layout); `last_stats`
    describes the last adapter transfer (its `num_bytes`: the adapters' generation bytes), or
    the base's on the first call. Plain weights (no adapters, e.g. an SFT result) move as
    `WeightSync.transfer` moves them, and leave the cached base alone.
    """

    def __init__(self, model_cfg: Any, lora: lora_lib.LoRAConfig, meshes: Meshes, generation_dtype: Any = None, *,
                 group_bytes: int = DEFAULT_GROUP_BYTES):
        if not lora.enabled:
            raise ValueError("AdapterSync needs LoRAConfig.rank > 0 (use WeightSync for full fine-tuning)")
        self.lora = lora
        self.base_sync = WeightSync.for_model(model_cfg, meshes, generation_dtype, group_bytes=group_bytes)
        train_specs, generation_specs = model_partition_specs(model_cfg, meshes.train,
                                                              meshes.generation.shape["tensor"], lora,
                                                              meshes.generation.shape["expert"])
        self.adapter_sync = WeightSync(meshes, train_specs, generation_specs, generation_dtype, group_bytes=group_bytes)
        self._base: PyTree | None = None
        self._merge = None
        self.last_transfer_s: float | None = None
        self.last_stats: TransferStats | None = None

    @property
    def meshes(self) -> Meshes:
        return self.base_sync.meshes

    @property
    def generation_base(self) -> PyTree | None:
        """The frozen base on the generation devices (None before the first transfer)."""
        return self._base

    def transfer(self, train_params: PyTree) -> PyTree:
        """Merged generation weights of `train_params` (every process calls it, as `WeightSync.transfer`)."""
        if lora_lib.adapters_of(train_params) is None:
            return self.base_sync.transfer(train_params)
        if self._base is None:
            self._base = self.base_sync.transfer(lora_lib.detach(train_params))
            shardings = jax.tree.map(lambda x: x.sharding, self._base)
            self._merge = jax.jit(functools.partial(lora_lib.merge_split, scale=self.lora.scale),
                                  out_shardings=shardings)
            base_s = self.base_sync.last_transfer_s
        else:
            base_s = 0.0
        adapters = self.adapter_sync.transfer({LAYERS: lora_lib.split_trainable(train_params)[1]})
        merged = self._merge(self._base, adapters)
        jax.block_until_ready(merged)
        stats = self.adapter_sync.last_stats
        self.last_stats = stats if base_s == 0.0 else self.base_sync.last_stats
        self.last_transfer_s = base_s + stats.total_s
        return merged


def adapter_bytes(model_cfg: Any, lora: lora_lib.LoRAConfig, dtype: Any = jnp.bfloat16) -> int:
    """Bytes one adapter transfer moves (every a and b, in the generation dtype)."""
    return lora_lib.adapter_param_count(model_cfg, lora) * jnp.dtype(dtype).itemsize
