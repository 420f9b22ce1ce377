"""Logits parity of areal_jax's Qwen2-MoE / Qwen3-MoE decoders with transformers (fp32) on tiny
random checkpoints, and the round trip through HF files."""

import jax
import numpy as np
import pytest

from areal_jax.models import load_pretrained, read_config
from tests.model_fixtures import TINY, models_with_logits
from tests.test_model_parity import _tol, assert_each_sequence_matches, assert_round_trip, packed_rows

RNG = np.random.default_rng(1)
SEQS = [RNG.integers(0, TINY["vocab_size"], size=n).tolist() for n in (13, 5, 1, 9, 20)]
MOE = dict(TINY, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)

CONFIGS = {
    # Every layer sparse, renormalized top-k, q/k norm.
    "qwen3_moe": ("qwen3_moe", dict(MOE, head_dim=12, norm_topk_prob=True, rope_theta=1000000.0)),
    # A dense middle layer, raw top-k probabilities, a shared expert behind its gate, tied embeddings.
    "qwen2_moe": ("qwen2_moe", dict(MOE, mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
                                    shared_expert_intermediate_size=40)),
    # Every second layer sparse (decoder_sparse_step), three experts per token.
    "qwen3_moe_step2": ("qwen3_moe", dict(MOE, num_hidden_layers=4, decoder_sparse_step=2, num_experts_per_tok=3,
                                          norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    """name -> (directory, reference logits per sequence of SEQS)."""
    return models_with_logits(reference, tmp_path_factory.mktemp("hf_moe"), CONFIGS, SEQS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_reads_the_expert_block(checkpoints, name):
    cfg = read_config(checkpoints[name][0])
    family, hf = CONFIGS[name]
    assert cfg.family == family and cfg.moe.num_experts == 8
    assert cfg.moe.num_experts_per_tok == hf["num_experts_per_tok"]
    assert cfg.moe.norm_topk_prob == hf["norm_topk_prob"]
    expect = [i not in hf.get("mlp_only_layers", []) and (i + 1) % hf.get("decoder_sparse_step", 1) == 0
              for i in range(hf["num_hidden_layers"])]
    assert list(cfg.sparse_layers) == expect
    assert cfg.moe.shared_expert_intermediate_size == hf.get("shared_expert_intermediate_size", 0) * (
        family == "qwen2_moe")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unpadded_logits_match_transformers(checkpoints, name):
    path, refs = checkpoints[name]
    model = load_pretrained(path)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(model.params))
    # A mixed pattern also holds the unused stacked slices (a dense MLP in sparse layers and back).
    assert (n_params == model.config.num_params()) == all(model.config.sparse_layers)
    assert_each_sequence_matches(model, refs, SEQS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_rows_match_per_sequence_reference(checkpoints, name):
    path, refs = checkpoints[name]
    model = load_pretrained(path)
    ids, seg, _, spans = packed_rows(SEQS)
    out = np.asarray(model(ids, segment_ids=seg))
    for i, (r, start, n) in spans.items():
        np.testing.assert_allclose(out[r, start:start + n], refs[i], atol=_tol(refs), rtol=0)


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe_step2"])
def test_round_trip_save_load_transformers(checkpoints, reference, tmp_path, name):
    path, refs = checkpoints[name]
    assert_round_trip(path, refs, reference, tmp_path / name, SEQS)
