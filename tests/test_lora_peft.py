"""Parity with PEFT on transformers (.venv-ref): our adapted decoder gives PEFT's logits for an
adapter PEFT wrote, and an adapter we write loads in PEFT with our logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import lora as lora_lib
from areal_jax.models import read_config
from areal_jax.models.hf_io import load_params
from areal_jax.models.lora import LoRAConfig
from areal_jax.models.peft_io import load_adapter, save_adapter
from areal_jax.models.transformer import forward
from tests.model_fixtures import FAMILY_CONFIGS, TINY, make_models

RNG = np.random.default_rng(0)
SEQS = [RNG.integers(0, TINY["vocab_size"], size=n).tolist() for n in (11, 4, 17)]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def our_logits(model_dir, adapters) -> list[np.ndarray]:
    cfg, params = load_params(model_dir)
    params = lora_lib.attach(params, jax.tree.map(jnp.asarray, adapters))
    return [np.asarray(forward(params, cfg, jnp.asarray([seq]))[0])[0] for seq in SEQS]


def reference_logits(path) -> list[np.ndarray]:
    ref = np.load(path)
    return [ref[f"logits_{i}"] for i in range(len(SEQS))]


def _tol(refs) -> float:  # as tests/test_model_parity.py: 1e-4 of the logit scale
    return 1e-4 * max(max(float(np.abs(r).max()) for r in refs), 1.0)


@pytest.fixture(scope="module")
def setup(reference, tmp_path_factory):
    """Tiny qwen2 and llama3 models, a random PEFT adapter of each, and PEFT's adapted logits."""
    root = tmp_path_factory.mktemp("peft")
    configs = {k: FAMILY_CONFIGS[k] for k in ("qwen2", "llama3")}
    dirs = make_models(reference, root, configs)
    targets = {"qwen2": ALL, "llama3": ["q_proj", "v_proj", "o_proj", "down_proj"]}
    requests = []
    for name, d in dirs.items():
        requests.append({"op": "make_adapter", "model": str(d), "out": str(root / f"{name}_peft"), "rank": 4,
                         "alpha": 8, "targets": targets[name], "seed": 1})
        requests.append({"op": "adapter_logits", "model": str(d), "adapter": str(root / f"{name}_peft"),
                         "sequences": SEQS, "out": str(root / f"{name}_peft.npz")})
    reference.run("many", requests=requests)
    return root, dirs


@pytest.mark.parametrize("name", ["qwen2", "llama3"])
def test_our_adapted_model_gives_peft_logits(setup, name):
    root, dirs = setup
    lora, adapters = load_adapter(root / f"{name}_peft", read_config(dirs[name]))
    assert lora.rank == 4 and lora.scale == 2.0
    refs = reference_logits(root / f"{name}_peft.npz")
    ours = our_logits(dirs[name], adapters)
    base = our_logits(dirs[name], lora_lib.init_adapters(read_config(dirs[name]), LoRAConfig(rank=4)))
    for got, want, plain in zip(ours, refs, base):
        np.testing.assert_allclose(got, want, atol=_tol(refs), rtol=0)
        assert np.abs(want - plain).max() > 100 * _tol(refs)  # the adapter changes the logits


def test_an_adapter_we_write_loads_in_peft_with_our_logits(setup, reference):
    root, dirs = setup
    cfg = read_config(dirs["qwen2"])
    lora = LoRAConfig(rank=3, alpha=5.0, targets=("k", "o", "gate", "up"))
    rng = np.random.default_rng(7)
    adapters = {k: v if k == lora_lib.SCALE else {n: rng.normal(0, 0.2, x.shape).astype(np.float32)
                                                  for n, x in v.items()}
                for k, v in lora_lib.init_adapters(cfg, lora).items()}
    out = save_adapter(adapters, cfg, lora, root / "ours_peft", base_model=str(dirs["qwen2"]))
    reference.run("adapter_logits", model=str(dirs["qwen2"]), adapter=str(out), sequences=SEQS,
                  out=str(root / "ours_peft.npz"))
    refs = reference_logits(root / "ours_peft.npz")
    for got, want in zip(our_logits(dirs["qwen2"], adapters), refs):
        np.testing.assert_allclose(got, want, atol=_tol(refs), rtol=0)
