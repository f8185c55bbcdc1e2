"""A pipeline run that did not complete, recorded once, by whoever outlives it: every MLflow run it
left open ends FAILED (the run raised) or KILLED (it crashed or was cancelled: its process was
killed, died or was stopped) with the reason, and the webhook gets one `failed`, `crashed` or
`cancelled` notification (the event names the run's final Prefect state) whose `id` is
"<flow run id>:<event>".

`rl_pipeline` calls `run_ended` from its Prefect hooks: `on_failure` in the flow-run process,
`on_crashed` in the serving process (Prefect's runner, when the run's process exited without a
final state) or in the run's own process (interrupted: SIGTERM, Ctrl-C; or orphaned: its serving
process died, `rlcore.lifecycle.automations.ServeWatch`); `on_cancellation` in the serving process
(a cancel from the UI/API, or `pipeline serve` stopped by SIGINT/SIGTERM: Prefect's runner cancels
the runs it has). A run whose serving process died with it (the whole machine) is marked crashed
and notified by the Prefect server (`rlcore.lifecycle.automations`); its MLflow runs are ended by
the next `pipeline serve` (`end_runs_of_finished_flow_runs`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

from rlcore.config import Config
from rlcore.lifecycle.notify import notify

log = logging.getLogger(__name__)

RunEnd = Literal["failed", "crashed", "cancelled"]
MLFLOW_STATUS: dict[RunEnd, str] = {"failed": "FAILED", "crashed": "KILLED", "cancelled": "KILLED"}
NOTIFIED: tuple[RunEnd, ...] = ("failed", "crashed", "cancelled")  # one notification per run that did not complete
STOPPED_MESSAGE = "Cancelled: `pipeline serve` was stopped (SIGINT/SIGTERM) while this run was starting"
serve_stopping = threading.Event()  # set in the serving process when a SIGINT/SIGTERM stops it
_sent: set[str] = set()  # the notification ids this process sent: a second hook about the same end sends none
_sent_lock = threading.Lock()


def notification_id(flow_run_id: str, event: str) -> str:
    """What a receiver deduplicates on: the same for every notification about one outcome of one run."""
    return f"{flow_run_id}:{event}"


def flow_run_ui_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI when a server is in use (None in ephemeral mode)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    if not (PREFECT_API_URL.value() and PREFECT_UI_URL.value()):
        return None
    return f"{str(PREFECT_UI_URL.value()).rstrip('/')}/runs/flow-run/{flow_run_id}"


def config_of(parameters: dict[str, Any]) -> Config | None:
    """The pipeline's config as its flow run's parameters give it (the tiny example's model and data
    paths aside, which tracking and the webhook do not depend on); None when it does not load."""
    from rlcore.lifecycle.flow_secrets import unseal
    from rlcore.lifecycle.pipeline_run import load_pipeline_config

    try:
        parameters = unseal(parameters)  # the secrets Prefect stores redacted, from this process's environment
        return load_pipeline_config(parameters.get("config_path"), list(parameters.get("overrides") or []),
                                    parameters.get("data_path"))
    except Exception as err:  # noqa: BLE001 - the run may have failed for exactly this
        log.warning("the failed run's config does not load (%s): no MLflow runs to end, no webhook to notify", err)
        return None


def run_ended(flow_run: Any, state: Any, event: RunEnd, detected_by: str) -> None:
    """Record the end of pipeline flow run `flow_run` in state `state` (Prefect's objects); never
    raises (a hook's failure must not hide the run's)."""
    try:
        from prefect.client.orchestration import get_client

        flow_run_id = str(flow_run.id)
        try:  # the name as the flow set it: the serving process's copy may predate the renaming
            with get_client(sync_client=True) as client:
                name = client.read_flow_run(flow_run.id).name
        except Exception:  # noqa: BLE001
            name = flow_run.name
        reason = state.message or state.name or event
        config = config_of(dict(flow_run.parameters or {}))
        if config is None:
            return
        from rlcore.lifecycle.pipeline_run import end_open_runs

        ended = end_open_runs(config, {"prefect.flow_run_id": flow_run_id}, MLFLOW_STATUS[event], reason)
        log.info("pipeline run %s %s: ended %d MLflow run(s) %s", name, event, len(ended), MLFLOW_STATUS[event])
        with _sent_lock:
            if event not in NOTIFIED or notification_id(flow_run_id, event) in _sent:
                return
            _sent.add(notification_id(flow_run_id, event))
        notify(config.registry.webhook_url, event, {
            "id": notification_id(flow_run_id, event), "pipeline_run": name, "error": reason, "state": state.name,
            "flow_run_id": flow_run_id, "prefect_ui": flow_run_ui_url(flow_run_id), "detected_by": detected_by})
    except Exception as err:  # noqa: BLE001
        log.warning("could not record the end of flow run %s: %s", getattr(flow_run, "id", "?"), err)


def end_runs_of_finished_flow_runs(config: Config) -> list[str]:
    """End the MLflow runs left RUNNING by flow runs the Prefect server knows to have failed, crashed
    or been cancelled (a run whose serving process died with it: the server marked it crashed, and
    no process of its was left to end them), with the state's message as the reason. Called when
    `pipeline serve` starts; returns the MLflow run ids it ended."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    from rlcore.lifecycle.pipeline_run import end_open_runs, open_runs

    status_of = {"FAILED": "FAILED", "CRASHED": "KILLED", "CANCELLED": "KILLED"}
    ended: list[str] = []
    flow_run_ids = sorted({tags["prefect.flow_run_id"] for tags in open_runs(config).values() if "prefect.flow_run_id" in tags})
    with get_client(sync_client=True) as client:
        for flow_run_id in flow_run_ids:
            try:
                state = client.read_flow_run(UUID(flow_run_id)).state
            except Exception:  # noqa: BLE001 - another server's run, or deleted: leave it
                continue
            if state is not None and state.type.value in status_of:
                ended += end_open_runs(config, {"prefect.flow_run_id": flow_run_id}, status_of[state.type.value],
                                       state.message or state.name or "")
    return ended


def on_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """`rl_pipeline`'s on_failure hook (in the flow-run process)."""
    run_ended(flow_run, state, "failed", "flow")


def on_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    """`rl_pipeline`'s on_crashed hook (in the serving process, or the interrupted run's own). In a
    serving process that is being stopped, the crash is the stop's doing (a Ctrl-C reaches the
    whole process group, and a run still starting has not yet learnt to ignore it): the run is
    set Cancelled, as the runs the stop cancels are, and reported so."""
    if _in_serving_process():
        _close_liveness(flow_run)
    if _in_serving_process() and serve_stopping.is_set():
        run_ended(flow_run, _cancel(flow_run), "cancelled", "rlcore pipeline serve")
        return
    run_ended(flow_run, state, "crashed", "rlcore pipeline serve" if _in_serving_process() else "flow")


def _close_liveness(flow_run: Any) -> None:
    """The run's process is gone (its Heartbeat did not close): `rlcore.pipeline.ended` for it, so
    the server's liveness automation does not try to crash a run that has ended (a cron run's
    Crashed/Cancelled event reaches it late)."""
    if getattr(flow_run, "deployment_id", None) is not None:
        from rlcore.lifecycle.liveness import send_ended

        send_ended(str(flow_run.id), str(flow_run.deployment_id))


def _cancel(flow_run: Any) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    state: Any = Cancelled(message=STOPPED_MESSAGE)
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, state, force=True)
    except Exception as err:  # noqa: BLE001 - reported as cancelled all the same
        log.warning("could not set flow run %s Cancelled: %s", flow_run.id, err)
    return state


def on_cancellation(flow: Any, flow_run: Any, state: Any) -> None:
    """`rl_pipeline`'s on_cancellation hook: its MLflow runs end KILLED and the run's `cancelled`
    notification goes out (once per flow run and event: `NOTIFIED`, `notification_id`)."""
    if _in_serving_process():
        _close_liveness(flow_run)
    run_ended(flow_run, state, "cancelled", "rlcore pipeline serve" if _in_serving_process() else "flow")


def _in_serving_process() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is None


__all__ = [
    "MLFLOW_STATUS", "config_of", "end_runs_of_finished_flow_runs", "flow_run_ui_url", "notification_id",
    "on_cancellation", "on_crashed", "on_failure", "run_ended",
]
