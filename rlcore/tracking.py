"""Metrics sinks: a JSONL file in the run directory and a console progress line.

`Tracker.log(step, metrics)` fans out to every configured sink. The JSONL file is the record
that resume relies on: lines past the checkpoint being resumed are dropped first, so the file
of a resumed run reads like that of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Protocol


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Keep only records with step <= last_step (used before resuming from that step)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class ConsoleSink:
    """One short line per step: the handful of numbers a person watches."""

    KEYS = ("reward/mean", "acc/mean", "val/acc", "actor/kl", "actor/entropy", "actor/pg_clipfrac", "time/step_s")

    def __init__(self, total_steps: int, stream=sys.stderr) -> None:
        self.total_steps = total_steps
        self.stream = stream

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        shown = [f"{k}={_plain(metrics[k]):.4g}" for k in self.KEYS if k in metrics and isinstance(_plain(metrics[k]), (int, float))]
        bar_width = 20
        filled = int(bar_width * step / max(1, self.total_steps))
        bar = "#" * filled + "-" * (bar_width - filled)
        print(f"[{bar}] step {step}/{self.total_steps} " + " ".join(shown), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class Tracker:
    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


_MLFLOW_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. :/")


def mlflow_key(name: str) -> str:
    """A metric/param name MLflow accepts: letters, digits and `_-. :/` only; `@` (as in
    `val/pass@8`) becomes `_at_`, anything else `_`."""
    name = name.replace("@", "_at_")
    return "".join(c if c in _MLFLOW_NAME_OK else "_" for c in name)


class MlflowSink:
    """Per-step metrics to an MLflow run, by run id (no reliance on a thread's active run, so it
    works from Prefect task threads). Non-numeric and non-finite values are skipped."""

    def __init__(self, run_id: str, tracking_uri: str | None = None, client: Any = None) -> None:
        if client is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
        self.client = client
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for key, value in sorted(metrics.items()):
            value = _plain(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            batch.append(Metric(key=mlflow_key(key), value=float(value), timestamp=now, step=int(step)))
        for start in range(0, len(batch), 1000):  # MLflow's limit per log_batch call
            self.client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def close(self) -> None:
        pass
