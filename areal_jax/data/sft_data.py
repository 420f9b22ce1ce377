"""SFT data: rows of files -> token sequences, each with the mask of the tokens the loss trains.

Rows (auto-detected per row, or DataConfig.format):

- GSM8K (`question`/`answer`), MATH (`problem`/`solution`), AReaL (`prompt`/`solutions`, the
  first one): the prompt is built exactly as for RL (`DataConfig.prompt_encoder`), and the whole
  solution is the completion, reasoning and final answer alike.
- chat (`messages`: a list of {role, content}): every assistant turn is trained, the rest is context.

With a chat template, a question/solution row is the chat [user: question, assistant: solution],
and an assistant turn's tokens are what the template adds for it: the text of the conversation
through that turn minus the text of its prompt (the conversation before it plus the generation
prompt), end-of-turn token included, so the model learns to stop (a newline after it is context). Pieces are encoded one at a
time, the way generation meets them: the first prompt's ids equal the RL prompt's ids. A template
that renders earlier turns differently once later ones follow (Qwen3 drops their reasoning) cannot
be cut into pieces; then the last such turn's prompt, as the template renders it, is all context.

With `DataConfig.prompt_template` (base models): prompt text (with bos) + " " + solution + eos;
no space is added when the prompt ends in whitespace. Chat rows need a chat template.

Every row is read and tokenized up front, like prompts (data/pipeline.py): malformed rows and rows
longer than the packed row are counted and skipped, and no usable row at all is an error naming the
files and why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from areal_jax.data.formats import RowFormatError, solution_pair
from areal_jax.data.pipeline import DataConfig, LoadStats, scan_rows
from areal_jax.data.templating import PromptEncoder, TemplateTokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training sequence: `ids` [N] int32 and `trained` [N] bool (token n is a target of the
    loss: a completion token). Token 0 is never trained: nothing before it predicts it."""

    ids: np.ndarray
    trained: np.ndarray
    source: str = ""

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids, np.int32).reshape(-1)
        trained = np.asarray(self.trained, bool).reshape(-1)
        if ids.shape != trained.shape:
            raise ValueError(f"SFTExample {self.source}: ids {ids.shape} and trained {trained.shape} differ in length")
        if ids.size < 2 or trained[0] or not trained.any():
            raise ValueError(f"SFTExample {self.source}: needs a non-empty prompt and at least one trained token")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "trained", trained)

    @classmethod
    def from_pair(cls, prompt_ids: Sequence[int], completion_ids: Sequence[int], source: str = "") -> SFTExample:
        """A prompt followed by a completion, the completion trained."""
        prompt, completion = np.asarray(prompt_ids, np.int32).reshape(-1), np.asarray(completion_ids, np.int32).reshape(-1)
        if prompt.size == 0 or completion.size == 0:
            raise ValueError(f"examples need a non-empty prompt and completion, got {prompt.size} and "
                             f"{completion.size} tokens")
        return cls(np.concatenate([prompt, completion]),
                   np.concatenate([np.zeros(prompt.size, bool), np.ones(completion.size, bool)]), source)


class SFTEncoder:
    """Rows -> SFTExample under a DataConfig's templates (see the module docstring)."""

    def __init__(self, config: DataConfig, tokenizer: TemplateTokenizer):
        self.config, self.template = config, config.template
        self.encoder: PromptEncoder = config.prompt_encoder(tokenizer)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        if not self.encoder.uses_chat_template and self.eos_id is None:
            name = getattr(tokenizer, "name", type(tokenizer).__name__)
            raise ValueError(f"the tokenizer in {name} has no eos_token: SFT completions after "
                             "DataConfig.prompt_template must end with one")

    def example(self, record: Mapping[str, Any], source: str) -> SFTExample:
        """The example of one record; RowFormatError when the record cannot be one."""
        if self.config.format == "auto" and record.get("messages") is not None:
            pieces = self._chat_pieces(_chat_messages(record["messages"]))
        else:
            question, solution = solution_pair(record, self.config.format)
            if self.encoder.uses_chat_template:
                prompt = self.template.row_messages(record, question, source)
                pieces = self._chat_pieces(prompt + [{"role": "assistant", "content": solution}])
            else:
                text = self.template.fill(record, source)
                prompt_ids = self.encoder.prompt_ids([{"role": "user", "content": text}])
                sep = "" if text[-1:].isspace() else " "
                completion = self.encoder.text_ids(sep + solution) + [self.eos_id]
                return SFTExample.from_pair(prompt_ids, completion, source)
        ids = [self.encoder.text_ids(text) for text, _ in pieces]
        trained = [np.full(len(piece), flag) for piece, (_, flag) in zip(ids, pieces)]
        return SFTExample(np.concatenate([np.asarray(i, np.int32) for i in ids]), np.concatenate(trained), source)

    def _chat_pieces(self, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
        """(text, trained) pieces of a conversation whose assistant turns are trained."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise RowFormatError("field 'messages' has no assistant turn to train on")
        if turns[0] == 0:
            raise RowFormatError("field 'messages' starts with an assistant turn: no prompt precedes it")
        if not self.encoder.uses_chat_template:
            raise RowFormatError("chat rows need the model's chat template, and DataConfig.prompt_template is set")
        built, pieces = "", []
        for i in turns:
            prompt = self._render(messages[:i], True)
            through = self._render(messages[:i + 1], False)
            if not through.startswith(prompt) or through == prompt:
                raise RowFormatError(f"the chat template does not render assistant turn {i} as a continuation of "
                                     "its prompt")
            if prompt.startswith(built):
                pieces.append((prompt[len(built):], False))
            else:  # earlier turns re-rendered differently: all of it is context now
                pieces = [(prompt, False)]
            turn = through[len(prompt):]
            # The newline a template writes after the end-of-turn token is context: generation stops
            # at that token, so nothing ever predicts what follows it.
            kept = turn.rstrip("\n") or turn
            pieces += [(kept, True), (turn[len(kept):], False)]
            built = through
        return [(text, flag) for text, flag in pieces if text]

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.encoder.chat_text(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as err:  # the template refused the conversation (e.g. roles not alternating)
            raise RowFormatError(str(err)) from None


def _chat_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise RowFormatError("field 'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowFormatError(f"messages[{i}] must be an object with string 'role' and 'content'")
        # Other keys (reasoning_content, tool_calls...) are the template's to read; Parquet and
        # `datasets` give every message every key, None where it had none.
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def load_sft_examples(config: DataConfig, tokenizer: TemplateTokenizer, *, max_len: int,
                      limit_name: str = "SFTConfig.max_len") -> tuple[list[SFTExample], LoadStats]:
    """Every usable example of `config.paths`, in file order, with the load's counts.

    max_len: tokens a packed row holds; a sequence of N tokens fills N - 1 positions (inputs are
    the sequence without its last token), so longer ones are skipped as "too_long". Raises
    ValueError naming the files and why when no row is usable.
    """
    sft = SFTEncoder(config, tokenizer)

    def too_long(example: SFTExample) -> str | None:
        n = example.ids.size
        return f"{n} tokens > {limit_name} + 1 = {max_len + 1}" if n - 1 > max_len else None

    examples, stats = scan_rows(config.paths, sft.example, too_long, noun="SFT rows", limit=limit_name)
    logger.info("SFT data %s: %s", ", ".join(config.paths), stats.summary())
    if not examples:
        raise ValueError(f"no usable SFT examples in {', '.join(config.paths)}: {stats.why_unusable()}")
    return examples, stats
