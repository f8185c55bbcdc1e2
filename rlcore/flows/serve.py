"""Deployments of `rl_pipeline`: a cron schedule for recurring retraining and a trigger on
`rlcore.data.arrived` events (one run per new data file, on that file), served by this process
against the Prefect server at PREFECT_API_URL, with server-side failure notifications
(rlcore.lifecycle.automations). `rlcore pipeline serve` calls `serve_pipeline`; `prefect.yaml` at
the repository root declares the same deployment for `prefect deploy`."""

from __future__ import annotations

import os
from typing import Any, cast
from uuid import UUID

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from rlcore.lifecycle.automations import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_UNRESPONSIVE_AFTER_S,
    SERVER_NOTIFIES_ENV,
    install_failure_notifications,
    remove_failure_notifications,
)
from rlcore.lifecycle.events import DATA_EVENT, RESOURCE_PREFIX

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


def build_deployment(flow: Flow[..., Any], parameters: dict[str, Any], cron: str | None = DEFAULT_CRON,
                     name: str = DEPLOYMENT_NAME, on_data: bool = True) -> RunnerDeployment:
    """The deployment, with a module-path entrypoint (`rlcore.flows.rl_pipeline.rl_pipeline`):
    its runs import the installed package, whatever the working directory."""
    return cast(RunnerDeployment, flow.to_deployment(  # sync here: the deployment itself
        name=name,
        cron=cron,
        triggers=[data_trigger()] if on_data else None,
        parameters=parameters,
        tags=["rlcore"],
        description="RL post-training pipeline: data_prep -> train -> evaluate -> promote",
        entrypoint_type=EntrypointType.MODULE_PATH,
    ))


def setup_failure_notifications(deployment_id: UUID, flow_name: str, deployment_name: str, webhook_url: str | None,
                                unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                                heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> bool:
    """Server-side `failed`/`crashed` notifications for the deployment's runs when a webhook is
    configured (removed when it no longer is); marks this process's environment so that its flow
    runs leave `failed` to the server. True when installed."""
    if not webhook_url:
        remove_failure_notifications(deployment_id, flow_name, deployment_name)
        os.environ.pop(SERVER_NOTIFIES_ENV, None)
        return False
    install_failure_notifications(webhook_url, deployment_id, flow_name, deployment_name,
                                  unresponsive_after_s=unresponsive_after_s, heartbeat_s=heartbeat_s)
    os.environ[SERVER_NOTIFIES_ENV] = "1"  # inherited by the flow-run processes this one starts
    return True


def serve_pipeline(flow: Flow[..., Any], parameters: dict[str, Any], cron: str | None = DEFAULT_CRON,
                   watch_dir: str | None = None, watch_interval_s: float = 5.0, limit: int = 1,
                   webhook_url: str | None = None, unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                   heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> None:
    """Create the deployment and its failure notifications, then run its flow runs here (each in
    a process of its own, sending heartbeats) until interrupted; with `watch_dir`, every new data
    file there is announced as an `rlcore.data.arrived` event."""
    from prefect import serve

    from rlcore.lifecycle.events import DirectoryWatcher

    deployment = build_deployment(flow, parameters, cron)
    deployment_id = cast(UUID, deployment.apply())  # sync here: a UUID; serve() applies it again (same name, same id)
    setup_failure_notifications(deployment_id, flow.name, deployment.name, webhook_url,
                                unresponsive_after_s=unresponsive_after_s, heartbeat_s=heartbeat_s)
    watcher = DirectoryWatcher(watch_dir, interval_s=watch_interval_s).start() if watch_dir else None
    try:
        serve(deployment, limit=limit, heartbeat_seconds=heartbeat_s)
    finally:
        if watcher is not None:
            watcher.stop()
