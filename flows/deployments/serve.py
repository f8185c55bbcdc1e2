"""Deployments of `rl_pipeline`: a cron schedule for recurring retraining and a trigger on
`rlcore.data.arrived` events (one run per new data file, on that file), served by this process
against the Prefect server at PREFECT_API_URL. `rlcore pipeline serve` calls `serve_pipeline`;
`prefect.yaml` at the repository root declares the same for `prefect deploy`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # flows/ is not an installed package
    sys.path.insert(0, str(ROOT))

from typing import Any  # noqa: E402

from prefect.events import DeploymentEventTrigger  # noqa: E402

from rlcore.lifecycle.events import DATA_EVENT, RESOURCE_PREFIX  # noqa: E402

DEPLOYMENT_NAME = "rl-pipeline"
DEFAULT_CRON = "0 3 * * *"


def data_trigger() -> DeploymentEventTrigger:
    """Each `rlcore.data.arrived` event starts a run with `data_path` = the event's file."""
    return DeploymentEventTrigger(
        name="rlcore-data-arrived",
        expect={DATA_EVENT},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters={"data_path": "{{ event.payload.path }}"},
    )


def build_deployment(flow: Any, parameters: dict[str, Any], cron: str | None = DEFAULT_CRON,
                     name: str = DEPLOYMENT_NAME, on_data: bool = True) -> Any:
    return flow.to_deployment(
        name=name,
        cron=cron,
        triggers=[data_trigger()] if on_data else None,
        parameters=parameters,
        tags=["rlcore"],
        description="RL post-training pipeline: data_prep -> train -> evaluate -> promote",
    )


def serve_pipeline(flow: Any, parameters: dict[str, Any], cron: str | None = DEFAULT_CRON,
                   watch_dir: str | None = None, watch_interval_s: float = 5.0, limit: int = 1) -> None:
    """Create the deployment and run its flow runs here until interrupted; with `watch_dir`,
    every new data file there is announced as an `rlcore.data.arrived` event."""
    from prefect import serve

    from rlcore.lifecycle.events import DirectoryWatcher

    watcher = DirectoryWatcher(watch_dir, interval_s=watch_interval_s).start() if watch_dir else None
    try:
        serve(build_deployment(flow, parameters, cron), limit=limit)
    finally:
        if watcher is not None:
            watcher.stop()
