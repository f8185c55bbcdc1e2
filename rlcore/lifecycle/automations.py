"""Failure notifications that do not depend on the run that failed: Prefect automations on the
server send `registry.webhook_url` a `failed` or `crashed` notification for a pipeline run.

A flow can only report what it lives to see: an exception (rl_pipeline's `failed`), not the
SIGKILL, OOM kill or power loss of the process running it. `rlcore pipeline serve` therefore
sets up two automations on the Prefect server, scoped to the deployment it serves:

- `... failed or crashed -> webhook`: on `prefect.flow-run.Failed` / `prefect.flow-run.Crashed`
  of one of the deployment's runs, a CallWebhook action POSTs the same JSON shape as
  rlcore.lifecycle.notify (`{"source": "rlcore", "event": "failed"|"crashed", "time": ...,
  "pipeline_run": ..., "error": ...}`) through a Webhook block that holds the URL (a secret:
  only the block, which the server stores as a secret, sees it).
- `... unresponsive -> crashed`: Prefect's zombie detection. Served flow runs emit a heartbeat
  event every `heartbeat_s` (>= 30 s, Prefect's minimum); when a run has sent neither another
  heartbeat nor a terminal state `unresponsive_after_s` after its last one, the server marks it
  Crashed, which the first automation reports. This covers a run whose serving process died
  with it (nobody is left to say so); when only the flow-run process dies, the serving process
  marks it Crashed at once.

Runs of the deployment then do not send `failed` themselves (the serving process sets
`RLCORE_FAILURES_NOTIFIED_BY_SERVER=1` for them): one notification per failure.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast
from uuid import UUID

from rlcore.lifecycle.notify import request_target
from rlcore.redact import redact_secret

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger(__name__)

SERVER_NOTIFIES_ENV = "RLCORE_FAILURES_NOTIFIED_BY_SERVER"
HEARTBEAT_MIN_S = 30  # prefect.flow_engine.MINIMUM_HEARTBEAT_INTERVAL: shorter settings are raised to it
DEFAULT_HEARTBEAT_S = 30
DEFAULT_UNRESPONSIVE_AFTER_S = 90.0  # three missed heartbeats, as Prefect's zombie-detection guide has it
FAILURE_EVENTS = ("prefect.flow-run.Failed", "prefect.flow-run.Crashed")
TERMINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Cancelled", *FAILURE_EVENTS)
HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"

# Rendered by the server's sandboxed Jinja with the triggering event and the flow run, flow and
# deployment it names; tojson keeps messages with quotes or newlines valid JSON.
PAYLOAD_TEMPLATE = """{
  "source": "rlcore",
  "event": {{ event.event | replace("prefect.flow-run.", "") | lower | tojson }},
  "time": {{ event.occurred.timestamp() }},
  "pipeline_run": {{ flow_run.name | tojson }},
  "error": {{ event.resource["prefect.state-message"] | tojson }},
  "state": {{ event.resource["prefect.state-name"] | tojson }},
  "flow": {{ flow.name | tojson }},
  "deployment": {{ deployment.name | tojson }},
  "flow_run_id": {{ flow_run.id | string | tojson }},
  "prefect_ui": {{ flow_run | ui_url | tojson }},
  "detected_by": "prefect-server"
}"""


def failures_notified_by_server() -> bool:
    """Whether this process runs under `rlcore pipeline serve` with failure automations in place
    (then the server, not the flow, sends `failed`)."""
    return os.environ.get(SERVER_NOTIFIES_ENV) == "1"


@dataclass(frozen=True)
class FailureNotifications:
    """What was set up on the server for one deployment."""

    block_id: UUID
    failed_automation_id: UUID
    unresponsive_automation_id: UUID


def automation_names(flow_name: str, deployment_name: str) -> tuple[str, str]:
    """The names of the two automations for a deployment (how a re-run of serve finds them)."""
    where = f"rlcore {flow_name}/{deployment_name}"
    return f"{where}: failed or crashed -> webhook", f"{where}: unresponsive -> crashed"


def _block_name(deployment_id: UUID) -> str:
    return f"rlcore-failure-webhook-{deployment_id}"  # block names: lowercase letters, digits, dashes


def _delete_automations(client: SyncPrefectClient, names: tuple[str, ...]) -> None:
    for name in names:
        for automation in client.read_automations_by_name(name):
            client.delete_automation(automation.id)


def install_failure_notifications(webhook_url: str, deployment_id: UUID, flow_name: str, deployment_name: str,
                                  unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                                  heartbeat_s: int = DEFAULT_HEARTBEAT_S) -> FailureNotifications:
    """Create (or replace) the webhook block and both automations for `deployment_id` on the
    Prefect server in use (PREFECT_API_URL). Idempotent: a second call leaves one of each."""
    from prefect.blocks.webhook import Webhook
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import CallWebhook, ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.types import SecretDict
    from pydantic import SecretStr

    beat = max(int(heartbeat_s), HEARTBEAT_MIN_S)
    if unresponsive_after_s <= beat:
        raise ValueError(f"unresponsive_after_s ({unresponsive_after_s:g}) must exceed the heartbeat interval ({beat} s)")
    target, auth = request_target(webhook_url)  # credentials in the URL -> Basic authorization
    block = Webhook(method="POST", url=SecretStr(target), headers=SecretDict({"Content-Type": "application/json", **auth}))
    block_id = cast(UUID, block.save(_block_name(deployment_id), overwrite=True))  # sync here: a UUID
    ours: dict[str, str | list[str]] = {"prefect.resource.id": f"prefect.deployment.{deployment_id}",
                                        "prefect.resource.role": "deployment"}
    failed_name, unresponsive_name = automation_names(flow_name, deployment_name)
    failed = AutomationCore(
        name=failed_name,
        description=f"POST a failed/crashed notification for runs of {flow_name}/{deployment_name} ({redact_secret(webhook_url)})",
        trigger=EventTrigger(expect=set(FAILURE_EVENTS), match={"prefect.resource.id": "prefect.flow-run.*"},
                             match_related=ours, posture=Posture.Reactive, threshold=1),
        actions=[CallWebhook(block_document_id=block_id, payload=PAYLOAD_TEMPLATE)],
    )
    unresponsive = AutomationCore(
        name=unresponsive_name,
        description=f"Mark runs of {flow_name}/{deployment_name} crashed after {unresponsive_after_s:g} s without a heartbeat",
        trigger=EventTrigger(after={HEARTBEAT_EVENT}, expect={HEARTBEAT_EVENT, *TERMINAL_EVENTS},
                             match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=ours,
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=unresponsive_after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=(
            f"No heartbeat for {unresponsive_after_s:g} s: the process running this flow run died or hangs"))],
    )
    with get_client(sync_client=True) as client:
        _delete_automations(client, (failed_name, unresponsive_name))
        found = FailureNotifications(block_id, client.create_automation(failed), client.create_automation(unresponsive))
    log.info("failure notifications for %s/%s go to %s (unresponsive after %g s)", flow_name, deployment_name,
             redact_secret(webhook_url), unresponsive_after_s)
    return found


def remove_failure_notifications(deployment_id: UUID, flow_name: str, deployment_name: str) -> None:
    """Remove what install_failure_notifications set up for the deployment (served again without
    a webhook URL: no notifications to a URL that is no longer configured)."""
    from prefect.blocks.webhook import Webhook
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        _delete_automations(client, automation_names(flow_name, deployment_name))
        try:
            block = client.read_block_document_by_name(_block_name(deployment_id), Webhook.get_block_type_slug())
        except Exception:  # noqa: BLE001 - none there (ObjectNotFound)
            return
        client.delete_block_document(block.id)
