"""Likelihood rewards ("lm:<dir>" terms): a causal LM's mean log-prob of an answer, against
transformers computing the same definition on tiny random checkpoints made locally (fp32; padded
batches of unequal lengths; chat-rendered prompts), the same scores on a data=2 x tensor=2 mesh,
the term wired through `LearnedRewards`, and bad input refused by name."""

import json
import shutil

import jax
import numpy as np
import pytest

from areal_jax.parallel.meshes import generation_mesh
from areal_jax.reward import composite
from areal_jax.reward.likelihood import LikelihoodReward, check_causal_lm, likelihood_input
from tests.model_fixtures import FAMILY_CONFIGS
from tests.tokenizer_fixtures import build_tiny_tokenizer

V = 512  # covers the tiny tokenizer's 508 ids
PAIRS = [("What is 2 + 3?", "It is 5."), ("7 * 6", "42, I think"), ("hi", "hello there, how are you today?"),
         ("Compute 3+4-1.", "3+4=7\n7-1=6\n\\boxed{6}"), ("x", "y")]


@pytest.fixture(scope="module")
def lms(reference, tmp_path_factory):
    """family -> (directory, the reference's scores of PAIRS)."""
    root = tmp_path_factory.mktemp("lm")
    tok = build_tiny_tokenizer(root / "tok", "chatml")
    dirs = {name: root / name for name in FAMILY_CONFIGS}
    reference.run("many", requests=[
        {"op": "make_model", "family": family, "config": dict(config, vocab_size=V), "out": str(dirs[name]),
         "seed": 2} for name, (family, config) in FAMILY_CONFIGS.items()])
    for d in dirs.values():
        for f in tok.iterdir():
            shutil.copy(f, d / f.name)
    replies = reference.run("many", requests=[
        {"op": "answer_loglik", "model": str(d), "tokenizer": str(d), "pairs": PAIRS} for d in dirs.values()])
    return {name: (d, np.asarray(r["scores"])) for (name, d), r in zip(dirs.items(), replies["results"])}


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_scores_match_transformers_in_padded_batches(lms, name):
    path, ref = lms[name]
    lm = LikelihoodReward.from_pretrained(path, batch_size=2)  # three calls, the last one row padded
    scores = lm.score(PAIRS)
    np.testing.assert_allclose(scores, ref, atol=1e-4, rtol=0)
    assert (scores < 0).all() and len(set(np.round(scores, 5))) == len(PAIRS)  # a mixed-up row would show
    alone = np.array([lm.score([p])[0] for p in PAIRS])  # each row alone: padding changes nothing
    np.testing.assert_allclose(alone, scores, atol=1e-5, rtol=0)


def test_the_answer_is_what_is_scored(lms):
    path, _ = lms["qwen2"]
    lm = LikelihoodReward.from_pretrained(path)
    ids, start = likelihood_input(lm.tokenizer, *PAIRS[0])
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": PAIRS[0][0]}], add_generation_prompt=True)
    assert ids[:start] == list(prompt) and len(ids) > start
    # The same answer after another question scores differently: the prompt conditions it.
    a = lm.score([("What is 2 + 3?", "It is 5.")])[0]
    b = lm.score([("Name a colour.", "It is 5.")])[0]
    assert a != pytest.approx(b, abs=1e-6)


def test_on_a_data2_tensor2_mesh_equals_one_device(lms):
    path, ref = lms["llama3"]
    assert len(jax.devices()) >= 4
    mesh = generation_mesh(jax.devices()[:4], tensor=2)
    lm = LikelihoodReward.from_pretrained(path, mesh=mesh, batch_size=3)  # 3 rows round up to 4: 2 per replica
    assert lm.batch_size == 4
    np.testing.assert_allclose(lm.score(PAIRS), ref, atol=1e-4, rtol=0)


def test_the_term_scores_through_learned_rewards(lms):
    path, ref = lms["qwen3"]
    terms = composite.normalize_reward(((f"lm:{path}", 1.0), ("arithmetic", 0.0)))
    assert composite.is_learned(f"lm:{path}") and not composite.is_learned("arithmetic")
    composite.check_terms(terms, lambda name, field: None, "RLVRConfig.reward")
    learned = composite.LearnedRewards([f"lm:{path}"], warmup_tokens=32)
    try:
        got = [learned.submit(f"lm:{path}", q, a).result(timeout=60) for q, a in PAIRS]
    finally:
        learned.close()
    assert all(failed is None for _, failed in got)
    np.testing.assert_allclose([s for s, _ in got], ref, atol=1e-4, rtol=0)
    memory = composite.learned_reward_memory(terms)
    from areal_jax.models.hf_io import read_config

    assert memory[f"lm:{path}"] == {"weights_bytes": read_config(path).num_params() * 4, "kv_bytes": 0}


def test_bad_terms_and_inputs_are_refused_by_name(lms, tmp_path):
    path, _ = lms["qwen2"]
    with pytest.raises(ValueError, match="directory after 'lm:'"):
        composite.normalize_reward((("lm:", 1.0),))
    hf = json.loads((path / "config.json").read_text())
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text(json.dumps(hf | {"architectures": ["Qwen2ForSequenceClassification"]}))
    with pytest.raises(ValueError, match=r"term 'lm:.*rm'.*not a causal LM.*'rm:' term"):
        composite.check_terms(((f"lm:{tmp_path / 'rm'}", 1.0),), lambda n, f: None, "RLVRConfig.reward")
    with pytest.raises(ValueError, match="not found"):
        check_causal_lm(tmp_path / "missing")
    lm = LikelihoodReward.from_pretrained(path)
    with pytest.raises(ValueError, match="row 1 has no answer token"):
        lm.score_ids([([1, 2, 3], 1), ([1, 2], 2)])
    with pytest.raises(ValueError, match="outside"):
        lm.score_ids([([1, V], 1)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lm.score_ids([(list(range(1, 3)) * lm.config.max_position_embeddings, 1)])


def test_a_reference_subdirectory_makes_it_an_implicit_reward_model(lms, tmp_path):
    """With `reference/` the score is the mean log-ratio to the reference LM (here another family's
    random model over the same vocabulary): transformers' two mean log-probs subtracted."""
    (path, own), (ref_path, ref) = lms["qwen2"], lms["qwen3"]
    implicit = tmp_path / "implicit"
    shutil.copytree(path, implicit)
    shutil.copytree(ref_path, implicit / "reference")
    lm = LikelihoodReward.from_pretrained(implicit, batch_size=4)
    assert lm.reference is not None
    np.testing.assert_allclose(lm.score(PAIRS), own - ref, atol=2e-4, rtol=0)
    memory = composite.learned_reward_memory(((f"lm:{implicit}", 1.0),))
    from areal_jax.models.hf_io import read_config

    assert memory[f"lm:{implicit}"]["weights_bytes"] == 4 * (read_config(path).num_params()
                                                             + read_config(ref_path).num_params())
    (implicit / "reference" / "config.json").write_text(json.dumps(
        json.loads((ref_path / "config.json").read_text()) | {"vocab_size": V + 1}))
    with pytest.raises(ValueError, match="reference's vocabulary"):
        LikelihoodReward.from_pretrained(implicit)
