"""Shared-prefix training (trainer/prefix_tree.py, TrainEngineConfig.share_prefixes): a group's rows
packed as one prefix trie give the same loss, gradients and proximal log-probs as plain packing,
on a tiny random model; the trie layout (positions, mask, sources, index) against a hand-built case;
the micro-batch budget counts trie tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels.flash_attention import reference_flash_attention
from areal_jax.models import ModelConfig, init_params
from areal_jax.models.attention import causal_attention
from areal_jax.models.transformer import self_attention_mask
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
import dataclasses

from areal_jax.trainer.algorithm import PPOStep, ppo_trainer
from areal_jax.trainer.batching import build_sequences, make_microbatches, sequence_group_ids
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer
from areal_jax.trainer.prefix_tree import PrefixTrie, pack_tree_bin, trie_units

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
BUDGET, BUCKETS = 64, (32, 64)
PPO = PPOConfig(eps_clip=0.2, behav_imp_weight_cap=3.0, num_minibatches=1)
OPT = OptimizerConfig(lr=1e-2)
INIT = init_params(CFG, jax.random.key(0), std=0.1)


def shared_groups(seed, n_groups=3, per_group=4):
    """Groups whose rows share a prompt and, for most rows, sampled tokens too (an agent's turns);
    the last group's rows share nothing. Per-row behaviour log-probs, versions and rewards, so a
    shared trained token carries different weights in each row through it."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(0, CFG.vocab_size, int(rng.integers(3, 8)))
        common = rng.integers(0, CFG.vocab_size, int(rng.integers(2, 6)))  # e.g. a tool call's opening
        trajs = []
        for j in range(per_group):
            if g == n_groups - 1:  # no sharing at all
                p, c = rng.integers(0, CFG.vocab_size, 4), rng.integers(0, CFG.vocab_size, int(rng.integers(1, 8)))
            else:
                tail = rng.integers(0, CFG.vocab_size, int(rng.integers(0, 6)))
                p = prompt
                c = np.concatenate([common[:int(rng.integers(1, len(common) + 1))], tail]) if j else common
                if j == 3:  # a row that is a prefix of another row (an earlier turn)
                    c = common[:1]
            trajs.append(Trajectory(np.asarray(p), np.asarray(c), (-3.0 - 2.0 * rng.random(len(c))).astype(np.float32),
                                    rng.integers(3, 6, len(c)), float(rng.normal())))
        groups.append(TrajectoryGroup(f"q{g}", tuple(trajs), 0))
    seqs = build_sequences(groups, AdvantageConfig(norm="none"))
    for s in seqs:  # per-row advantages per token: shared tokens differ across rows
        s["advantages"] = (rng.normal(size=s["loss_mask"].shape) * s["loss_mask"]).astype(np.float32)
    return groups, seqs


def batches(seqs, groups, share, **kw):
    [micro] = make_microbatches(seqs, max_tokens_per_microbatch=BUDGET, num_minibatches=1, buckets=BUCKETS,
                                group_ids=sequence_group_ids(groups), share_prefixes=share, **kw)
    return micro


@pytest.fixture(scope="module", params=["auto", "blocked"])
def trainers(request):
    plain = ppo_trainer(CFG, INIT, OPT, PPO, engine=TrainEngineConfig(max_tokens_per_microbatch=BUDGET,
                                                                      attention_impl=request.param))
    tree = ppo_trainer(CFG, INIT, OPT, PPO, engine=TrainEngineConfig(max_tokens_per_microbatch=BUDGET,
                                                                     attention_impl=request.param,
                                                                     share_prefixes=True))
    return plain, tree


def reset(*trainers):
    for t in trainers:
        t.load_state_dict({"params": INIT, "opt_state": build_optimizer(OPT).init(INIT), "step": 0})


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradients_and_logprobs_equal_plain_packing(trainers, seed):
    plain, tree = trainers
    reset(plain, tree)
    groups, seqs = shared_groups(seed)
    plain_mb, tree_mb = batches(seqs, groups, False), batches(seqs, groups, True)
    tree_tokens = sum(int((np.asarray(m.arrays["tree_segment_ids"]) > 0).sum()) for m in tree_mb)
    plain_tokens = sum(len(s["input_ids"]) for s in seqs)
    assert tree_tokens < 0.8 * plain_tokens  # the prefixes really are shared
    # Proximal log-probs (the algorithm's recompute) through the same path, per sequence.
    for mb_plain, mb_tree in ((plain_mb, tree_mb),):
        lp_plain = {i: None for i in range(len(seqs))}
        for trainer, mbs in ((plain, mb_plain), (tree, mb_tree)):
            for m in mbs:
                out = np.asarray(trainer.compute_logprobs(m))
                seg = np.asarray(m.arrays["segment_ids"])
                for r, row in enumerate(m.rows):
                    for k, i in enumerate(row):
                        lp = out[r][seg[r] == k + 1]
                        mask = seqs[i]["loss_mask"] > 0
                        if lp_plain[i] is None:
                            lp_plain[i] = lp
                        else:
                            np.testing.assert_allclose(lp[mask], lp_plain[i][mask], atol=2e-5, rtol=0)
    g_plain, s_plain = plain.minibatch_gradients(plain_mb)
    g_tree, s_tree = tree.minibatch_gradients(tree_mb)
    assert float(s_tree["n_valid"]) == float(s_plain["n_valid"]) == sum(float(s["loss_mask"].sum()) for s in seqs)
    for name in ("loss", "entropy_sum", "behav_logp_gap_sum", "clip_frac", "capped_frac"):
        np.testing.assert_allclose(float(s_tree[name]), float(s_plain[name]), atol=2e-5, rtol=1e-5, err_msg=name)
    assert float(s_plain["clip_frac"]) > 0 or float(s_plain["capped_frac"]) > 0
    for (path, a), b in zip(jax.tree.leaves_with_path(g_tree), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4, err_msg=str(path))


def test_ppo_step_with_two_minibatches_equals_plain(trainers):
    """The algorithm's step packs tries when the engine shares prefixes, and its proximal recompute
    (two updates) runs through them: the step's metrics and weights equal plain packing's."""
    plain, tree = trainers
    reset(plain, tree)
    groups, _ = shared_groups(3, n_groups=4)
    ppo = dataclasses.replace(PPO, num_minibatches=2)
    adv = AdvantageConfig(norm="group")
    out_plain = PPOStep(plain, adv, ppo)(groups, step=0, version=5)
    out_tree = PPOStep(tree, adv, ppo)(groups, step=0, version=5)
    assert all("tree_index" in m.arrays for mb in out_tree.minibatches for m in mb)
    for name in ("loss", "entropy", "n_valid_tokens", "grad_norm", "clip_frac"):
        np.testing.assert_allclose(out_tree.train[name], out_plain.train[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # Two AdamW steps of lr 1e-2 each move a weight up to ~2e-2 whatever its gradient's size, so an
    # element whose gradient is near zero turns an fp32 summation-order difference into a step
    # difference; 1e-4 is 0.5% of the steps taken (1.8e-5 seen on some CPUs).
    for a, b in zip(jax.tree.leaves(tree.params), jax.tree.leaves(plain.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    reset(plain, tree)


def test_trie_layout_by_hand():
    """Rows [5 6 7 8], [5 6 9], [5 6 7]: trie 5-6-{7-8, 9} in pre-order 5 6 7 8 9."""
    seqs = [{"input_ids": np.array(x, np.int32), "targets": np.array(x[1:] + [0], np.int32),
             "loss_mask": np.ones(len(x), np.float32)} for x in ([5, 6, 7, 8], [5, 6, 9], [5, 6, 7])]
    units = trie_units(seqs, [0, 1, 2], [0, 0, 0], 16)
    assert len(units) == 1 and units[0][1].num_nodes == 5
    m = pack_tree_bin(seqs, units, 8, 1, 8)
    a = {k: np.asarray(v) for k, v in m.arrays.items()}
    np.testing.assert_array_equal(a["tree_input_ids"][0], [5, 6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(a["tree_positions"][0], [0, 1, 2, 3, 2, 0, 0, 0])  # 9 restarts at depth 2
    np.testing.assert_array_equal(a["tree_segment_ids"][0], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(a["tree_key_ends"][0], [5, 5, 4, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(a["tree_sources"][0][:5], [0, 0, 1, 2, 1])  # parents (the root: itself)
    # The plain layout: 4 + 3 + 3 tokens in rows of 8; each position's target is the next node.
    nodes = {0: [0, 1, 2, 3], 1: [0, 1, 4], 2: [0, 1, 2]}
    seg = a["segment_ids"]
    for r, row in enumerate(m.rows):
        for k, i in enumerate(row):
            want = nodes[i][1:] + nodes[i][-1:]
            np.testing.assert_array_equal(a["tree_index"][r][seg[r] == k + 1], want)
    mask = np.asarray(self_attention_mask(1, 8, jnp.asarray(a["tree_segment_ids"]), jnp.asarray(a["tree_key_ends"])))[0]
    want = np.zeros((8, 8), bool)
    for q, ancestors in {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 4]}.items():
        want[q, ancestors] = True
    np.testing.assert_array_equal(mask, want)


def test_flash_reference_takes_the_trie_mask():
    """The reference flash attention with key_ends equals the blocked formula under the same mask,
    in value and gradient (several key blocks, so the loop path runs too)."""
    rng = np.random.default_rng(0)
    B, T, N, K, H = 3, 96, 4, 2, 8
    seqs = [{"input_ids": rng.integers(0, 4, int(rng.integers(5, 30))).astype(np.int32)} for _ in range(12)]
    for s in seqs:
        s["targets"] = s["loss_mask"] = s["input_ids"]
    units = trie_units(seqs, list(range(12)), [i // 4 for i in range(12)], T)
    m = pack_tree_bin(seqs, units, T, B, 1)
    seg, ends = jnp.asarray(m.arrays["tree_segment_ids"]), jnp.asarray(m.arrays["tree_key_ends"])
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    mask = self_attention_mask(B, T, seg, ends)

    def loss(f, q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v)))

    flash = lambda q, k, v: reference_flash_attention(q, k, v, seg, key_ends=ends, block_k=32)  # noqa: E731
    blocked = lambda q, k, v: causal_attention(q, k, v, mask)  # noqa: E731
    np.testing.assert_allclose(flash(q, k, v), blocked(q, k, v), atol=1e-5)
    for a, b in zip(jax.grad(lambda *x: loss(flash, *x), (0, 1, 2))(q, k, v),
                    jax.grad(lambda *x: loss(blocked, *x), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_budget_counts_trie_tokens():
    """A group whose plain tokens are far over the budget fits one micro-batch as a trie, and a
    trie longer than the longest row is split."""
    prompt = list(range(1, 41))
    seqs = [{"input_ids": np.array(prompt + [50 + j], np.int32)} for j in range(6)]  # 41 tokens each, 46 nodes
    for s in seqs:
        n = len(s["input_ids"])
        s.update(targets=np.zeros(n, np.int32), loss_mask=np.ones(n, np.float32),
                 behavior_logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32),
                 advantages=np.zeros(n, np.float32))
    [micro] = make_microbatches(seqs, max_tokens_per_microbatch=64, num_minibatches=1, buckets=(64,),
                                group_ids=[0] * 6, share_prefixes=True)
    assert len(micro) == 1 and int((np.asarray(micro[0].arrays["tree_segment_ids"]) > 0).sum()) == 46
    assert micro[0].arrays["tree_input_ids"].shape == (1, 64)
    assert sorted(micro[0].sequence_indices) == list(range(6))
    assert micro[0].arrays["input_ids"].shape == (8, 64)  # 6 plain rows of 41, rounded up to 8
    [plain] = make_microbatches(seqs, max_tokens_per_microbatch=64, num_minibatches=1, buckets=(64,),
                                group_ids=[0] * 6)
    assert len(plain) == 6
    # Longest row 44: 46 nodes do not fit; the group splits into tries of <= 44 nodes.
    units = trie_units(seqs, list(range(6)), [0] * 6, 44)
    assert [len(u[0]) for u in units] == [4, 2] and all(u[1].num_nodes <= 44 for u in units)


def test_trie_of_sequences():
    trie = PrefixTrie()
    assert trie.new_nodes([1, 2]) == 2
    trie.insert([1, 2, 3])
    assert trie.new_nodes([1, 2, 4]) == 1 and trie.new_nodes([1, 2]) == 0
    trie.insert([1, 2, 4])
    trie.insert([7])
    lay = trie.layout()
    assert trie.num_nodes == 5
    np.testing.assert_array_equal(lay["order"][trie.paths[1]], [0, 1, 3])
    np.testing.assert_array_equal(lay["end"][trie.paths[0]], [4, 4, 3])
    np.testing.assert_array_equal(lay["order"][trie.paths[2]], [4])


def test_config_and_engine_refusals():
    with pytest.raises(ValueError, match="share_prefixes"):
        TrainEngineConfig(share_prefixes=1)
    seqs = [{"input_ids": np.arange(4, dtype=np.int32), "loss_mask": np.ones(4, np.float32)}]
    with pytest.raises(ValueError, match="share_prefixes"):
        make_microbatches(seqs, max_tokens_per_microbatch=64, num_minibatches=1, share_prefixes=True,
                          agree_max=lambda x: x)
