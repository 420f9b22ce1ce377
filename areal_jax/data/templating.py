"""Prompts as token ids: through the tokenizer's chat template, or a plain format string for base
models (Llama 3 base and the like ship no chat template).

`PromptEncoder` is the one place that decides which: RL prompts, evaluation prompts and SFT
sequences all go through it, so the three see the same prompt for the same row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class TemplateTokenizer(Protocol):
    """What the encoder needs from a tokenizer (areal_jax.models.tokenizer.Tokenizer fits)."""

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool,
                            **template_kwargs: Any) -> list[int] | str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def has_chat_template(tokenizer: Any) -> bool:
    """Whether `tokenizer` can render chat messages (tokenizers without the property are assumed to)."""
    return bool(getattr(tokenizer, "has_chat_template", True))


def check_chat_template_kwargs(kwargs: Any) -> None:
    """`chat_template_kwargs` must be a dict of template variable names to JSON-like values."""
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(kwargs).__name__}")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"chat_template_kwargs keys must be template variable names, got {key!r}")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(f"chat_template_kwargs[{key!r}] must be JSON-like data, got {value!r}") from None


class PromptEncoder:
    """Turns a row's prompt into token ids, and renders chat text for SFT's assistant spans.

    prompt_template set: the row's prompt text (`PromptTemplate.fill`) encoded with the tokenizer's
    special tokens (a base model's bos). Otherwise the chat template with the generation prompt,
    `chat_template_kwargs` passed to it as template variables (e.g. enable_thinking=False for Qwen3).
    A tokenizer with no chat template and no prompt_template is an error naming its directory and
    both fields.
    """

    def __init__(self, tokenizer: TemplateTokenizer, *, prompt_template: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.uses_chat_template = prompt_template is None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        check_chat_template_kwargs(self.chat_template_kwargs)
        if self.uses_chat_template and not has_chat_template(tokenizer):
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
            raise ValueError(
                f"the tokenizer in {name} has no chat template (a base model?): set DataConfig.prompt_template to "
                "a format string over the rows' fields, e.g. 'Question: {question}\\nAnswer:', or use a model that "
                "ships a chat template (DataConfig.chat_template_kwargs are passed to it)")

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of the prompt that generation continues."""
        if not self.uses_chat_template:
            return self.tokenizer.encode(messages[-1]["content"], add_special_tokens=True)
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                  **self.chat_template_kwargs)

    def chat_text(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool) -> str:
        """The chat template's text of `messages` (chat template only)."""
        if not self.uses_chat_template:
            raise ValueError("chat rows need the model's chat template; DataConfig.prompt_template is set")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **self.chat_template_kwargs)

    def text_ids(self, text: str) -> list[int]:
        """Ids of a piece of text inside a sequence (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)
