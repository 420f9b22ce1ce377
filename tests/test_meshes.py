"""Device split and mesh construction on 8 fake CPU devices (one process)."""

import logging
import types

import jax
import pytest
from jax.sharding import AxisType

from areal_jax.parallel import MeshConfig, build_meshes, split_local_devices


def _ids(devices):
    return [d.id for d in devices]


def test_default_split_is_three_quarters_generation():
    meshes = build_meshes(MeshConfig())
    assert dict(meshes.train.shape) == {"fsdp": 2, "expert": 1, "tensor": 1}
    assert dict(meshes.generation.shape) == {"data": 6, "expert": 1, "tensor": 1}
    assert _ids(meshes.train_devices_local) == [0, 1]
    assert _ids(meshes.generation_devices_local) == [2, 3, 4, 5, 6, 7]
    assert not meshes.colocated
    assert meshes.num_hosts == 1 and meshes.host_index == 0
    assert meshes.train.axis_types == (AxisType.Auto,) * 3
    assert meshes.generation.axis_types == (AxisType.Auto,) * 3


@pytest.mark.parametrize(
    "cfg, train_shape, generation_shape",
    [
        (MeshConfig(train_tensor=2, generation_tensor=2), (1, 1, 2), (3, 1, 2)),
        (MeshConfig(num_generation_devices_per_host=4, train_tensor=2, generation_tensor=4), (2, 1, 2), (1, 1, 4)),
        (MeshConfig(generation_fraction=0.5, generation_tensor=2), (4, 1, 1), (2, 1, 2)),
        (MeshConfig(num_generation_devices_per_host=5), (3, 1, 1), (5, 1, 1)),
        (MeshConfig(num_generation_devices_per_host=4, train_expert=2, generation_expert=2), (2, 2, 1), (2, 2, 1)),
        (MeshConfig(num_generation_devices_per_host=4, train_expert=4, generation_expert=2, generation_tensor=2),
         (1, 4, 1), (1, 2, 2)),
    ],
)
def test_split_shapes(cfg, train_shape, generation_shape):
    meshes = build_meshes(cfg)
    assert meshes.train.axis_names == ("fsdp", "expert", "tensor")
    assert meshes.generation.axis_names == ("data", "expert", "tensor")
    assert meshes.train.devices.shape == train_shape
    assert meshes.generation.devices.shape == generation_shape
    train, generation = set(meshes.train_devices_local), set(meshes.generation_devices_local)
    assert not train & generation
    assert train | generation == set(jax.devices())
    # Mesh order is the listed local order.
    assert list(meshes.train.devices.flat) == list(meshes.train_devices_local)
    assert list(meshes.generation.devices.flat) == list(meshes.generation_devices_local)


def test_colocated_uses_every_device_in_the_same_order():
    meshes = build_meshes(MeshConfig(colocated=True, train_tensor=2, generation_tensor=4))
    assert meshes.colocated
    assert dict(meshes.train.shape) == {"fsdp": 4, "expert": 1, "tensor": 2}
    assert dict(meshes.generation.shape) == {"data": 2, "expert": 1, "tensor": 4}
    assert list(meshes.train.devices.flat) == list(meshes.generation.devices.flat) == jax.devices()


def test_small_hosts_colocate_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="areal_jax.parallel.meshes"):
        meshes = build_meshes(MeshConfig(), devices=jax.devices()[:2])
    assert meshes.colocated
    assert "colocating" in caplog.text
    assert _ids(meshes.train_devices_local) == _ids(meshes.generation_devices_local) == [0, 1]


def test_small_host_with_explicit_split_does_not_colocate():
    meshes = build_meshes(MeshConfig(num_generation_devices_per_host=1), devices=jax.devices()[:3])
    assert not meshes.colocated
    assert _ids(meshes.train_devices_local) == [0, 1]
    assert _ids(meshes.generation_devices_local) == [2]


def test_split_local_devices_rounds_generation_down():
    split = split_local_devices(MeshConfig(), 6)  # 0.75 * 6 = 4.5
    assert (split.num_train, split.num_generation, split.colocated) == (2, 4, False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"generation_fraction": 0.0}, "strictly between 0 and 1"),
        ({"generation_fraction": 1.0}, "strictly between 0 and 1"),
        ({"train_tensor": 0}, "train_tensor must be >= 1"),
        ({"generation_tensor": -2}, "generation_tensor must be >= 1"),
        ({"num_generation_devices_per_host": 0}, "must be >= 1"),
        ({"num_generation_devices_per_host": 2, "colocated": True}, "do not also set"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (MeshConfig(num_generation_devices_per_host=8), "leaves 8 generation and 0 training"),
        (MeshConfig(generation_fraction=0.1), "leaves 0 generation and 8 training"),
        (MeshConfig(train_tensor=3), "train_tensor=3 does not divide the 2 training"),
        (MeshConfig(generation_tensor=4), "generation_tensor=4 does not divide the 6 generation"),
        (MeshConfig(colocated=True, train_tensor=3), "train_tensor=3 does not divide the 8"),
    ],
)
def test_impossible_splits_are_named(cfg, message):
    with pytest.raises(ValueError, match=message):
        build_meshes(cfg)


def test_hosts_with_differing_device_counts_are_rejected():
    # Device-like records: the check runs before any mesh is built.
    fake = [types.SimpleNamespace(id=i, process_index=0 if i < 4 else 1) for i in range(7)]
    with pytest.raises(ValueError, match="differing device counts"):
        build_meshes(MeshConfig(), devices=fake)


def test_devices_of_other_processes_only_are_rejected():
    fake = [types.SimpleNamespace(id=i, process_index=1) for i in range(4)]
    with pytest.raises(ValueError, match="owns none of the given devices"):
        build_meshes(MeshConfig(), devices=fake)
