"""Datasets in verl's parquet/jsonl schema: validation, prompt rendering, resumable loading."""

from rlcore.chat import prompt_ids, render_prompt
from rlcore.data.dataset import PromptItem, RLDataset
from rlcore.data.io import check_data_file, peek_fields, peek_rows, read_column, read_rows, write_rows
from rlcore.data.loader import PromptLoader, collate_prompts
from rlcore.data.schema import (
    RL_FIELDS,
    DataError,
    DatasetError,
    DataValidationError,
    UnreadableRow,
    apply_policy,
    validate_row,
    validate_rows,
)

__all__ = [
    "RL_FIELDS", "DataError", "DataValidationError", "DatasetError", "PromptItem", "PromptLoader", "RLDataset",
    "UnreadableRow", "apply_policy", "check_data_file", "collate_prompts", "peek_fields", "peek_rows", "prompt_ids",
    "read_column", "read_rows", "render_prompt", "validate_row", "validate_rows", "write_rows",
]
