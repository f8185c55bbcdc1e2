"""data_prep: validate every row (fail or skip by policy), deduplicate, split, write parquet,
fingerprint. Cached by input fingerprint: the same files and settings reuse the prepared data."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import flow, task

from rlcore.config import config_from_dict
from rlcore.lifecycle import stages
from rlcore.lifecycle.data_prep import retry_if_transient
from rlcore.lifecycle.results import PipelineContext, PreparedData


def _cache_key(context: Any, parameters: dict[str, Any]) -> str:
    config = config_from_dict(parameters["config"])
    key = stages.data_prep_key(config, parameters.get("val_fraction", 0.1))
    # the workdir (a path) enters hashed: a storage key must not contain "/"
    workdir = hashlib.sha256(str(Path(parameters["workdir"]).resolve()).encode()).hexdigest()[:16]
    return f"rlcore-data-prep-{key}-{workdir}"


# Retried once for a transient failure (I/O, the tracking store); a data or config error is final.
@task(name="data_prep", cache_key_fn=_cache_key, persist_result=True, retries=1, retry_delay_seconds=2,
      retry_condition_fn=retry_if_transient)
def prepare_data_task(config: dict[str, Any], workdir: str, val_fraction: float = 0.1,
                      ctx: PipelineContext | None = None) -> PreparedData:
    return stages.prepare_data_stage(config_from_dict(config), workdir, val_fraction, ctx)


@flow(name="data_prep")
def data_prep(config_path: str | None = None, overrides: list[str] | None = None, data_path: str | None = None,
              workdir: str = "runs/pipeline", val_fraction: float = 0.1) -> PreparedData:
    config = stages.load_pipeline_config(config_path, overrides or [], data_path)
    return prepare_data_task(config.model_dump(mode="json"), workdir, val_fraction)
