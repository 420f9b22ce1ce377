"""The typed prompt example (data/examples.py): the gold each task scores against, and one-line errors
that name what a malformed row lacks, wherever the row is read."""

import re

import numpy as np
import pytest

from areal_jax.data.examples import PromptExample, gold_answer, prompt_example
from areal_jax.data.formats import PromptRow
from areal_jax.evaluation import EvalConfig, GreedyAccuracy, run_evaluation
from areal_jax.models import ModelConfig, init_params
from areal_jax.rollout import workflow

MATH = PromptRow(query_id="m1", messages=[{"role": "user", "content": "1+1?"}], answer="2", test_cases=None,
                 task="math", source="a.jsonl:3")
CODE = PromptRow(query_id=7, messages=[{"role": "user", "content": "echo"}], answer=None,
                 test_cases={"inputs": ["x"], "outputs": ["x"]}, task="code", source="b.parquet[0]")


def test_the_gold_is_the_answer_of_a_math_row_and_the_test_cases_of_a_code_row():
    rng = np.random.default_rng(0)
    for record in (MATH, CODE):
        ids = rng.integers(0, 1000, rng.integers(1, 20)).tolist()  # a list, as a user may give it
        example = prompt_example({"prompt_ids": ids, "row": record})
        assert isinstance(example, PromptExample) and example.row is record
        assert example.prompt_ids.dtype == np.int32 and example.prompt_ids.tolist() == ids
        assert example.query_id == str(record.query_id) and example.source == record.source
        assert example.gold is (record.answer if record.task == "math" else record.test_cases)
        assert prompt_example(example) is example
    # What user workflows import (docs/user_guide.md) is the same reading.
    assert workflow.gold_answer is gold_answer
    assert gold_answer({"prompt_ids": [1], "row": CODE}) == {"inputs": ["x"], "outputs": ["x"]}


@pytest.mark.parametrize("row, error, message", [
    ({"row": MATH}, ValueError, "no key 'prompt_ids'"),
    ({"prompt_ids": [1, 2]}, ValueError, "no key 'row'"),
    ([[1, 2], MATH], TypeError, "a loader row {'prompt_ids', 'row'}, got list"),
    ({"prompt_ids": [1], "row": {"answer": "2"}}, TypeError, "'row' has no .query_id: expected a PromptRow"),
])
def test_a_malformed_row_is_one_line_naming_what_it_lacks(row, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        prompt_example(row)
    assert "\n" not in str(info.value)
    # The evaluators read rows through it before any engine starts; `areal-jax eval` adds the row's index.
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    good = {"prompt_ids": [1, 2], "row": MATH}
    with pytest.raises(error, match="^row 1: .*" + re.escape(message)):
        run_evaluation((cfg, init_params(cfg, 0)), None, [good, row], EvalConfig(max_new_tokens=4, max_seq_len=16))
    with pytest.raises(error, match=re.escape(message)):
        GreedyAccuracy(cfg, [good, row], None, max_new_tokens=4)
