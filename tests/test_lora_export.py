"""A LoRA RL run end to end (tiny): adapter-only swaps recorded in the metrics, checkpoints that
export merged (transformers loads them) or as a PEFT adapter (peft loads it on the base), both
with our adapted model's logits."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.checkpoint import SavedParams
from areal_jax.cli import main
from areal_jax.jobs.export import saved_lora
from areal_jax.models import lora as lora_lib
from areal_jax.models.config import ModelConfig
from areal_jax.models.hf_io import leaf_keys, write_params
from areal_jax.models.transformer import forward
from tests.test_export import SEQS, TINY_RUN
from tests.test_model_parity import _tol

LORA_RUN = [*TINY_RUN, "--gin_param=LoRAConfig.rank = 4", "--gin_param=LoRAConfig.alpha = 8.0",
            "--gin_param=LoRAConfig.targets = ('q', 'v', 'o', 'gate', 'down')",
            "--gin_param=LoRAConfig.base_dtype = 'float32'", "--gin_param=OptimizerConfig.lr = 1e-2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora_export") / "run"
    assert main(["train", *LORA_RUN, f"--run_dir={run}"]) == 0
    return run


def _our_logits(saved: SavedParams, cfg) -> list[np.ndarray]:
    tree: dict = {}
    for leaf in saved.shapes:
        node = tree
        for key in leaf[:-1]:
            node = node.setdefault(key, {})
        node[leaf[-1]] = jnp.asarray(saved.read(leaf))
    return [np.asarray(forward(tree, cfg, jnp.asarray([seq]))[0])[0] for seq in SEQS]


def _cfg(run_dir):
    return ModelConfig.from_hf(json.loads((run_dir / "model_config.json").read_text()))


def test_swaps_move_only_the_adapters(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    moved = [r["metrics"]["transfer/bytes"] for r in records if "transfer/bytes" in r.get("metrics", {})]
    lora = saved_lora(SavedParams(run_dir / "checkpoints", 2))
    assert len(moved) == 2 and all(m == lora_lib.adapter_param_count(_cfg(run_dir), lora) * 4 for m in moved), moved


def test_exports_load_in_transformers_and_peft_with_our_logits(run_dir, tmp_path, reference):
    cfg = _cfg(run_dir)
    saved = SavedParams(run_dir / "checkpoints", 2)
    lora = saved_lora(saved)
    assert (lora.rank, lora.alpha, lora.targets) == (4, 8.0, ("q", "v", "o", "gate", "down"))
    assert np.abs(saved.read(("layers", "lora", "wq", "b"))).max() > 0  # RL moved the adapters
    merged, adapter, base = tmp_path / "merged", tmp_path / "adapter", tmp_path / "base"
    assert main(["export", f"--checkpoint={run_dir / 'checkpoints'}", f"--out={merged}"]) == 0
    assert main(["export", f"--checkpoint={run_dir / 'checkpoints'}", f"--out={adapter}", "--adapter"]) == 0
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    write_params(saved.read, cfg, base, dtype=np.float32)  # the frozen base alone, as HF
    assert set(leaf_keys(cfg)) <= set(saved.shapes)
    reference.run("many", requests=[
        {"op": "logits", "model": str(merged), "sequences": SEQS, "out": str(tmp_path / "merged.npz")},
        {"op": "adapter_logits", "model": str(base), "adapter": str(adapter), "sequences": SEQS,
         "out": str(tmp_path / "peft.npz")},
        {"op": "logits", "model": str(base), "sequences": SEQS, "out": str(tmp_path / "base.npz")}])
    ours = _our_logits(saved, cfg)
    for name in ("merged", "peft"):
        ref = np.load(tmp_path / f"{name}.npz")
        refs = [ref[f"logits_{i}"] for i in range(len(SEQS))]
        for got, want in zip(ours, refs):
            np.testing.assert_allclose(got, want, atol=_tol(refs), rtol=0, err_msg=name)
    plain = np.load(tmp_path / "base.npz")
    assert max(np.abs(plain[f"logits_{i}"] - o).max() for i, o in enumerate(ours)) > 10 * _tol(ours)


def test_adapters_of_a_run_whose_sft_trained_the_base_are_refused(run_dir, tmp_path, capsys):
    """Its adapters fit the SFT policy, not the run's base: PEFT would load them on the wrong weights."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("final_model", "tensorboard"))
    meta = run / "checkpoints" / "2" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    record["extra"]["summary"]["sft_steps"] = 10  # as a run with an SFT stage records it
    meta.write_text(json.dumps(record))
    out = tmp_path / "adapter"
    assert main(["export", f"--checkpoint={run / 'checkpoints'}", f"--out={out}", "--adapter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--adapter: the run's SFT stage trained every base weight (10 steps)" in err[0], err
    assert not out.exists()
    assert main(["export", f"--checkpoint={run / 'checkpoints'}", f"--out={out}"]) == 0  # merged: the SFT policy's
    assert (out / "model.safetensors").is_file()
