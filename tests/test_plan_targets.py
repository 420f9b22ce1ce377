"""Targets of `areal-jax plan`: names, per-device figures and the fake topologies built for them."""

import importlib.util

import pytest

from areal_jax.plan.targets import ACCELERATORS, parse_target, tpu_topology_name

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None or \
    importlib.util.find_spec("jax_cuda12_plugin") is not None


@pytest.mark.parametrize("name, hosts, per_host, devices, capacity_gib", [
    ("v5e-16", 4, 4, 16, 16),
    ("v5e-8", 1, 8, 8, 16),  # a v5litepod-8 is one VM
    ("v5p-32", 4, 4, 16, 95),  # v5p names count TensorCores: 16 chips
    ("v5p-128", 16, 4, 64, 95),
    ("v6e-16", 4, 4, 16, 32),
    ("v4-16", 2, 4, 16, 16),  # 8 chips, each shown as two 16 GiB devices
    ("8xh100", 1, 8, 8, 80),
    ("4x8xh100", 4, 8, 32, 80),
    ("8xH200", 1, 8, 8, 141e9 / 2**30),
])
def test_targets_resolve_to_hosts_and_devices(name, hosts, per_host, devices, capacity_gib):
    t = parse_target(name)
    assert (t.hosts, t.chips_per_host, t.num_devices) == (hosts, per_host, devices)
    assert t.capacity_bytes_per_device == pytest.approx(capacity_gib * 2**30, rel=1e-9)


@pytest.mark.parametrize("bad", ["v5e-12", "v5p-3", "tpu", "8xv100", ""])
def test_unknown_or_impossible_targets_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="target|unknown"):
        parse_target(bad)


def test_every_accelerator_cites_its_source():
    for acc in ACCELERATORS.values():
        assert acc.source.startswith("https://") and acc.hbm_bytes > 0 and acc.bf16_flops > 1e14


@pytest.mark.parametrize("acc, n, want", [("v5e", 1, "v5e:1x1"), ("v5e", 4, "v5e:2x2"), ("v5e", 8, "v5e:2x4"),
                                          ("v5e", 16, "v5e:4x4"), ("v6e", 2, "v6e:1x2"), ("v5p", 4, "v5p:2x2x1"),
                                          ("v5p", 8, "v5p:2x2x2"), ("v5p", 64, "v5p:4x4x4"), ("v4", 8, "v4:2x2x1")])
def test_tpu_topologies_have_exactly_the_role_size(acc, n, want):
    assert tpu_topology_name(ACCELERATORS[acc], n) == want


def test_a_device_count_that_is_no_topology_names_the_split():
    with pytest.raises(ValueError, match="MeshConfig"):
        tpu_topology_name(ACCELERATORS["v5e"], 3)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install 'areal-jax[plan]')")
def test_libtpu_topology_gives_the_devices_asked_for():
    # In a subprocess: a process that loads libtpu holds its lock until it exits.
    import subprocess
    import sys

    code = ("from areal_jax.plan.targets import parse_target, topology_devices; "
            "d = topology_devices(parse_target('v5e-16'), 4); print(len(d), d[0].device_kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1"})
    if "in use by another process" in out.stderr:
        pytest.skip("another process holds libtpu (one at a time)")
    assert out.returncode == 0, out.stderr[-2000:]
    count, kind = out.stdout.strip().split(" ", 1)
    assert int(count) == 4 and "v5 lite" in kind.lower()


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax-cuda12-plugin not installed (pip install 'areal-jax[plan]')")
def test_xla_gpu_topology_gives_the_devices_asked_for():
    from areal_jax.plan.targets import topology_devices

    devices = topology_devices(parse_target("2x8xh100"), 6, hosts=2)
    assert len(devices) == 6 and "H100" in devices[0].device_kind


@pytest.mark.parametrize("name, billions, family", [("qwen3-235b-a22b", 235.1, "qwen3_moe"),
                                                    ("llama-3.3-70b", 70.6, "llama")])
def test_the_large_model_configs_read_as_their_published_sizes(name, billions, family):
    import pathlib

    from areal_jax.plan.planner import read_model_config

    m = read_model_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "models" / f"{name}.json")
    assert m.family == family and m.num_params() / 1e9 == pytest.approx(billions, abs=0.05)
