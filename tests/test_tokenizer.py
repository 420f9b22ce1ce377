"""Tokenizer + chat template: parity with transformers on tiny local tokenizers, and clear errors.

All transformers work happens in one reference call (module fixture) to keep the suite fast.
"""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest

from areal_jax.models.tokenizer import ChatTemplateError, Tokenizer, TokenizerConfig
from tests.tokenizer_fixtures import build_tiny_tokenizer, build_tiny_wordpiece_tokenizer

DATE = {"date_string": "26 Jul 2024"}  # Llama-3 templates otherwise print today's date

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 12 + 30?"}],
    "system_user": [{"role": "system", "content": "You are a careful math tutor."},
                    {"role": "user", "content": "Solve 3x + 7 = 22 and put the answer in \\boxed{}."}],
    "multi_turn": [{"role": "user", "content": "How many apples: 17 - 9?"},
                   {"role": "assistant", "content": "<think>\n17 minus 9\n</think>\n\nThere are 8 apples."},
                   {"role": "user", "content": "And 8 × 125?"},
                   {"role": "assistant", "content": "1000"}],
    "unicode_digits": [{"role": "user", "content": "  Größe ≤ 3.14159, √2 ≈ 1.41421356; 数学答案 🙂 — число 0042\n"}],
    "assistant_first": [{"role": "assistant", "content": "hi"}],  # the Llama-3 template refuses this
    # Reasoning given under an older key name; None-valued keys must act as if absent.
    "reasoning_field": [{"role": "user", "content": "2 ^ 10?"},
                        {"role": "assistant", "content": "1024", "reasoning": "ten doublings", "tool_calls": None}],
}
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluates <expr> & returns a number — café",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
GENERATION_TAG_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}"
                           "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")

TEXTS = ["Hello world 12345 + 678 = 13023.", "café naïve über Größe 数学 🙂 π ≤ √2", "", "  \n\n  spaced\t out  ",
         "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
         "<think>\nx = 7\n</think>\n\n\\boxed{7}"]


def _chat(name, add_generation_prompt, tools=None, **template_kwargs):
    return {"name": name, "messages": CONVERSATIONS[name], "add_generation_prompt": add_generation_prompt,
            "tools": tools, "template_kwargs": template_kwargs}


def _standard_chats(**template_kwargs):
    names = ["single", "system_user", "multi_turn", "unicode_digits"]
    return [_chat(n, agp, **template_kwargs) for n in names for agp in (True, False)]


# (key, style, template_storage, chats)
SETUPS = [
    ("chatml", "chatml", "config",
     _standard_chats() + [_chat("system_user", True, TOOLS), _chat("single", False, TOOLS)]),
    ("chatml_jinja", "chatml", "jinja", _standard_chats()),
    ("chatml_named", "chatml", "named", _standard_chats()[:2]),
    ("llama3", "llama3", "config",
     _standard_chats(**DATE) + [_chat("system_user", True, TOOLS, **DATE),
                                _chat("unicode_digits", True, chat_template=GENERATION_TAG_TEMPLATE),
                                _chat("assistant_first", True, **DATE)]),  # keep last: the raise_exception case
    ("qwen3", "qwen3", "config",
     _standard_chats() + [_chat("multi_turn", True, enable_thinking=False), _chat("single", True, enable_thinking=True),
                          _chat("reasoning_field", False), _chat("reasoning_field", True)]),
    ("qwen3_jinja", "qwen3", "jinja", _standard_chats()[:4]),
]


def _chat_id(setup_key, chat):
    extras = "+tools" if chat["tools"] else ""
    extras += "".join(f"+{k}" for k in chat["template_kwargs"] if k != "date_string")
    return f"{setup_key}-{chat['name']}-agp{int(chat['add_generation_prompt'])}{extras}"


CHAT_CASES = [(key, i) for key, _, _, chats in SETUPS for i in range(len(chats))]
SETUPS_BY_KEY = {s[0]: s for s in SETUPS}
CHAT_IDS = [_chat_id(key, SETUPS_BY_KEY[key][3][i]) for key, i in CHAT_CASES]


EXTRA_DIRS = ["chatml_map", "chatml_bosflag", "wordpiece"]  # tokenizer dirs checked without chats


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {key: build_tiny_tokenizer(root / key, style, template_storage=storage) for key, style, storage, _ in SETUPS}
    # Legacy special_tokens_map.json wins over tokenizer_config.json (when there is no added_tokens_decoder).
    dirs["chatml_map"] = build_tiny_tokenizer(root / "chatml_map", "chatml")
    (dirs["chatml_map"] / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>", "special": True}, "pad_token": "<|im_start|>"}))
    # transformers 5 ignores add_bos_token when tokenizer.json exists: its post-processor decides.
    dirs["chatml_bosflag"] = build_tiny_tokenizer(root / "chatml_bosflag", "chatml")
    config_path = dirs["chatml_bosflag"] / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "add_bos_token": True,
                                       "bos_token": "<|endoftext|>"}))
    # WordPiece decoding goes through the legacy clean-up (" ," -> ","); BPE decoding does not.
    dirs["wordpiece"] = build_tiny_wordpiece_tokenizer(root / "wordpiece")
    return dirs


def _ids_of(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    punctuated = "hello , world . is n't it ? yes ! 3 , 4"
    return [tok.encode(t) for t in TEXTS + [punctuated]] + [[0, 1, 2, 3, 4, 5, 17, 42, 99]]


@pytest.fixture(scope="module")
def hf(reference, tokenizer_dirs):
    """transformers' answers for every setup, from one reference call."""
    keys = [s[0] for s in SETUPS] + EXTRA_DIRS
    chats = {s[0]: s[3] for s in SETUPS} | {k: [] for k in EXTRA_DIRS}
    requests = [{"path": str(tokenizer_dirs[k]), "texts": TEXTS, "id_lists": _ids_of(tokenizer_dirs[k]),
                 "chats": [{k2: v for k2, v in c.items() if k2 != "name"} for c in chats[k]]} for k in keys]
    results = reference.run("tokenizer_parity", requests=requests)["results"]
    return dict(zip(keys, results))


def _render(tok, chat, tokenize):
    return tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"],
                                   tokenize=tokenize, tools=chat["tools"], **chat["template_kwargs"])


@pytest.mark.parametrize("key,index", CHAT_CASES, ids=CHAT_IDS)
def test_chat_template_matches_transformers(hf, tokenizer_dirs, key, index):
    chat = SETUPS_BY_KEY[key][3][index]
    expected = hf[key]["chats"][index]
    tok = Tokenizer.from_pretrained(tokenizer_dirs[key])
    if "error" in expected:  # the template itself refused the input: same message, our error type
        with pytest.raises(ChatTemplateError) as info:
            _render(tok, chat, tokenize=False)
        assert expected["error"].split(": ", 1)[1] in str(info.value)
        return
    assert _render(tok, chat, tokenize=False) == expected["text"]
    assert _render(tok, chat, tokenize=True) == expected["ids"]


def test_reference_cases_cover_errors_and_thinking(hf):
    """Guards the parity table itself: the raise_exception case fails in transformers, thinking toggles text."""
    assert "roles must alternate" in hf["llama3"]["chats"][-1]["error"]
    qwen3 = {(_chat_id("qwen3", c)): r for c, r in zip(SETUPS_BY_KEY["qwen3"][3], hf["qwen3"]["chats"])}
    assert qwen3["qwen3-multi_turn-agp1+enable_thinking"]["text"].endswith("<think>\n\n</think>\n\n")
    assert "ten doublings" in qwen3["qwen3-reasoning_field-agp0"]["text"]
    assert "17 minus 9" not in qwen3["qwen3-multi_turn-agp0"]["text"]  # reasoning before the last query is dropped


@pytest.mark.parametrize("key", [s[0] for s in SETUPS] + EXTRA_DIRS)
def test_encode_decode_and_special_ids_match_transformers(hf, tokenizer_dirs, key):
    expected = hf[key]
    tok = Tokenizer.from_pretrained(tokenizer_dirs[key])
    assert [tok.encode(t) for t in TEXTS] == expected["encode"]
    assert [tok.encode(t, add_special_tokens=False) for t in TEXTS] == expected["encode_plain"]
    id_lists = _ids_of(tokenizer_dirs[key])
    assert tok.batch_decode(id_lists) == expected["decode"]
    assert tok.batch_decode(id_lists, skip_special_tokens=True) == expected["decode_skip"]
    assert {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id} == expected["special"]
    assert tok.vocab_size == len(tok) == expected["len"]


def test_special_tokens_and_stop_ids(tmp_path):
    chatml = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "c", "chatml"))
    assert chatml.bos_token_id is None and chatml.eos_token == "<|im_end|>"
    assert chatml.stop_token_ids == (chatml.token_to_id("<|im_end|>"), chatml.token_to_id("<|endoftext|>"))
    assert chatml.pad_token_id == chatml.token_to_id("<|endoftext|>")

    llama = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "l", "llama3"))
    bos, eot = llama.token_to_id("<|begin_of_text|>"), llama.token_to_id("<|eot_id|>")
    assert (llama.bos_token_id, llama.eos_token_id, llama.pad_token_id) == (bos, eot, None)
    assert llama.stop_token_ids == (eot, llama.token_to_id("<|end_of_text|>"))
    assert llama.encode("hi")[0] == bos and llama.encode("hi", add_special_tokens=False)[0] != bos
    ids = llama.apply_chat_template(CONVERSATIONS["single"], **DATE)
    assert ids[0] == bos and ids[1] != bos  # the template writes bos; tokenizing must not add a second one

    qwen3 = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "q", "qwen3"))
    assert qwen3.stop_token_ids == (qwen3.eos_token_id, qwen3.token_to_id("<|endoftext|>"))
    think = qwen3.token_to_id("<think>")
    assert think not in qwen3.special_token_ids and qwen3.eos_token_id in qwen3.special_token_ids
    assert qwen3.decode([think, qwen3.eos_token_id], skip_special_tokens=True) == "<think>"


@pytest.mark.parametrize("style", ["chatml", "llama3", "qwen3"])
def test_round_trip(tmp_path, style):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, style))
    for text in TEXTS + ["x" * 300, "1234567890" * 7, "\n".join(str(i) for i in range(200))]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(np.asarray(ids, dtype=np.int32)) == text  # numpy/jax id arrays are accepted


def test_strftime_now_in_template(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "llama3"))
    before = datetime.datetime.now().strftime("%d %b %Y")
    text = tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False)
    after = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}" in text or f"Today Date: {after}" in text


def test_template_storage_layouts_agree(tmp_path):
    texts = set()
    for storage in ("config", "jinja", "named"):
        tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / storage, "qwen3", template_storage=storage))
        texts.add(tok.apply_chat_template(CONVERSATIONS["multi_turn"], tokenize=False))
    assert len(texts) == 1
    named = Tokenizer.from_pretrained(tmp_path / "named")
    with pytest.raises(ChatTemplateError, match="rag template used"):
        named.apply_chat_template(CONVERSATIONS["single"], chat_template="rag")


def test_jinja_file_overrides_config_template(tmp_path):
    d = build_tiny_tokenizer(tmp_path, "chatml")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tok = Tokenizer.from_pretrained(d)
    assert tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False) == "[What is 12 + 30?]"


def test_tool_use_template_is_chosen_when_tools_are_given(tmp_path):
    d = build_tiny_tokenizer(tmp_path, "chatml", template_storage="none")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain"},
                               {"name": "tool_use", "template": "{{ tools[0].function.name }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(d)
    assert tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False) == "plain"
    assert tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False, tools=TOOLS) == "calc"


def test_template_is_sandboxed(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|SecurityError|access"):
        tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False, chat_template=escape)
    with pytest.raises(ChatTemplateError, match="_secret"):
        tok.apply_chat_template(CONVERSATIONS["single"], tokenize=False,
                                chat_template="{% set ns = namespace(_secret=1) %}{{ ns._secret }}")


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------


def test_missing_directory_and_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    d = build_tiny_tokenizer(tmp_path / "t", "chatml")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(d)


def test_malformed_files_are_named(tmp_path):
    d = build_tiny_tokenizer(tmp_path / "a", "chatml")
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",')
    with pytest.raises(ValueError, match="malformed JSON in .*tokenizer_config.json"):
        Tokenizer.from_pretrained(d)
    d = build_tiny_tokenizer(tmp_path / "b", "chatml")
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="could not load .*tokenizer.json"):
        Tokenizer.from_pretrained(d)
    d = build_tiny_tokenizer(tmp_path / "c", "chatml")
    (d / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_pretrained(d)
    d = build_tiny_tokenizer(tmp_path / "d", "chatml")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": 5}))
    with pytest.raises(ValueError, match="bos_token"):
        Tokenizer.from_pretrained(d)


def test_template_syntax_error_at_load(tmp_path):
    d = build_tiny_tokenizer(tmp_path, "chatml", template_storage="none")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="'default'.*syntax error"):
        Tokenizer.from_pretrained(d)


def test_raise_exception_in_template(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    with pytest.raises(ChatTemplateError, match="Unsupported role: critic"):
        tok.apply_chat_template([{"role": "critic", "content": "no"}])


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml", template_storage="none"))
    assert tok.chat_template is None and not tok.has_chat_template
    assert Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "named", "chatml",
                                                          template_storage="named")).has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template configured"):
        tok.apply_chat_template(CONVERSATIONS["single"])


def test_bad_messages(tmp_path):
    tok = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path, "chatml"))
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\['content'\].*object"):
        tok.apply_chat_template([{"role": "user", "content": object()}])
    with pytest.raises(ChatTemplateError, match=r"tools\[0\]"):
        tok.apply_chat_template(CONVERSATIONS["single"], tools=[len])


def test_config_validation():
    with pytest.raises(ValueError, match="unknown special token name"):
        TokenizerConfig(special_tokens={"start_token": "<s>"})
    with pytest.raises(ValueError, match="generation_eos_token_ids"):
        TokenizerConfig(generation_eos_token_ids=(-1,))
    with pytest.raises(ValueError, match="eos_token must be a non-empty string"):
        TokenizerConfig(special_tokens={"eos_token": ""})
