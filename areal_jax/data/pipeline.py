"""Prompt datasets as a checkpointable, per-process-sharded grain pipeline.

Construction makes one pre-pass over every file: read, parse, tokenize (`PromptEncoder`: the
chat template, or `prompt_template` for a base model), and keep the rows that parse and fit
`max_prompt_tokens` (and, for a run, leave its engine a position for a new token). Doing validity up
front (instead of a grain `filter`) is deliberate:

- the counts of malformed and over-long rows are exact and known before training starts
  (a lazy filter only counts what it has reached, and its counters live in whichever
  process/thread ran it, so they are lost on resume);
- the pipeline then holds only valid rows, so a global position maps to a row with no
  holes, and sharding can hand each process exactly the same number of prompts per epoch;
- prompt datasets are small (tens of thousands of rows), so this costs seconds.

Order: grain shuffles the global list of valid rows with `seed` (a fresh permutation per
epoch: grain uses seed + epoch), then process p takes global positions p, p + P, p + 2P...
Every process computes the same permutation, so shards are disjoint and their union is
the epoch. With `even_shards` the epoch's last N mod P rows are left out so that all
processes see the same count (they would otherwise drift apart by one per epoch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grain
import numpy as np

from areal_jax.data.formats import RECORD_FORMATS, PromptRow, PromptTemplate, RowFormatError, parse_record
from areal_jax.data.sources import iter_records
from areal_jax.data.templating import PromptEncoder, TemplateTokenizer, check_chat_template_kwargs

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Issues logged one by one before the rest are only counted (all are kept in LoadStats).
_MAX_LOGGED_ISSUES = 20


ChatTokenizer = TemplateTokenizer  # what the loader needs from a tokenizer


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are turned into a stream.

    paths: JSONL / Parquet files or `datasets` directories, read in this order.
    format: "auto" (per row, from its keys) or one of "gsm8k", "math", "areal", "code".
    prompt_suffix / system_prompt: appended to the user turn / a system turn of the chat template.
    prompt_template: for base models without a chat template: the whole prompt, a format string over
        the row's fields, e.g. 'Question: {question}\\nAnswer:' for GSM8K ('{problem}' for MATH),
        encoded with the tokenizer's bos. Exclusive with the two fields above.
    chat_template_kwargs: variables passed to the chat template, e.g. {"enable_thinking": False}
        for Qwen3.
    max_prompt_tokens: rows whose templated prompt is longer are skipped (None: no cap).
    seed: shuffle seed, in [0, 2**32); all processes must use the same one.
    num_epochs: passes over the data; None repeats forever.
    even_shards: drop each epoch's N mod process_count leftover rows so every process
        gets the same number of prompts (keep it on for training; off for evaluation).
    """

    paths: tuple[str, ...]
    format: str = "auto"
    prompt_suffix: str = ""
    system_prompt: str | None = None
    prompt_template: str | None = None
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_prompt_tokens: int | None = None
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    even_shards: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.paths, str) or not isinstance(self.paths, Sequence):
            raise TypeError(f"DataConfig.paths must be a sequence of paths, got {self.paths!r}")
        object.__setattr__(self, "paths", tuple(self.paths))  # lists from CLI/gin become tuples
        if not self.paths or not all(isinstance(p, str) and p for p in self.paths):
            raise ValueError(f"DataConfig.paths must be non-empty strings, got {self.paths!r}")
        if self.format not in RECORD_FORMATS:
            raise ValueError(f"DataConfig.format={self.format!r}; expected one of {RECORD_FORMATS}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError(f"DataConfig.max_prompt_tokens must be positive or None, got {self.max_prompt_tokens}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"DataConfig.seed must be in [0, 2**32), got {self.seed}")
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise ValueError(f"DataConfig.num_epochs must be positive or None, got {self.num_epochs}")
        try:
            self.template  # validates the three template fields together
            check_chat_template_kwargs(self.chat_template_kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"DataConfig.{err}") from None
        if self.prompt_template is not None and self.chat_template_kwargs:
            raise ValueError("DataConfig.chat_template_kwargs apply to a chat template; DataConfig.prompt_template "
                             "replaces it")
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs))  # own copy

    @property
    def template(self) -> PromptTemplate:
        """How rows become prompts under this config."""
        return PromptTemplate(self.prompt_suffix, self.system_prompt, self.prompt_template)

    def prompt_encoder(self, tokenizer: TemplateTokenizer) -> PromptEncoder:
        """Prompt -> token ids for `tokenizer`; ValueError naming its directory when it has no chat template and
        prompt_template is unset."""
        return PromptEncoder(tokenizer, prompt_template=self.prompt_template,
                             chat_template_kwargs=self.chat_template_kwargs)


@dataclasses.dataclass(frozen=True)
class RowIssue:
    """A row left out of the dataset: `kind` is "malformed", "too_long" (over the length limit) or
    "no_room" (its prompt leaves the generation engine no position for a new token)."""

    source: str
    kind: str
    reason: str


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """Outcome of the pre-pass: rows read, rows kept, and every row left out and why."""

    rows_read: int
    rows_kept: int
    issues: tuple[RowIssue, ...]
    noun: str = "prompt rows"  # what was kept
    limit: str = "max_prompt_tokens"  # the length limit "too_long" rows exceeded

    @property
    def num_malformed(self) -> int:
        """Rows that could not be read or parsed."""
        return sum(i.kind == "malformed" for i in self.issues)

    @property
    def num_too_long(self) -> int:
        """Rows longer than the length limit."""
        return sum(i.kind == "too_long" for i in self.issues)

    @property
    def num_no_room(self) -> int:
        """Rows whose prompt fills the engine's EngineConfig.max_seq_len."""
        return sum(i.kind == "no_room" for i in self.issues)

    def summary(self) -> str:
        """One line for logs."""
        no_room = f", {self.num_no_room} with no room for a new token" if self.num_no_room else ""
        return (
            f"{self.rows_kept}/{self.rows_read} {self.noun} kept; "
            f"{self.num_malformed} malformed, {self.num_too_long} over {self.limit}{no_room}"
        )

    def why_unusable(self) -> str:
        """The summary with the first reason of each kind, for the error when nothing is usable."""
        examples = []
        for kind in ("malformed", "too_long", "no_room"):
            first = next((i for i in self.issues if i.kind == kind), None)
            if first is not None:
                examples.append(f"{first.source}: {first.reason}")
        return self.summary() + (f" (e.g. {'; '.join(examples)})" if examples else "")


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A valid row with its templated prompt token ids (read-only int32)."""

    row: PromptRow
    prompt_ids: np.ndarray


class PromptDataset:
    """All valid prompt rows of a DataConfig, tokenized once; see the module docstring."""

    def __init__(self, config: DataConfig, tokenizer: ChatTokenizer, *, max_seq_len: int | None = None):
        """max_seq_len: the generation engine's EngineConfig.max_seq_len; a row whose prompt leaves
        it no position for a new token is left out, with one warning and a count (each would
        otherwise fail at generation, on every pass over the data)."""
        self.config = config
        self.prompts, self.stats = _load_prompts(config, tokenizer)
        if max_seq_len is not None:
            self.prompts, self.stats = _fitting(self.prompts, self.stats, max_seq_len, config.paths)
        logger.info("prompt data %s: %s", ", ".join(config.paths), self.stats.summary())
        if not self.prompts:
            raise ValueError(f"no usable prompt rows in {', '.join(config.paths)}: {self.stats.why_unusable()}")

    def __len__(self) -> int:
        return len(self.prompts)

    def map_dataset(self, *, process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
        """This process's stream of examples as a grain MapDataset (length: its total count)."""
        if process_count <= 0 or not 0 <= process_index < process_count:
            raise ValueError(f"bad process_index={process_index} / process_count={process_count}")
        n = len(self.prompts)
        end = (n // process_count) * process_count if self.config.even_shards else n
        if end <= process_index:
            raise ValueError(
                f"{n} prompt rows cannot feed {process_count} processes "
                f"(process {process_index} would get none; even_shards={self.config.even_shards})"
            )
        ds = grain.MapDataset.source(self.prompts)
        if self.config.shuffle:
            ds = ds.shuffle(seed=self.config.seed)
        # Indices past the slice's length map to later epochs of the parent, so the
        # repeated slice walks epoch e of the shuffle (seed + e) with the same stride.
        ds = ds[process_index:end:process_count]
        ds = ds.repeat(self.config.num_epochs)
        return ds.map(_to_example)


class PromptLoader:
    """Iterator over this process's prompt examples, with checkpointable position.

    Each example is ``{"prompt_ids": np.int32 array, "row": PromptRow}``. `iterator` is
    the underlying grain DatasetIterator: pass it to ``grain.checkpoint.CheckpointSave``
    (or use get_state / set_state here) to save and resume the exact position.
    """

    def __init__(self, dataset: PromptDataset, map_dataset: grain.MapDataset):
        self.dataset = dataset
        self.map_dataset = map_dataset
        # In-memory rows: reading threads would only add overhead and nondeterminism risk.
        read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self.iterator = map_dataset.to_iter_dataset(read_options).__iter__()

    @property
    def stats(self) -> LoadStats:
        """Counts from the pre-pass (rows kept, malformed, too long)."""
        return self.dataset.stats

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self.iterator)

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable position of the iterator."""
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume at a position from get_state (of a loader with the same config)."""
        self.iterator.set_state(state)


def build_prompt_loader(
    config: DataConfig, tokenizer: ChatTokenizer, *, process_index: int = 0, process_count: int = 1,
    max_seq_len: int | None = None,
) -> PromptLoader:
    """Load, validate and tokenize the prompts of `config`; iterate this process's shard.
    max_seq_len: leave out rows that cannot fit the engine (`PromptDataset`)."""
    dataset = PromptDataset(config, tokenizer, max_seq_len=max_seq_len)
    return PromptLoader(dataset, dataset.map_dataset(process_index=process_index, process_count=process_count))


def _to_example(prompt: TokenizedPrompt) -> dict[str, Any]:
    # Fresh message dicts per example: a consumer editing them must not alter later epochs.
    row = dataclasses.replace(prompt.row, messages=[dict(m) for m in prompt.row.messages])
    return {"prompt_ids": prompt.prompt_ids, "row": row}


def scan_rows(paths: Sequence[str], make: Callable[[Mapping[str, Any], str], T],
              too_long: Callable[[T], str | None], *, noun: str, limit: str) -> tuple[list[T], LoadStats]:
    """Every row of `paths` through `make(record, source)` (RowFormatError: the row is malformed),
    kept unless `too_long(item)` gives a reason; returns the kept items in file order and the counts."""
    items: list[T] = []
    issues: list[RowIssue] = []
    rows_read = 0

    def skip(source: str, kind: str, reason: str) -> None:
        issues.append(RowIssue(source, kind, reason))
        if len(issues) <= _MAX_LOGGED_ISSUES:
            logger.warning("skipping %s row %s: %s", kind, source, reason)
        elif len(issues) == _MAX_LOGGED_ISSUES + 1:
            logger.warning("further skipped rows are counted, not logged")

    for path in paths:
        for raw in iter_records(path):
            rows_read += 1
            if raw.error is not None:
                skip(raw.source, "malformed", raw.error)
                continue
            try:
                item = make(raw.record, raw.source)
            except RowFormatError as err:
                skip(raw.source, "malformed", str(err))
                continue
            reason = too_long(item)
            if reason is not None:
                skip(raw.source, "too_long", reason)
                continue
            items.append(item)
    return items, LoadStats(rows_read, len(items), tuple(issues), noun=noun, limit=limit)


def _load_prompts(config: DataConfig, tokenizer: ChatTokenizer) -> tuple[list[TokenizedPrompt], LoadStats]:
    template = config.template
    encoder = config.prompt_encoder(tokenizer)
    cap = config.max_prompt_tokens

    def make(record: Mapping[str, Any], source: str) -> TokenizedPrompt:
        row = parse_record(record, source=source, fmt=config.format, template=template)
        return TokenizedPrompt(row, _tokenize(encoder, row))

    def too_long(prompt: TokenizedPrompt) -> str | None:
        n = len(prompt.prompt_ids)
        return f"{n} prompt tokens > max_prompt_tokens={cap}" if cap is not None and n > cap else None

    return scan_rows(config.paths, make, too_long, noun="prompt rows", limit="max_prompt_tokens")


def _fitting(prompts: list[TokenizedPrompt], stats: LoadStats, max_seq_len: int,
             files: Sequence[str]) -> tuple[list[TokenizedPrompt], LoadStats]:
    """The prompts with room for a new token within `max_seq_len`; the rest counted, one warning."""
    kept = [p for p in prompts if len(p.prompt_ids) < max_seq_len]
    if len(kept) == len(prompts):
        return prompts, stats
    left = [p for p in prompts if len(p.prompt_ids) >= max_seq_len]
    issues = tuple(RowIssue(p.row.source, "no_room", f"{len(p.prompt_ids)} prompt tokens >= EngineConfig.max_seq_len"
                            f"={max_seq_len}") for p in left)
    longest = max(len(p.prompt_ids) for p in left)
    logger.warning("%d of %d prompt rows of %s left out: their prompt leaves no room for a new token within "
                   "EngineConfig.max_seq_len = %d (the first: %s; the longest: %d tokens)", len(left), len(prompts),
                   ", ".join(files), max_seq_len, left[0].row.source, longest)
    return kept, dataclasses.replace(stats, rows_kept=len(kept), issues=stats.issues + issues)


def _tokenize(encoder: PromptEncoder, row: PromptRow) -> np.ndarray:
    ids = encoder.prompt_ids(row.messages)
    if not isinstance(ids, (list, tuple, np.ndarray)) or not all(isinstance(t, (int, np.integer)) for t in ids):
        raise TypeError(
            f"{type(encoder.tokenizer).__name__} must return a list of ints for a prompt, "
            f"got {type(ids).__name__} for row {row.source}"
        )
    array = np.asarray(ids, dtype=np.int32)
    array.flags.writeable = False  # shared across epochs
    return array
