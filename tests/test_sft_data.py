"""SFT data from files: GSM8K / MATH rows train on the whole solution, chat rows on assistant turns,
base models through DataConfig.prompt_template; every format read from real files; unusable rows
counted, and none usable an error naming the files and why."""

import json
import pathlib

import numpy as np
import pytest

from areal_jax.data import DataConfig, SFTExample, build_prompt_loader, load_sft_examples
from areal_jax.models.tokenizer import Tokenizer
from tests.tokenizer_fixtures import build_tiny_tokenizer

GSM8K = {"question": "Tom has 12 apples and buys 3 more. How many?", "answer": "12 + 3 = 15\n#### 15"}
MATH = {"problem": "What is 1/2 + 1/4?", "solution": "We get $\\boxed{\\frac{3}{4}}$ by adding."}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("chatml"), "chatml"))


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: pathlib.Path, rows: list[dict]) -> str:
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the [data] extra)")
    import pyarrow.parquet as pq

    keys = list(dict.fromkeys(k for r in rows for k in r))  # every key a column, None where a row lacks it
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in keys}), path)
    return str(path)


def write_datasets_dir(path: pathlib.Path, rows: list[dict]) -> str:
    datasets = pytest.importorskip("datasets", reason="`datasets` directories need datasets (the [data] extra)")
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_list would take the first row's columns only
    datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys}).save_to_disk(str(path))
    return str(path)


def spans(tokenizer: Tokenizer, example: SFTExample) -> list[tuple[str, bool]]:
    """The example as runs of (decoded text, trained)."""
    out, start = [], 0
    for i in range(1, example.ids.size + 1):
        if i == example.ids.size or example.trained[i] != example.trained[start]:
            out.append((tokenizer.decode(example.ids[start:i]), bool(example.trained[start])))
            start = i
    return out


def pieces_reference(tokenizer: Tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """ids and trained mask of hand-written (text, trained) pieces, each encoded alone."""
    ids, trained = [], []
    for text, flag in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        trained += [flag] * len(piece)
    return ids, trained


SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"  # the chatml fixture's default


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet, write_datasets_dir])
def test_each_file_format_gives_the_hand_computed_examples(tmp_path, chatml, writer):
    suffix = {write_jsonl: ".jsonl", write_parquet: ".parquet", write_datasets_dir: ""}[writer]
    path = writer(tmp_path / f"rows{suffix}", [GSM8K, MATH, CHAT])
    examples, stats = load_sft_examples(DataConfig(paths=(path,)), chatml, max_len=256)
    assert (stats.rows_read, stats.rows_kept, stats.issues) == (3, 3, ())
    sources = [f"{path}:{n}" for n in (1, 2, 3)] if writer is write_jsonl else [f"{path}[{n}]" for n in range(3)]
    assert [e.source for e in examples] == sources
    # Question/solution rows: the whole solution and the end-of-turn token are trained; the newline
    # the template writes after that token is context.
    for example, (question, solution) in zip(examples, [(GSM8K["question"], GSM8K["answer"]),
                                                         (MATH["problem"], MATH["solution"])]):
        prompt = f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        ids, trained = pieces_reference(chatml, [(prompt, False), (solution + "<|im_end|>", True), ("\n", False)])
        np.testing.assert_array_equal(example.ids, ids)
        np.testing.assert_array_equal(example.trained, trained)
        # The prompt part is exactly what RL generates from.
        rl_prompt = chatml.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        np.testing.assert_array_equal(example.ids[:len(rl_prompt)], rl_prompt)
    ids, trained = pieces_reference(chatml, [
        (f"{SYSTEM}<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        ("hello there<|im_end|>", True),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", False),
        ("4<|im_end|>", True), ("\n", False)])
    np.testing.assert_array_equal(examples[2].ids, ids)
    np.testing.assert_array_equal(examples[2].trained, trained)


def test_llama3_chat_rows_train_each_assistant_turn(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok", "llama3"))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "system", "content": "Be brief."}]
                                                  + CHAT["messages"]}])
    config = DataConfig(paths=(path,))
    (example,), _ = load_sft_examples(config, tok, max_len=256)
    assert [text for text, trained in spans(tok, example) if trained] == ["hello there<|eot_id|>", "4<|eot_id|>"]
    assert not example.trained[:5].any() and spans(tok, example)[-1][1]  # ends on the trained turn


def test_qwen3_template_kwargs_and_re_rendered_turns(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok", "qwen3"))
    path = write_jsonl(tmp_path / "rows.jsonl", [GSM8K, CHAT])
    config = DataConfig(paths=(path,), chat_template_kwargs={"enable_thinking": False})
    (single, multi), _ = load_sft_examples(config, tok, max_len=256)
    think_off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert spans(tok, single) == [(f"<|im_start|>user\n{GSM8K['question']}<|im_end|>\n{think_off}", False),
                                  (GSM8K["answer"] + "<|im_end|>", True), ("\n", False)]
    # Qwen3 drops an earlier turn's think block once a later user turn follows, so the earlier turn
    # cannot be cut out of the conversation: the last turn is trained, all before it is context.
    assert [text for text, trained in spans(tok, multi) if trained] == ["4<|im_end|>"]
    prompt = tok.apply_chat_template(CHAT["messages"][:3], add_generation_prompt=True, enable_thinking=False)
    np.testing.assert_array_equal(multi.ids[:len(prompt)], prompt)
    # Thinking on: a turn's reasoning (message key `reasoning_content`) is trained with its answer.
    reasoned = {"messages": [{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4", "reasoning_content": "two and two"}]}
    (example,), _ = load_sft_examples(DataConfig(paths=(write_jsonl(tmp_path / "r.jsonl", [reasoned]),)), tok,
                                      max_len=256)
    assert [text for text, trained in spans(tok, example) if trained] == \
        ["<think>\ntwo and two\n</think>\n\n4<|im_end|>"]


def test_prompt_template_for_a_base_model(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok", "llama3", template_storage="none"))
    path = write_jsonl(tmp_path / "rows.jsonl", [GSM8K, CHAT])
    template = "Question: {question}\nAnswer:"
    (example,), stats = load_sft_examples(DataConfig(paths=(path,), prompt_template=template), tok, max_len=256)
    prompt = tok.encode(template.format(**GSM8K), add_special_tokens=True)  # bos first
    completion = tok.encode(" " + GSM8K["answer"], add_special_tokens=False) + [tok.eos_token_id]
    np.testing.assert_array_equal(example.ids, prompt + completion)
    np.testing.assert_array_equal(example.trained, [False] * len(prompt) + [True] * len(completion))
    # The same prompt ids RL and eval generate from.
    rl = next(build_prompt_loader(DataConfig(paths=(path,), prompt_template=template, format="gsm8k"), tok))
    np.testing.assert_array_equal(rl["prompt_ids"], prompt)
    (issue,) = stats.issues
    assert issue.source == f"{path}:2" and "chat rows need the model's chat template" in issue.reason
    with pytest.raises(ValueError, match=f"{tok.name}.*DataConfig.prompt_template.*DataConfig.chat_template_kwargs"):
        load_sft_examples(DataConfig(paths=(path,)), tok, max_len=256)


def test_unusable_rows_are_counted_and_none_usable_is_an_error(tmp_path, chatml):
    long = {"question": "How many? " * 60, "answer": "#### 1"}
    code = {"question": "Print 1.", "input_output": json.dumps({"inputs": [""], "outputs": ["1\n"]})}
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"foo": 1}, GSM8K, long, code,
                                                  {"messages": [{"role": "user", "content": "no reply"}]}])
    examples, stats = load_sft_examples(DataConfig(paths=(path,)), chatml, max_len=128)
    assert [e.source for e in examples] == [f"{path}:2"]
    assert {i.source: i.kind for i in stats.issues} == {f"{path}:1": "malformed", f"{path}:3": "too_long",
                                                        f"{path}:4": "malformed", f"{path}:5": "malformed"}
    reasons = {i.source: i.reason for i in stats.issues}
    assert "cannot detect the format from keys ['foo']" in reasons[f"{path}:1"]
    assert "SFTConfig.max_len + 1 = 129" in reasons[f"{path}:3"]
    assert "no reference solution" in reasons[f"{path}:4"] and "no assistant turn" in reasons[f"{path}:5"]

    wrong = write_jsonl(tmp_path / "wrong_columns.jsonl", [{"prompt": "p", "completion": "c"}] * 2)
    with pytest.raises(ValueError) as err:
        load_sft_examples(DataConfig(paths=(wrong,)), chatml, max_len=64)
    message = str(err.value)
    assert message.startswith(f"no usable SFT examples in {wrong}: 0/2 SFT rows kept; 2 malformed")
    assert "cannot detect the format from keys ['completion', 'prompt']" in message and "\n" not in message
    too_long = write_jsonl(tmp_path / "long.jsonl", [long])
    with pytest.raises(ValueError, match=r"0/1 SFT rows kept; 0 malformed, 1 over SFTConfig.max_len"):
        load_sft_examples(DataConfig(paths=(too_long,)), chatml, max_len=64)
