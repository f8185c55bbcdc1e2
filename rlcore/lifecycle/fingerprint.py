"""Content fingerprints of datasets: the hash that follows a model through the registry.

A fingerprint depends on the rows' content (canonical JSON, keys sorted), not on the file format,
file name or modification time, so the same data written as parquet or JSON lines, today or
tomorrow, gives the same fingerprint; any change to any row gives a different one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlcore.data.io import read_rows


def canonical_row(row: Any) -> str:
    """One row as canonical JSON (sorted keys, no whitespace): equal content, equal text."""
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def rows_fingerprint(rows: Iterable[Any]) -> str:
    """sha256 over the rows in order (row order matters: it is the training order)."""
    h = hashlib.sha256()
    for row in rows:
        h.update(canonical_row(row).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def files_fingerprint(paths: Sequence[str | Path], extra: dict[str, Any] | None = None) -> str:
    """Fingerprint of several dataset files (their rows' content, in the given order) plus
    `extra` settings that change what is derived from them (e.g. split fraction, bad-row policy)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(rows_fingerprint(read_rows(path)).encode())
    h.update(canonical_row(extra or {}).encode())
    return h.hexdigest()
