"""Tokenizer and chat template for Hugging Face tokenizer directories, without transformers.

`Tokenizer.from_pretrained(path)` reads what `save_pretrained` writes:

- `tokenizer.json` (required): the whole encode/decode pipeline, run by the `tokenizers` library.
- `tokenizer_config.json`: named special tokens (strings or AddedToken dicts `{"content": ...}`)
  and `chat_template` (a string, or a list of `{"name", "template"}` entries).
- `special_tokens_map.json`: legacy special tokens; like transformers, it is read only when
  `tokenizer_config.json` has no `added_tokens_decoder`, and then it wins over the config.
- `chat_template.jinja` and `additional_chat_templates/*.jinja` (transformers 5 layout): they
  take priority over templates inside `tokenizer_config.json`.
- `generation_config.json`: extra stop ids (`eos_token_id`, an int or a list) and `pad_token_id`.

Behaviour follows transformers 5 so that ids match its `AutoTokenizer` for the generic
(`PreTrainedTokenizerFast`) tokenizer class: `add_bos_token` in the config is ignored because
the post-processor in `tokenizer.json` decides which special tokens `encode` adds, and chat
templates are tokenized with `add_special_tokens=False` (templates write bos themselves).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"
# Message keys that hold a reasoning trace; templates read different ones (see _alias_reasoning).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template failed: syntax error, `raise_exception(...)` in the template, or bad input."""


# ----------------------------------------------------------------------------------------------
# Reading the directory
# ----------------------------------------------------------------------------------------------


def _read_json(path: pathlib.Path) -> Any:
    """Parses a JSON file, naming the file in any error."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON in {path}: {e}") from e


def _read_optional_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token entry is null, a string, or an AddedToken dict; returns its text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an AddedToken dict with 'content', got {value!r}")


def _as_id_tuple(value: Any, where: str) -> tuple[int, ...]:
    """generation_config ids are null, an int or a list of ints."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: expected a non-negative int or a list of them, got {value!r}")
    return tuple(values)


def _optional_id(value: Any, where: str) -> int | None:
    """A single optional id (generation_config's pad_token_id); a list keeps its first entry."""
    ids = _as_id_tuple(value, where)
    return ids[0] if ids else None


def _config_templates(raw: Any, where: str) -> dict[str, str]:
    """`chat_template` in tokenizer_config.json: a string or a list of {name, template} entries."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {DEFAULT_TEMPLATE: raw}
    if isinstance(raw, list):
        templates = {}
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"{where}: each named chat template must be {{'name': str, 'template': str}}, "
                                 f"got {entry!r}")
            templates[entry["name"]] = entry["template"]
        return templates
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates, got {type(raw).__name__}")


def _file_templates(directory: pathlib.Path) -> dict[str, str]:
    """Templates stored as files (transformers 5): chat_template.jinja plus additional_chat_templates/."""
    templates = {}
    single = directory / "chat_template.jinja"
    if single.is_file():
        templates[DEFAULT_TEMPLATE] = single.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return templates


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """What the JSON files around tokenizer.json say, after precedence rules are applied.

    special_tokens: named special tokens (bos_token, eos_token, ...) that are set, as text.
    extra_special_tokens: additional special tokens, as text.
    chat_templates: template name -> jinja source; "default" is the one used normally.
    generation_eos_token_ids / generation_pad_token_id: from generation_config.json.
    clean_up_tokenization_spaces: the legacy decode clean-up flag (ignored for BPE models,
        like transformers 5 does).
    """

    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra_special_tokens: tuple[str, ...] = ()
    chat_templates: Mapping[str, str] = dataclasses.field(default_factory=dict)
    generation_eos_token_ids: tuple[int, ...] = ()
    generation_pad_token_id: int | None = None
    clean_up_tokenization_spaces: bool = False

    def __post_init__(self):
        for key, value in self.special_tokens.items():
            if key not in NAMED_SPECIAL_TOKENS:
                raise ValueError(f"unknown special token name {key!r}; expected one of {NAMED_SPECIAL_TOKENS}")
            if not isinstance(value, str) or not value:
                raise ValueError(f"special token {key} must be a non-empty string, got {value!r}")
        if not all(isinstance(t, str) and t for t in self.extra_special_tokens):
            raise ValueError(f"extra_special_tokens must be non-empty strings, got {self.extra_special_tokens!r}")
        for name, source in self.chat_templates.items():
            if not isinstance(name, str) or not isinstance(source, str):
                raise ValueError(f"chat template {name!r} must map a string name to a string template")
        _as_id_tuple(list(self.generation_eos_token_ids), "generation_eos_token_ids")
        _optional_id(self.generation_pad_token_id, "generation_pad_token_id")
        if not isinstance(self.clean_up_tokenization_spaces, bool):
            raise ValueError(f"clean_up_tokenization_spaces must be a bool, got {self.clean_up_tokenization_spaces!r}")

    @classmethod
    def from_directory(cls, directory: str | pathlib.Path) -> TokenizerConfig:
        """Reads tokenizer_config.json, special_tokens_map.json, chat templates and generation_config.json."""
        directory = pathlib.Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = _read_optional_json(config_path)
        raw = {key: config.get(key) for key in NAMED_SPECIAL_TOKENS}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if "added_tokens_decoder" not in config:  # transformers reads the legacy map only then
            map_path = directory / "special_tokens_map.json"
            special_map = _read_optional_json(map_path)
            raw.update({key: value for key, value in special_map.items() if key in NAMED_SPECIAL_TOKENS})
            extra = list(extra) + [t for t in special_map.get("additional_special_tokens", []) if t not in extra]
        special = {key: _token_content(value, f"{config_path}: {key}") for key, value in raw.items()}
        if isinstance(extra, dict):  # transformers 5 may store model-specific tokens by name
            extra = list(extra.values())
        extra_text = tuple(_token_content(t, f"{config_path}: extra_special_tokens") for t in extra)

        templates = _config_templates(config.get("chat_template"), str(config_path))
        templates = _file_templates(directory) or templates  # files win, as in transformers 5

        generation_path = directory / "generation_config.json"
        generation = _read_optional_json(generation_path)
        clean_up = config.get("clean_up_tokenization_spaces", False)
        return cls(
            special_tokens={key: value for key, value in special.items() if value},
            extra_special_tokens=extra_text,
            chat_templates=templates,
            generation_eos_token_ids=_as_id_tuple(generation.get("eos_token_id"), f"{generation_path}: eos_token_id"),
            generation_pad_token_id=_optional_id(generation.get("pad_token_id"), f"{generation_path}: pad_token_id"),
            clean_up_tokenization_spaces=bool(clean_up),
        )


# ----------------------------------------------------------------------------------------------
# Rendering chat templates
# ----------------------------------------------------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '); HF templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes, so templates cannot reach CPython internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a chat template in a sandbox configured like transformers' (cached per source)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def _plain(value: Any, where: str) -> Any:
    """Deep-copies template input into plain JSON-like types (the template may only see data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy float64) are cut back to the base type: no extra methods reach the sandbox.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item(), where)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise ChatTemplateError(f"{where}: chat template inputs must be JSON-like data, got {type(value).__name__}")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Drops None-valued keys and fills reasoning aliases, as transformers does before rendering."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of dicts, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        # APIs return content=None / tool_calls=None; templates handle a missing key, not a None.
        message = {k: v for k, v in _plain(message, f"messages[{i}]").items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            # Templates read either `reasoning_content` (Qwen3) or `thinking` (gpt-oss).
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                         tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs) -> str:
    """Renders one conversation with a chat template; template errors become ChatTemplateError.

    `template_kwargs` become template variables (special tokens, `enable_thinking`, `date_string`...).
    """
    template = compile_chat_template(source)
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ChatTemplateError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
        tools = _plain(list(tools), "tools")
    variables = _plain(template_kwargs, "template_kwargs")
    try:
        return template.render(messages=_normalize_messages(messages), tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------


def _clean_up_spaces(text: str) -> str:
    """Legacy WordPiece-era decode clean-up: removes the space before punctuation and contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class Tokenizer:
    """A Hugging Face tokenizer directory: encode/decode via `tokenizers`, chat templates via jinja2."""

    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig, *, name: str = "<memory>"):
        self._backend = backend
        self.config = config
        self.name = name
        # Special tokens named in the config but absent from tokenizer.json are added, as transformers does.
        known = set(backend.get_vocab(with_added_tokens=True))
        missing = [t for t in (*config.special_tokens.values(), *config.extra_special_tokens) if t not in known]
        if missing:
            backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                        for t in dict.fromkeys(missing)])

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path) -> Tokenizer:
        """Loads a tokenizer directory (see the module docstring for the files read)."""
        directory = pathlib.Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {directory}")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found (a fast tokenizer.json is required)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"could not load {tokenizer_file}: {e}") from e
        config = TokenizerConfig.from_directory(directory)
        for name, source in config.chat_templates.items():  # fail at load time, naming the template
            try:
                compile_chat_template(source)
            except ChatTemplateError as e:
                raise ChatTemplateError(f"{directory}: chat template {name!r}: {e}") from e
        return cls(backend, config, name=str(directory))

    # -- ids ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. a special token), or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def _special_id(self, key: str) -> int | None:
        token = self.config.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        """The bos token text, or None when the tokenizer has none (Qwen)."""
        return self.config.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The eos token text (for chat models usually the end-of-turn token)."""
        return self.config.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The pad token text, or None."""
        return self.config.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        """Id of bos_token, or None."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of eos_token, or None."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of pad_token; falls back to generation_config's pad_token_id; None when neither is set."""
        pad = self._special_id("pad_token")
        return pad if pad is not None else self.config.generation_pad_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos_token_id, then generation_config's eos ids, deduplicated in order."""
        ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + list(self.config.generation_eos_token_ids)
        return tuple(dict.fromkeys(ids))

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of every token marked special in tokenizer.json (those skip_special_tokens drops)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies tokenizer.json's post-processor (e.g. bos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids; skip_special_tokens drops tokens marked special."""
        ids = [int(i) for i in ids]  # accepts numpy / jax integer arrays
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # transformers 5 skips the legacy clean-up for BPE models because it corrupts their text.
        if self.config.clean_up_tokenization_spaces and not isinstance(self._backend.model, tokenizers.models.BPE):
            text = _clean_up_spaces(text)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each sequence."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    # -- chat --------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template, or None when none is configured."""
        return self.config.chat_templates.get(DEFAULT_TEMPLATE)

    @property
    def has_chat_template(self) -> bool:
        """Whether any chat template is configured (base models usually ship none)."""
        return bool(self.config.chat_templates)

    def _template_source(self, chat_template: str | None, tools) -> str:
        templates = self.config.chat_templates
        if chat_template is not None:  # a template name, or a template source
            return templates.get(chat_template, chat_template)
        if tools is not None and TOOL_USE_TEMPLATE in templates:
            return templates[TOOL_USE_TEMPLATE]
        if DEFAULT_TEMPLATE in templates:
            return templates[DEFAULT_TEMPLATE]
        if templates:
            raise ChatTemplateError(f"{self.name}: several chat templates {sorted(templates)} but no 'default'; "
                                    "pass chat_template=<name>")
        raise ChatTemplateError(f"{self.name}: no chat template configured (no chat_template in tokenizer_config.json "
                                "and no chat_template.jinja)")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, **template_kwargs) -> list[int] | str:
        """Renders `messages` with the chat template; returns ids, or the text when tokenize=False.

        Named special tokens (bos_token, eos_token, ...) are template variables; `template_kwargs`
        override them and add others (e.g. `enable_thinking=False`). `chat_template` picks a named
        template or passes a template source. Ids are the rendered text encoded without added
        special tokens, since templates write bos themselves.
        """
        source = self._template_source(chat_template, tools)
        variables = {**self.config.special_tokens, **template_kwargs}
        text = render_chat_template(source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"
