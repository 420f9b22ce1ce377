"""Tiny HF-format tokenizer directories built locally (no model hub), for tests.

`build_tiny_tokenizer(dir, style)` trains a byte-level BPE on a few hundred generated
sentences (words, digits, math symbols, some non-ASCII) and writes `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json` laid out like the model family:

- "chatml": Qwen2.5-style ChatML (`<|im_start|>`/`<|im_end|>`, default system message).
- "llama3": Llama-3-style headers; bos `<|begin_of_text|>` is written by the template and
  also added by tokenizer.json's post-processor for plain `encode`.
- "qwen3": Qwen3-style ChatML with `<think>` sections (reasoning kept only after the last
  user turn; `enable_thinking=False` emits an empty think block).

The templates are written for these tests in the style of those families.
"""

from __future__ import annotations

import functools
import json
import pathlib
import random

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

STYLES = ("chatml", "llama3", "qwen3")
TEMPLATE_STORAGE = ("config", "jinja", "named", "none")

# Pre-tokenizer split patterns in the style of each family (Llama 3 groups up to 3 digits).
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHATML_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = 'You are a helpful assistant.' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You have access to the following functions:\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = messages | length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = message.reasoning_content | default('') %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Deterministic sentences mixing words, numbers, math and a little non-ASCII text."""
    rng = random.Random(seed)
    words = ("the answer is what how many apples does she have left total sum of product "
             "equation solve for x find value integer prime square root step first then "
             "therefore so we get compute each train travels miles per hour minutes").split()
    extras = ("café", "naïve", "über", "Größe", "число", "数学", "答案", "π", "√", "≤", "≥", "×", "÷", "🙂")
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9999), rng.randint(1, 999)
        op = rng.choice("+-*/=^<>%")
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))
        out.append(f"{sentence.capitalize()} {a} {op} {b} = {rng.randint(0, 99999)}. {rng.choice(extras)}"
                   f" ({a / b:.3f}) \\boxed{{{a % b}}}\n")
    return out


@functools.lru_cache(maxsize=None)
def _trained_json(style: str) -> str:
    """Trains the BPE once per style (deterministic) and returns its tokenizer.json text."""
    if style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        split = _LLAMA_SPLIT
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        split = _QWEN_SPLIT
    tok = Tokenizer(models.BPE())
    if style != "llama3":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    if style == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if style == "qwen3":  # Qwen3's think markers are added tokens, but not special ones.
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False)])
    return tok.to_str()


def build_tiny_wordpiece_tokenizer(directory: str | pathlib.Path) -> pathlib.Path:
    """A BERT-like WordPiece tokenizer with the legacy decode clean-up on (spaces before punctuation)."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    punctuation = ["Hello, world! Isn't it? Yes, it's 3, 4. We're done; I'm sure you've seen."] * 5
    tok.train_from_iterator(_corpus() + punctuation, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials,
                                                                 show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
              **{f"{name}_token": f"[{name.upper()}]" for name in ("pad", "unk", "cls", "sep", "mask")}}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


def _added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


def _configs(style: str, ids: dict[str, int]) -> tuple[dict, dict, str]:
    """(tokenizer_config, generation_config, template) for a style."""
    if style == "llama3":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _added_token("<|begin_of_text|>"),
                  "eos_token": _added_token("<|eot_id|>"), "pad_token": None, "model_max_length": 131072,
                  "clean_up_tokenization_spaces": True}
        generation = {"bos_token_id": ids["<|begin_of_text|>"],
                      "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
        return config, generation, LLAMA3_TEMPLATE
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "model_max_length": 32768}
    # Qwen3 stores a single int, Qwen2.5 a list: both forms get exercised.
    eos = ids["<|endoftext|>"] if style == "qwen3" else [ids["<|im_end|>"], ids["<|endoftext|>"]]
    generation = {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]}
    return config, generation, QWEN3_TEMPLATE if style == "qwen3" else CHATML_TEMPLATE


def build_tiny_tokenizer(directory: str | pathlib.Path, style: str, *,
                         template_storage: str = "config") -> pathlib.Path:
    """Writes a tiny tokenizer of `style` ("chatml", "llama3", "qwen3") into `directory`; returns it.

    template_storage: "config" (a string in tokenizer_config.json, transformers 4 layout),
    "jinja" (a chat_template.jinja file, transformers 5 layout), "named" (a list of named
    templates in tokenizer_config.json, "default" plus an unused "rag"), or "none".
    """
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; expected one of {STYLES}")
    if template_storage not in TEMPLATE_STORAGE:
        raise ValueError(f"unknown template_storage {template_storage!r}; expected one of {TEMPLATE_STORAGE}")
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    text = _trained_json(style)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = {t["content"]: t["id"] for t in json.loads(text)["added_tokens"]}
    config, generation, template = _configs(style, ids)
    if template_storage == "config":
        config["chat_template"] = template
    elif template_storage == "named":
        config["chat_template"] = [{"name": "default", "template": template},
                                   {"name": "rag", "template": "{{ raise_exception('rag template used') }}"}]
    elif template_storage == "jinja":
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return out
