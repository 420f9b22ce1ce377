"""Prompt datasets as a checkpointable, per-process-sharded grain pipeline.

Construction makes one pre-pass over every file: read, parse, tokenize with the chat
template, and keep the rows that parse and fit `max_prompt_tokens`. Doing validity up
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
from collections.abc import Sequence
from typing import Any, Protocol

import grain
import numpy as np

from areal_jax.data.formats import RECORD_FORMATS, PromptRow, PromptTemplate, RowFormatError, parse_record
from areal_jax.data.sources import iter_records

logger = logging.getLogger(__name__)

# Issues logged one by one before the rest are only counted (all are kept in LoadStats).
_MAX_LOGGED_ISSUES = 20


class ChatTokenizer(Protocol):
    """What the loader needs from a tokenizer (areal_jax.models.tokenizer.Tokenizer fits)."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool, tokenize: bool
    ) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are turned into a stream.

    paths: JSONL / Parquet files or `datasets` directories, read in this order.
    format: "auto" (per row, from its keys) or one of "gsm8k", "math", "areal", "code".
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
        PromptTemplate(self.prompt_suffix, self.system_prompt)  # validates both

    @property
    def template(self) -> PromptTemplate:
        """The chat template settings of this config."""
        return PromptTemplate(self.prompt_suffix, self.system_prompt)


@dataclasses.dataclass(frozen=True)
class RowIssue:
    """A row left out of the dataset: `kind` is "malformed" or "too_long"."""

    source: str
    kind: str
    reason: str


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """Outcome of the pre-pass: rows read, rows kept, and every row left out and why."""

    rows_read: int
    rows_kept: int
    issues: tuple[RowIssue, ...]

    @property
    def num_malformed(self) -> int:
        """Rows that could not be read or parsed."""
        return sum(i.kind == "malformed" for i in self.issues)

    @property
    def num_too_long(self) -> int:
        """Rows whose prompt exceeded max_prompt_tokens."""
        return sum(i.kind == "too_long" for i in self.issues)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.rows_kept}/{self.rows_read} prompt rows kept; "
            f"{self.num_malformed} malformed, {self.num_too_long} over max_prompt_tokens"
        )


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A valid row with its templated prompt token ids (read-only int32)."""

    row: PromptRow
    prompt_ids: np.ndarray


class PromptDataset:
    """All valid prompt rows of a DataConfig, tokenized once; see the module docstring."""

    def __init__(self, config: DataConfig, tokenizer: ChatTokenizer):
        self.config = config
        self.prompts, self.stats = _load_prompts(config, tokenizer)
        logger.info("prompt data %s: %s", ", ".join(config.paths), self.stats.summary())
        if not self.prompts:
            raise ValueError(f"no usable prompt rows in {config.paths}: {self.stats.summary()}")

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
    config: DataConfig, tokenizer: ChatTokenizer, *, process_index: int = 0, process_count: int = 1
) -> PromptLoader:
    """Load, validate and tokenize the prompts of `config`; iterate this process's shard."""
    dataset = PromptDataset(config, tokenizer)
    return PromptLoader(dataset, dataset.map_dataset(process_index=process_index, process_count=process_count))


def _to_example(prompt: TokenizedPrompt) -> dict[str, Any]:
    # Fresh message dicts per example: a consumer editing them must not alter later epochs.
    row = dataclasses.replace(prompt.row, messages=[dict(m) for m in prompt.row.messages])
    return {"prompt_ids": prompt.prompt_ids, "row": row}


def _load_prompts(config: DataConfig, tokenizer: ChatTokenizer) -> tuple[list[TokenizedPrompt], LoadStats]:
    prompts: list[TokenizedPrompt] = []
    issues: list[RowIssue] = []
    rows_read = 0

    def skip(source: str, kind: str, reason: str) -> None:
        issues.append(RowIssue(source, kind, reason))
        if len(issues) <= _MAX_LOGGED_ISSUES:
            logger.warning("skipping %s row %s: %s", kind, source, reason)
        elif len(issues) == _MAX_LOGGED_ISSUES + 1:
            logger.warning("further skipped rows are counted, not logged")

    template = config.template
    for path in config.paths:
        for raw in iter_records(path):
            rows_read += 1
            if raw.error is not None:
                skip(raw.source, "malformed", raw.error)
                continue
            try:
                row = parse_record(raw.record, source=raw.source, fmt=config.format, template=template)
            except RowFormatError as err:
                skip(raw.source, "malformed", str(err))
                continue
            ids = _tokenize(tokenizer, row)
            if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
                skip(raw.source, "too_long", f"{len(ids)} prompt tokens > max_prompt_tokens={config.max_prompt_tokens}")
                continue
            prompts.append(TokenizedPrompt(row, ids))
    return prompts, LoadStats(rows_read, len(prompts), tuple(issues))


def _tokenize(tokenizer: ChatTokenizer, row: PromptRow) -> np.ndarray:
    ids = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, (list, tuple, np.ndarray)) or not all(isinstance(t, (int, np.integer)) for t in ids):
        raise TypeError(
            f"{type(tokenizer).__name__}.apply_chat_template(tokenize=True) must return a list of ints, "
            f"got {type(ids).__name__} for row {row.source}"
        )
    array = np.asarray(ids, dtype=np.int32)
    array.flags.writeable = False  # shared across epochs
    return array
