"""Preference datasets for DPO (pairwise) and KTO (unpaired): validation, tokenizing, batches.

Rows (parquet or JSON lines):
- pairwise: `{"prompt": str | [messages], "chosen": completion, "rejected": completion}`
- unpaired: `{"prompt": str | [messages], "completion": completion, "label": bool}` (true: desirable)
A completion is a string or a list of assistant messages (their contents are concatenated).
Optional `data_source` (str) and `extra_info` (object) are kept as metadata; a pairwise row may
carry a `margin` (a number >= 0: by how much a reward model must score chosen above rejected).

A completion is tokenized without special tokens and closed with EOS, the same shape as an RL
response (`responses`/`response_mask` with EOS inside the mask), so sequence log-probs go through
exactly the per-token log-prob path of RL.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from rlcore.chat import as_messages, prompt_ids
from rlcore.data.io import read_rows
from rlcore.data.loader import PromptLoader
from rlcore.data.schema import (
    BadRowPolicy,
    DataError,
    DatasetError,
    DataValidationError,
    UnreadableRow,
    check_extra_info,
    type_name,
    validate_prompt,
)
from rlcore.protocol import Batch

log = logging.getLogger(__name__)

PreferenceKind = Literal["pairwise", "unpaired"]
KINDS = ("pairwise", "unpaired")
# The top-level fields each kind's rows must have (what a file's columns are checked against before loading).
PREFERENCE_FIELDS: dict[PreferenceKind, tuple[str, ...]] = {
    "pairwise": ("prompt", "chosen", "rejected"), "unpaired": ("prompt", "completion", "label")}
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


# ----------------------------------------------------------------------------- validation
def _completion_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "".join(m["content"] for m in value)


def _validate_completion(value: Any, file: str, row: int, name: str) -> list[DataError]:
    if value is None:
        return [DataError(file, row, name, "missing (required: a string or a list of assistant messages)")]
    if isinstance(value, str):
        return [] if value.strip() else [DataError(file, row, name, "empty completion")]
    if hasattr(value, "tolist") and not isinstance(value, dict):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return [DataError(file, row, name, f"expected a string or a list of assistant messages, got {type_name(value)}")]
    if not value:
        return [DataError(file, row, name, "empty completion (no messages)")]
    errors = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            errors.append(DataError(file, row, where, f"expected a message {{'role', 'content'}}, got {type_name(msg)}"))
            continue
        if msg.get("role") != "assistant":
            errors.append(DataError(file, row, f"{where}.role", f"completion messages must have role 'assistant', got {msg.get('role')!r}"))
        if not isinstance(msg.get("content"), str):
            errors.append(DataError(file, row, f"{where}.content", f"expected a string, got {type_name(msg.get('content'))}"))
    if not errors and not _completion_text(value).strip():
        errors.append(DataError(file, row, name, "empty completion (every message's content is empty)"))
    return errors


def validate_preference_row(row: Any, file: str, index: int, kind: PreferenceKind) -> list[DataError]:
    """Every problem in one preference row (empty list: the row is good)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(row, UnreadableRow):
        return list(row.errors)
    if not isinstance(row, dict):
        return [DataError(file, index, "<row>", f"expected an object, got {type_name(row)}")]
    errors = validate_prompt(row.get("prompt"), file, index)
    if kind == "pairwise":
        errors += _validate_completion(row.get("chosen"), file, index, "chosen")
        errors += _validate_completion(row.get("rejected"), file, index, "rejected")
        if not errors and _completion_text(row["chosen"]) == _completion_text(row["rejected"]):
            errors.append(DataError(file, index, "rejected", "identical to 'chosen' (the pair carries no preference)"))
        margin = row.get("margin")
        if margin is not None and (isinstance(margin, (bool, np.bool_)) or not isinstance(margin, (int, float, np.number))
                                   or not np.isfinite(margin) or margin < 0):
            errors.append(DataError(file, index, "margin", f"expected a finite number >= 0, got {type_name(margin)} {margin!r}"))
    else:
        errors += _validate_completion(row.get("completion"), file, index, "completion")
        label = row.get("label")
        if not isinstance(label, (bool, np.bool_)):
            msg = "missing" if label is None else f"expected true (desirable) or false (undesirable), got {type_name(label)} {label!r}"
            errors.append(DataError(file, index, "label", msg))
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        errors.append(DataError(file, index, "data_source", f"expected a string, got {type_name(source)}"))
    errors.extend(check_extra_info(row, file, index))
    return errors


def detect_kind(rows: list[Any], file: str) -> PreferenceKind:
    """"pairwise" when the first readable row has `chosen`, "unpaired" when it has `completion`."""
    first = next((row for row in rows if not isinstance(row, UnreadableRow)), None)
    if isinstance(first, dict) and "chosen" in first:
        return "pairwise"
    if isinstance(first, dict) and "completion" in first:
        return "unpaired"
    raise DataError(file, 0, "<row>", "cannot tell the preference format: expected 'chosen'/'rejected' (pairwise) "
                                      "or 'completion'/'label' (unpaired)")


# ----------------------------------------------------------------------------- dataset
@dataclass(frozen=True)
class PreferenceItem:
    """One tokenized example. `responses` is (chosen, rejected) or (completion,), each ending in EOS."""

    index: int
    prompt_ids: list[int]
    responses: tuple[list[int], ...]
    label: bool | None = None
    raw_prompt: str = ""
    data_source: str = "preference"
    extra_info: dict[str, Any] = field(default_factory=dict)
    file: str = ""
    row: int = -1
    messages: list[dict[str, str]] = field(default_factory=list)  # the prompt as chat messages
    completions: tuple[str, ...] = ()  # the texts of `responses` (a reward model renders them with its own template)
    margin: float | None = None  # pairwise: the row's own margin, if it has one


class PreferenceDataset:
    """All examples of `files` (one kind), validated and tokenized once, in file then row order."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        kind: PreferenceKind | None = None,
        max_prompt_length: int = 512,
        max_response_length: int = 512,
        apply_chat_template: bool = True,
        on_bad_row: BadRowPolicy = "error",
    ) -> None:
        if isinstance(files, (str, Path)):
            files = [files]
        if not files:
            raise ValueError("PreferenceDataset needs at least one file")
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        self.files = [str(f) for f in files]
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token: a completion must end with one")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id: int = pad if pad is not None else eos
        self.items: list[PreferenceItem] = []
        self.bad_rows: list[DataError] = []
        self.stats = {"rows_read": 0, "bad_rows": 0, "too_long": 0, "kept": 0}
        self.kind: PreferenceKind | None = kind
        errors: list[DataError] = []
        for file in self.files:
            rows = read_rows(file, keep_unreadable=True)  # undecodable rows: reported or skipped below
            self.stats["rows_read"] += len(rows)
            file_kind = kind or detect_kind(rows, file)
            if self.kind is not None and file_kind != self.kind:
                raise DataError(file, 0, "<row>", f"a {file_kind} file among {self.kind} files")
            self.kind = file_kind
            for i, row in enumerate(rows):
                row_errors = validate_preference_row(row, file, i, file_kind)
                if row_errors:
                    errors.extend(row_errors)
                    continue
                text, p_ids = prompt_ids(row["prompt"], tokenizer, apply_chat_template)
                names = ("chosen", "rejected") if file_kind == "pairwise" else ("completion",)
                responses = tuple(
                    list(tokenizer(_completion_text(row[n]), add_special_tokens=False)["input_ids"]) + [eos] for n in names
                )
                too_long = [(n, len(r)) for n, r in zip(names, responses) if len(r) > max_response_length]
                if len(p_ids) > max_prompt_length:
                    too_long.insert(0, ("prompt", len(p_ids)))
                if too_long:
                    self.stats["too_long"] += 1
                    name, n_tok = too_long[0]
                    limit = max_prompt_length if name == "prompt" else max_response_length
                    self.bad_rows.append(DataError(file, i, name, f"{n_tok} tokens, longer than {limit}"))
                    continue
                self.items.append(PreferenceItem(
                    index=len(self.items), prompt_ids=p_ids, responses=responses,
                    label=bool(row["label"]) if file_kind == "unpaired" else None, raw_prompt=text,
                    data_source=row.get("data_source") or "preference", extra_info=dict(row.get("extra_info") or {}),
                    file=file, row=i, messages=as_messages(row["prompt"]),
                    completions=tuple(_completion_text(row[n]) for n in names),
                    margin=float(row["margin"]) if row.get("margin") is not None else None,
                ))
        if errors and on_bad_row == "error":
            raise DataValidationError(errors)
        self.bad_rows = errors + self.bad_rows
        self.stats["bad_rows"] = len({(e.file, e.row) for e in errors})
        self.stats["kept"] = len(self.items)
        if self.bad_rows:
            log.warning("preference data: dropped %d row(s) in %s; first: %s", len(self.bad_rows), self.files, self.bad_rows[0])
        if not self.items:
            raise DatasetError(f"no usable preference rows in {self.files} (stats: {self.stats})")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PreferenceItem:
        return self.items[i]

    def fingerprint(self) -> str:
        """sha256 of exactly what a model sees: every item's token ids, in order."""
        h = hashlib.sha256(str(self.kind).encode())
        for it in self.items:
            h.update(np.asarray(it.prompt_ids, dtype=np.int64).tobytes() + b"|")
            for r in it.responses:
                h.update(np.asarray(r, dtype=np.int64).tobytes() + b"|")
            h.update(b"L1" if it.label else b"L0" if it.label is not None else b"L-")
        return h.hexdigest()

    def collate(self, items: list[PreferenceItem], uids: list[str]) -> Batch:
        if self.kind == "pairwise":
            return collate_pairs(items, self.pad_token_id, uids)
        return collate_unpaired(items, self.pad_token_id, uids)


# ----------------------------------------------------------------------------- batches
def sequence_tensors(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                     prompt_width: int | None = None, response_width: int | None = None) -> dict[str, torch.Tensor]:
    """The rollout-output layout for given (prompt, response) pairs: LEFT-padded prompts, RIGHT-padded
    responses, `input_ids = cat(prompts, responses)`, float `response_mask`, positions from the mask."""
    n = len(prompts)
    p_w = prompt_width or max(len(p) for p in prompts)
    r_w = response_width or max(len(r) for r in responses)
    prompt = torch.full((n, p_w), pad_id, dtype=torch.long)
    p_mask = torch.zeros((n, p_w), dtype=torch.long)
    resp = torch.full((n, r_w), pad_id, dtype=torch.long)
    r_mask = torch.zeros((n, r_w), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt[i, p_w - len(p):] = torch.tensor(p, dtype=torch.long)
        p_mask[i, p_w - len(p):] = 1
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        r_mask[i, : len(r)] = 1
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    return {
        "input_ids": torch.cat([prompt, resp], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": resp,
        "response_mask": r_mask.float(),
    }


def _meta(items: list[PreferenceItem], uids: list[str]) -> dict[str, Any]:
    return {
        "uid": np.array(uids, dtype=object),
        "index": np.array([it.index for it in items], dtype=np.int64),
        "data_source": [it.data_source for it in items],
        "raw_prompt": [it.raw_prompt for it in items],
    }


def collate_pairs(items: list[PreferenceItem], pad_id: int, uids: list[str]) -> Batch:
    """One row per pair: `chosen_*` and `rejected_*` sequences sharing one prompt and response width,
    so a worker can stack them into a single forward."""
    prompts = [it.prompt_ids for it in items]
    p_w = max(len(p) for p in prompts)
    r_w = max(len(r) for it in items for r in it.responses)
    tensors: dict[str, torch.Tensor] = {}
    for side, k in (("chosen", 0), ("rejected", 1)):
        seq = sequence_tensors(prompts, [it.responses[k] for it in items], pad_id, p_w, r_w)
        tensors.update({f"{side}_{name}": t for name, t in seq.items()})
    return Batch(tensors=tensors, meta=_meta(items, uids))


def collate_unpaired(items: list[PreferenceItem], pad_id: int, uids: list[str]) -> Batch:
    """One row per example: the (prompt, completion) sequence under the standard names, `label`
    (1.0 desirable), and `kl_*`: the same prompt with the previous example's completion (rotated by
    one within the batch), the mismatched pairs KTO's reference point z0 is estimated from."""
    prompts = [it.prompt_ids for it in items]
    completions = [it.responses[0] for it in items]
    mismatched = completions[-1:] + completions[:-1]
    p_w = max(len(p) for p in prompts)
    r_w = max(len(r) for r in completions)
    tensors = sequence_tensors(prompts, completions, pad_id, p_w, r_w)
    tensors.update({f"kl_{k}": t for k, t in sequence_tensors(prompts, mismatched, pad_id, p_w, r_w).items()})
    tensors["label"] = torch.tensor([1.0 if it.label else 0.0 for it in items])
    return Batch(tensors=tensors, meta=_meta(items, uids))


def collate_rm_pairs(items: list[PreferenceItem], uids: list[str]) -> Batch:
    """Pairs for a reward model, as text: the prompt messages and both completions (the reward
    model renders and tokenizes them with its own template, as it does in RL), and each pair's
    margin (`margin_given` 0 where the row has none, so the configured one applies)."""
    if any(len(it.completions) != 2 for it in items):
        raise ValueError("collate_rm_pairs needs pairwise rows (chosen, rejected)")
    meta = _meta(items, uids)
    meta.update(prompt_messages=[list(it.messages) for it in items], chosen_text=[it.completions[0] for it in items],
                rejected_text=[it.completions[1] for it in items])
    tensors = {"margin": torch.tensor([it.margin or 0.0 for it in items], dtype=torch.float32),
               "margin_given": torch.tensor([float(it.margin is not None) for it in items])}
    return Batch(tensors=tensors, meta=meta)


def sequence_view(batch: Batch, prefix: str = "") -> Batch:
    """The `prefix`ed sequence tensors of a preference batch under the standard names, ready for
    `response_log_probs` / `compute_log_prob` (e.g. prefix "chosen_", "rejected_", "kl_", "")."""
    return Batch(tensors={k: batch[f"{prefix}{k}"] for k in SEQUENCE_KEYS}, info=dict(batch.info))


def sequence_log_prob_sums(token_log_probs: torch.Tensor, response_mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sequence log-prob: sum over response tokens (mean when `average`, as IPO uses it)."""
    total = (token_log_probs * response_mask).sum(-1)
    return total / response_mask.sum(-1).clamp(min=1.0) if average else total


class PreferenceLoader(PromptLoader):
    """`PromptLoader`'s deterministic, resumable order over a `PreferenceDataset`; batches are the
    dataset's own collation, or `collate(items, uids)` (`collate_rm_pairs` for a reward model)."""

    def __init__(self, dataset: PreferenceDataset, batch_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, collate: Callable[[list[PreferenceItem], list[str]], Batch] | None = None) -> None:
        super().__init__(dataset, batch_size, seed, shuffle=shuffle, drop_last=drop_last)  # type: ignore[arg-type]
        self.collate = collate or dataset.collate

    def batch_at(self, epoch: int, position: int) -> Batch:
        idx = self.order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        items = [self.dataset[int(i)] for i in idx]
        return self.collate(items, [f"{epoch}-{it.index}" for it in items])


__all__ = [
    "KINDS", "PREFERENCE_FIELDS", "PreferenceDataset", "PreferenceItem", "PreferenceKind", "PreferenceLoader", "collate_pairs",
    "collate_rm_pairs",
    "collate_unpaired", "detect_kind", "sequence_log_prob_sums", "sequence_tensors", "sequence_view",
    "validate_preference_row",
]
