"""Data preparation: validate every row, fail or skip bad ones by policy, deduplicate, split,
write parquet, fingerprint.

Validation reports every bad row at once (`DataValidationError` lists them all), so a broken
file is fixed in one pass. Deduplication keys on what the model sees and is graded on (prompt,
data source, ground truth). Held-out rows never leak into training: a training row equal to a
validation row is dropped from training.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlcore.data.io import read_rows, write_rows
from rlcore.data.schema import DataError, apply_policy
from rlcore.lifecycle.fingerprint import canonical_row, rows_fingerprint

log = logging.getLogger(__name__)


@dataclass
class PreparedData:
    train_file: str
    val_file: str
    fingerprint: str  # content hash of (train rows, val rows)
    train_fingerprint: str
    val_fingerprint: str
    counts: dict[str, int] = field(default_factory=dict)
    bad_rows: list[str] = field(default_factory=list)  # str(DataError) for every skipped row problem

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dedup_key(row: dict[str, Any]) -> str:
    """What makes two rows the same example: prompt, data source and ground truth."""
    gt = (row.get("reward_model") or {}).get("ground_truth")
    return canonical_row([row.get("prompt"), row.get("data_source"), gt])


def _load_valid(paths: Sequence[str | Path], on_bad_row: Literal["error", "skip"]) -> tuple[list[dict], list[DataError]]:
    """Rows of all files that pass validation; with "error", every bad row of every file is
    reported in one `DataValidationError` before anything is written."""
    from rlcore.data.schema import DataValidationError

    rows: list[dict] = []
    errors: list[DataError] = []
    for path in paths:
        good, errs = apply_policy(read_rows(path), str(path), "skip")
        rows.extend(r for _, r in good)
        errors.extend(errs)
    if errors and on_bad_row == "error":
        raise DataValidationError(errors)
    return rows, errors


def _dedupe(rows: list[dict], exclude: set[str] | None = None) -> tuple[list[dict], int]:
    seen = set(exclude or ())
    kept = []
    for row in rows:
        key = dedup_key(row)
        if key in seen:
            continue
        seen.add(key)
        kept.append(row)
    return kept, len(rows) - len(kept)


def _in_val_split(row: dict, fraction: float, seed: int) -> bool:
    """Deterministic split by content hash: a row lands on the same side whatever its position."""
    digest = hashlib.sha256(f"{seed}:{dedup_key(row)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def prepare_dataset(
    train_files: Sequence[str | Path],
    out_dir: str | Path,
    val_files: Sequence[str | Path] = (),
    *,
    on_bad_row: Literal["error", "skip"] = "error",
    val_fraction: float = 0.1,
    seed: int = 0,
) -> PreparedData:
    """Validate, dedupe and split; write `out_dir/train.parquet`, `out_dir/val.parquet` and
    `out_dir/prep_report.json`. Without `val_files`, `val_fraction` of the (deduplicated) rows
    are held out by content hash."""
    if not train_files:
        raise ValueError("prepare_dataset needs at least one training file")
    if not 0.0 < val_fraction < 1.0 and not val_files:
        raise ValueError(f"val_fraction must be in (0, 1) when no validation file is given, got {val_fraction}")
    train_rows, train_errors = _load_valid(train_files, on_bad_row)
    val_rows, val_errors = _load_valid(val_files, on_bad_row) if val_files else ([], [])
    counts = {"rows_read": len(train_rows) + len(val_rows) + len({(e.file, e.row) for e in train_errors + val_errors}),
              "bad_rows": len({(e.file, e.row) for e in train_errors + val_errors})}
    if val_files:
        val_rows, val_dupes = _dedupe(val_rows)
        train_rows, train_dupes = _dedupe(train_rows, exclude={dedup_key(r) for r in val_rows})
    else:
        rows, train_dupes = _dedupe(train_rows)
        val_dupes = 0
        val_rows = [r for r in rows if _in_val_split(r, val_fraction, seed)]
        train_rows = [r for r in rows if not _in_val_split(r, val_fraction, seed)]
    counts.update(duplicates=train_dupes + val_dupes, train=len(train_rows), val=len(val_rows))
    if not train_rows:
        raise ValueError(f"no training rows left after validation and deduplication ({counts})")
    if not val_rows:
        raise ValueError(f"no validation rows left after validation and deduplication ({counts})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path = write_rows(train_rows, out / "train.parquet").resolve()
    val_path = write_rows(val_rows, out / "val.parquet").resolve()
    # Fingerprint what was written (as read back), so anyone can recompute it from the files.
    train_fp, val_fp = rows_fingerprint(read_rows(train_path)), rows_fingerprint(read_rows(val_path))
    result = PreparedData(
        train_file=str(train_path),
        val_file=str(val_path),
        fingerprint=hashlib.sha256(f"{train_fp}:{val_fp}".encode()).hexdigest(),
        train_fingerprint=train_fp,
        val_fingerprint=val_fp,
        counts=counts,
        bad_rows=[str(e) for e in train_errors + val_errors],
    )
    (out / "prep_report.json").write_text(json.dumps(result.to_dict(), indent=1))
    if result.bad_rows:
        log.warning("data prep skipped %d bad row(s); first: %s", counts["bad_rows"], result.bad_rows[0])
    return result
