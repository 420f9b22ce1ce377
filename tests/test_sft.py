"""SFT: packed batches, completion-only loss (packed == unpacked) on the RL trainer's engine, training to
100% on a few examples."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import forward, init_params
from areal_jax.packing import unpack
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.tokenizer_builder import build_tokenizer, task_model_config
from areal_jax.data import SFTExample
from areal_jax.evaluation.held_out import GreedyAccuracy, evaluate_accuracy, sample_rewards
from areal_jax.ppo import token_logprobs
from areal_jax.trainer.config import TrainEngineConfig
from areal_jax.trainer.optimizer import OptimizerConfig, build_optimizer, learning_rate_schedule
from areal_jax.trainer.sft import (
    PackedBatches,
    SFTConfig,
    packed_eval_batches,
    run_sft,
    sequence_arrays,
    sft_microbatch,
    sft_objective,
)
from areal_jax.trainer.train_step import JaxTrainEngine

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def completion_loss(params, cfg, batch, **forward_kw):
    """The reference: token-mean negative log-likelihood of the trained tokens of a packed batch, by
    the plain decoder (no engine); (loss, trained tokens)."""
    logits, _ = forward(params, cfg, batch["input_ids"], batch.get("positions"), batch.get("segment_ids"),
                        **forward_kw)
    mask = batch["loss_mask"].astype(jnp.float32)
    n = jnp.sum(mask)
    return -jnp.sum(token_logprobs(logits, batch["targets"]) * mask) / jnp.maximum(n, 1.0), n


def _random_examples(rng, n, vocab=50):
    return [(rng.integers(1, vocab, rng.integers(1, 9)), rng.integers(1, vocab, rng.integers(1, 9)))
            for _ in range(n)]


def test_sequence_arrays_shift_and_mask():
    arrays = sequence_arrays([5, 6, 7], [8, 9])
    np.testing.assert_array_equal(arrays["input_ids"], [5, 6, 7, 8])
    np.testing.assert_array_equal(arrays["targets"], [6, 7, 8, 9])
    np.testing.assert_array_equal(arrays["loss_mask"], [0, 0, 1, 1])  # targets 8 and 9 are the completion
    with pytest.raises(ValueError, match="non-empty"):
        sequence_arrays([], [1])


def test_packed_batches_cover_each_example_once_per_epoch():
    rng = np.random.default_rng(0)
    examples = _random_examples(rng, 57)
    batches = PackedBatches(examples, rows=3, max_len=16, seed=1)
    seen = []
    while batches.epoch < 2 or batches._pending:  # stop at an epoch boundary, after at least two
        batch = next(batches)
        for key in ("input_ids", "targets", "loss_mask", "segment_ids", "positions"):
            assert batch[key].shape == (3, 16)
        groups, start = [], 0
        for r in range(3):
            k = int(batch["segment_ids"][r].max())
            groups.append(list(range(start, start + k)))
            start += k
        for seq in unpack(batch, groups, keys=["input_ids", "targets", "loss_mask"]):
            seen.append((tuple(seq["input_ids"]), tuple(seq["targets"]), tuple(seq["loss_mask"])))
    expected = []
    for p, c in examples:
        a = sequence_arrays(p, c)
        expected.append((tuple(a["input_ids"]), tuple(a["targets"]), tuple(a["loss_mask"])))
    assert sorted(seen) == sorted(expected * batches.epoch)
    # Tokens are packed densely: padding only where the next sequence did not fit.
    assert np.mean(batch["segment_ids"] > 0) > 0.5


def test_too_long_example_is_rejected():
    with pytest.raises(ValueError, match="example 1 .*max_len"):
        PackedBatches([([1, 2], [3]), ([1] * 10, [2] * 10)], rows=2, max_len=16)


@pytest.mark.parametrize("kwargs, culprit", [
    ({"steps": 0}, "steps"), ({"warmup_steps": 20, "steps": 10}, "warmup_steps"), ({"lr": 0.0}, "lr"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"), ({"rows_per_step": 0}, "rows_per_step"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio"), ({"eval_every": -1}, "eval_every"), ({"eval_from": -2}, "eval_from"),
    ({"stop_accuracy": 1.5, "eval_every": 10}, "stop_accuracy"), ({"stop_accuracy": 0.5}, "eval_every > 0"),
    ({"steps": 100, "eval_every": 20, "eval_from": 101}, "no validation check"),
    ({"val_every": 2}, "SFTConfig.val_every needs held-out files"), ({"paths": "a.jsonl"}, "SFTConfig.paths"),
])
def test_config_validation_names_the_culprit(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        SFTConfig(**kwargs)


@pytest.mark.parametrize("steps, warmup", [(10, 10), (10, 0), (10, 3), (1, 1)])
def test_schedule_warms_up_to_the_peak_and_decays_to_the_floor(steps, warmup):
    cfg = SFTConfig(steps=steps, warmup_steps=warmup, lr=1e-2, min_lr_ratio=0.1)
    lr = [float(learning_rate_schedule(cfg.optimizer_config())(s)) for s in range(steps + 1)]
    assert lr[warmup] == pytest.approx(1e-2, rel=1e-6)
    assert all(a <= b + 1e-12 for a, b in zip(lr[:warmup], lr[1:warmup + 1]))  # rising warm-up
    if warmup < steps:
        assert lr[steps] == pytest.approx(1e-3, rel=1e-6)
        assert all(a >= b - 1e-12 for a, b in zip(lr[warmup:], lr[warmup + 1:]))  # then decaying


def test_sft_updates_with_the_rl_trainers_optimizer():
    """SFT's steps are AdamW steps of trainer/optimizer.py (the RL trainer's) with SFTConfig's fields:
    the weights after SFT equal plain gradient steps of the completion loss through `build_optimizer`
    of the OptimizerConfig written out by hand, and the logged lr is that schedule's."""
    cfg = task_model_config(vocab_size=50, **TINY)
    params = init_params(cfg, jax.random.key(1), std=0.2)
    examples = _random_examples(np.random.default_rng(11), 10)
    sft = SFTConfig(steps=4, rows_per_step=2, max_len=24, lr=3e-3, warmup_steps=2, min_lr_ratio=0.2, weight_decay=0.05,
                    max_grad_norm=0.5, log_every=1, seed=3)
    trained, metrics = run_sft(cfg, params, examples, sft, progress=False,
                               engine=TrainEngineConfig(scan_layers=False, attention_impl="reference"))
    assert sft_objective().name == "sft"
    opt_cfg = OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="cosine", total_steps=4, min_lr_ratio=0.2,
                              weight_decay=0.05, b2=0.98, max_grad_norm=0.5)
    assert sft.optimizer_config() == opt_cfg
    optimizer = build_optimizer(opt_cfg)
    want, state = jax.tree.map(jnp.asarray, params), None
    state = optimizer.init(want)
    batches = PackedBatches(examples, rows=2, max_len=24, seed=3)
    for _ in range(4):
        batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
        grads = jax.grad(lambda p: completion_loss(p, cfg, batch, scan_layers=False,
                                                   attention_impl="reference")[0])(want)
        updates, state = optimizer.update(grads, state, want)
        want = jax.tree.map(lambda p, u: p + u, want, updates)
    # Adam normalizes each update, so the jitted step's float rounding in tiny gradients shows up to
    # ~1e-5; one update of another optimizer or schedule moves weights by ~lr = 3e-3.
    for got, ref, start in zip(jax.tree.leaves(trained), jax.tree.leaves(want), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=3e-5)
        assert np.abs(np.asarray(ref) - np.asarray(start)).max() > 3e-3  # SFT moved them
    schedule = learning_rate_schedule(opt_cfg)
    assert [m["lr"] for m in metrics] == pytest.approx([float(schedule(s)) for s in range(4)], rel=1e-6)
    assert metrics[0]["lr"] == pytest.approx(3e-3 / 2, rel=1e-6)  # the first update already moves the weights


def test_packed_loss_equals_per_sequence_reference():
    cfg = task_model_config(vocab_size=50, **TINY)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(3)
    examples = _random_examples(rng, 11)
    batch = next(PackedBatches(examples, rows=4, max_len=24, seed=0))
    # The training engine's loss of the batch as SFT runs it: one micro-batch, the completion loss.
    trainer = JaxTrainEngine(cfg, params, OptimizerConfig(), sft_objective())
    _, stats = trainer.minibatch_gradients([sft_microbatch(batch)])
    packed_loss, n = stats["loss"], stats["n_valid"]

    # Reference: each packed sequence alone, NumPy log-softmax, token mean over the batch.
    groups, start = [], 0
    for r in range(4):
        k = int(batch["segment_ids"][r].max())
        groups.append(list(range(start, start + k)))
        start += k
    total, count = 0.0, 0.0
    for seq in unpack(batch, groups):
        logits, _ = forward(params, cfg, jnp.asarray(seq["input_ids"])[None])
        logits = np.asarray(logits[0], np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = logp[np.arange(len(seq["targets"])), seq["targets"]]
        total += -np.sum(picked * seq["loss_mask"])
        count += np.sum(seq["loss_mask"])
    assert float(n) == count
    np.testing.assert_allclose(float(packed_loss), total / count, rtol=1e-5)


def test_packing_and_completion_mask_match_a_hand_computed_layout():
    a = SFTExample(ids=[10, 11, 12, 13, 14], trained=[0, 0, 1, 0, 1])  # two trained spans (a chat's turns)
    b = ([20, 21], [22, 23])  # a (prompt, completion) pair
    c = SFTExample(ids=[30, 31, 32], trained=[0, 1, 1])
    (batch,) = packed_eval_batches([a, b, c], rows=2, max_len=8)
    # First-fit-decreasing over the input lengths 4, 3, 2 in rows of 8: a and b share row 0, c opens row 1.
    expected = {
        "input_ids": [[10, 11, 12, 13, 20, 21, 22, 0], [30, 31, 0, 0, 0, 0, 0, 0]],
        "targets": [[11, 12, 13, 14, 21, 22, 23, 0], [31, 32, 0, 0, 0, 0, 0, 0]],
        "loss_mask": [[0, 1, 0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]],
        "segment_ids": [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0, 0, 0]],
        "positions": [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 0, 0, 0, 0, 0, 0]],
    }
    assert set(batch) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(batch[key], value, err_msg=key)
    with pytest.raises(ValueError, match="at least one trained token"):
        SFTExample(ids=[1, 2], trained=[1, 1])  # token 0 has nothing before it to predict it


def _reference_loss(params, cfg, examples) -> float:
    """Token-mean loss over the trained targets of every example, each run alone, NumPy log-softmax."""
    total, count = 0.0, 0.0
    for e in examples:
        logits, _ = forward(params, cfg, jnp.asarray(e.ids[:-1])[None])
        logits = np.asarray(logits[0], np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        picked = logp[np.arange(e.ids.size - 1), e.ids[1:]]
        total -= np.sum(picked * e.trained[1:])
        count += np.sum(e.trained[1:])
    return total / count


def test_per_step_records_and_validation_loss():
    cfg = task_model_config(vocab_size=50, **TINY)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(5)
    examples = [SFTExample(ids, np.arange(ids.size) % 3 == 2) for ids in (rng.integers(1, 50, n) for n in
                                                                            rng.integers(4, 12, 16))]
    held_out = [SFTExample.from_pair(p, c) for p, c in _random_examples(rng, 7)]
    sft = SFTConfig(steps=5, rows_per_step=2, max_len=24, warmup_steps=1, log_every=2, val_every=2, lr=3e-3,
                    eval_paths=("held_out.jsonl",))  # run_sft takes the examples: the paths are the job's
    records = []
    trained, metrics = run_sft(cfg, params, examples, sft, progress=False, val_examples=held_out,
                               on_step=lambda step, m: records.append((step, m)))
    assert [step for step, _ in records] == [1, 2, 3, 4, 5]  # one record per step, in order
    assert [step for step, m in records if "val_loss" in m] == [2, 4, 5]  # every val_every steps, and the last
    assert all(set(m) >= {"loss", "tokens", "grad_norm", "lr"} for _, m in records)
    # A logged entry's loss is the mean of its steps' losses.
    assert [m["step"] for m in metrics] == [2, 4, 5]
    np.testing.assert_allclose(metrics[0]["loss"], np.mean([m["loss"] for _, m in records[:2]]), rtol=1e-6)
    np.testing.assert_allclose(records[-1][1]["val_loss"], _reference_loss(trained, cfg, held_out), rtol=1e-5)
    assert metrics[-1]["val_loss"] == records[-1][1]["val_loss"]


@pytest.fixture
def six_problems(tokenizer):
    """(examples, prompt rows, model config, random params) of 6 arithmetic problems, a tiny model."""
    items = ar.problems(ar.ArithmeticConfig(min_operands=2, max_operands=3), "train", 6, seed=7)
    cfg = task_model_config(**TINY)
    return ar.sft_examples(tokenizer, items), list(ar.prompt_rows(tokenizer, items)), cfg, init_params(
        cfg, jax.random.key(0))


def test_sft_overfits_a_handful_of_problems(tokenizer, six_problems):
    examples, rows, cfg, params = six_problems
    sft = SFTConfig(steps=120, rows_per_step=2, max_len=96, lr=1e-2, warmup_steps=10, log_every=20, seed=0)
    trained, metrics = run_sft(cfg, params, examples, sft, progress=False)
    assert [m["step"] for m in metrics] == [20, 40, 60, 80, 100, 120]
    assert metrics[-1]["loss"] < 0.05 < metrics[0]["loss"]
    assert all(m["tokens"] > 0 for m in metrics)
    assert evaluate_accuracy(cfg, trained, rows, tokenizer, max_new_tokens=32, slots=8) == 1.0
    # Sampling several completions per prompt: shape [R, n], all correct for a memorized set.
    rewards = sample_rewards(cfg, trained, rows, tokenizer, max_new_tokens=32, n=2, temperature=0.3, seed=1)
    assert rewards.shape == (6, 2) and rewards.mean() > 0.9
    # The input params were not consumed (the step donates only its own copy).
    np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(init_params(cfg, jax.random.key(0))["embed"]))


def test_validation_checks_run_where_configured_and_the_first_to_reach_the_target_stops_sft():
    """Control flow of the accuracy stop with a scripted validation curve (the real probe below)."""
    rng = np.random.default_rng(0)
    cfg = task_model_config(**TINY)
    params = init_params(cfg, jax.random.key(0))
    examples = _random_examples(rng, 12)
    curve = iter([0.1, 0.45, 0.5, 0.9])
    seen = []

    def validate(p):
        seen.append(p["embed"].shape)
        return next(curve)

    sft = SFTConfig(steps=20, rows_per_step=2, max_len=32, warmup_steps=2, log_every=5, eval_every=3, eval_from=4,
                    stop_accuracy=0.5)
    _, metrics = run_sft(cfg, params, examples, sft, progress=False, validate=validate)
    # Checks at steps 6, 9, 12 (multiples of 3 from step 4); 12 reaches 0.5 and ends the run.
    checks = [(m["step"], m["val_accuracy"]) for m in metrics if "val_accuracy" in m]
    assert checks == [(6, 0.1), (9, 0.45), (12, 0.5)] and len(seen) == 3
    assert [m["step"] for m in metrics] == [5, 6, 9, 10, 12] and metrics[-1]["stopped_early"] is True
    # Without a target every check runs and SFT runs all its steps.
    curve = iter([0.1, 0.45, 0.5, 0.9, 0.95, 0.97])
    _, metrics = run_sft(cfg, params, examples, dataclasses.replace(sft, stop_accuracy=0.0), progress=False,
                         validate=validate)
    assert [m["step"] for m in metrics if "val_accuracy" in m] == [6, 9, 12, 15, 18]
    assert metrics[-1]["step"] == 20 and "stopped_early" not in metrics[-1]
    with pytest.raises(ValueError, match="validate"):
        run_sft(cfg, params, examples, sft, progress=False)


def test_sft_stops_once_greedy_accuracy_on_validation_rows_reaches_the_target(tokenizer, six_problems):
    """The real probe: one engine across checks; the run ends at the first check with every row right."""
    examples, rows, cfg, params = six_problems
    probe = GreedyAccuracy(cfg, rows, tokenizer, max_new_tokens=32, slots=4)
    sft = SFTConfig(steps=160, rows_per_step=2, max_len=96, lr=1e-2, warmup_steps=10, log_every=20, seed=0,
                    eval_every=10, eval_from=30, stop_accuracy=1.0)
    trained, metrics = run_sft(cfg, params, examples, sft, progress=False, validate=probe)
    checks = [m["val_accuracy"] for m in metrics if "val_accuracy" in m]
    assert metrics[-1]["stopped_early"] and metrics[-1]["step"] < 160
    assert checks[-1] == 1.0 and all(a < 1.0 for a in checks[:-1])
    assert probe.calls == len(checks) and probe.engine.version == probe.calls  # one engine, weights swapped in
    # The probe scores as the one-off evaluation does.
    assert evaluate_accuracy(cfg, trained, rows, tokenizer, max_new_tokens=32, slots=4) == 1.0
    assert probe(params) == evaluate_accuracy(cfg, params, rows, tokenizer, max_new_tokens=32, slots=4) == 0.0


def test_sft_on_a_sharded_train_mesh_equals_sft_on_one_device(tokenizer, six_problems):
    """The same SFT on a (fsdp=2, tensor=2) train mesh of fake devices: weights, optimizer state and
    batch rows sharded, the same losses and weights as on one device, and whole weights returned
    (what validation and the RL stage take)."""
    from areal_jax.parallel.meshes import MeshConfig, build_meshes

    examples, _, cfg, params = six_problems
    sft = SFTConfig(steps=12, rows_per_step=2, max_len=96, lr=1e-2, warmup_steps=2, log_every=4, seed=0,
                    eval_every=6, eval_from=6)
    mesh = build_meshes(MeshConfig(num_generation_devices_per_host=4, train_tensor=2), jax.devices()[:8]).train
    assert dict(mesh.shape) == {"fsdp": 2, "expert": 1, "tensor": 2}
    seen = []

    def probe(p):  # validation sees whole weights on one device
        leaf = p["layers"]["wq"]
        seen.append(len(leaf.sharding.device_set))
        return 0.0

    one, m_one = run_sft(cfg, params, examples, sft, progress=False, validate=probe, val_examples=examples[:3])
    sharded, m_mesh = run_sft(cfg, params, examples, sft, progress=False, validate=probe, mesh=mesh,
                              val_examples=examples[:3])
    assert seen == [1, 1, 1, 1]
    np.testing.assert_allclose([m["loss"] for m in m_mesh], [m["loss"] for m in m_one], rtol=1e-4)
    np.testing.assert_allclose(m_mesh[-1]["val_loss"], m_one[-1]["val_loss"], rtol=1e-4)
    assert [m["tokens"] for m in m_mesh] == [m["tokens"] for m in m_one]
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one)):
        assert len(a.sharding.device_set) == 1
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
