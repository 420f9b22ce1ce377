"""Tiny random HF checkpoints made by transformers (in the reference venv), shared by tests."""

from __future__ import annotations

import pathlib

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5)

# Each family with the features that set it apart; other configurations are tried in tests.
FAMILY_CONFIGS = {
    "llama3": ("llama", dict(TINY, rope_theta=500000.0, tie_word_embeddings=False, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": ("qwen2", dict(TINY, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(TINY, head_dim=12, rope_theta=1000000.0, tie_word_embeddings=False)),
}


def make_models(reference, root: pathlib.Path, configs: dict[str, tuple[str, dict]], seed: int = 0,
                **extra) -> dict[str, pathlib.Path]:
    """Creates one random model per entry of `configs` under `root`; returns name -> directory."""
    requests, dirs = [], {}
    for name, (family, config) in configs.items():
        dirs[name] = root / name
        requests.append({"op": "make_model", "family": family, "config": config, "out": str(dirs[name]),
                         "seed": seed, **extra})
    reference.run("many", requests=requests)
    return dirs


def models_with_logits(reference, root: pathlib.Path, configs: dict[str, tuple[str, dict]], sequences: list
                       ) -> dict[str, tuple[pathlib.Path, list]]:
    """`make_models`, then transformers' fp32 logits of each sequence: name -> (directory, logits)."""
    import numpy as np

    dirs = make_models(reference, root, configs)
    reference.run("many", requests=[{"op": "logits", "model": str(d), "sequences": sequences,
                                     "out": str(d / "ref.npz")} for d in dirs.values()])
    out = {}
    for name, d in dirs.items():
        ref = np.load(d / "ref.npz")
        out[name] = (d, [ref[f"logits_{i}"] for i in range(len(sequences))])
    return out
