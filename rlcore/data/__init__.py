"""Datasets in verl's parquet/jsonl schema: validation, prompt rendering, resumable loading."""

from rlcore.data.chat import prompt_ids, render_prompt
from rlcore.data.dataset import PromptItem, RLDataset
from rlcore.data.io import read_rows, write_rows
from rlcore.data.loader import PromptLoader, collate_prompts
from rlcore.data.schema import DataError, DataValidationError, apply_policy, validate_row, validate_rows

__all__ = [
    "DataError", "DataValidationError", "PromptItem", "PromptLoader", "RLDataset", "apply_policy",
    "collate_prompts", "prompt_ids", "read_rows", "render_prompt", "validate_row", "validate_rows", "write_rows",
]
