"""Several TPU slices joined by DCN: the train mesh's "fsdp" axis spans them outermost, on
simulated CPU devices (the transfer between slices bit-exact) and on libtpu's multi-slice topology."""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.parallel import MeshConfig, WeightSync, build_meshes
from areal_jax.parallel.meshes import slice_major
from areal_jax.plan.job import network_transfer
from areal_jax.plan.targets import parse_target
from tests.test_weight_sync import SPLIT_PARAMS, _assert_transferred, _host_values, _on_train_mesh, _specs


def test_two_simulated_slices_carry_the_outer_fsdp_axis_and_the_push_is_bit_exact():
    # 8 CPU devices, one host: 4 train (2 simulated slices of 2), 4 generate (2 replicas of tensor 2).
    cfg = MeshConfig(num_slices=2, num_generation_devices_per_host=4, generation_tensor=2)
    meshes = build_meshes(cfg)
    train = meshes.train
    assert dict(train.shape) == {"fsdp": 4, "expert": 1, "tensor": 1}
    slice0, slice1 = set(meshes.train_devices_local[:2]), set(meshes.train_devices_local[2:])
    # The DCN (slice) part of "fsdp" is outermost: its first half lies on slice 0, the rest on slice 1.
    assert set(train.devices[:2].flat) == slice0 and set(train.devices[2:].flat) == slice1
    values = _host_values()
    params = _on_train_mesh(meshes, values)
    # The embedding's rows shard over "fsdp": slice 0 holds rows 0-7, slice 1 rows 8-15.
    for shard in params["embed"].addressable_shards:
        rows = range(16)[shard.index[0]]
        assert (shard.device in slice0) == (rows.start < 8)
        assert np.asarray(shard.data).tobytes() == values["embed"][shard.index].tobytes()
    # The push gathers both slices' shards onto the generation devices, bit for bit.
    sync = WeightSync(meshes, _specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS), generation_dtype=jnp.bfloat16)
    _assert_transferred(meshes, sync.transfer(params), values, jnp.bfloat16)
    # An array moved from one slice's devices to the other's arrives unchanged.
    x = jax.device_put(values["embed"], NamedSharding(jax.sharding.Mesh(train.devices[:2, 0, 0], ("s",)), P("s")))
    y = jax.device_put(x, NamedSharding(jax.sharding.Mesh(train.devices[2:, 0, 0], ("s",)), P(None, "s")))
    assert {d for d in y.sharding.device_set} == slice1 and np.asarray(y).tobytes() == values["embed"].tobytes()


def test_a_slice_count_the_training_devices_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="num_slices=3"):
        build_meshes(MeshConfig(num_slices=3, num_generation_devices_per_host=4))
    with pytest.raises(ValueError, match="num_slices"):
        MeshConfig(num_slices=0)


@dataclasses.dataclass(frozen=True)
class _Dev:  # a device's identity as slice_major reads it
    id: int
    slice_index: int


def test_devices_that_name_their_slice_are_grouped_by_it():
    devices = [_Dev(0, 1), _Dev(1, 0), _Dev(2, 1), _Dev(3, 0)]
    assert [d.id for d in slice_major(devices, 2)] == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="slices"):
        slice_major(devices, 4)
    with pytest.raises(ValueError, match="slices"):
        slice_major([_Dev(0, 0), _Dev(1, 0), _Dev(2, 1), _Dev(3, 2)], 2)


def test_a_multislice_target_costs_the_push_at_dcn():
    t = parse_target("2xv5p-64")
    # v5p-64: 64 TensorCores = 32 chips on 8 hosts of 4; two of them.
    assert (t.slices, t.hosts, t.chips_per_host, t.num_devices) == (2, 16, 4, 64)
    assert t.host_network_bandwidth == 4 * 50e9 / 8  # 50 Gbps of DCN per chip (Cloud TPU v5p docs)
    cost = network_transfer(16e9, t)
    assert cost["transfer_network_bytes_per_host"] == 8e9  # the other slice's half
    assert cost["transfer_network_s"] == pytest.approx(8e9 / 25e9)
    assert network_transfer(16e9, parse_target("v5p-64")) == {}  # one slice: all ICI
    assert parse_target("2xv5e-16").host_network_bandwidth == pytest.approx(4 * 25e9 / 8)  # hosts of 4 chips
    with pytest.raises(ValueError, match="data-centre network"):
        parse_target("2xv6e-16")


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed ([plan] extra)")
def test_the_planner_builds_a_hybrid_mesh_on_libtpus_multislice_topology():
    from areal_jax.parallel.meshes import split_local_devices
    from areal_jax.plan.planner import role_meshes
    from areal_jax.plan.targets import LibtpuBusy

    target = parse_target("2xv5e-16")
    split = split_local_devices(MeshConfig(num_generation_devices_per_host=2, num_slices=2), target.devices_per_host)
    try:
        meshes = role_meshes(target, split, 1, 1)
    except LibtpuBusy:
        pytest.skip("another process holds libtpu (one at a time)")
    devices = meshes.train.devices.reshape(-1)
    assert meshes.train.shape["fsdp"] == 16
    # create_hybrid_device_mesh: slice 0's 8 training chips, then slice 1's.
    assert [d.slice_index for d in devices] == [0] * 8 + [1] * 8


def test_the_tunes_stand_in_devices_build_a_multislice_targets_train_mesh():
    """`simulate --tune` estimates a point on stand-in GPU devices of one slice (plan/fit.py: no
    libtpu): on a two-slice target they took the hybrid mesh, whose DCN axis of 2 they cannot fill,
    and every point of the 70B v5p config was refused. They take the flat mesh, of the same "fsdp"."""
    from areal_jax.parallel.meshes import split_local_devices
    from areal_jax.plan.fit import stand_in_devices
    from areal_jax.plan.planner import role_meshes

    target = parse_target("2xv5p-64")
    split = split_local_devices(MeshConfig(num_generation_devices_per_host=2, num_slices=2), target.devices_per_host)
    meshes = role_meshes(target, split, 2, 2, devices=stand_in_devices)
    assert meshes.train.shape["fsdp"] == 2 * 8 * 2 // 2 and meshes.train.shape["tensor"] == 2
    assert meshes.generation_replicas_per_host == 1
