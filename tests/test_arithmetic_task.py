"""The arithmetic task: problems, splits, solutions, JSONL rows, tokenizer and reward."""

import json
import random
import re

import numpy as np
import pytest

from areal_jax.data import DataConfig, build_prompt_loader, parse_record
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.reward.registry import load_reward_function, resolve_reward_path
from areal_jax.tasks import arithmetic as ar
from areal_jax.tasks.reward import arithmetic_reward, parse_boxed_integer
from areal_jax.tasks.tokenizer_builder import (
    ALPHABET,
    EOS,
    PAD,
    build_task_model_dir,
    build_tokenizer,
    task_model_config,
    vocabulary,
)

CONFIGS = [
    ar.ArithmeticConfig(),
    ar.ArithmeticConfig(min_operands=3, max_operands=5, max_digits=3, operators="+-*", mul_max_digits=2),
    ar.ArithmeticConfig(min_operands=2, max_operands=2, max_digits=2, operators="*", mul_max_digits=2, test_percent=30),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


# ---- problems -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS)
def test_problems_are_deterministic_and_seed_dependent(cfg):
    a = ar.problems(cfg, "train", 200, seed=3)
    assert a == ar.problems(cfg, "train", 200, seed=3)
    assert [p.expression for p in a] != [p.expression for p in ar.problems(cfg, "train", 200, seed=4)]
    assert len({p.expression for p in a}) == 200  # unique within a split


@pytest.mark.parametrize("cfg", CONFIGS)
def test_splits_are_disjoint_whatever_the_seeds(cfg):
    train = {p.expression for s in (0, 1) for p in ar.problems(cfg, "train", 300, seed=s)}
    test = {p.expression for s in (0, 2) for p in ar.problems(cfg, "test", 100, seed=s)}
    assert not train & test
    assert all(ar.split_of(e, cfg.test_percent) == "test" for e in test)


def test_split_share_matches_test_percent():
    rng = random.Random(0)
    exprs = [f"{rng.randint(0, 999)}+{rng.randint(0, 999)}" for _ in range(20000)]
    share = np.mean([ar.split_of(e, 10) == "test" for e in exprs])
    assert abs(share - 0.10) < 0.01


@pytest.mark.parametrize("cfg", CONFIGS)
def test_solutions_are_correct_and_well_formed(cfg):
    for p in ar.problems(cfg, "train", 300, seed=1) + ar.problems(cfg, "test", 100, seed=1):
        assert p.answer == eval(p.expression)  # independent reference: Python's own arithmetic
        assert p.question == f"Compute {p.expression}."
        lines = p.solution.split("\n")
        assert lines[-1] == f"\\boxed{{{eval(p.expression)}}}"
        numbers = re.findall(r"\d+", p.expression)
        assert cfg.min_operands <= len(numbers) <= cfg.max_operands
        assert all(len(n) <= cfg.max_digits and (n == "0" or not n.startswith("0")) for n in numbers)
        assert set(re.findall(r"[-+*]", p.expression)) <= set(cfg.operators)
        assert len(lines) - 1 == len(numbers) - 1  # one step per operator
        for step in lines[:-1]:  # every step is itself a true equation
            lhs, rhs = step.split("=")
            assert eval(lhs.replace("--", "+")) == int(rhs)


def test_steps_respect_precedence():
    steps, value = ar.solve("3+4*5-6*2")
    assert steps == ["4*5=20", "6*2=12", "3+20=23", "23-12=11"] and value == 11
    steps, value = ar.solve("9-47-9")
    assert steps == ["9-47=-38", "-38-9=-47"] and value == -47
    with pytest.raises(ValueError, match="cannot parse"):
        ar.solve("3+(4)")


def test_mul_operands_are_short():
    cfg = ar.ArithmeticConfig(min_operands=3, max_operands=4, max_digits=3, operators="+*", mul_max_digits=1)
    for p in ar.problems(cfg, "train", 300):
        for a, b in re.findall(r"(\d+)\*(\d+)", p.expression):
            assert len(a) == 1 and len(b) == 1


@pytest.mark.parametrize("kwargs, culprit", [
    ({"min_operands": 1}, "min_operands"), ({"max_digits": 0}, "max_digits"), ({"operators": "+/"}, "operators"),
    ({"mul_max_digits": 3}, "mul_max_digits"), ({"test_percent": 0}, "test_percent"),
])
def test_config_validation_names_the_culprit(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        ar.ArithmeticConfig(**kwargs)


def test_exhausted_space_is_reported():
    cfg = ar.ArithmeticConfig(min_operands=2, max_operands=2, max_digits=1, operators="+")
    with pytest.raises(ValueError, match="distinct"):
        ar.problems(cfg, "test", 100)  # only 100 expressions exist, ~10% are test


# ---- rows for the data pipeline -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["math", "areal"])
def test_write_jsonl_is_read_by_the_data_pipeline(tmp_path, tokenizer, fmt):
    path = ar.write_jsonl(tmp_path / f"{fmt}.jsonl", "test", 20, seed=5, fmt=fmt)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    expected = ar.problems(ar.ArithmeticConfig(), "test", 20, seed=5)
    for record, p in zip(records, expected, strict=True):
        row = parse_record(record, source="x")
        assert row.answer == str(p.answer) and row.query_id == p.expression
        assert row.messages == [{"role": "user", "content": p.question}]
    loader = build_prompt_loader(DataConfig(paths=(str(path),), shuffle=False, num_epochs=1), tokenizer)
    from_loader = {ex["row"].query_id: ex for ex in loader}
    in_memory = list(ar.prompt_rows(tokenizer, expected))
    assert len(from_loader) == 20
    for ex in in_memory:
        ref = from_loader[ex["row"].query_id]
        np.testing.assert_array_equal(ex["prompt_ids"], ref["prompt_ids"])
        assert ex["prompt_ids"].dtype == np.int32
        assert ex["row"].answer == ref["row"].answer and ex["row"].messages == ref["row"].messages


def test_sft_examples_are_prompt_then_solution_then_eos(tokenizer):
    p = ar.problems(ar.ArithmeticConfig(), "train", 1)[0]
    (prompt, completion), = ar.sft_examples(tokenizer, [p])
    assert tokenizer.decode(prompt) == f"<|user|>{p.question}<|end|><|assistant|>"
    assert completion[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(completion[:-1]) == p.solution
    # Prompt + completion is exactly the chat template of the whole conversation.
    full = tokenizer.apply_chat_template([{"role": "user", "content": p.question},
                                          {"role": "assistant", "content": p.solution}])
    assert list(prompt) + list(completion) == full


# ---- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trips_every_task_string(tokenizer):
    cfg = CONFIGS[1]
    texts = [t for p in ar.problems(cfg, "train", 200) for t in (p.question, p.solution)]
    texts.append(ALPHABET)
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    # Digits are single tokens, and so is \boxed.
    assert all(len(tokenizer.encode(d)) == 1 for d in "0123456789")
    assert tokenizer.encode("\\boxed{7}") == [tokenizer.token_to_id("\\boxed")] + tokenizer.encode("{7}")
    assert len(tokenizer.encode("123+45")) == 6


def test_tokenizer_directory_loads_with_special_tokens_and_template(tokenizer):
    vocab = vocabulary()
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.eos_token_id == vocab[EOS] and tokenizer.pad_token_id == vocab[PAD] == 0
    assert tokenizer.stop_token_ids == (vocab[EOS],)
    assert tokenizer.bos_token_id is None
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be exact."},
                                          {"role": "user", "content": "Compute 1+2."}],
                                         add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be exact.<|end|><|user|>Compute 1+2.<|end|><|assistant|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Compute 1+2."}], add_generation_prompt=True)
    assert ids[0] == tokenizer.token_to_id("<|user|>") and ids[-1] == tokenizer.token_to_id("<|assistant|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Compute 1+2."
    with pytest.raises(ValueError, match="Unsupported role"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}])
    # Tools (the agent example's calculator): named in a system turn, called and answered in turns.
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Compute 1+2."},
                                          {"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "tool", "content": "3"}], add_generation_prompt=True,
                                         tools=[{"type": "function", "function": {
                                             "name": "calculator", "parameters": {"properties": {"expression": {}}}}}],
                                         tokenize=False)
    assert text == ('<|system|>Tools: calculator(expression)<|end|><|user|>Compute 1+2.<|end|><|assistant|>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call><|end|>'
                    '<|user|><tool_response>3</tool_response><|end|><|assistant|>')


def test_unknown_characters_map_to_unk(tokenizer):
    ids = tokenizer.encode("1é2")
    assert ids[1] == tokenizer.token_to_id("<|unk|>") and len(ids) == 3


def test_task_model_dir_is_a_loadable_checkpoint(tmp_path):
    from areal_jax.models import load_params
    import jax

    cfg = task_model_config()
    assert 300_000 <= cfg.num_params() <= 2_000_000
    directory = build_task_model_dir(tmp_path / "m", cfg, seed=1)
    loaded_cfg, params = load_params(directory)
    assert loaded_cfg == cfg
    from areal_jax.models.transformer import init_params
    ref = init_params(cfg, jax.random.key(1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert Tokenizer.from_pretrained(directory).vocab_size == cfg.vocab_size


# ---- reward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, answer, expected", [
    ("3+4=7\n\\boxed{7}", 7, 1.0),
    ("\\boxed{7}", "7", 1.0),
    ("\\boxed{ 7 }", 7, 1.0),
    ("\\boxed{-47}", -47, 1.0),
    ("\\boxed{-47}", 47, 0.0),
    ("\\boxed{+5}", 5, 1.0),
    ("\\boxed{007}", 7, 1.0),
    ("\\boxed{8}", 7, 0.0),
    ("\\boxed{7} then \\boxed{8}", 7, 0.0),  # the last box counts
    ("\\boxed{8} then \\boxed{7}", 7, 1.0),
    ("\\boxed{7.0}", 7, 0.0),  # exactly an integer
    ("\\boxed{3+4}", 7, 0.0),
    ("\\boxed{}", 7, 0.0),
    ("the answer is 7", 7, 0.0),
    ("\\boxed{7", 7, 0.0),  # truncated
    ("\\boxed{7}\\boxed{8", 7, 0.0),  # a truncated last box: no answer (areal_jax/answers.py)
    ("", 0, 0.0),
])
def test_reward_table(text, answer, expected):
    assert arithmetic_reward(text, answer) == expected


def test_reward_of_every_solution_is_one_and_of_a_wrong_answer_zero():
    for p in ar.problems(CONFIGS[1], "test", 100):
        assert arithmetic_reward(p.solution, p.answer) == 1.0
        assert arithmetic_reward(p.solution, str(p.answer + 1)) == 0.0
    assert parse_boxed_integer("no box") is None


def test_reward_is_registered_by_name_and_path():
    import areal_jax.tasks  # noqa: F401  (registers "arithmetic")

    assert resolve_reward_path("arithmetic") == "areal_jax.tasks.reward:arithmetic_reward"
    assert load_reward_function(resolve_reward_path("areal_jax.tasks.reward:arithmetic_reward")) is arithmetic_reward


def test_problem_stream_covers_each_epoch_once_and_resumes_where_it_stopped(tokenizer):
    items = ar.problems(CONFIGS[1], "train", 7)
    questions = {p.question for p in items}

    def question(row) -> str:
        return row["row"].messages[-1]["content"]

    stream = ar.ProblemStream(tokenizer, items, seed=3)
    first, second = [question(next(stream)) for _ in range(7)], [question(next(stream)) for _ in range(7)]
    assert all(q.startswith(tuple(questions)) for q in first)  # the question, then the template's suffix
    assert len(set(first)) == len(set(second)) == 7 and first != second  # a fresh permutation per epoch
    row = next(ar.ProblemStream(tokenizer, items, seed=3))  # the data loader's row of that problem
    item = next(p for p in items if question(row).startswith(p.question))
    assert row["prompt_ids"].dtype == np.int32
    np.testing.assert_array_equal(row["prompt_ids"], ar.prompt_ids(tokenizer, item))
    state, rest = stream.get_state(), [question(next(stream)) for _ in range(5)]
    resumed = ar.ProblemStream(tokenizer, items, seed=3)
    resumed.set_state(state)
    assert [question(next(resumed)) for _ in range(5)] == rest
    with pytest.raises(ValueError, match="no training problems"):
        ar.ProblemStream(tokenizer, [], seed=0)
