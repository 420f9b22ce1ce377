"""Device partition (train vs generation meshes) and train -> generation weight transfer."""

from areal_jax.parallel.distributed import (
    agree_max,
    agree_sum,
    agree_sum_array,
    fully_local,
    gather_json,
    initialize_distributed,
)
from areal_jax.parallel.meshes import (
    GENERATION_AXES,
    TRAIN_AXES,
    DeviceSplit,
    Meshes,
    MeshConfig,
    batch_shards,
    build_meshes,
    check_model_fits_mesh,
    split_local_devices,
)
from areal_jax.parallel.transfer_plan import model_partition_specs, transfer_view
from areal_jax.parallel.weight_sync import DEFAULT_GROUP_BYTES, TransferStats, WeightSync, transfer_program_specs

__all__ = [
    "DEFAULT_GROUP_BYTES",
    "GENERATION_AXES",
    "TRAIN_AXES",
    "DeviceSplit",
    "MeshConfig",
    "Meshes",
    "TransferStats",
    "WeightSync",
    "agree_max",
    "agree_sum",
    "agree_sum_array",
    "batch_shards",
    "build_meshes",
    "check_model_fits_mesh",
    "fully_local",
    "gather_json",
    "initialize_distributed",
    "model_partition_specs",
    "split_local_devices",
    "transfer_program_specs",
    "transfer_view",
]
