"""One pipeline run as it travels across the stages: its name and config, its MLflow run (the
parent of every stage's run) and the links between MLflow and the Prefect flow run behind it.

`start_pipeline` opens the run and gives the `PipelineContext` every stage is handed;
`stage_tags` tags a stage's MLflow run with the pipeline run and the Prefect flow run, so each side
leads to the other; `finish_pipeline` closes it with the summary, and `end_open_runs` ends what a
run that did not complete left RUNNING (`rlcore.lifecycle.run_end`). Also the UI links (MLflow
run, model version, Prefect flow run), what every webhook notification of the run carries, and
`announce`, how a lifecycle decision is printed. The stages themselves: `rlcore.lifecycle.stages`.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.config import Config, load_config
from rlcore.lifecycle.mlflow_store import MlflowStore
from rlcore.lifecycle.results import PipelineContext, Summary
from rlcore.tracking import (
    MLFLOW_TRAINING_VIEW,
    MLFLOW_UI_DEFAULT,
    default_tracking_uri,
    flatten,
    is_tracking_server,
    mlflow_run_url,
    mlflow_ui_base,
    model_version_url,
)

log = logging.getLogger(__name__)

PIPELINE_TAG = "rlcore.pipeline_run"
STAGE_TAG = "rlcore.stage"


def new_run_name() -> str:
    return time.strftime("pipeline-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def load_pipeline_config(config_path: str | None, overrides: Sequence[str] = (), data_path: str | None = None) -> Config:
    """The run's config; `data_path` (a newly arrived data file) replaces `data.train_files`."""
    overrides = list(overrides)
    if data_path:
        overrides.append(f"data.train_files=[{data_path}]")
    return load_config(config_path, overrides)


def tracking_uri(config: Config) -> str:
    """`tracking.mlflow_uri`, else $MLFLOW_TRACKING_URI, else a SQLite file in the working directory."""
    return config.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def open_store(config: Config, workdir: str | Path) -> MlflowStore:
    uri = tracking_uri(config)
    return MlflowStore(uri, experiment=config.tracking.experiment)


def prepare_store(config: Config) -> str:
    """Create the config's MLflow store and experiment before the runs that write it start (what
    `pipeline serve` does first): two runs creating a fresh SQLite store at once race its schema
    migration (one fails "table ... already exists") and the experiment's creation. Returns the
    store's tracking URI."""
    return open_store(config, ".").tracking_uri


# ---------------------------------------------------------------------- Prefect <-> MLflow
def prefect_flow_run() -> dict[str, str]:
    """The Prefect flow run this code runs in (`id`, `name`, and `url` when a Prefect UI is
    known, i.e. a server rather than the ephemeral API); empty outside a flow run."""
    try:
        from prefect.runtime import flow_run
        from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
    except ImportError:
        return {}
    if not flow_run.id:
        return {}
    found = {"id": str(flow_run.id), "name": str(flow_run.name)}
    if PREFECT_API_URL.value() and PREFECT_UI_URL.value():
        found["url"] = f"{str(PREFECT_UI_URL.value()).rstrip('/')}/runs/flow-run/{flow_run.id}"
    return found


def stage_tags(ctx: PipelineContext, stage: str) -> dict[str, str]:
    """Tags of every MLflow run of a pipeline run: its name, the stage, and the Prefect flow run
    behind it (`prefect.flow_run_id`, `_name`, `_url`) so each side leads to the other."""
    return {PIPELINE_TAG: ctx["run_name"], STAGE_TAG: stage,
            **{f"prefect.flow_run_{k}": v for k, v in prefect_flow_run().items()}}


PREFECT_UI_DEFAULT = "http://127.0.0.1:4200"  # where `prefect server start` serves its UI


def prefect_ui_hint(api_url: str | None, ui_url: str | None, home: str, db_url: str | None = None) -> str:
    """Where to see a run's flow runs: the UI of the Prefect server in use (`api_url` set; `ui_url`
    is Prefect's PREFECT_UI_URL, derived from it), or `prefect server start` here over the database
    the ephemeral API wrote to (`db_url` when rlcore gave it one of its own, else under `home`)."""
    if api_url:
        return f"Prefect UI at {(ui_url or api_url.removesuffix('/api')).rstrip('/')}"
    from rlcore.lifecycle.prefect_db import DB_URL_VAR

    if db_url:
        return f"{DB_URL_VAR}={db_url} prefect server start  (UI at {PREFECT_UI_DEFAULT})"
    return f"prefect server start  (UI at {PREFECT_UI_DEFAULT}; flow runs are stored under {home})"


def prefect_flow_run_url(flow_run_id: str) -> str:
    """The flow run's page: on the server in use, or on `prefect server start` over the database
    the ephemeral API wrote to."""
    return prefect_flow_run().get("url") or f"{PREFECT_UI_DEFAULT}/runs/flow-run/{flow_run_id}"


def _mlflow_run_link(store: MlflowStore, run_id: str) -> str:
    """The run's page on a tracking server, or how to open the UI on a local store."""
    url = mlflow_run_url(store.tracking_uri, store.experiment_id, run_id)
    if is_tracking_server(store.tracking_uri):
        return f"[MLflow run {run_id}]({url})"
    return f"[MLflow run {run_id}]({url}) once `mlflow ui --backend-store-uri {store.tracking_uri}` serves it"


def notification_fields(ctx: PipelineContext, event: str, about: str) -> dict[str, str | None]:
    """What every webhook notification of a pipeline run carries: its name, an `id` a receiver can
    drop repeats by (flow run, event and what it is about: a stage or a model), and the flow run's
    page in the Prefect UI when a server is in use."""
    run = ctx["prefect_flow_run_id"] or ctx["run_name"]
    return {"pipeline_run": ctx["run_name"], "id": f"{run}:{event}:{about}", "flow_run_id": ctx["prefect_flow_run_id"],
            "prefect_ui": prefect_flow_run().get("url")}


def _link_flow_run_to_mlflow(store: MlflowStore, run_id: str, run_name: str) -> None:
    """A markdown artifact on the current Prefect flow run naming its MLflow run; never fails
    the pipeline (a link is not worth a failed run)."""
    if not prefect_flow_run():
        return
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            markdown=f"# MLflow\n\nPipeline run `{run_name}`: {_mlflow_run_link(store, run_id)}\n\n"
                     f"Tracking URI: `{store.tracking_uri}`\n",
            key="mlflow-run", description=f"mlflow_run_id={run_id}")
    except Exception as err:  # noqa: BLE001
        log.warning("could not link the Prefect flow run to MLflow run %s: %s", run_id, err)


def announce(message: str) -> None:
    """A lifecycle decision, printed once: by rlcore's logger when it is on (`rlcore -v`), else,
    inside a Prefect run, by the run's logger (the console of `pipeline run`/`pipeline serve`
    and the flow run's logs in the Prefect UI)."""
    log.info(message)
    if log.isEnabledFor(logging.INFO):
        return
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger
    except ImportError:
        return
    try:
        get_run_logger().info(message)
    except MissingContextError:
        pass


# ---------------------------------------------------------------------- pipeline run
def start_pipeline(config: Config, workdir: str | Path, run_name: str, trigger: dict[str, Any] | None = None) -> PipelineContext:
    store = open_store(config, workdir)
    run_id = store.start_run(run_name, tags={PIPELINE_TAG: run_name, STAGE_TAG: "pipeline",
                                             **{f"prefect.flow_run_{k}": v for k, v in prefect_flow_run().items()},
                                             **{f"trigger.{k}": str(v) for k, v in (trigger or {}).items()}})
    store.log_params(run_id, flatten(config.model_dump(mode="json")))
    _link_flow_run_to_mlflow(store, run_id, run_name)
    return {"run_id": run_id, "run_name": run_name, "tracking_uri": store.tracking_uri, "experiment_id": store.experiment_id,
            "workdir": str(Path(workdir).resolve()), "prefect_flow_run_id": prefect_flow_run().get("id")}


def finish_pipeline(config: Config, ctx: PipelineContext, summary: Summary | dict[str, Any], status: str = "FINISHED") -> None:
    store = open_store(config, ctx["workdir"])
    metrics = {k: summary[k] for k in ("accuracy_before", "accuracy_after") if isinstance(summary.get(k), (int, float))}
    store.log_metrics(ctx["run_id"], metrics)
    store.set_tags(ctx["run_id"], {f"summary.{k}": v for k, v in summary.items() if not isinstance(v, (dict, list))})
    store.log_json(ctx["run_id"], summary, "summary.json")
    store.end_run(ctx["run_id"], status)


def open_runs(config: Config) -> dict[str, dict[str, str]]:
    """The MLflow runs of the config's experiment still RUNNING: run id -> tags (none when the
    default SQLite store was never created)."""
    uri = tracking_uri(config)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return {}
    store = MlflowStore(uri, experiment=config.tracking.experiment)
    runs = store.client.search_runs([store.experiment_id], "attributes.status = 'RUNNING'", max_results=10000)
    return {run.info.run_id: dict(run.data.tags) for run in runs}


def end_open_runs(config: Config, tags: dict[str, str], status: str, reason: str) -> list[str]:
    """End every MLflow run still RUNNING that carries `tags` (a pipeline run's own and its stages'),
    with `status` (FAILED, KILLED) and `reason` as its `failure` tag; returns their ids."""
    ended = [run_id for run_id, found in open_runs(config).items() if all(found.get(k) == v for k, v in tags.items())]
    if ended:
        store = MlflowStore(tracking_uri(config), experiment=config.tracking.experiment)
        for run_id in ended:
            store.set_tags(run_id, {"failure": reason[:4000]})
            store.end_run(run_id, status)
    return ended


__all__ = [
    "MLFLOW_TRAINING_VIEW", "MLFLOW_UI_DEFAULT", "PIPELINE_TAG", "PREFECT_UI_DEFAULT", "STAGE_TAG", "announce", "end_open_runs",
    "finish_pipeline", "load_pipeline_config", "mlflow_run_url", "mlflow_ui_base", "model_version_url", "new_run_name",
    "notification_fields", "open_runs", "open_store", "prefect_flow_run", "prefect_flow_run_url", "prefect_ui_hint", "prepare_store", "stage_tags",
    "start_pipeline", "tracking_uri",
]
