"""data_prep: validate every row (fail or skip by policy), deduplicate, split, write parquet,
fingerprint. Cached by input fingerprint: the same files and settings reuse the prepared data.
The cached result is JSON under the pipeline's working folder, read back only if it is data
(`rlcore.flows.results`): a planted record is refused with a warning and the task runs again."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.utilities.annotations import NotSet

from rlcore.config import config_from_dict
from rlcore.flows.results import DATA_ONLY_JSON, result_storage_for
from rlcore.lifecycle import pipeline_run, stages
from rlcore.lifecycle.results import PipelineContext, PreparedData
from rlcore.lifecycle.retry import STAGE_RETRIES, retry_if_transient
from rlcore.redact import redacts_errors  # a failed task's or flow's message is stored by Prefect


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    config = config_from_dict(parameters["config"])
    key = stages.data_prep_key(config, parameters.get("val_fraction", 0.1))
    # the workdir (a path) enters hashed: a storage key must not contain "/"
    workdir = hashlib.sha256(str(Path(parameters["workdir"]).resolve()).encode()).hexdigest()[:16]
    return f"rlcore-data-prep-{key}-{workdir}"


# Retried once (STAGE_RETRIES) for a transient failure (I/O, the tracking store); a data or config error is final.
# Call it through `prepare_data`, which stores its result under the workdir.
@task(name="data_prep", cache_key_fn=_cache_key, persist_result=True, result_serializer=DATA_ONLY_JSON,
      retries=STAGE_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient)
@redacts_errors
def prepare_data_task(config: dict[str, Any], workdir: str, val_fraction: float = 0.1,
                      ctx: PipelineContext | None = None) -> PreparedData:
    return stages.prepare_data_stage(config_from_dict(config), workdir, val_fraction, ctx)


def prepare_data(config: dict[str, Any], workdir: str, val_fraction: float = 0.1, ctx: PipelineContext | None = None,
                 *, refresh: bool = False, retries: int | None = None) -> PreparedData:
    """The data_prep task, its cached result kept in `<workdir>/task-results` (`refresh`: recompute;
    `retries`: its retries after a transient failure, None: STAGE_RETRIES)."""
    task = prepare_data_task.with_options(result_storage=result_storage_for(workdir), refresh_cache=True if refresh else NotSet,
                                          retries=STAGE_RETRIES if retries is None else retries)
    return task(config, workdir, val_fraction, ctx)


@flow(name="data_prep")
@redacts_errors
def data_prep(config_path: str | None = None, overrides: list[str] | None = None, data_path: str | None = None,
              workdir: str = "runs/pipeline", val_fraction: float = 0.1) -> PreparedData:
    config = pipeline_run.load_pipeline_config(config_path, overrides or [], data_path)
    return prepare_data(config.model_dump(mode="json"), workdir, val_fraction)
