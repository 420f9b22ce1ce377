"""Prompt datasets: record formats, file readers and the grain pipeline."""

from areal_jax.data.formats import (
    RECORD_FORMATS,
    PromptRow,
    PromptTemplate,
    RowFormatError,
    detect_format,
    extract_gsm8k_answer,
    extract_last_boxed,
    parse_record,
)
from areal_jax.data.pipeline import (
    ChatTokenizer,
    DataConfig,
    LoadStats,
    PromptDataset,
    PromptLoader,
    RowIssue,
    TokenizedPrompt,
    build_prompt_loader,
)
from areal_jax.data.sources import RawRecord, iter_records

__all__ = [
    "RECORD_FORMATS",
    "ChatTokenizer",
    "DataConfig",
    "LoadStats",
    "PromptDataset",
    "PromptLoader",
    "PromptRow",
    "PromptTemplate",
    "RawRecord",
    "RowFormatError",
    "RowIssue",
    "TokenizedPrompt",
    "build_prompt_loader",
    "detect_format",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "iter_records",
    "parse_record",
]
