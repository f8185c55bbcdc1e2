"""Reading and writing dataset files: parquet (verl's format) and JSON lines.

Whatever is wrong with a file is an error that names it, and a row that cannot be decoded (bytes
that are not UTF-8, a line that is not JSON) names its row and field too: a user must never have
to bisect a file to find the one bad byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlcore.data.schema import DataError, DatasetError, UnreadableRow

PARQUET = (".parquet",)
JSONL = (".jsonl", ".json", ".ndjson")
_BOM = b"\xef\xbb\xbf"


def _to_python(value: Any) -> Any:
    """numpy arrays/scalars (from pandas-written files) to plain Python containers."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    return value


def check_data_file(path: str | Path) -> Path:
    """`path` if it names a readable file of a known format, else a DatasetError saying which of
    those it is not."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    if not path.is_file():
        raise DatasetError(f"{path}: not a file (a dataset is one .parquet or .jsonl file)")
    if not os.access(path, os.R_OK):
        raise DatasetError(f"{path}: not readable (permission denied)")
    if path.suffix.lower() not in PARQUET + JSONL:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r} (expected .parquet, or .jsonl/.json/.ndjson)")
    return path


def read_rows(path: str | Path, *, keep_unreadable: bool = False) -> list[Any]:
    """All rows of a parquet or JSON-lines file, as plain Python objects.

    A row that cannot be decoded is a `DataError` naming the file, row and field (the first such
    row); with `keep_unreadable` it stays in the list as an `UnreadableRow` at its own index
    instead, so a dataset's validation lists every one and `on_bad_row` decides. A file that
    cannot be read at all is a `DatasetError` naming it.
    """
    path = check_data_file(path)
    rows = _read_parquet(path) if path.suffix.lower() in PARQUET else _read_jsonl(path)
    if not keep_unreadable:
        for row in rows:
            if isinstance(row, UnreadableRow):
                raise row.errors[0]
    return rows


def peek_fields(path: str | Path) -> list[str]:
    """The top-level field names of a dataset file, read cheaply (parquet: the schema in its
    footer; JSON lines: the first row), so a wrong, empty or unreadable file is refused before
    anything expensive starts. Raises `DatasetError` naming the file (and row, for JSON lines)."""
    path = check_data_file(path)
    if path.suffix.lower() in PARQUET:
        pf = _open_parquet(path)
        if pf.metadata.num_rows == 0:
            raise DatasetError(f"{path}: no rows")
        return list(pf.schema_arrow.names)
    try:
        with path.open("rb") as f:
            first = next((ln for ln in f if ln.strip()), None)
    except OSError as err:
        raise DatasetError(f"{path}: cannot read: {err}") from None
    if first is None:
        raise DatasetError(f"{path}: no rows")
    row = _parse_json_line(first.removeprefix(_BOM), str(path), 0)
    if isinstance(row, UnreadableRow):
        raise row.errors[0]
    if not isinstance(row, dict):
        raise DataError(str(path), 0, "<row>", f"expected an object, got {type(row).__name__}")
    return list(row)


def peek_rows(path: str | Path, n: int, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The first `n` rows of a dataset file (only `columns`, when given), read without the rest of
    it: a sample for start-up checks. Rows that cannot be decoded are left out."""
    path = check_data_file(path)
    if n <= 0:
        return []
    if path.suffix.lower() in PARQUET:
        pf = _open_parquet(path)
        present = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
        rows: list[Any] = []
        try:
            for batch in pf.iter_batches(batch_size=n, columns=present):
                rows = [_to_python(r) for r in batch.to_pylist()]
                break
        except UnicodeDecodeError:
            rows = [r for r in _read_parquet(path)[:n] if not isinstance(r, UnreadableRow)]
    else:
        rows = []
        with path.open("rb") as f:
            for line in f:
                if len(rows) >= n:
                    break
                if line.strip():
                    rows.append(_parse_json_line(line.removeprefix(_BOM), str(path), len(rows)))
    picked = [r for r in rows if isinstance(r, dict)]
    return picked if columns is None else [{k: r[k] for k in columns if k in r} for r in picked]


def read_column(path: str | Path, column: str) -> list[Any]:
    """One top-level field of every row, in row order (parquet: that column alone is read); None
    where a row lacks it or cannot be decoded. For start-up checks that name rows."""
    path = check_data_file(path)
    if path.suffix.lower() in PARQUET:
        pf = _open_parquet(path)
        if column not in pf.schema_arrow.names:
            return [None] * pf.metadata.num_rows
        try:
            return [_to_python(v) for v in pf.read(columns=[column]).column(column).to_pylist()]
        except UnicodeDecodeError:
            rows = _read_parquet(path)
    else:
        rows = _read_jsonl(path)
    return [r.get(column) if isinstance(r, dict) else None for r in rows]


# ----------------------------------------------------------------------------- parquet
def _open_parquet(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow as pa

    try:
        table = _open_parquet(path).read()
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    try:
        return [_to_python(r) for r in table.to_pylist()]
    except UnicodeDecodeError:
        pass  # some string is not UTF-8: decode column by column to find each one
    bad: dict[int, list[DataError]] = {}
    columns: dict[str, list[Any]] = {}
    for name in table.column_names:
        values: list[Any] = []
        for chunk in table.column(name).chunks:
            values += _decode_array(chunk, len(values), name, str(path), bad)
        columns[name] = values
    return [
        UnreadableRow(tuple(bad[i])) if i in bad else _to_python({name: columns[name][i] for name in columns})
        for i in range(table.num_rows)
    ]


def _decode_array(array: Any, offset: int, field: str, file: str, bad: dict[int, list[DataError]]) -> list[Any]:
    """`array` as Python values; each row that will not decode is None, with its error in `bad`.
    Halving narrows a failure to its rows at the cost of about one more pass over the column."""
    try:
        return list(array.to_pylist())
    except UnicodeDecodeError:
        if len(array) == 1:
            where, err = _undecodable_field(array[0], field)
            bad.setdefault(offset, []).append(DataError(file, offset, where, _utf8_message(err.object, err.start)))
            return [None]
    half = len(array) // 2
    return (_decode_array(array.slice(0, half), offset, field, file, bad)
            + _decode_array(array.slice(half), offset + half, field, file, bad))


def _undecodable_field(scalar: Any, where: str) -> tuple[str, UnicodeDecodeError]:
    """The innermost field of an arrow value that fails to decode (`prompt[0].content`), and its error."""
    import pyarrow as pa

    try:
        scalar.as_py()
    except UnicodeDecodeError as err:
        error = err
    else:
        raise AssertionError(f"{where} decodes")  # only called on values that failed
    if isinstance(scalar, pa.StructScalar):
        for key in scalar.keys():
            try:
                scalar[key].as_py()
            except UnicodeDecodeError:
                return _undecodable_field(scalar[key], f"{where}.{key}")
    elif isinstance(scalar, Sequence):  # list, large list, fixed-size list and map values
        for j, item in enumerate(scalar):
            try:
                item.as_py()
            except UnicodeDecodeError:
                return _undecodable_field(item, f"{where}[{j}]")
    return where, error


def _utf8_message(raw: bytes, position: int) -> str:
    return f"not valid UTF-8: byte 0x{raw[position]:02x} at position {position}"


# ----------------------------------------------------------------------------- JSON lines
def _read_jsonl(path: Path) -> list[Any]:
    try:
        with path.open("rb") as f:
            lines = [ln for ln in f if ln.strip()]
    except OSError as err:
        raise DatasetError(f"{path}: cannot read: {err}") from None
    if lines:
        lines[0] = lines[0].removeprefix(_BOM)
    return [_parse_json_line(line, str(path), i) for i, line in enumerate(lines)]


def _parse_json_line(raw: bytes, file: str, row: int) -> Any:
    """One JSON line: its value, or an `UnreadableRow` naming the field whose bytes are not UTF-8
    (undecodable bytes are kept as lone surrogates to parse the line and find them)."""
    text = raw.decode("utf-8", errors="surrogateescape")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return UnreadableRow((DataError(file, row, "<json>", f"not valid JSON: {err.msg} at column {err.colno}"),))
    except RecursionError:  # the parser's own limit (about 1,000 levels): no row of a dataset nests so deep
        return UnreadableRow((DataError(file, row, "<json>", "nested too deep for the JSON parser"),))
    except ValueError as err:  # a number of more than 4,300 digits
        return UnreadableRow((DataError(file, row, "<json>", f"not readable JSON: {str(err)[:120]}"),))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        try:
            found = tuple(DataError(file, row, where or "<row>", message) for where, message in _surrogates(value, ""))
        except RecursionError:  # nested near the parser's limit: name the byte, not the field
            found = ()
        return UnreadableRow(found or (DataError(file, row, "<json>", _utf8_message(raw, err.start)),))
    return value


def _surrogates(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """(field, message) for every string (or key) holding bytes that were not UTF-8."""
    if isinstance(value, str):
        for position, char in enumerate(value):
            if "\udc80" <= char <= "\udcff":
                yield where, f"not valid UTF-8: byte 0x{ord(char) - 0xDC00:02x} at position {position}"
                return
    elif isinstance(value, dict):
        for key, item in value.items():
            name = _printable(key)
            inner = f"{where}.{name}" if where else name
            if name != key:
                yield inner, "field name is not valid UTF-8"
            yield from _surrogates(item, inner)
    elif isinstance(value, list):
        for j, item in enumerate(value):
            yield from _surrogates(item, f"{where}[{j}]")


def _printable(text: str) -> str:
    """`text` with undecodable bytes written as \\xNN (a lone surrogate cannot be printed)."""
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")


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


__all__ = ["JSONL", "PARQUET", "check_data_file", "peek_fields", "peek_rows", "read_column", "read_rows", "write_rows"]
