"""Prompt data: record formats, file readers with provenance, and the grain pipeline."""

import json
import logging
import pathlib

import grain
import numpy as np
import pytest

from areal_jax.data import (
    DataConfig,
    TemplateFieldError,
    PromptTemplate,
    RowFormatError,
    build_prompt_loader,
    detect_format,
    iter_records,
    parse_record,
)
from areal_jax.models.tokenizer import Tokenizer
from tests.tokenizer_fixtures import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "chatml"))


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    """Llama-3-like, with no chat template: a base model's tokenizer (its post-processor adds bos)."""
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("base"), "llama3",
                                                          template_storage="none"))


SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

GSM8K = {"question": "Tom has 1,200 apples and buys 34 more. How many?", "answer": "1200 + 34 = 1234\n#### 1,234"}
MATH = {"problem": "What is 1/2 + 1/4?", "solution": "We get $\\boxed{\\frac{3}{4}}$ by adding."}
AREAL = {
    "query_id": "areal-7",
    "prompt": "Compute 2^3.",
    "solutions": ["Since 2*2*2 = 8, \\boxed{8}.", "\\boxed{9}"],
}
CODE = {
    "question": "Read n and print n squared.",
    "input_output": json.dumps({"inputs": ["3\n", "4\n"], "outputs": ["9\n", "16\n"]}),
}


# ---------------------------------------------------------------- formats


# Answer extraction itself (boxes, ####): tests/test_answers.py.


def test_detect_format_treats_null_as_absent():
    assert detect_format(GSM8K) == "gsm8k"
    assert detect_format(MATH) == "math"
    assert detect_format(AREAL) == "areal"
    assert detect_format(CODE) == "code"
    # Parquet rows of a mixed file carry every column, None where absent.
    assert detect_format({"question": None, "answer": None, **MATH}) == "math"
    with pytest.raises(RowFormatError, match="cannot detect"):
        detect_format({"text": "hi"})


def test_parse_each_format():
    template = PromptTemplate(prompt_suffix=SUFFIX, system_prompt="Be brief.")
    row = parse_record(GSM8K, source="f.jsonl:1", template=template)
    assert (row.task, row.answer, row.test_cases, row.query_id) == ("math", "1234", None, "f.jsonl:1")
    assert row.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": GSM8K["question"] + SUFFIX},
    ]
    assert parse_record(MATH, source="s").answer == "\\frac{3}{4}"
    areal = parse_record(AREAL, source="s")
    assert (areal.answer, areal.query_id) == ("8", "areal-7")  # last box of the FIRST solution
    code = parse_record(CODE, source="s")
    assert code.task == "code" and code.answer is None
    assert code.test_cases == {"inputs": ["3\n", "4\n"], "outputs": ["9\n", "16\n"]}
    as_dict = parse_record({"prompt": "p", "input_output": {"inputs": [1], "outputs": [2]}}, source="s")
    assert as_dict.test_cases == {"inputs": [1], "outputs": [2]}
    assert as_dict.messages == [{"role": "user", "content": "p"}]


@pytest.mark.parametrize(
    "record,fmt,reason",
    [
        ({"question": "q"}, "gsm8k", "missing field 'answer'"),
        ({"question": 3, "answer": "#### 1"}, "auto", "must be a string"),
        ({"question": "  ", "answer": "#### 1"}, "auto", "is empty"),
        ({"problem": "p", "solution": "no box"}, "auto", "no \\\\boxed"),
        ({"prompt": "p", "solutions": []}, "auto", "non-empty list"),
        ({"question": "q", "input_output": "{not json"}, "auto", "not valid JSON"),
        ({"question": "q", "input_output": {"inputs": [1, 2], "outputs": [1]}}, "auto", "as many inputs"),
        (GSM8K, "math", "missing field 'problem'"),  # forced format that does not fit
        (GSM8K, "code", "missing field 'input_output'"),
    ],
)
def test_parse_rejects_bad_records(record, fmt, reason):
    with pytest.raises(RowFormatError, match=reason):
        parse_record(record, source="s", fmt=fmt)


# ---------------------------------------------------------------- readers


def write_jsonl(path: pathlib.Path, lines: list) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
    return str(path)


def write_parquet(path: pathlib.Path, records: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Column-wise so every key of every record becomes a column (from_pylist would take
    # the schema from the first record only); rows lacking a key get None.
    keys = list(dict.fromkeys(k for r in records for k in r))
    pq.write_table(pa.table({k: [r.get(k) for r in records] for k in keys}), path)
    return str(path)


def prompt_length(tokenizer, record: dict) -> int:
    messages = parse_record(record, source="s").messages
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def loaded_rows(config: DataConfig, tokenizer) -> list:
    return [example["row"] for example in build_prompt_loader(config, tokenizer)]


def check_all_formats(rows, expected_sources):
    by_task = sorted((r.source, r.task, r.answer) for r in rows)
    assert by_task == sorted(
        zip(expected_sources, ["math", "math", "math", "code"], ["1234", "\\frac{3}{4}", "8", None])
    )
    code = next(r for r in rows if r.task == "code")
    assert code.test_cases["outputs"] == ["9\n", "16\n"]
    assert all(r.messages[-1]["content"].endswith(SUFFIX) for r in rows)


def test_jsonl_loads_every_format_with_line_numbers(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GSM8K, b"\n", MATH, AREAL, CODE])  # line 2 blank
    config = DataConfig(paths=[path], prompt_suffix=SUFFIX, shuffle=False, num_epochs=1)
    rows = loaded_rows(config, tokenizer)
    check_all_formats(rows, [f"{path}:{n}" for n in (1, 3, 4, 5)])
    assert [r.source for r in rows] == [f"{path}:{n}" for n in (1, 3, 4, 5)]  # file order kept


def test_parquet_loads_every_format_with_row_numbers(tmp_path, tokenizer):
    # One file with all formats: pyarrow unifies columns, filling the gaps with None.
    path = write_parquet(tmp_path / "mixed.parquet", [GSM8K, MATH, AREAL, CODE])
    config = DataConfig(paths=(path,), prompt_suffix=SUFFIX, shuffle=False, num_epochs=1)
    check_all_formats(loaded_rows(config, tokenizer), [f"{path}[{n}]" for n in range(4)])


def test_datasets_directory(tmp_path, tokenizer):
    import datasets  # a test dependency (pyproject [test])
    directory = tmp_path / "saved"
    datasets.Dataset.from_list([GSM8K, {"question": "No gold", "answer": "none"}]).save_to_disk(str(directory))
    loader = build_prompt_loader(DataConfig(paths=(str(directory),), shuffle=False, num_epochs=1), tokenizer)
    assert [(e["row"].source, e["row"].answer) for e in loader] == [(f"{directory}[0]", "1234")]
    assert [(i.source, i.kind) for i in loader.stats.issues] == [(f"{directory}[1]", "malformed")]
    dict_dir = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GSM8K])}).save_to_disk(str(dict_dir))
    with pytest.raises(ValueError, match="one split.*train"):
        list(iter_records(str(dict_dir)))


def test_bad_paths_raise_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        iter_records(str(tmp_path / "nope.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv"):
        iter_records(str(tmp_path / "data.csv"))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="plain_dir.*save_to_disk"):
        list(iter_records(str(tmp_path / "plain_dir")))


def test_malformed_and_too_long_rows_are_counted_not_fatal(tmp_path, tokenizer):
    long_question = {"question": "How many? " * 200, "answer": "#### 1"}
    lines = [
        GSM8K,  # 1 ok
        b"{not json\n",  # 2
        b"[1, 2]\n",  # 3 not an object
        {"question": "q"},  # 4 missing answer
        {"question": ["q"], "answer": "#### 1"},  # 5 wrong type
        b'{"question": "caf\xe9", "answer": "#### 1"}\n',  # 6 bad UTF-8
        long_question,  # 7 too long
        MATH,  # 8 ok
        {"question": "q", "input_output": {"inputs": [1]}},  # 9 no outputs
    ]
    path = write_jsonl(tmp_path / "dirty.jsonl", lines)
    # The cap sits exactly at the longest good prompt: "<=" keeps, ">" skips.
    cap = max(prompt_length(tokenizer, r) for r in (GSM8K, MATH))
    assert prompt_length(tokenizer, long_question) > cap
    config = DataConfig(paths=(path,), max_prompt_tokens=cap, shuffle=False, num_epochs=1)
    loader = build_prompt_loader(config, tokenizer)
    assert [e["row"].source for e in loader] == [f"{path}:1", f"{path}:8"]
    stats = loader.stats
    assert (stats.rows_read, stats.rows_kept, stats.num_malformed, stats.num_too_long) == (9, 2, 6, 1)
    kinds = {i.source: i.kind for i in stats.issues}
    assert kinds == {f"{path}:{n}": "malformed" for n in (2, 3, 4, 5, 6, 9)} | {f"{path}:7": "too_long"}
    reasons = {i.source: i.reason for i in stats.issues}
    assert "invalid JSON" in reasons[f"{path}:2"] and "UTF-8" in reasons[f"{path}:6"]
    assert "max_prompt_tokens" in reasons[f"{path}:7"]
    assert "2/9 prompt rows kept; 6 malformed, 1 over max_prompt_tokens" in stats.summary()


def test_prompts_with_no_room_in_the_engine_are_left_out_with_one_warning(tmp_path, tokenizer, caplog):
    """A prompt of max_seq_len tokens or more would fail at generation on every pass over the data:
    left out at load, counted, one warning for all of them."""
    rows = [GSM8K, {"question": "How many? " * 60, "answer": "#### 1"}, MATH,
            {"question": "How many? " * 90, "answer": "#### 2"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    lengths = [prompt_length(tokenizer, r) for r in rows]
    limit = max(lengths[0], lengths[2]) + 1  # the short prompts leave exactly one position
    assert min(lengths[1], lengths[3]) >= limit
    config = DataConfig(paths=(path,), shuffle=False, num_epochs=1)
    with caplog.at_level(logging.WARNING, logger="areal_jax.data.pipeline"):
        loader = build_prompt_loader(config, tokenizer, max_seq_len=limit)
    assert [e["row"].source for e in loader] == [f"{path}:1", f"{path}:3"]
    assert (loader.stats.rows_kept, loader.stats.num_no_room) == (2, 2)
    assert "2/4 prompt rows kept; 0 malformed, 0 over max_prompt_tokens, 2 with no room" in loader.stats.summary()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(f"2 of 4 prompt rows of {path} left out")
    assert f"EngineConfig.max_seq_len = {limit} (the first: {path}:2; the longest: {lengths[3]} tokens)" in warned[0]
    with pytest.raises(ValueError, match="no usable prompt rows.*no room for a new token"):
        build_prompt_loader(config, tokenizer, max_seq_len=min(lengths))


def test_no_usable_rows_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [b"nope\n"])
    with pytest.raises(ValueError, match="no usable prompt rows.*1 malformed"):
        build_prompt_loader(DataConfig(paths=(path,)), tokenizer)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"paths": "one.jsonl"}, "sequence of paths"),
        ({"paths": ()}, "non-empty"),
        ({"paths": ("a.jsonl",), "format": "csv"}, "format"),
        ({"paths": ("a.jsonl",), "max_prompt_tokens": 0}, "max_prompt_tokens"),
        ({"paths": ("a.jsonl",), "seed": -1}, "seed"),
        ({"paths": ("a.jsonl",), "num_epochs": 0}, "num_epochs"),
        ({"paths": ("a.jsonl",), "system_prompt": 3}, "system_prompt"),
        ({"paths": ("a.jsonl",), "prompt_template": "Q: {}"}, r"DataConfig.prompt_template field \{\}"),
        ({"paths": ("a.jsonl",), "prompt_template": "Q: {question.upper}"}, "field name"),
        ({"paths": ("a.jsonl",), "prompt_template": "Q: {question"}, "not a format string"),
        ({"paths": ("a.jsonl",), "prompt_template": "Answer:"}, "names no field"),
        ({"paths": ("a.jsonl",), "prompt_template": "{question}", "prompt_suffix": "!"}, "whole prompt"),
        ({"paths": ("a.jsonl",), "prompt_template": "{question}", "chat_template_kwargs": {"enable_thinking": False}},
         "chat_template_kwargs apply to a chat template"),
        ({"paths": ("a.jsonl",), "chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs keys"),
        ({"paths": ("a.jsonl",), "chat_template_kwargs": {"x": object()}}, "JSON-like"),
    ],
)
def test_data_config_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DataConfig(**kwargs)


# ---------------------------------------------------------------- pipeline


def numbered_file(tmp_path, n: int) -> str:
    return write_jsonl(tmp_path / f"n{n}.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(n)])


def answers(loader, count=None) -> list[str]:
    out = []
    for example in loader:
        assert example["prompt_ids"].dtype == np.int32 and example["prompt_ids"].ndim == 1
        out.append(example["row"].answer)
        if count is not None and len(out) == count:
            break
    return out


def test_examples_carry_the_templated_prompt_ids(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 3)
    example = next(build_prompt_loader(DataConfig(paths=(path,), prompt_suffix=SUFFIX, shuffle=False), tokenizer))
    expected = tokenizer.apply_chat_template(example["row"].messages, add_generation_prompt=True, tokenize=True)
    np.testing.assert_array_equal(example["prompt_ids"], np.asarray(expected, dtype=np.int32))


def test_shuffle_is_deterministic_and_reshuffles_each_epoch(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 20)
    config = DataConfig(paths=(path,), seed=3, num_epochs=2)
    first = answers(build_prompt_loader(config, tokenizer))
    assert first == answers(build_prompt_loader(config, tokenizer))  # same seed, same order
    epoch0, epoch1 = first[:20], first[20:]
    assert sorted(epoch0, key=int) == sorted(epoch1, key=int) == [str(i) for i in range(20)]
    assert epoch0 != epoch1  # a fresh permutation per epoch
    assert epoch0 != [str(i) for i in range(20)]  # actually shuffled
    other_seed = answers(build_prompt_loader(DataConfig(paths=(path,), seed=4, num_epochs=2), tokenizer))
    assert other_seed != first
    unshuffled = answers(build_prompt_loader(DataConfig(paths=(path,), shuffle=False, num_epochs=1), tokenizer))
    assert unshuffled == [str(i) for i in range(20)]


def test_infinite_by_default(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 3)
    got = answers(build_prompt_loader(DataConfig(paths=(path,)), tokenizer), count=10)
    assert len(got) == 10 and sorted(got[:3]) == sorted(got[3:6]) == ["0", "1", "2"]


def test_two_processes_split_the_same_global_order(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 12)
    config = DataConfig(paths=(path,), seed=11, num_epochs=2)
    global_order = answers(build_prompt_loader(config, tokenizer))
    shards = [answers(build_prompt_loader(config, tokenizer, process_index=p, process_count=2)) for p in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 12
    # Process p takes global positions p, p + 2, ...: interleaving restores the order.
    assert [a for pair in zip(*shards) for a in pair] == global_order
    for epoch in (slice(0, 6), slice(6, 12)):
        assert not set(shards[0][epoch]) & set(shards[1][epoch])  # disjoint within each epoch


def test_uneven_rows_even_shards_drop_the_leftover(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 7)
    even = DataConfig(paths=(path,), seed=5, num_epochs=1)
    shards = [answers(build_prompt_loader(even, tokenizer, process_index=p, process_count=2)) for p in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 3
    assert len(set(shards[0]) | set(shards[1])) == 6
    uneven = DataConfig(paths=(path,), seed=5, num_epochs=1, even_shards=False)
    shards = [answers(build_prompt_loader(uneven, tokenizer, process_index=p, process_count=2)) for p in (0, 1)]
    assert (len(shards[0]), len(shards[1])) == (4, 3)
    assert sorted(shards[0] + shards[1], key=int) == [str(i) for i in range(7)]
    with pytest.raises(ValueError, match="cannot feed 8 processes"):
        build_prompt_loader(even, tokenizer, process_index=0, process_count=8)
    with pytest.raises(ValueError, match="process_index"):
        build_prompt_loader(even, tokenizer, process_index=2, process_count=2)


def test_resume_from_state_yields_the_same_next_elements(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 9)
    config = DataConfig(paths=(path,), seed=2)
    for k in (0, 4, 13):  # including a position past an epoch boundary
        loader = build_prompt_loader(config, tokenizer, process_index=1, process_count=2)
        if k:
            answers(loader, count=k)
        state = json.loads(json.dumps(loader.get_state()))  # must survive JSON
        expected = answers(loader, count=10)
        fresh = build_prompt_loader(config, tokenizer, process_index=1, process_count=2)
        fresh.set_state(state)
        assert answers(fresh, count=10) == expected, k


def test_resume_through_grain_checkpoint_handler(tmp_path, tokenizer):
    path = numbered_file(tmp_path, 5)
    config = DataConfig(paths=(path,), seed=8)
    loader = build_prompt_loader(config, tokenizer)
    answers(loader, count=7)
    handler = grain.checkpoint.CheckpointHandler()
    (tmp_path / "ckpt").mkdir()  # orbax makes the directory before calling the handler
    handler.save(tmp_path / "ckpt", item=loader.iterator)
    expected = answers(loader, count=6)
    fresh = build_prompt_loader(config, tokenizer)
    handler.restore(tmp_path / "ckpt", item=fresh.iterator)
    assert answers(fresh, count=6) == expected


# ---------------------------------------------------------------- templates


def test_prompt_template_replaces_the_chat_template_for_a_base_model(tmp_path, base_tokenizer):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GSM8K, {"problem": "1+1?", "solution": "\\boxed{2}"}])
    config = DataConfig(paths=(path,), prompt_template="Question: {question}\nAnswer:", format="gsm8k",
                        shuffle=False, num_epochs=1)
    loader = build_prompt_loader(config, base_tokenizer)
    (example,) = list(loader)  # format="gsm8k": the MATH row is malformed (no question), skipped
    text = f"Question: {GSM8K['question']}\nAnswer:"
    assert example["row"].messages == [{"role": "user", "content": text}] and example["row"].answer == "1234"
    expected = base_tokenizer.encode(text, add_special_tokens=True)
    assert expected[0] == base_tokenizer.bos_token_id  # a base model's prompt starts with bos
    np.testing.assert_array_equal(example["prompt_ids"], expected)
    assert loader.stats.num_malformed == 1


def test_a_template_field_the_rows_lack_is_an_error_naming_field_and_file(tmp_path, base_tokenizer):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K])
    config = DataConfig(paths=(path,), prompt_template="Problem: {problem}\nSolution:")
    with pytest.raises(TemplateFieldError, match=rf"\{{problem\}}, which {path}:1 lacks .*answer, question"):
        build_prompt_loader(config, base_tokenizer)


def test_a_model_without_a_chat_template_needs_a_prompt_template(tmp_path, base_tokenizer):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K])
    with pytest.raises(ValueError) as err:
        build_prompt_loader(DataConfig(paths=(path,)), base_tokenizer)
    message = str(err.value)
    assert base_tokenizer.name in message and "\n" not in message
    assert "DataConfig.prompt_template" in message and "DataConfig.chat_template_kwargs" in message


def test_chat_template_kwargs_reach_the_template(tmp_path):
    qwen3 = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "qwen3", "qwen3"))
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K])
    messages = [{"role": "user", "content": GSM8K["question"]}]
    for kwargs, think in (({}, False), ({"enable_thinking": False}, True)):
        example = next(build_prompt_loader(DataConfig(paths=(path,), chat_template_kwargs=kwargs), qwen3))
        text = qwen3.decode(example["prompt_ids"])
        # Thinking off: the template writes an empty think block after the generation prompt.
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == think
        expected = qwen3.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        np.testing.assert_array_equal(example["prompt_ids"], expected)
