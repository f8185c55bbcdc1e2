"""Prefect task results that are data, never code: a JSON serializer and a result storage that
refuses any other record.

Prefect persists a cached task result as a record naming its own serializer, and reads a record
back with whatever serializer the *record* names (pickle by default; even its JSON serializer
takes the decoder's and JSON library's import paths from the record). So a record planted in the
result storage runs code on the next run with the same cache key, whatever the task was declared
with. The storage here (`DataOnlyResultStorage`) therefore checks each record before Prefect sees
it: only records written by `DataOnlyJSON` (exactly `{"type": "rlcore-json"}`, a JSON text as the
result) pass; anything else is refused with a warning naming the file, and Prefect treats the
cache entry as absent, so the task runs again and its fresh record replaces the refused one.
A record in rlcore's own format is also checked against the type of what its task returns
(`RESULT_SCHEMAS`, by the record's cache-key prefix): a result with missing, extra or mistyped
fields, or naming data files that are gone, is refused the same way (a record of no known task
too), so a cached value is never handed on unless it is what the task itself would return.

It lives under the pipeline's own working folder (`result_storage_for(workdir)`), not Prefect's
shared `~/.prefect/storage` (which Prefect derives from its default home, not `PREFECT_HOME`).
A task that persists results takes both: `task.with_options(result_storage=...)` at the call, and
`result_serializer=DATA_ONLY_JSON` in its decorator (tests/test_no_pickle.py checks every one).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from prefect.filesystems import LocalFileSystem
from prefect.serializers import Serializer
from pydantic import Field, TypeAdapter, ValidationError

from rlcore.lifecycle.results import PreparedData

log = logging.getLogger(__name__)

SERIALIZER_TYPE = "rlcore-json"
RESULTS_FOLDER = "task-results"  # under the pipeline's working folder


class DataOnlyJSON(Serializer):
    """Plain JSON both ways: no object hooks, no import paths, nothing a stored record can choose."""

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return json.dumps(obj).encode("utf-8")

    def loads(self, blob: bytes) -> Any:
        return json.loads(blob.decode("utf-8"))


DATA_ONLY_JSON = DataOnlyJSON()


def _missing_data_files(prepared: PreparedData) -> str | None:
    gone = [f for f in (prepared["train_file"], prepared["val_file"]) if not Path(f).is_file()]
    return f"the data files it names are gone: {', '.join(gone)}" if gone else None


# Cache-key prefix -> (what the task returns, a check of what the type cannot say). Every task that
# persists its result needs a row: a record under any other key is refused (and its task recomputed).
RESULT_SCHEMAS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {
    "rlcore-data-prep-": (PreparedData, _missing_data_files),
}


def result_refusal(key: str, result: Any) -> str | None:
    """Why the JSON value `result`, stored under the cache key `key`, is not what its task returns
    (None: it is): no schema for the key, fields missing, unknown or of the wrong type (strictly:
    no coercion), or the schema's own check (files it names exist)."""
    name = Path(key).name
    row = next((v for prefix, v in RESULT_SCHEMAS.items() if name.startswith(prefix)), None)
    if row is None:
        return f"no rlcore task stores results under {name!r}"
    schema, check = row
    if not isinstance(result, dict):
        return f"its result is a JSON {type(result).__name__}, not the task's {schema.__name__} object"
    extra = sorted(set(result) - set(schema.__required_keys__) - set(schema.__optional_keys__))
    if extra:
        return f"its result has fields {schema.__name__} does not: {', '.join(map(repr, extra))[:200]}"
    try:
        TypeAdapter(schema).validate_python(result, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(top)"
        return f"its result is not a {schema.__name__}: {where}: {first['msg']} ({err.error_count()} problem(s))"
    return check(result)


def record_refusal(content: bytes, key: str | None = None) -> str | None:
    """Why a stored result record is not one `DataOnlyJSON` wrote (None: it is); with the record's
    cache `key`, also why its result is not what that task returns (`result_refusal`)."""
    try:
        record = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        return f"not a JSON result record ({type(err).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("metadata"), dict):
        return "not a result record of this Prefect (no metadata)"
    serializer = record["metadata"].get("serializer")
    if serializer != {"type": SERIALIZER_TYPE}:
        named = serializer.get("type") if isinstance(serializer, dict) else serializer
        return f"its serializer is {named!r}, not rlcore's data-only {SERIALIZER_TYPE!r} (loading it could run code)"
    if not isinstance(record.get("result"), str):
        return "its result is not JSON text"
    try:
        result = json.loads(record["result"])
    except (ValueError, RecursionError) as err:
        return f"its result is not JSON ({type(err).__name__})"
    return None if key is None else result_refusal(key, result)


class DataOnlyResultStorage(LocalFileSystem):
    """Prefect's local result storage, reading back only records `DataOnlyJSON` wrote (module doc).
    A refused record reads as absent: Prefect then runs the task again and overwrites it."""

    _block_type_name = "rlcore data-only results"

    def _checked(self, path: str, content: bytes) -> bytes:
        why = record_refusal(content, key=path)
        if why is not None:
            where = self._resolve_path(path)
            log.warning("refused the cached task result %s: %s; the task runs again and replaces it", where, why)
            raise ValueError(f"{where}: refused cached task result: {why}")
        return content

    # Prefect reads results through `aread_path` (async) or `read_path(path, _sync=True)`.
    async def aread_path(self, path: str) -> bytes:
        return self._checked(path, await super().aread_path(path))

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:  # type: ignore[override]
        content = LocalFileSystem.read_path(self, path, _sync=True)  # type: ignore[call-arg]
        return self._checked(path, cast(bytes, content))  # with _sync=True: the bytes, not a coroutine


def result_storage_for(workdir: str | Path) -> DataOnlyResultStorage:
    """The result storage of the pipeline working in `workdir`: `<workdir>/task-results`, saved as
    a block on the Prefect API in use (Prefect takes only saved blocks as a task's storage)."""
    basepath = Path(workdir).resolve() / RESULTS_FOLDER
    storage = DataOnlyResultStorage(basepath=str(basepath))
    storage.save(f"rlcore-results-{hashlib.sha256(str(basepath).encode()).hexdigest()[:16]}", overwrite=True)
    return storage


__all__ = ["DATA_ONLY_JSON", "RESULT_SCHEMAS", "DataOnlyJSON", "DataOnlyResultStorage", "record_refusal", "result_refusal",
           "result_storage_for"]
