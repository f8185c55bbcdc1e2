"""Deployments of `rl_pipeline`: a cron schedule for recurring retraining and a trigger on
`rlcore.data.arrived` events (one run per new data file, on that file), served by this process
against the Prefect server at PREFECT_API_URL, with liveness and crash notifications
(rlcore.lifecycle.automations). `rlcore pipeline serve` calls `serve_pipeline`; `prefect.yaml` at
the repository root declares the same deployment for `prefect deploy`.

No secret is stored with the deployment: its parameters hold the redacted form of any secret in
them (an override of `registry.webhook_url`, credentials in a URL), and this process holds the
values for the flow runs it starts (`rlcore.lifecycle.flow_secrets`); the server's crash
notification reads the webhook from a Prefect Webhook block, whose URL is stored as a secret.

One SIGINT or SIGTERM stops serving cleanly: runs in progress are cancelled (Prefect's runner
does that; each is notified `cancelled` once, its MLflow runs KILLED), and the deployment stays
active (not paused), so the next `serve` picks it up as is. When this process is killed
(SIGKILL, the OOM killer), the runs it started end themselves as crashed and report it
(`rlcore.lifecycle.automations.ServeWatch`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any, cast
from uuid import UUID

from prefect import Flow
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.runner import Runner
from prefect.types.entrypoint import EntrypointType

from rlcore.config import Config
from rlcore.lifecycle.automations import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_UNRESPONSIVE_AFTER_S,
    HEARTBEAT_ENV,
    SERVE_PID_ENV,
    install_failure_notifications,
)
from rlcore.lifecycle.events import DATA_EVENT, RESOURCE_PREFIX
from rlcore.lifecycle.flow_secrets import sealed
from rlcore.lifecycle.run_end import serve_stopping

log = logging.getLogger(__name__)

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
                     name: str = DEPLOYMENT_NAME, on_data: bool = True, concurrency_limit: int | None = None) -> RunnerDeployment:
    """The deployment, with a module-path entrypoint (`rlcore.flows.rl_pipeline.rl_pipeline`):
    its runs import the installed package, whatever the working directory. Active (`paused=False`):
    applying it resumes one an earlier serve left paused. `concurrency_limit`: runs of it at once on
    the server, whichever process serves them (more wait, Prefect's default ENQUEUE); None: no limit."""
    return cast(RunnerDeployment, flow.to_deployment(  # sync here: the deployment itself
        name=name,
        cron=cron,
        triggers=[data_trigger()] if on_data else None,
        parameters=parameters,
        tags=["rlcore"],
        description="RL post-training pipeline: data_prep -> train -> evaluate -> promote",
        entrypoint_type=EntrypointType.MODULE_PATH,
        paused=False,
        concurrency_limit=concurrency_limit,
    ))


def setup_liveness(deployment_id: UUID, flow_name: str, deployment_name: str, webhook_url: str | None,
                   unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                   heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
    """The deployment's liveness automation (and, with a webhook, its crash notification) on the
    server, and this process's environment set so that the flow runs it starts send heartbeats."""
    install_failure_notifications(webhook_url, deployment_id, flow_name, deployment_name,
                                  unresponsive_after_s=unresponsive_after_s, heartbeat_s=heartbeat_s)
    os.environ[HEARTBEAT_ENV] = f"{heartbeat_s:g}"  # inherited by the flow-run processes this one starts
    os.environ[SERVE_PID_ENV] = str(os.getpid())  # they end themselves when this process dies (ServeWatch)


async def serve_until_signal(runner: Runner) -> None:
    """Run `runner` until it stops or this process gets SIGINT or SIGTERM, then stop it and return.
    (Prefect's own `serve` leaves a SIGTERM half-handled: a coroutine never awaited and a
    traceback, and a paused deployment; a first Ctrl-C only starts its shutdown.)"""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    serve_stopping.clear()

    def stop_now() -> None:
        serve_stopping.set()  # a run that crashes from here on was stopped with it: Cancelled (run_end.on_crashed)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_now)
    started = asyncio.create_task(runner.start())
    await asyncio.sleep(0)  # runner.start() installs its own SIGTERM handler first thing: ours again
    loop.add_signal_handler(signal.SIGTERM, stop_now)
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({started, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if started in done:
            started.result()
            return
        log.warning("rlcore: stopping `pipeline serve` (runs in progress are cancelled; the deployment stays active)")
        if runner.started:
            await runner.astop()
        await started
    finally:
        stopping.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def serve_pipeline(flow: Flow[..., Any], parameters: dict[str, Any], cron: str | None = DEFAULT_CRON,
                   watch_dir: str | None = None, watch_interval_s: float = 5.0, limit: int = 1,
                   webhook_url: str | None = None, unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                   heartbeat_s: float = DEFAULT_HEARTBEAT_S, config: Config | None = None,
                   concurrency_limit: int | None = None) -> None:
    """Create the deployment, its liveness and crash notifications and `config`'s MLflow store (its
    runs may start together), end the MLflow runs that runs which died with an earlier serving
    process left open, then run its flow runs here (each in a process of its own, sending
    heartbeats) until SIGINT or SIGTERM; with `watch_dir`, every new data file there is announced
    as an `rlcore.data.arrived` event."""
    from rlcore.lifecycle.events import DirectoryWatcher
    from rlcore.lifecycle.pipeline_run import prepare_store
    from rlcore.lifecycle.run_end import end_runs_of_finished_flow_runs

    with sealed(parameters) as stored:  # the deployment's parameters, secrets redacted; their values stay here
        deployment = build_deployment(flow, stored, cron, concurrency_limit=concurrency_limit)
        runner = Runner(name=f"rlcore-{deployment.name}", limit=limit, pause_on_shutdown=False)
        # applied once, here (applying again would replace the runs its schedule already made)
        deployment_id = cast(UUID, runner.add_deployment(deployment))  # sync here: a UUID
        setup_liveness(deployment_id, flow.name, deployment.name, webhook_url, unresponsive_after_s, heartbeat_s)
        if config is not None:
            prepare_store(config)  # before any run: two runs creating a fresh SQLite store at once race its migration
            ended = end_runs_of_finished_flow_runs(config)
            if ended:
                log.warning("rlcore: ended %d MLflow run(s) of pipeline runs that died with their process", len(ended))
        watcher = DirectoryWatcher(watch_dir, interval_s=watch_interval_s).start() if watch_dir else None
        try:
            asyncio.run(serve_until_signal(runner))
        finally:
            if watcher is not None:
                watcher.stop()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_until_stopped(flow: Flow[..., Any], parameters: dict[str, Any], **kwargs: Any) -> None:
    """`serve_pipeline`, with SIGINT or SIGTERM during its set-up (before the runner takes them
    over) stopping it as quietly: no traceback, nothing half-served (the deployment stays active)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve_pipeline(flow, parameters, **kwargs)
    except KeyboardInterrupt:
        log.warning("rlcore: `pipeline serve` stopped while setting up")
    finally:
        signal.signal(signal.SIGTERM, previous)
