"""Generative judges (areal_jax/reward/judge.py) on a tiny random judge model saved locally: the
config's checks, regex and logprob parsing against direct computations, malformed outputs and
deadlines (scored 0, counted), and a judge engine that policy weight pushes never reach."""

import dataclasses
import math
import shutil

import jax
import numpy as np
import pytest

from areal_jax.api import SamplingParams
from areal_jax.generation.config import EngineConfig
from areal_jax.generation.engine import GenerationEngine
from areal_jax.models import ModelConfig, init_params, save_params
from areal_jax.models.hf_io import load_params
from areal_jax.models.transformer import forward
from areal_jax.reward.judge import Judge, JudgeConfig, Verdict, parse_regex_score
from tests.tokenizer_fixtures import build_tiny_tokenizer

CFG = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, family="qwen2", qkv_bias=True)
PAIRS = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "41"), ("Name a colour.", "blue, I think")]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    save_params(init_params(CFG, 3, std=0.3), CFG, root / "judge")
    for f in build_tiny_tokenizer(root / "tok", "chatml").iterdir():
        shutil.copy(f, root / "judge" / f.name)
    return root / "judge"


def test_config_is_checked_on_construction():
    ok = JudgeConfig(model="m")
    assert ok.choice_values == (1.0, 0.0)
    assert JudgeConfig(model="m", choices=tuple(str(i) for i in range(1, 11))).choice_values == tuple(range(1, 11))
    for bad, match in [(dict(model=""), "model"), (dict(parse="vote"), "parse"),
                       (dict(template="{question} only"), "answer"), (dict(template="{answer} {grade}"), "only"),
                       (dict(pattern="(unclosed"), "regular expression"), (dict(choices=("Yes", "Yes")), "distinct"),
                       (dict(values=(1.0,)), "1 entries for 2"), (dict(timeout_s=0), "timeout_s"),
                       (dict(dtype="int8"), "dtype"), (dict(max_new_tokens=0), "max_new_tokens")]:
        with pytest.raises(ValueError, match=match):
            JudgeConfig(**{"model": "m", **bad})


@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 7.0), ("I'd say 3, no, 8.5", 8.5), ("-2 points", -2.0), ("no number here", None), ("", None),
])
def test_regex_parse_takes_the_last_match(text, expected):
    assert parse_regex_score(text, r"(-?\d+(?:\.\d+)?)") == expected


def test_regex_parse_malformed_match_is_none():
    assert parse_regex_score("grade: A", r"grade: (\w)") is None  # matched, but not a number
    assert parse_regex_score("grade: 4", r"grade: \d") is None  # whole match "grade: 4" is no number
    assert parse_regex_score("4", r"\d") == 4.0


_FORWARD = jax.jit(lambda p, ids, seg: forward(p, CFG, ids, segment_ids=seg)[0])


def _next_logprobs(params, prompt):
    """The next token's log-probs after `prompt`, by the plain forward (one compile: padded to 128)."""
    ids, seg = np.zeros((1, 128), np.int32), np.zeros((1, 128), np.int32)
    ids[0, :len(prompt)], seg[0, :len(prompt)] = prompt, 1
    z = np.asarray(_FORWARD(params, ids, seg)[0, len(prompt) - 1], np.float64)
    return z - np.log(np.exp(z - z.max()).sum()) - z.max()


def test_logprob_judge_reads_the_choices_probabilities(judge_dir):
    _, params = load_params(judge_dir)
    for choices, values in [(("Yes", "No"), None), (tuple(str(i) for i in range(1, 6)), None),
                            (("good", "bad", "so-so"), (1.0, -1.0, 0.25))]:
        config = JudgeConfig(model=str(judge_dir), parse="logprob", choices=choices, values=values or (),
                             batch_size=2, timeout_s=600.0)  # 3 pairs: a full batch of 2, then one padded row
        judge = Judge(config)
        verdicts = judge.score(PAIRS)
        expected_values = np.asarray(config.choice_values)
        for (q, a), v in zip(PAIRS, verdicts):
            logp = _next_logprobs(params, judge.prompt_ids(q, a))
            first = [judge.tokenizer.encode(c, add_special_tokens=False)[0] for c in choices]
            p = np.exp(logp[first])
            assert v.failed is None
            assert v.score == pytest.approx(float(p @ expected_values / p.sum()), abs=1e-5)
        assert judge.stats.calls == 3 and judge.stats.failed == 0
    assert len({round(v.score, 6) for v in verdicts}) == 3  # the pairs' prompts differ, so do their scores


def test_logprob_choices_must_differ_in_their_first_token(judge_dir):
    with pytest.raises(ValueError, match="first token"):
        Judge(JudgeConfig(model=str(judge_dir), choices=("4", "42")))


def test_regex_judge_generates_on_its_engine_and_parses_the_text(judge_dir):
    _, params = load_params(judge_dir)
    judge = Judge(JudgeConfig(model=str(judge_dir), parse="regex", pattern=r"(\S)", max_new_tokens=5, batch_size=2,
                              timeout_s=600.0))  # no deadline in play on a loaded host
    try:
        verdicts = judge.score(PAIRS)
        for (q, a), v in zip(PAIRS, verdicts):  # greedy by hand, one full forward per token
            seq = judge.prompt_ids(q, a)
            out = []
            for _ in range(5):
                nxt = int(np.argmax(_next_logprobs(params, seq + out)))
                out.append(nxt)
                if nxt in judge.tokenizer.stop_token_ids:
                    break
            assert v.text == judge.tokenizer.decode(out, skip_special_tokens=True)
            value = parse_regex_score(v.text, r"(\S)")
            assert v == (Verdict(value, None, v.text) if value is not None else Verdict(0.0, "unparseable", v.text))
        # A pattern nothing matches: every verdict 0.0, each counted.
        strict = dataclasses.replace(judge.config, pattern=r"(SCORE=\d+)")
        judge.config = strict
        again = judge.score(PAIRS)
        assert [v.score for v in again] == [0.0] * 3 and {v.failed for v in again} == {"unparseable"}
        assert judge.stats.unparseable >= 3 and judge.stats.calls == 6
    finally:
        judge.close()


def test_a_judge_past_its_deadline_scores_zero_and_is_counted(judge_dir):
    """The same warm judge meets a generous deadline and misses a tiny one: the deadline, not a
    compile or a broken engine, is what fails the calls, and the judge scores as before after."""
    for parse in ("regex", "logprob"):
        judge = Judge(JudgeConfig(model=str(judge_dir), parse=parse, max_new_tokens=64, timeout_s=600.0))
        try:
            warm = judge.score(PAIRS)  # compiles the programs, well within the deadline
            assert all(v.failed != "timeout" for v in warm) and judge.stats.timeouts == 0
            judge.config = dataclasses.replace(judge.config, timeout_s=1e-4)
            verdicts = judge.score(PAIRS)  # compiled, but no forward finishes in 0.1 ms
            assert verdicts == [Verdict(0.0, "timeout")] * 3
            assert judge.stats.timeouts == 3 and judge.stats.failed == 3 + sum(v.failed is not None for v in warm)
            judge.config = dataclasses.replace(judge.config, timeout_s=600.0)
            assert judge.score(PAIRS) == warm  # late requests were aborted; the engine serves on
            assert judge.stats.timeouts == 3
        finally:
            judge.close()


def test_the_judge_engine_never_receives_policy_weights(judge_dir):
    """The policy's engine takes weight pushes; the judge's, an engine of the same shape, keeps its
    own weights and version, and scores as before."""
    cfg, judge_params = load_params(judge_dir)
    judge = Judge(JudgeConfig(model=str(judge_dir), parse="regex", pattern=r"(\S)", max_new_tokens=4,
                              timeout_s=600.0))  # no deadline in play on a loaded host
    policy = GenerationEngine((cfg, init_params(cfg, 9, std=0.3)), EngineConfig(num_slots=2, max_seq_len=128))
    try:
        before = judge.score(PAIRS[:2])
        assert judge.engine is not policy
        policy.update_weights(init_params(cfg, 10, std=0.3), version=1)
        policy.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
        policy.run_until_idle()
        assert policy.version == 1
        assert judge.engine.version == 0
        for name, a in judge.engine.params["layers"].items():
            np.testing.assert_array_equal(np.asarray(a), np.asarray(judge_params["layers"][name]))
        assert judge.score(PAIRS[:2]) == before
    finally:
        judge.close()
        policy.stop()
    assert math.isfinite(before[0].score)
