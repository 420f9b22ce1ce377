"""run_evaluation with a tiny random model, the real tokenizer, real loader rows and a real RewardPool.

The reward (tests.evaluation_fixtures) judges a completion by its text alone, so every metric
is recomputed here from the JSONL by closed forms (math.comb for pass@k, a plain vote count
for maj@k) and compared with the report.
"""

import json
import math
import time
from collections import Counter

import jax
import numpy as np
import pytest

from areal_jax.data import DataConfig, PromptRow, build_prompt_loader, extract_last_boxed
from areal_jax.evaluation import EvalConfig, EvalReport, dataset_of, run_evaluation
from areal_jax.generation import generate
from areal_jax.models import ModelConfig, Transformer, init_params
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.reward import RewardPool, RewardPoolConfig
from tests.evaluation_fixtures import parity_answer, parity_reward
from tests.tokenizer_fixtures import build_tiny_tokenizer

REWARD = "tests.evaluation_fixtures:parity_reward"
EXTRACTOR = "tests.evaluation_fixtures:parity_answer"
FIELDS = {"query_id", "source", "dataset", "sample", "completion", "answer", "gold", "reward", "correct",
          "stop_reason", "num_tokens"}
TIMINGS = {"wall_s", "generation_s", "scoring_s", "tokens_per_s"}
ENGINE = dict(max_new_tokens=10, max_seq_len=96, num_slots=8, decode_chunk=4)
SAMPLED = EvalConfig(n_samples=4, temperature=1.0, ks=(4, 1, 2), reward=REWARD, answer_extractor=EXTRACTOR,
                     seed=3, **ENGINE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return cfg, init_params(cfg, jax.random.key(0), std=0.3)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """Two GSM8K-style JSONL files; gold answers alternate "0", "1"."""
    root = tmp_path_factory.mktemp("data")
    paths = []
    for name, count in (("alpha", 4), ("beta", 3)):
        path = root / f"{name}.jsonl"
        lines = [json.dumps({"question": f"{name} question {i}: what is {i} + {i}?", "answer": f"#### {i % 2}"})
                 for i in range(count)]
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def loader_rows(tokenizer, paths):
    loader = build_prompt_loader(DataConfig(paths=tuple(paths), num_epochs=1, shuffle=False, even_shards=False),
                                 tokenizer)
    return list(loader)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def sampled_run(tokenizer, model, data_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "samples.jsonl"
    rows = loader_rows(tokenizer, data_files)
    report = run_evaluation(model, tokenizer, rows, SAMPLED, out_path=out)
    return rows, report, read_jsonl(out)


def expected_metrics(lines, ks):
    """Metrics from JSONL lines by closed forms, recomputing answers and rewards from the text."""
    by_prompt = {}
    for line in lines:
        by_prompt.setdefault((line["source"]), []).append(line)
    out = {f"{m}@{k}": 0.0 for k in ks for m in ("pass", "maj")}
    accuracy = 0.0
    for samples in by_prompt.values():
        samples.sort(key=lambda s: s["sample"])
        answers = [parity_answer(s["completion"]) for s in samples]
        correct = [a is not None and a == s["gold"] for a, s in zip(answers, samples)]
        n, c = len(samples), sum(correct)
        accuracy += c / n
        for k in ks:
            out[f"pass@{k}"] += 1.0 - math.comb(n - c, k) / math.comb(n, k)
            votes = Counter(a for a in answers[:k] if a is not None)  # None casts no vote
            if votes:
                top = max(votes.values())
                winner = next(a for a in answers[:k] if a is not None and votes[a] == top)  # ties: first seen
                out[f"maj@{k}"] += float(winner == samples[0]["gold"])
    prompts = len(by_prompt)
    out = {key: value / prompts for key, value in out.items()}
    out.update(accuracy=accuracy / prompts, num_prompts=prompts, num_samples=len(lines),
               mean_reward=sum(parity_reward(s["completion"], s["gold"]) for s in lines) / len(lines),
               generated_tokens=sum(s["num_tokens"] for s in lines),
               truncated_fraction=sum(s["stop_reason"] == "length" for s in lines) / len(lines))
    return out


def assert_metrics_equal(actual, expected):
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, abs=1e-12), key


def test_jsonl_has_one_line_per_sample_with_its_fields(sampled_run, tokenizer):
    rows, report, lines = sampled_run
    assert len(lines) == len(rows) * SAMPLED.n_samples
    stop_ids = set(tokenizer.stop_token_ids)
    for index, line in enumerate(lines):
        assert set(line) == FIELDS
        row = rows[index // SAMPLED.n_samples]["row"]  # rows in order, then sample index
        assert line["sample"] == index % SAMPLED.n_samples
        assert (line["query_id"], line["source"], line["gold"]) == (row.query_id, row.source, row.answer)
        assert line["dataset"] == row.source.rsplit(":", 1)[0]
        assert line["answer"] == parity_answer(line["completion"])
        assert line["reward"] == parity_reward(line["completion"], line["gold"])
        assert line["correct"] == (line["reward"] >= 1.0)
        assert line["stop_reason"] in ("stop", "length")
        assert 1 <= line["num_tokens"] <= SAMPLED.max_new_tokens
        assert (line["num_tokens"] == SAMPLED.max_new_tokens) or line["stop_reason"] == "stop"
        # The completion text is the decoded tokens without special tokens: no stop token text.
        assert not any(tokenizer.decode([t]) in line["completion"] for t in stop_ids if tokenizer.decode([t]))
    # The data exercise every case of the vote: both answers, no answer, and a mix of verdicts.
    assert {line["answer"] for line in lines} == {"0", "1", None}
    assert 0 < sum(line["correct"] for line in lines) < len(lines)


def test_metrics_match_a_hand_computation_from_the_jsonl(sampled_run):
    rows, report, lines = sampled_run
    assert isinstance(report, EvalReport)
    assert report.config["ks"] == (1, 2, 4)  # sorted
    overall = {k: v for k, v in report.overall.items() if k not in TIMINGS}
    assert overall.pop("reward_failures") == 0
    expected = expected_metrics(lines, (1, 2, 4))
    assert_metrics_equal(overall, expected)
    # The data tell the metrics apart (a swapped or constant metric would not pass).
    assert len({expected[key] for key in ("pass@1", "pass@2", "pass@4", "maj@2", "maj@4")}) == 5
    assert report.overall["pass@1"] == pytest.approx(report.overall["accuracy"], abs=1e-12)
    assert report.overall["pass@1"] <= report.overall["pass@2"] <= report.overall["pass@4"]
    assert report.overall["generation_s"] + report.overall["scoring_s"] <= report.overall["wall_s"]
    assert report.overall["tokens_per_s"] == pytest.approx(
        report.overall["generated_tokens"] / report.overall["generation_s"])
    # The report's JSON round-trips.
    parsed = json.loads(report.to_json())
    assert parsed["overall"] == pytest.approx(report.overall) and set(parsed) == {"config", "overall", "per_dataset"}


def test_per_dataset_split_by_source_file(sampled_run, data_files):
    rows, report, lines = sampled_run
    assert set(report.per_dataset) == set(data_files)
    for path in data_files:
        subset = [line for line in lines if line["source"].startswith(path + ":")]
        assert_metrics_equal(report.per_dataset[path], expected_metrics(subset, (1, 2, 4)))
    assert report.per_dataset[data_files[0]]["num_prompts"] == 4
    assert report.per_dataset[data_files[1]]["num_prompts"] == 3
    # Sample-weighted: the overall mean reward is the sample-weighted mean of the datasets'.
    total = sum(d["mean_reward"] * d["num_samples"] for d in report.per_dataset.values())
    assert report.overall["mean_reward"] == pytest.approx(total / report.overall["num_samples"], abs=1e-12)


@pytest.fixture(scope="module")
def pool():
    config = RewardPoolConfig(num_workers=2, timeout_s=10.0, preload=("tests.evaluation_fixtures",))
    with RewardPool(config) as reward_pool:
        yield reward_pool


def test_reward_pool_scores_like_in_process(sampled_run, tokenizer, model, data_files, pool, tmp_path):
    _, report, lines = sampled_run
    out = tmp_path / "pool.jsonl"
    before = pool.stats().succeeded
    pooled = run_evaluation(model, tokenizer, loader_rows(tokenizer, data_files), SAMPLED, reward_pool=pool,
                            out_path=out)
    assert pool.stats().succeeded - before == len(lines)
    assert read_jsonl(out) == lines  # same seed: same samples, same rewards
    strip = lambda d: {k: v for k, v in d.items() if k not in TIMINGS}  # noqa: E731
    assert strip(pooled.overall) == strip(report.overall)
    assert pooled.per_dataset == report.per_dataset


def test_a_reward_past_its_deadline_scores_zero_and_is_counted(tokenizer, model, data_files, pool):
    rows = loader_rows(tokenizer, data_files)[:2]
    config = EvalConfig(reward="tests.evaluation_fixtures:hang_reward", reward_timeout_s=0.5, **ENGINE)
    start = time.monotonic()
    report = run_evaluation(model, tokenizer, rows, config, reward_pool=pool)
    assert time.monotonic() - start < 30  # the 60 s sleeps were cut short
    assert report.overall["reward_failures"] == 2
    assert report.overall["mean_reward"] == 0.0 and report.overall["accuracy"] == 0.0


def test_greedy_single_sample_matches_offline_generation(tokenizer, model, tmp_path):
    sources = ["sets/x.parquet[0]", "sets/x.parquet[1]", "sets/y.jsonl:7"]
    rows = []
    for i, source in enumerate(sources):
        messages = [{"role": "user", "content": f"Compute {i} times {i + 2}."}]
        row = PromptRow(query_id=f"q{i}", messages=messages, answer=str(i % 2), test_cases=None, task="math",
                        source=source)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        rows.append({"prompt_ids": np.asarray(ids, np.int32), "row": row})
    config = EvalConfig(reward=REWARD, **ENGINE)  # greedy, n=1, default "boxed" answers
    out = tmp_path / "greedy.jsonl"
    report = run_evaluation(Transformer(*model), tokenizer, rows, config, out_path=out)
    lines = read_jsonl(out)

    reference = generate(Transformer(*model), [r["prompt_ids"].tolist() for r in rows],
                         max_new_tokens=config.max_new_tokens, temperature=0.0,
                         stop_token_ids=tokenizer.stop_token_ids, num_slots=2)
    assert len(lines) == len(rows)
    for line, (completion,) in zip(lines, reference):
        assert line["completion"] == tokenizer.decode(completion.tokens.tolist(), skip_special_tokens=True)
        assert (line["num_tokens"], line["stop_reason"]) == (len(completion.tokens), completion.stop_reason)
        boxed = extract_last_boxed(line["completion"])
        assert line["answer"] == ((boxed.strip() or None) if boxed is not None else None)
    assert report.overall["pass@1"] == report.overall["accuracy"]
    assert report.overall["accuracy"] == pytest.approx(np.mean([line["correct"] for line in lines]), abs=1e-12)
    assert set(report.per_dataset) == {"sets/x.parquet", "sets/y.jsonl"}
    assert report.per_dataset["sets/x.parquet"]["num_prompts"] == 2


@pytest.mark.parametrize("overrides, culprit", [
    (dict(n_samples=0), "n_samples"),
    (dict(n_samples=2, temperature=1.0, ks=(1, 3)), "k=3 > n_samples=2"),
    (dict(ks=()), "ks"),
    (dict(ks=(0,)), "ks entry"),
    (dict(n_samples=2, ks=(1,)), "greedy"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=64, max_seq_len=64), "max_new_tokens"),
    (dict(reward=""), "reward"),
    (dict(reward_timeout_s=0.0), "reward_timeout_s"),
    (dict(correct_threshold=float("nan")), "correct_threshold"),
    (dict(answer_extractor="last number"), "answer_extractor"),
    (dict(num_slots=True), "num_slots"),
])
def test_bad_config_names_the_culprit(overrides, culprit):
    with pytest.raises(ValueError, match=culprit.replace("(", r"\(")):
        EvalConfig(**overrides)


def test_config_normalizes_ks():
    assert EvalConfig(n_samples=8, temperature=0.7, ks=[8, 1, 4, 1]).ks == (1, 4, 8)


def test_problems_are_reported_before_generation(tokenizer, model, data_files):
    rows = loader_rows(tokenizer, data_files)
    too_long = EvalConfig(reward=REWARD, max_new_tokens=4, max_seq_len=8)
    with pytest.raises(ValueError, match=r"row 0 \(.*alpha.jsonl:1\).*max_seq_len=8"):
        run_evaluation(model, tokenizer, rows, too_long)
    with pytest.raises(ValueError, match="no_such_reward"):
        run_evaluation(model, tokenizer, rows, EvalConfig(reward="no_such_reward", **ENGINE))
    with pytest.raises(ValueError, match="no rows"):
        run_evaluation(model, tokenizer, [], EvalConfig(reward=REWARD, **ENGINE))
    forever = build_prompt_loader(DataConfig(paths=tuple(data_files)), tokenizer)
    with pytest.raises(ValueError, match="num_epochs"):
        run_evaluation(model, tokenizer, forever, EvalConfig(reward=REWARD, **ENGINE))


@pytest.mark.parametrize("source, dataset", [
    ("data/gsm8k.jsonl:12", "data/gsm8k.jsonl"),
    ("/abs/math/test-00000.parquet[3]", "/abs/math/test-00000.parquet"),
    ("hf_dir[0]", "hf_dir"),
    ("C:/odd:name.jsonl:5", "C:/odd:name.jsonl"),
    ("no-suffix", "no-suffix"),
])
def test_dataset_of_strips_the_row_suffix(source, dataset):
    assert dataset_of(source) == dataset
