"""Data events: `rlcore.data.arrived` when a new data file lands, and a directory watcher that
emits it. The `rl_pipeline` deployment's trigger turns each such event into a pipeline run on
that file (see flows/deployments/serve.py)."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

DATA_EVENT = "rlcore.data.arrived"
RESOURCE_PREFIX = "rlcore.data."
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".ndjson")


def data_resource(path: str | Path) -> dict[str, str]:
    path = str(Path(path).resolve())
    return {"prefect.resource.id": RESOURCE_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:16],
            "prefect.resource.name": Path(path).name, "rlcore.data.path": path}


def emit_data_arrived(path: str | Path) -> str:
    """Send `rlcore.data.arrived` for `path` to the Prefect server in use (PREFECT_API_URL) and
    return the event's id once the server has it: one POST to its `/events`, not Prefect's
    background events worker, which a short-lived process would leave to flush at exit ("Still
    processing items")."""
    from prefect.client.orchestration import get_client
    from prefect.events import Event

    resource = data_resource(path)
    event = Event(event=DATA_EVENT, resource=resource, payload={"path": resource["rlcore.data.path"]})
    with get_client(sync_client=True) as client:
        client.request("POST", "/events", json=[event.model_dump(mode="json")]).raise_for_status()
    return str(event.id)


def new_files(directory: str | Path, seen: set[str], suffixes: Iterable[str] = DATA_SUFFIXES) -> list[Path]:
    """Data files in `directory` not in `seen` (which is updated). Hidden and partial files
    (`.name`, `*.tmp`, `*.part`) are ignored: write elsewhere and rename into place."""
    found = []
    for p in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
        if not p.is_file() or p.name.startswith(".") or p.suffix.lower() not in tuple(suffixes):
            continue
        key = str(p.resolve())
        if key not in seen:
            seen.add(key)
            found.append(p)
    return found


class DirectoryWatcher:
    """Polls `directory` every `interval_s` and calls `on_file(path)` for each new data file.
    Files present at start are taken as already seen (only new arrivals trigger runs)."""

    def __init__(self, directory: str | Path, on_file: Callable[[Path], object] = emit_data_arrived,
                 interval_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self.on_file = on_file
        self.interval_s = interval_s
        self.seen: set[str] = set()
        new_files(self.directory, self.seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlcore-data-watcher", daemon=True)

    def start(self) -> DirectoryWatcher:
        self._thread.start()
        return self

    def poll(self) -> list[Path]:
        arrived = new_files(self.directory, self.seen)
        for path in arrived:
            try:
                self.on_file(path)
                log.info("data arrived: %s", path)
            except Exception as err:  # noqa: BLE001 - keep watching
                log.warning("could not announce %s: %s", path, err)
        return arrived

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
