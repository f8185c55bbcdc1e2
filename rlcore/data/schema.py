"""Row validation for verl-schema RL datasets, with errors that say where and what.

A row is `{"prompt": str | [{"role", "content"}, ...], "data_source": str,
"reward_model": {"ground_truth": str, "style": "rule"}, "extra_info": dict (optional)}`.
Validation reports every bad row, so a user fixes a file in one pass instead of one row per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rlcore.errors import RLCoreError

ROLES = ("system", "user", "assistant", "tool")
BadRowPolicy = Literal["error", "skip"]
# The top-level fields every RL row must have (what a file's columns are checked against before loading).
RL_FIELDS = ("prompt", "data_source", "reward_model")


class DatasetError(RLCoreError, ValueError):
    """A dataset file that cannot be used (missing, unreadable, no usable rows); the message names
    the file. `DataError` (one row) and `DataValidationError` (many rows) are its kinds."""


class DataError(DatasetError):
    """One problem in one row: `str()` names the file, the row index and the field."""

    def __init__(self, file: str, row: int, field: str, message: str) -> None:
        self.file, self.row, self.field, self.message = str(file), row, field, message
        super().__init__(f"{self.file}: row {row}: field '{field}': {message}")

    def __reduce__(self):  # keep the four fields through pickling (Ray, multiprocessing)
        return (DataError, (self.file, self.row, self.field, self.message))


class DataValidationError(DatasetError):
    """All the bad rows of a file (policy "error"); `.errors` holds each `DataError`."""

    MAX_LISTED = 20

    def __init__(self, errors: list[DataError]) -> None:
        self.errors = list(errors)
        lines = [str(e) for e in self.errors[: self.MAX_LISTED]]
        more = len(self.errors) - len(lines)
        if more > 0:
            lines.append(f"... and {more} more")
        rows = len({(e.file, r) for e in self.errors for r in getattr(e, "rows", (e.row,))})  # a grouped error: its rows
        head = f"{rows} bad row(s) in the dataset:"  # one problem (of one or many rows): one line
        super().__init__(f"{head} {lines[0]}" if len(lines) == 1 else f"{head}\n  " + "\n  ".join(lines))

    def __reduce__(self):
        return (DataValidationError, (self.errors,))


@dataclass(frozen=True)
class UnreadableRow:
    """Stands in for a row whose bytes could not be decoded (not UTF-8, not JSON), at the row's own
    index, so validation reports its errors beside the others and `on_bad_row` decides its fate."""

    errors: tuple[DataError, ...]


def type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def validate_prompt(prompt: Any, file: str, row: int) -> list[DataError]:
    if prompt is None:
        return [DataError(file, row, "prompt", "missing (required: a string or a list of chat messages)")]
    if isinstance(prompt, str):
        return [] if prompt.strip() else [DataError(file, row, "prompt", "empty prompt")]
    if hasattr(prompt, "tolist") and not isinstance(prompt, dict):  # numpy arrays from pandas
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        return [DataError(file, row, "prompt", f"expected a string or a list of messages, got {type_name(prompt)}")]
    if not prompt:
        return [DataError(file, row, "prompt", "empty prompt (no messages)")]
    errors = []
    for i, msg in enumerate(prompt):
        where = f"prompt[{i}]"
        if not isinstance(msg, dict):
            errors.append(DataError(file, row, where, f"expected a message {{'role', 'content'}}, got {type_name(msg)}"))
            continue
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            errors.append(DataError(file, row, f"{where}.role", f"bad role {role!r} (expected one of {', '.join(ROLES)})"))
        if not isinstance(content, str):
            errors.append(DataError(file, row, f"{where}.content", f"expected a string, got {type_name(content)}"))
    if not errors and not any(m["content"].strip() for m in prompt):
        errors.append(DataError(file, row, "prompt", "empty prompt (every message's content is empty)"))
    return errors


def check_extra_info(row: dict, file: str, index: int) -> list[DataError]:
    """`extra_info` is optional; when present it must be an object (RL and preference rows)."""
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        return [DataError(file, index, "extra_info", f"expected an object or null, got {type_name(extra)}")]
    return []


def validate_row(row: Any, file: str, index: int) -> list[DataError]:
    """Every problem found in one row (empty list: the row is good)."""
    if isinstance(row, UnreadableRow):
        return list(row.errors)
    if not isinstance(row, dict):
        return [DataError(file, index, "<row>", f"expected an object, got {type_name(row)}")]
    errors = validate_prompt(row.get("prompt"), file, index)
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        msg = "missing" if source is None else f"expected a non-empty string, got {type_name(source)} {source!r}"
        errors.append(DataError(file, index, "data_source", msg))
    rm = row.get("reward_model")
    if not isinstance(rm, dict):
        msg = "missing" if rm is None else f"expected an object with 'ground_truth', got {type_name(rm)}"
        errors.append(DataError(file, index, "reward_model", msg))
    else:
        gt = rm.get("ground_truth")
        if gt is None:
            errors.append(DataError(file, index, "reward_model.ground_truth", "missing"))
        elif not isinstance(gt, str):
            errors.append(DataError(file, index, "reward_model.ground_truth",
                                    f"expected a string, got {type_name(gt)} {gt!r} (write it as \"{gt}\")"))
        style = rm.get("style")
        if style is not None and not isinstance(style, str):
            errors.append(DataError(file, index, "reward_model.style", f"expected a string, got {type_name(style)}"))
    errors.extend(check_extra_info(row, file, index))
    return errors


def validate_rows(rows: Iterable[Any], file: str) -> list[DataError]:
    """Every problem in every row of `file`, in row order."""
    errors: list[DataError] = []
    for i, row in enumerate(rows):
        errors.extend(validate_row(row, file, i))
    return errors


def apply_policy(rows: list[Any], file: str, on_bad_row: BadRowPolicy = "error") -> tuple[list[tuple[int, dict]], list[DataError]]:
    """(good rows with their row index, errors). "error" raises `DataValidationError` listing
    every bad row; "skip" drops bad rows and returns their errors for counting and reporting."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    good: list[tuple[int, dict]] = []
    errors: list[DataError] = []
    for i, row in enumerate(rows):
        row_errors = validate_row(row, file, i)
        if row_errors:
            errors.extend(row_errors)
        else:
            good.append((i, row))
    if errors and on_bad_row == "error":
        raise DataValidationError(errors)
    return good, errors
