"""`rlcore runs`: the recent pipeline runs of an MLflow store, and two registered versions side
by side, read back from what the pipeline wrote (`pipeline_run`: the parent run tagged
`rlcore.stage=pipeline`, its `summary.*` tags and `accuracy_*` metrics, a `failure` tag when it
did not finish; `promotion`: the promote stage's `version`/`alias`/`decision` tags and each
version's `rlcore.decision`/`rlcore.check` tags). Read only: nothing here writes to the store."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlcore.errors import RLCoreError
from rlcore.lifecycle.mlflow_store import CHAMPION
from rlcore.lifecycle.pipeline_run import PIPELINE_TAG, STAGE_TAG
from rlcore.tracking import MlflowStore, default_tracking_uri, is_tracking_server


class RunsError(RLCoreError):
    """The store, experiment, model or a version asked for is not there."""


@dataclass
class RunRow:
    """One pipeline run as `rlcore runs` lists it."""

    started: str
    name: str
    status: str
    accuracy_before: float | None
    accuracy_after: float | None
    version: str | None
    decision: str | None  # promoted / rejected
    check: str | None  # the gate check that decided (gate.decide: promoted, margin, kl_budget, length_budget)
    failure: str | None
    run_id: str


@dataclass
class CompareRow:
    field: str
    first: str
    second: str

    @property
    def differs(self) -> bool:
        return self.first != self.second


def default_uri() -> str:
    """What `rlcore pipeline run` records into without `tracking.mlflow_uri`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def open_store(uri: str, experiment: str) -> MlflowStore:
    """The store at `uri`, refused in one line when there is none (never creates one)."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise RunsError(f"--tracking-uri: no MLflow store at {uri} (run `rlcore pipeline run` here, or name the store)")
    if is_tracking_server(uri):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # unreachable: say so now, not after minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow.tracking import MlflowClient

    try:
        if MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment) is None:
            raise RunsError(f"--experiment: no experiment {experiment!r} in {uri}: no runs")
        return MlflowStore(uri, experiment=experiment)
    except RunsError:
        raise
    except Exception as err:  # a server that does not answer, a file that is not an MLflow database
        raise RunsError(f"--tracking-uri: cannot read the MLflow store at {uri}: {str(err).splitlines()[0]}") from err


def _time(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S") if ms else "-"


def _promote_tags(store: MlflowStore, run_id: str) -> dict[str, str]:
    """The tags of the pipeline run's promote stage (a child run tagged `alias`), {} when it never got there."""
    children = store.client.search_runs([store.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'", max_results=100)
    for child in children:
        if "alias" in child.data.tags:
            return dict(child.data.tags)
    return {}


def recent_runs(store: MlflowStore, limit: int) -> list[RunRow]:
    """The `limit` newest pipeline runs, newest first."""
    runs = store.client.search_runs([store.experiment_id], f"tags.`{STAGE_TAG}` = 'pipeline'",
                                    max_results=limit, order_by=["attributes.start_time DESC"])
    rows = []
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        promote = _promote_tags(store, run.info.run_id)
        version = promote.get("version") or tags.get("summary.version") or None
        decision = None
        if promote.get("alias"):
            decision = "promoted" if promote["alias"] == CHAMPION else "rejected"
        elif "summary.champion" in tags and version:
            decision = "promoted" if tags["summary.champion"] == "True" else "rejected"
        rows.append(RunRow(_time(run.info.start_time), tags.get(PIPELINE_TAG, run.info.run_name), run.info.status,
                           metrics.get("accuracy_before"), metrics.get("accuracy_after"), version, decision,
                           promote.get("decision"), tags.get("failure"), run.info.run_id))
    return rows


def compare_versions(store: MlflowStore, model: str, first: str, second: str) -> list[CompareRow]:
    """Two versions of `model`: when, from which run, the decision, and their run's metrics both have."""
    from mlflow.exceptions import MlflowException

    def load(version: str) -> tuple[Any, dict[str, float]]:
        try:
            mv = store.client.get_model_version(model, version)
        except MlflowException:
            try:
                known = sorted((str(v.version) for v in store.client.search_model_versions(f"name='{model}'")), key=int)
            except MlflowException:
                known = []
            if not known:
                raise RunsError(f"--model: no registered model {model!r} (or it has no versions)") from None
            raise RunsError(f"--compare: {model!r} has no version {version!r} (versions: {', '.join(known)})") from None
        metrics = dict(store.client.get_run(mv.run_id).data.metrics) if mv.run_id else {}
        return mv, metrics

    (a, ma), (b, mb) = load(first), load(second)
    rows = [CompareRow("version", str(a.version), str(b.version)),
            CompareRow("created", _time(a.creation_timestamp), _time(b.creation_timestamp)),
            CompareRow("aliases", ",".join(a.aliases or []) or "-", ",".join(b.aliases or []) or "-"),
            CompareRow("pipeline run", a.tags.get(PIPELINE_TAG, "-"), b.tags.get(PIPELINE_TAG, "-")),
            CompareRow("source run", a.run_id or "-", b.run_id or "-")]
    rows += [CompareRow(tag, a.tags.get(tag, "-"), b.tags.get(tag, "-")) for tag in ("rlcore.decision", "rlcore.check")]
    rows += [CompareRow(key, f"{ma[key]:.4g}", f"{mb[key]:.4g}") for key in sorted(ma.keys() & mb.keys())]
    return rows


# ---------------------------------------------------------------------- text
def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body])


def format_runs(rows: list[RunRow]) -> str:
    body = []
    for r in rows:
        decision = f"{r.decision} ({r.check})" if r.decision and r.check and r.check != r.decision else (r.decision or "-")
        body.append([r.started, r.name, r.status, f"{_num(r.accuracy_before)} -> {_num(r.accuracy_after)}",
                     r.version or "-", decision, (r.failure or "").splitlines()[0][:80] if r.failure else ""])
    return _table(["STARTED (UTC)", "RUN", "STATUS", "ACCURACY", "VERSION", "DECISION", "FAILURE"], body)


def format_compare(rows: list[CompareRow]) -> str:
    """Side by side; a `*` in the first column marks a row whose values differ."""
    return _table(["", "", f"v{rows[0].first}", f"v{rows[0].second}"],
                  [["*" if r.differs else "", r.field, r.first, r.second] for r in rows[1:]])


def runs_json(rows: list[RunRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def compare_json(rows: list[CompareRow]) -> list[dict[str, Any]]:
    return [{**asdict(r), "differs": r.differs} for r in rows]


__all__ = ["CompareRow", "RunRow", "RunsError", "compare_json", "compare_versions", "default_uri", "format_compare",
           "format_runs", "open_store", "recent_runs", "runs_json"]
