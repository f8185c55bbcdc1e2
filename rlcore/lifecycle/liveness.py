"""The rlcore events a served run's liveness is judged by, and how one is sent: a module of its
own below `automations` (the automations that read them, the heartbeat and `ServeWatch`) and
`run_end` (which closes a dead run's countdown), so neither imports the other for them."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

HEARTBEAT_EVENT = "rlcore.pipeline.heartbeat"
ENDED_EVENT = "rlcore.pipeline.ended"  # the last heartbeat: the flow function returned or raised


def pipeline_event(name: str, flow_run_id: str, deployment_id: str) -> dict[str, object]:
    """An rlcore event about one flow run of a deployment, as the server's `/events` takes it."""
    from prefect.events import Event, RelatedResource

    deployment = RelatedResource({"prefect.resource.id": f"prefect.deployment.{deployment_id}",
                                  "prefect.resource.role": "deployment"})
    return Event(event=name, resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"},
                 related=[deployment]).model_dump(mode="json")


def send_ended(flow_run_id: str, deployment_id: str) -> None:
    """`rlcore.pipeline.ended` for a run that ended without its own Heartbeat closing: its liveness
    countdown closes now (a cron run's final state event is evaluated late: `rlcore.lifecycle.automations`).
    Logged, not raised, when it cannot be sent: the final state closes the countdown too, later."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.request("POST", "/events", json=[pipeline_event(ENDED_EVENT, flow_run_id, deployment_id)])
    except Exception as err:  # noqa: BLE001 - see above
        log.warning("rlcore: end of flow run %s not sent: %s", flow_run_id, err)
