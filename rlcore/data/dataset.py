"""`RLDataset`: prompts from verl-schema files, validated, rendered and tokenized once.

Over-long prompts are dropped (counted and logged, like verl's overlong filter) or raise, by
choice; bad rows raise with every problem listed, or are skipped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlcore.chat import as_messages, prompt_ids
from rlcore.data.io import read_rows
from rlcore.data.schema import BadRowPolicy, DataError, DatasetError, DataValidationError, apply_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptItem:
    """One prompt, ready for rollout. `index` is its stable position in the dataset."""

    index: int
    input_ids: list[int]
    raw_prompt: str
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    file: str = ""
    row: int = -1
    messages: list[dict[str, str]] = field(default_factory=list)  # the prompt as chat messages (a reward model renders them itself)


class RLDataset:
    """All prompts of `files`, in file order then row order."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int,
        apply_chat_template: bool = True,
        on_bad_row: BadRowPolicy = "error",
        on_long_prompt: Literal["drop", "error"] = "drop",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        if not files:
            raise ValueError("RLDataset needs at least one file")
        if on_long_prompt not in ("drop", "error"):
            raise ValueError(f"on_long_prompt must be 'drop' or 'error', got {on_long_prompt!r}")
        self.files = [str(f) for f in files]
        self.max_prompt_length = max_prompt_length
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id: int = pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)
        self.items: list[PromptItem] = []
        self.bad_rows: list[DataError] = []
        self.stats = {"rows_read": 0, "bad_rows": 0, "too_long": 0, "kept": 0}
        too_long: list[DataError] = []
        for file in self.files:
            rows = read_rows(file, keep_unreadable=True)  # undecodable rows: reported or skipped below
            self.stats["rows_read"] += len(rows)
            good, errors = apply_policy(rows, file, on_bad_row)
            self.bad_rows.extend(errors)
            self.stats["bad_rows"] += len({e.row for e in errors})
            for row_idx, row in good:
                text, ids = prompt_ids(row["prompt"], tokenizer, apply_chat_template, tools)
                if len(ids) > max_prompt_length:
                    too_long.append(DataError(file, row_idx, "prompt",
                                              f"{len(ids)} tokens, longer than max_prompt_length={max_prompt_length}"))
                    continue
                self.items.append(PromptItem(
                    index=len(self.items),
                    input_ids=ids,
                    raw_prompt=text,
                    data_source=row["data_source"],
                    ground_truth=row["reward_model"]["ground_truth"],
                    extra_info=dict(row.get("extra_info") or {}),
                    file=file,
                    row=row_idx,
                    messages=as_messages(row["prompt"]),
                ))
        if too_long and on_long_prompt == "error":
            raise DataValidationError(too_long)
        self.stats["too_long"] = len(too_long)
        self.stats["kept"] = len(self.items)
        if self.stats["bad_rows"]:
            log.warning("skipped %d bad row(s) in %s; first: %s", self.stats["bad_rows"], self.files, self.bad_rows[0])
        if too_long:
            log.warning("dropped %d prompt(s) longer than %d tokens; first: %s", len(too_long), max_prompt_length, too_long[0])
        if not self.items:
            raise DatasetError(f"no usable prompts in {self.files} (stats: {self.stats})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]
