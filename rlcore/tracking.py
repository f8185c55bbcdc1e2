"""Metrics sinks (a JSONL file in the run directory, a console progress line, an MLflow run), the
tracker a training run opens from its config, and MLflow run access by explicit client and run id.

`Tracker.log(step, metrics)` fans out to every configured sink. The JSONL file is the record
that resume relies on: lines past the checkpoint being resumed are dropped first, so the file
of a resumed run reads like that of an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TextIO

from rlcore.redact import redact_json, redact_params, redact_text

log = logging.getLogger(__name__)


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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL log. A torn last line (the process was killed mid-write) is dropped
    with a warning; a bad line anywhere else is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                log.warning("%s: dropped a torn last line (a write was cut off): %.60s...", path, line)
                continue
            raise ValueError(f"{path}:{number}: not a JSON record: {err}") from None
    return records


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Keep only records with step <= last_step (before resuming from that step; -1 empties the
    log for a fresh start). A torn last line goes too (see `read_jsonl`)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def clock(seconds: float) -> str:
    """[h:]mm:ss, as tqdm writes elapsed and remaining time."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ConsoleSink:
    """One short line per step: the handful of numbers a person watches, and elapsed<remaining
    time (the remaining from this process's mean step time, resumed steps not counted)."""

    KEYS = ("reward/mean", "acc/mean", "val/acc", "actor/kl", "actor/entropy", "actor/pg_clipfrac", "train/loss", "val/loss",
            "reward_model/loss", "reward_model/accuracy", "val/pairwise_acc",
            "time/step_s", "throughput/update_actor_tok_s", "throughput/update_actor_mfu", "gpu/util_pct", "memory/allocated_gib")

    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.stream = stream
        self._start = time.monotonic()
        self._first_step: int | None = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        shown = [f"{k}={_plain(metrics[k]):.4g}" for k in self.KEYS if k in metrics and isinstance(_plain(metrics[k]), (int, float))]
        bar_width = 20
        filled = int(bar_width * step / max(1, self.total_steps))
        bar = "#" * filled + "-" * (bar_width - filled)
        if self._first_step is None:  # 0 (validation before training), 1, or a resumed run's next step
            self._first_step = step
        elapsed = time.monotonic() - self._start
        done = step - max(0, self._first_step - 1)  # training steps this process ran
        remaining = clock(elapsed / done * max(0, self.total_steps - step)) if done > 0 else "?"
        print(f"[{bar}] step {step}/{self.total_steps} [{clock(elapsed)}<{remaining}] " + " ".join(shown),
              file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _Lines:
    """A file for tqdm that hands each refreshed meter to `say` as one line (no carriage returns),
    for pipes, log files and Prefect task logs, where a redrawn bar would be one endless line."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self._last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line and line != self._last:
            self._last = line
            self.say(line)

    def flush(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "it", say: Callable[[str], None] | None = None,
             every_s: float = 5.0) -> Any:
    """A tqdm progress bar with elapsed<remaining time: redrawn in place on a terminal's stderr;
    with `say`, or when stderr is not a terminal, a line at most every `every_s` seconds."""
    from tqdm import tqdm

    stream = sys.stderr
    if say is None and stream.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return tqdm(total=total, desc=desc, unit=unit, file=_Lines(say or (lambda line: print(line, file=sys.stderr, flush=True))),
                mininterval=every_s, delay=every_s, bar_format="{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}, {rate_fmt}]")


class Tracker:
    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # a text metric (the first reward error) may quote user code: redacted for every sink
        metrics = {k: redact_text(v) if isinstance(v, str) else v for k, v in metrics.items()}
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

    def __init__(self, run_id: str, tracking_uri: str | None = None, client: Any = None, end_run_on_close: bool = False) -> None:
        if client is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
        self.client = client
        self.run_id = run_id
        self.end_run_on_close = end_run_on_close

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
        if self.end_run_on_close:
            end_mlflow_run(self.client, self.run_id)


def default_tracking_uri(workdir: str | Path | None = None) -> str:
    return f"sqlite:///{(Path(workdir) if workdir else Path.cwd()).resolve() / 'mlflow.db'}"


# ---------------------------------------------------------------------- MLflow UI links
MLFLOW_UI_DEFAULT = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store
# MLflow 3.17's UI shows an experiment as GenAI (traces, evaluations) or model training by a switch of
# its own, kept per browser and GenAI by default; a link can choose (the experiment's
# `mlflow.experimentKind` tag no longer decides it).
MLFLOW_TRAINING_VIEW = "?workflowType=machine_learning"
MLFLOW_LINKS_VAR = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"  # MLflow's own "View run" lines (stdout, GenAI view)


def is_tracking_server(tracking_uri: str) -> bool:
    """A tracking server (its UI is served at the same address), not a store read in this process."""
    return tracking_uri.startswith(("http://", "https://"))


def mlflow_ui_base(tracking_uri: str) -> str:
    """The MLflow UI of a store: the tracking server itself, or `mlflow ui` on a local one."""
    return tracking_uri.rstrip("/") if is_tracking_server(tracking_uri) else MLFLOW_UI_DEFAULT


def mlflow_experiment_url(tracking_uri: str, experiment_id: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}{MLFLOW_TRAINING_VIEW}"


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}{MLFLOW_TRAINING_VIEW}"


def model_version_url(tracking_uri: str, model: str, version: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/models/{model}/versions/{version}{MLFLOW_TRAINING_VIEW}"


def mlflow_ui_hint(tracking_uri: str, experiment_id: str) -> str:
    """Where to see a store's runs: a tracking server's own UI (the experiment, model-training view),
    a Databricks workspace, or `mlflow ui` started over a store this process wrote to directly."""
    if is_tracking_server(tracking_uri):
        return mlflow_experiment_url(tracking_uri, experiment_id)
    if tracking_uri.startswith("databricks"):
        return f"the experiment {experiment_id} in the Databricks workspace of {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}  (UI at {mlflow_experiment_url(tracking_uri, experiment_id)})"


def end_mlflow_run(client: Any, run_id: str, status: str = "FINISHED") -> None:
    """End a run. Against a tracking server MLflow prints "View run ... at" to stdout (into
    `pipeline run --json`'s output) with a link opening the GenAI view: rlcore prints the run's
    model-training page on stderr instead, unless the user set MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT."""
    uri = str(client.tracking_uri)
    if not is_tracking_server(uri) or MLFLOW_LINKS_VAR in os.environ:
        client.set_terminated(run_id, status=status)
        return
    os.environ[MLFLOW_LINKS_VAR] = "true"
    try:
        client.set_terminated(run_id, status=status)
    finally:
        os.environ.pop(MLFLOW_LINKS_VAR, None)
    try:  # a link is not worth a failed stage
        info = client.get_run(run_id).info
    except Exception as err:  # noqa: BLE001
        log.warning("MLflow run %s ended %s; its page is not known: %s", run_id, status, err)
        return
    print(f"rlcore: MLflow run {info.run_name} ({status}): {mlflow_run_url(uri, info.experiment_id, run_id)}",
          file=sys.stderr, flush=True)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"actor": {"optim": {"lr": 1e-6}}} -> {"actor.optim.lr": "1e-06"} (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return out


# MLflow's UI opens an experiment without this tag in its GenAI (traces) view; training runs
# belong in its model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


class MlflowStore:
    """Runs and artifacts in one experiment of one tracking store."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "rlcore", artifact_root: str | Path | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self._mlflow = mlflow
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
            if found.tags.get(EXPERIMENT_KIND_TAG) is None:  # a store made before rlcore set the kind
                self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        else:
            location = None
            if artifact_root is not None:
                location = Path(artifact_root).resolve().as_uri()
            elif self.tracking_uri.startswith("sqlite:///"):
                # Artifacts next to the database, not wherever the process happens to run.
                location = (Path(self.tracking_uri[len("sqlite:///"):]).parent / "mlruns").resolve().as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location,
                                                               tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})

    # ------------------------------------------------------------------ runs
    def start_run(self, name: str, parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
        all_tags = redact_params(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        end_mlflow_run(self.client, run_id, status)

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(k), str(v)[:6000]) for k, v in redact_params(params).items()]  # no secrets in MLflow
        for start in range(0, len(items), 100):  # MLflow's limit of params per batch
            self.client.log_batch(run_id, params=items[start:start + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int = 0) -> None:
        MlflowSink(run_id, client=self.client).log(step, metrics)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        for k, v in redact_params(tags).items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_json(self, run_id: str, obj: Any, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / name
            p.write_text(json.dumps(redact_json(obj), indent=1, default=str))
            self.client.log_artifact(run_id, str(p))

    def artifact_uri(self, run_id: str, path: str = "") -> str:
        base = self.client.get_run(run_id).info.artifact_uri
        return f"{base}/{path}" if path else base

    def run_url_hint(self) -> str:
        return mlflow_ui_hint(self.tracking_uri, self.experiment_id)


def open_tracker(loggers: Iterable[str], run_dir: Path, total_steps: int, *, mlflow_uri: str | None = None,
                 experiment: str = "rlcore", config_tree: dict[str, Any] | None = None, tags: dict[str, str] | None = None,
                 run_id: str | None = None) -> Tracker:
    """The sinks a training run's `trainer.loggers` name. `mlflow`: one MLflow run per run
    directory (its id kept in `mlflow_run_id`), so a resumed run keeps logging into the same run.
    With `run_id` (`tracking.run_id`), steps go live into that existing run instead, which its
    owner (the pipeline's train stage) made and ends: no second run. A resumed run first logs
    its record so far (metrics.jsonl, already cut back to the checkpoint) into it, so that run
    holds every step, once."""
    sinks: list[Sink] = []
    if "jsonl" in loggers:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if "console" in loggers:
        sinks.append(ConsoleSink(total_steps))
    if "mlflow" in loggers and run_id:
        sink = MlflowSink(run_id, client=MlflowStore(mlflow_uri, experiment).client)
        past = run_dir / "metrics.jsonl"
        for record in read_jsonl(past) if past.is_file() else []:
            sink.log(int(record["step"]), {k: v for k, v in record.items() if k != "step"})
        sinks.append(sink)
    elif "mlflow" in loggers:
        store = MlflowStore(mlflow_uri, experiment)
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = store.start_run(run_dir.name, tags=tags)
            store.log_params(run_id, flatten(config_tree or {}))
            id_file.write_text(run_id)
        sinks.append(MlflowSink(run_id, client=store.client, end_run_on_close=True))
    return Tracker(sinks)
