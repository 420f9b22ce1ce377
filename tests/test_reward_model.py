"""Scalar reward models (`*ForSequenceClassification`) against transformers, fp32, tiny random
checkpoints made locally: padded batches (left and right), chat-rendered inputs, our writer, and
the same scores on a data=2 x tensor=2 mesh as on one device."""

import json
import shutil

import jax
import numpy as np
import pytest

from areal_jax.models.reward_head import ScoreHead, load_reward_params, read_reward_config, save_reward_params
from areal_jax.parallel.meshes import generation_mesh
from areal_jax.reward.reward_model import RewardModel
from tests.model_fixtures import FAMILY_CONFIGS
from tests.tokenizer_fixtures import build_tiny_tokenizer

PAD = 0  # the chatml tokenizer's <|endoftext|>
V = 512  # covers the tiny tokenizer's 508 ids
RNG = np.random.default_rng(0)
SEQS = [RNG.integers(1, V, size=n).tolist() for n in (13, 5, 1, 9, 20, 31)]
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7 * 6"},
     {"role": "assistant", "content": "42, I think"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there, how are you today?"}],
]


@pytest.fixture(scope="module")
def rms(reference, tmp_path_factory):
    """family -> (directory, reference reply for SEQS, reference reply for CHATS)."""
    root = tmp_path_factory.mktemp("rm")
    tok = build_tiny_tokenizer(root / "tok", "chatml")
    dirs = {}
    requests = []
    for name, (family, config) in FAMILY_CONFIGS.items():
        dirs[name] = root / name
        config = dict(config, vocab_size=V, num_labels=1, pad_token_id=PAD)
        requests.append({"op": "make_model", "family": family, "config": config, "out": str(dirs[name]),
                         "seed": 1, "head": "score"})
    reference.run("many", requests=requests)
    for d in dirs.values():
        for f in tok.iterdir():
            shutil.copy(f, d / f.name)
    replies = reference.run("many", requests=[
        r for d in dirs.values() for r in (
            {"op": "seq_scores", "model": str(d), "sequences": SEQS},
            {"op": "seq_scores", "model": str(d), "tokenizer": str(d), "conversations": CHATS})])["results"]
    return {name: (d, replies[2 * i], replies[2 * i + 1]) for i, (name, d) in enumerate(dirs.items())}


def _tol(*refs) -> float:
    scale = max(float(np.abs(np.asarray(r)).max()) for r in refs)
    return 1e-4 * max(scale, 1.0)


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_padded_batches_score_as_transformers(rms, name):
    path, ref, _ = rms[name]
    alone = np.asarray(ref["alone"])[:, 0]
    tol = _tol(alone)
    # The reference's own padded batches (mask + positions) agree with its unpadded sequences.
    np.testing.assert_allclose(np.asarray(ref["right"])[:, 0], alone, atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(ref["left"])[:, 0], alone, atol=tol, rtol=0)
    rm = RewardModel.from_pretrained(path, batch_size=4)  # two batches: 4 rows, then 2 rows padded to 4
    assert rm.head == ScoreHead(num_labels=1, pad_token_id=PAD)
    for padding in ("right", "left"):
        np.testing.assert_allclose(rm.score_ids(SEQS, padding=padding), alone, atol=tol, rtol=0)
    assert len(set(np.round(alone, 6))) == len(SEQS)  # distinct scores: a mixed-up row would show


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_chats_rendered_by_the_rms_template_score_as_transformers(rms, name):
    path, _, ref = rms[name]
    rm = RewardModel.from_pretrained(path)
    ids = [rm.tokenizer.apply_chat_template(c, tokenize=True) for c in CHATS]
    assert ids == ref["ids"]
    alone = np.asarray(ref["alone"])[:, 0]
    np.testing.assert_allclose(rm.score_chats(CHATS), alone, atol=_tol(alone), rtol=0)
    # score(texts): the rendered text tokenized plainly (this tokenizer adds no special tokens).
    texts = [rm.tokenizer.apply_chat_template(c, tokenize=False) for c in CHATS]
    np.testing.assert_allclose(rm.score(texts), alone, atol=_tol(alone), rtol=0)


def test_written_reward_model_loads_in_transformers(rms, reference, tmp_path):
    path, ref, _ = rms["qwen3"]
    cfg, head, params = load_reward_params(path)
    save_reward_params(params, cfg, head, tmp_path / "copy")
    assert read_reward_config(tmp_path / "copy") == (cfg, head)
    again = reference.run("seq_scores", model=str(tmp_path / "copy"), sequences=SEQS[:3])
    alone = np.asarray(ref["alone"])[:3, 0]
    np.testing.assert_allclose(np.asarray(again["alone"])[:, 0], alone, atol=_tol(alone), rtol=0)


def test_rm_on_a_data2_tensor2_mesh_equals_one_device(rms):
    path, ref, _ = rms["llama3"]
    assert len(jax.devices()) >= 4
    one = RewardModel.from_pretrained(path, batch_size=4).score_ids(SEQS)
    mesh = generation_mesh(jax.devices()[:4], tensor=2)
    assert dict(mesh.shape) == {"data": 2, "expert": 1, "tensor": 2}
    rm = RewardModel.from_pretrained(path, mesh=mesh, batch_size=3)  # 3 rows round up to 4: 2 per replica
    assert rm.params["layers"]["wq"].sharding.spec[2] == "tensor"  # heads split over tensor
    np.testing.assert_allclose(rm.score_ids(SEQS), one, atol=_tol(one) * 0.1, rtol=0)


def test_a_causal_lm_or_bad_input_is_refused_by_name(rms, tmp_path):
    path, _, _ = rms["qwen2"]
    hf = json.loads((path / "config.json").read_text())
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps(hf | {"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="name no reward model"):
        read_reward_config(tmp_path / "lm")
    rm = RewardModel.from_pretrained(path)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        rm.score_ids([[1, 2], []])
    with pytest.raises(ValueError, match="outside"):
        rm.score_ids([[V]])
    with pytest.raises(TypeError, match="one str"):
        rm.score("a text")
