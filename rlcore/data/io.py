"""Reading and writing dataset files: parquet (verl's format) and JSON lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlcore.data.schema import DataError

PARQUET = (".parquet",)
JSONL = (".jsonl", ".json", ".ndjson")


def _to_python(value: Any) -> Any:
    """numpy arrays/scalars (from pandas-written files) to plain Python containers."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a parquet or JSON-lines file, as plain Python objects.

    A JSON line that does not parse is a `DataError` naming the file and row.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in PARQUET:
        import pyarrow.parquet as pq

        return [_to_python(r) for r in pq.read_table(path).to_pylist()]
    if suffix in JSONL:
        rows = []
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(ln for ln in f if ln.strip()):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(str(path), i, "<json>", f"not valid JSON: {e.msg} at column {e.colno}") from None
        return rows
    raise ValueError(f"{path}: unknown dataset format {suffix!r} (expected .parquet or .jsonl)")


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet or JSON lines, chosen by the file suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix in PARQUET:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix in JSONL:
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    else:
        raise ValueError(f"{path}: unknown dataset format {suffix!r} (expected .parquet or .jsonl)")
    return path
