"""Delta weight sync on 8 fake CPU devices: sparse bit-deltas or the full push, chosen by measured
size, and bit-identical to `WeightSync`'s full transfer after every push."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.parallel import MeshConfig, WeightSync, build_meshes
from areal_jax.parallel.delta_sync import DeltaSync, choose, sparse_bytes
from tests.test_weight_sync import SPLIT_PARAMS, _host_values, _on_train_mesh, _specs


def _same_bits(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)


def test_choose_sends_sparse_only_when_smaller():
    # 1,000 bf16 elements: 2,000 B whole; a changed element of a flat leaf costs 4 + 2 B, of a
    # stacked leaf 4 + 2 + 2 B.
    assert sparse_bytes(10, 2, False) == 60 and sparse_bytes(10, 2, True) == 80
    assert choose([10], [1000], [2], [False]) == ("sparse", 60)
    assert choose([333], [1000], [2], [False]) == ("sparse", 1998)
    assert choose([334], [1000], [2], [False]) == ("full", 2000)
    assert choose([100], [1000], [2], [True], sparse_fraction=0.25) == ("full", 2000)
    assert choose([0, 0], [1000, 10], [2, 4], [True, False]) == ("sparse", 0)


@pytest.mark.parametrize("cfg", [
    MeshConfig(train_tensor=2, generation_tensor=2),
    MeshConfig(num_generation_devices_per_host=4, train_tensor=1, generation_tensor=2),
], ids=["train1x2-gen3x2", "train4x1-gen2x2"])
def test_delta_pushes_are_bit_exact_over_several_steps(cfg):
    meshes = build_meshes(cfg)
    specs = (_specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS))
    full_sync = WeightSync(meshes, *specs, generation_dtype=jnp.bfloat16)
    delta = DeltaSync(WeightSync(meshes, *specs, generation_dtype=jnp.bfloat16))
    values = _host_values()
    rng = np.random.default_rng(0)

    def push(values):
        params = _on_train_mesh(meshes, values)
        got = delta.transfer(params)
        _same_bits(got, full_sync.transfer(params))
        return delta.last_stats

    first = push(values)
    assert first.mode == "full" and first.index == 1

    # Step 2: a few elements of two leaves change beyond bf16 rounding, one stacked; an update
    # far below half a bf16 ulp elsewhere changes no generation bits at all.
    values = jax.tree.map(np.copy, values)
    values["embed"][3, 5] += 1.0
    values["layers"]["mlp"]["w_in"][6, 7] -= 2.0
    values["layers"]["mlp"]["w_in"][1, 0] += 4.0
    values["layers"]["attn"]["wq"] *= np.float32(1 + 1e-6)
    second = push(values)
    assert second.mode == "sparse" and second.changed_elements == 3
    assert second.num_bytes == sparse_bytes(1, 2, False) + sparse_bytes(2, 2, True)

    # Step 3: nothing changed: nothing sent, the same weights again.
    third = push(values)
    assert third.mode == "sparse" and third.num_bytes == 0 and third.changed_elements == 0

    # Step 4: every weight moves: the sparse payload would be larger, so the full push.
    values = jax.tree.map(lambda x: x + (np.float32(rng.normal(size=x.shape)) if x.dtype == np.float32 else 1),
                          values)
    fourth = push(values)
    assert fourth.mode == "full" and fourth.num_bytes == full_sync.last_stats.num_bytes

    # Step 5: sparse again after a full push, from the new reference.
    values = jax.tree.map(np.copy, values)
    values["bias"][:4] += 8.0
    values["step"] += 1  # an integer leaf travels in its own dtype
    fifth = push(values)
    assert fifth.mode == "sparse" and fifth.changed_elements == 5 and fifth.index == 5


def test_the_stacked_layout_is_refused():
    meshes = build_meshes(MeshConfig(train_tensor=2, generation_tensor=2))
    sync = WeightSync(meshes, _specs(2, SPLIT_PARAMS), _specs(3, SPLIT_PARAMS), layout="stacked")
    with pytest.raises(ValueError, match="split"):
        DeltaSync(sync)


def test_the_simulator_charges_a_delta_push_its_sparse_bytes():
    from areal_jax.parallel.delta_sync import sent_fraction
    from areal_jax.simulate.costs import RooflineCosts

    # 1% of bf16 elements changed: 1% x (4 + 2 + 2) / 2 = 4% of the full bytes; 30% would be 120%: full.
    assert sent_fraction(0.01, 2) == pytest.approx(0.04)
    assert sent_fraction(0.3, 2) == 1.0 and sent_fraction(0.0, 2) == 0.0
    costs = dict(model=None, target=None, estimate_context=None, replicas=1, generation_tensor=1,
                 slots_per_replica=1, train_devices=1, hosts=1, generation_weight_bytes=16e9, kv_bytes_per_token=1.0,
                 separate_proximal=False, transfer_bytes_per_s=8e9)
    assert RooflineCosts(**costs).transfer_s == pytest.approx(2.0)
    assert RooflineCosts(**costs, transfer_sent_fraction=sent_fraction(0.01, 2)).transfer_s == pytest.approx(0.08)


@pytest.mark.slow  # a whole (short) run: over a minute on 2 cores
def test_a_run_with_delta_sync_reports_what_each_push_sent(tmp_path):
    # The quickstart's short form with RLConfig.transfer_mode = "delta": every step's record says how
    # many bytes the push sent, how long it took, and whether it went sparse. A step this short moves
    # few bf16 weights (none when every reward of the batch is equal: no gradient), so pushes go sparse.
    from areal_jax.cli import main
    from areal_jax.metrics import read_jsonl
    from tests.test_cli import SPLIT_8, _args

    assert main(_args(tmp_path, 'RLConfig.transfer_mode = "delta"', SPLIT_8)) == 0
    records = [r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    assert records
    for m in records:
        assert m["transfer/bytes"] >= 0 and m["transfer/seconds"] > 0 and m["transfer/sparse"] in (0.0, 1.0)
    assert any(m["transfer/sparse"] == 1.0 for m in records)
