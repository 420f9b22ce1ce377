"""Prompt datasets: record formats, file readers and the grain pipeline."""

# The answer readers golds are taken with, re-exported from the one place rewards use too.
from areal_jax.answers import extract_hashes_answer, extract_last_boxed

from areal_jax.data.formats import (
    RECORD_FORMATS,
    PromptRow,
    PromptTemplate,
    RowFormatError,
    TemplateFieldError,
    detect_format,
    parse_record,
    solution_pair,
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
from areal_jax.data.sft_data import SFTEncoder, SFTExample, load_sft_examples
from areal_jax.data.sources import RawRecord, iter_records
from areal_jax.data.templating import PromptEncoder

__all__ = [
    "RECORD_FORMATS",
    "ChatTokenizer",
    "DataConfig",
    "LoadStats",
    "PromptDataset",
    "PromptEncoder",
    "PromptLoader",
    "PromptRow",
    "PromptTemplate",
    "RawRecord",
    "RowFormatError",
    "RowIssue",
    "SFTEncoder",
    "SFTExample",
    "TemplateFieldError",
    "TokenizedPrompt",
    "build_prompt_loader",
    "detect_format",
    "extract_hashes_answer",
    "extract_last_boxed",
    "iter_records",
    "load_sft_examples",
    "parse_record",
    "solution_pair",
]
