"""The generation engine's record of MoE routing (routing replay, issue 29): what it records, that
the record survives weight swaps, preemption and multi-turn episodes as per-token history, how it
packs, and that the trainer replaying it reproduces the behaviour log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

from areal_jax.generation import EngineConfig, GenerationEngine, SamplingParams
from areal_jax.models import forward, init_params, moe
from areal_jax.packing import ffd_allocate, pack_sequences, unpack
from areal_jax.ppo import AdvantageConfig
from areal_jax.rollout.types import Trajectory, TrajectoryGroup
from areal_jax.tasks.tokenizer_builder import task_model_config
from areal_jax.trainer.batching import build_sequences, make_microbatches
from areal_jax.trainer.optimizer import OptimizerConfig
from areal_jax.trainer.algorithm import ppo_objective, ppo_trainer
from areal_jax.trainer.config import PPOConfig, TrainEngineConfig
from areal_jax.trainer.programs import MOE_ROUTING_KEY, build_train_programs, train_program_specs
from areal_jax.workflows.multi_turn_math import Episode

# Layers 0 and 2 sparse, 1 dense (Qwen2-MoE's mlp_only_layers): the record holds L_moe = 2 layers.
_SPARSE = task_model_config(hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48, num_experts=8)
CFG = dataclasses.replace(_SPARSE, moe=dataclasses.replace(_SPARSE.moe, mlp_only_layers=(1,)))
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [4]]
BASE = dict(num_slots=3, max_seq_len=48, decode_chunk=4, prefill_buckets=(8, 16, 32, 48), reprefill_pack_width=24)


def _params(seed):
    return init_params(CFG, seed, std=0.3)


def _generate(params, *, swap=None, n=1, temperature=1.0, max_new_tokens=16, **config):
    engine = GenerationEngine((CFG, params), EngineConfig(**{**BASE, **config}))
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    handles = [engine.submit(p, sp, n=n, seed=i) for i, p in enumerate(PROMPTS)]
    if swap is not None:
        engine.step()  # first token from prefill + 4 decode steps, twice: 9 tokens under the old weights
        engine.step()
        engine.update_weights(swap, version=1)
    engine.run_until_idle()
    return engine, [(p, c) for p, h in zip(PROMPTS, handles) for c in h.result().completions]


def _trainer_routing(params, seq) -> np.ndarray:
    """The training forward's experts `[S, L_moe, k]` of one sequence (routing afresh, fp32)."""
    ids = jnp.asarray([seq])
    _, _, routing = forward(params, CFG, ids, segment_ids=jnp.ones_like(ids), return_routing=True)
    return np.asarray(moe.record(CFG, routing.experts))[0]


def _trajectory(prompt, c) -> Trajectory:
    return Trajectory(np.asarray(prompt, np.int32), c.tokens, c.logprobs, c.versions, 0.0, moe_routing=c.moe_routing)


def test_config_has_a_dense_layer_between_sparse_ones():
    assert CFG.sparse_layers == (True, False, True) and moe.sparse_layer_ids(CFG) == (0, 2)


def test_recorded_routing_is_the_trainers_topk_and_replaying_it_gives_the_behaviour_logprobs():
    """fp32 engine and trainer: every input token's recorded experts (prompt from the prefill,
    completion from decode steps) are the training forward's top-k, in order; the last token,
    never fed in, records zeros. Packed through Trajectory rows, the replay program's log-probs
    equal the behaviour log-probs."""
    params = _params(0)
    _, samples = _generate(params, n=2)
    for prompt, c in samples:
        seq = prompt + list(c.tokens)
        assert c.moe_routing.shape == (len(seq), 2, CFG.moe.num_experts_per_tok)
        assert c.moe_routing.dtype == np.uint8
        np.testing.assert_array_equal(c.moe_routing[:-1], _trainer_routing(params, seq)[:-1])
        assert not c.moe_routing[-1].any()
    rows = [_trajectory(p, c).training_row() for p, c in samples]
    groups = ffd_allocate([len(r["input_ids"]) for r in rows], 64)
    packed = pack_sequences(rows, groups, 64)
    assert packed[MOE_ROUTING_KEY].dtype == np.uint8
    programs = build_train_programs(CFG, TrainEngineConfig(moe_routing="replay"), ppo_objective(PPOConfig(temperature=1.0)),
                                    optax.sgd(0.1))
    keys = ("input_ids", "targets", "segment_ids", "positions", MOE_ROUTING_KEY)
    logp = np.asarray(programs.logprobs(params, {k: jnp.asarray(packed[k]) for k in keys}))
    mask = packed["loss_mask"] > 0
    np.testing.assert_allclose(logp[mask], packed["behavior_logprobs"][mask], atol=1e-4)


def test_routing_recorded_before_a_swap_stays_the_old_policys():
    """An interrupting swap after 9 tokens: input tokens fed before it (prompt and 8 completion
    tokens) keep the old weights' experts, later ones carry the new weights' (over the history
    re-prefilled under them), like the per-token versions."""
    old, new = _params(1), _params(2)
    engine, samples = _generate(old, swap=new)
    assert engine.stats().weight_swaps == 1
    changed = 0
    for prompt, c in samples:
        np.testing.assert_array_equal(c.versions, [0] * 9 + [1] * 7)
        seq = prompt + list(c.tokens)
        before = len(prompt) + 8  # input tokens fed under the old weights
        under_old, under_new = _trainer_routing(old, seq), _trainer_routing(new, seq)
        np.testing.assert_array_equal(c.moe_routing[:before], under_old[:before])
        np.testing.assert_array_equal(c.moe_routing[before:-1], under_new[before:-1])
        changed += int((under_old[:before] != under_new[:before]).any())
    assert changed  # the record keeps experts the new weights would not choose


def test_preempted_samples_keep_their_routing():
    """A paged pool too small for every sample: preempted samples resume by re-prefill, and their
    records (greedy) equal an unconstrained dense-cache run's."""
    params = _params(3)
    _, want = _generate(params, temperature=0.0, max_new_tokens=30, kv_layout="dense")
    engine, got = _generate(params, temperature=0.0, max_new_tokens=30, kv_layout="paged", page_size=8,
                            kv_pool_pages=6)
    assert engine.stats().preempted_samples > 0
    for (_, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.moe_routing, b.moe_routing)


def test_a_dense_model_records_nothing():
    cfg = task_model_config(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48)
    engine = GenerationEngine((cfg, init_params(cfg, 0, std=0.3)), EngineConfig(**BASE))
    handle = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=6), seed=0)
    engine.run_until_idle()
    (c,) = handle.result().completions
    assert c.moe_routing is None and MOE_ROUTING_KEY not in _trajectory([1, 2, 3], c).training_row()


@pytest.mark.parametrize("num_experts", [8, 300])
def test_packing_round_trips_the_record(num_experts):
    """Records of different lengths packed into rows and unpacked: the same arrays, in the record
    dtype (uint8 up to 256 experts, else uint16)."""
    cfg = task_model_config(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, num_experts=num_experts)
    dtype = np.dtype(moe.record_dtype(cfg))
    assert dtype == (np.uint8 if num_experts <= 256 else np.uint16)
    rng = np.random.default_rng(0)
    rows = []
    for P, G in [(3, 5), (7, 2), (1, 9)]:
        routing = rng.integers(0, num_experts, (P + G, 2, 2)).astype(dtype)
        t = Trajectory(np.arange(1, P + 1), np.arange(G), np.zeros(G, np.float32), np.zeros(G, np.int32), 1.0,
                       moe_routing=routing)
        rows.append(t.training_row())
    groups = [[0, 1], [2]]
    packed = pack_sequences(rows, groups, 20)
    assert packed[MOE_ROUTING_KEY].shape == (2, 20, 2, 2) and packed[MOE_ROUTING_KEY].dtype == dtype
    for row, back in zip([rows[i] for g in groups for i in g], unpack(packed, groups), strict=True):
        np.testing.assert_array_equal(back[MOE_ROUTING_KEY], row[MOE_ROUTING_KEY])
    replay = moe.replay_layers(cfg, jnp.asarray(packed[MOE_ROUTING_KEY]))  # [L, R, T, k]
    np.testing.assert_array_equal(np.asarray(replay[1]), packed[MOE_ROUTING_KEY][:, :, 1].astype(np.int32))


class _PeerWithThreeBins:
    """`agree_max` as seen by a process whose peer's minibatch needs three bins of 16-token rows.
    `_plan_bins` agrees each bin's row length T, then its row count R; a T of 0 from every process
    ends the minibatch, so the peer must stop asking for bins (a peer that never does would loop)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, n: int) -> int:
        bin_index, is_row_count = divmod(self.calls, 2)
        self.calls += 1
        if is_row_count:
            return max(n, 1)
        return max(n, 16) if bin_index < 3 else n


def test_trainer_micro_batches_carry_the_record_padding_ones_too():
    """Through build_sequences and make_microbatches (with a peer holding more micro-batches, so
    all-padding ones are added): every micro-batch's record is `[R, T, L_moe, k]` in its dtype."""
    rng = np.random.default_rng(1)
    groups = []
    for q, (P, G) in enumerate([(3, 5), (4, 6)]):
        trajectories = tuple(Trajectory(np.arange(1, P + 1), np.arange(G), np.zeros(G, np.float32), np.zeros(G, np.int32),
                                        float(i), moe_routing=rng.integers(0, 8, (P + G, 2, 2)).astype(np.uint8))
                             for i in range(2))
        groups.append(TrajectoryGroup(str(q), trajectories, 0))
    seqs = build_sequences(groups, AdvantageConfig())
    (minibatch,) = make_microbatches(seqs, max_tokens_per_microbatch=32, num_minibatches=1, buckets=(16, 32),
                                     agree_max=_PeerWithThreeBins(), agree_sum=lambda n: n)
    assert len(minibatch) == 3 and minibatch[-1].rows == ()
    for micro in minibatch:
        record = micro.arrays[MOE_ROUTING_KEY]
        assert record.shape == (*micro.arrays["input_ids"].shape, 2, 2) and record.dtype == np.uint8


def test_planned_replay_programs_take_the_record():
    """The ahead-of-time specs of a replaying MoE trainer give every forward the record `[R, T,
    L_moe, k]` (uint8), and they lower; a recomputing one gives it to the loss forward alone (to
    measure how often its routing differs)."""
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:1])
    engine = dict(max_tokens_per_microbatch=64, row_buckets=(32, 64))
    objective = ppo_objective(PPOConfig())
    replay = train_program_specs(CFG, TrainEngineConfig(moe_routing="replay", **engine), objective, OptimizerConfig(),
                                 mesh)
    recompute = train_program_specs(CFG, TrainEngineConfig(**engine), objective, OptimizerConfig(), mesh)
    for spec in (s for s in replay if s.name.startswith(("train/grad", "train/logprobs"))):
        batch = spec.args[-2] if spec.name.startswith("train/grad") else spec.args[-1]
        R, T = batch["input_ids"].shape
        assert batch[MOE_ROUTING_KEY].shape == (R, T, 2, 2) and batch[MOE_ROUTING_KEY].dtype == jnp.uint8
    for spec in (s for s in recompute if s.name.startswith(("train/grad", "train/logprobs"))):
        batch = spec.args[-2] if spec.name.startswith("train/grad") else spec.args[-1]
        assert (MOE_ROUTING_KEY in batch) == spec.name.startswith("train/grad")
    logprobs = next(s for s in replay if s.name.startswith("train/logprobs"))
    logprobs.lower()


def test_a_multi_turn_episode_keeps_each_tokens_first_routing():
    """Two turns: the second request re-prefills the whole context (prompt, answer 1, feedback);
    the episode keeps turn 1's rows for the tokens turn 1 fed in, and takes turn 2's for the rest
    (answer 1's last token, the feedback, answer 2), so the trajectory's record covers every token."""
    P, G1, F, G2 = 3, 4, 2, 5
    first = np.full((P + G1, 2, 2), 1, np.uint8)
    first[-1] = 0  # answer 1's last token: never fed in by turn 1
    second = np.full((P + G1 + F + G2, 2, 2), 2, np.uint8)
    second[-1] = 0
    episode = Episode()
    episode.add_generated(np.arange(G1), np.zeros(G1), np.zeros(G1, np.int32), first)
    episode.add_inserted([7] * F)
    episode.add_generated(np.arange(G2), np.zeros(G2), np.ones(G2, np.int32), second)
    t = episode.trajectory(np.arange(1, P + 1), 1.0, "stop")
    assert t.moe_routing.shape == (P + G1 + F + G2, 2, 2)
    np.testing.assert_array_equal(t.moe_routing[:P + G1 - 1], first[:-1])
    np.testing.assert_array_equal(t.moe_routing[P + G1 - 1:], second[P + G1 - 1:])


def _step_metrics(params, samples, **engine):
    rows = [_trajectory(p, c) for p, c in samples]
    seqs = build_sequences([TrajectoryGroup("0", tuple(rows), 0)], AdvantageConfig())
    minibatches = make_microbatches(seqs, max_tokens_per_microbatch=64, num_minibatches=1, buckets=(32, 64))
    trainer = ppo_trainer(CFG, params, OptimizerConfig(), PPOConfig(temperature=1.0),
                          engine=TrainEngineConfig(max_tokens_per_microbatch=64, **engine))
    return trainer.train_step(minibatches)


@pytest.mark.parametrize("mode", ["recompute", "replay"])
def test_an_fp32_step_reports_no_route_mismatch_and_no_behaviour_gap(mode):
    """fp32 engine and trainer: the step's loss forward picks the recorded experts on every valid
    (token, sparse layer) pair and reproduces the behaviour log-probs, in either mode; a bf16
    trainer's own top-k departs from the fp32 engine's somewhere (reported, replay or not)."""
    params = _params(0)
    _, samples = _generate(params, n=2)
    metrics = _step_metrics(params, samples, moe_routing=mode)
    assert metrics["moe_route_mismatch"] == 0.0
    assert metrics["behav_logp_gap"] < 1e-4
    bf16 = _step_metrics(params, samples, moe_routing=mode, compute_dtype="bfloat16")
    assert bf16["moe_route_mismatch"] > 0.0 and bf16["behav_logp_gap"] > metrics["behav_logp_gap"]
