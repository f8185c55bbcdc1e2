"""Liveness and crash notifications of served pipeline runs that do not depend on the processes
running them.

Who reports a run that did not complete, exactly once (`rlcore.lifecycle.run_end` sends the
first two, in the same shape as the server's; each notification's `id` is
"<flow run id>:<failed|crashed>", the same whoever sends it, so a receiver can drop repeats):

- a run that raised: the flow-run process itself (`rl_pipeline`'s `on_failure` hook): `failed`;
- a run whose process died while its serving process lives: the serving process (Prefect's runner
  marks the run Crashed and runs the flow's `on_crashed` hook there): `crashed`;
- a run whose serving process died with it: the Prefect server, through two automations that
  `rlcore pipeline serve` sets up for its deployment (below): `crashed`.

Liveness: while a served run runs, it sends an `rlcore.pipeline.heartbeat` event every
`heartbeat_s` (`Heartbeat`), each one a plain POST that returns once the server has it, and the
last one before the run reports its final state (the heartbeat stops when the flow function
returns or raises, and sends `rlcore.pipeline.ended`). The `... unresponsive -> crashed` automation
marks a run Crashed when `unresponsive_after_s` pass after a heartbeat with neither another
heartbeat, nor `rlcore.pipeline.ended`, nor a final state. The ended event is what closes the
countdown in practice: the server orders a flow run's state events causally, and those of a
cron-scheduled run follow a Scheduled event that was never emitted, so its Completed event can
reach the automation after the countdown (the automation then failed: "already in terminal
state COMPLETED"); our own event follows nothing and is evaluated on arrival. A run whose process
cannot send it (killed: the OOM killer, a cancel) has it sent by `serve` from the run's
on_crashed/on_cancellation hook (`send_ended`).

A served run also watches its serving process (`ServeWatch`): when that dies (SIGKILL, the OOM
killer), the run ends itself within a second, Crashed, and reports that itself (one `crashed`, its
MLflow runs KILLED), instead of running on as an orphan until a write to the dead process's pipe
kills it. It ignores SIGINT: a Ctrl-C in `serve`'s terminal reaches the whole process group, and it is
`serve`'s to stop its runs (Cancelled, through Prefect's runner), not each run's to crash.
Prefect's own flow-run heartbeats are not used for this: its engine may deliver one after the
run's final state (PrefectHQ/prefect#20887, #21932), which restarts the countdown and has the
automation try to crash a finished run. The `... crashed (unresponsive) -> webhook` automation
POSTs `crashed` for the crashes the first one made, and only those (matched by their message:
the other crashes were reported by the serving process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from rlcore.lifecycle.liveness import ENDED_EVENT, HEARTBEAT_EVENT, pipeline_event, send_ended
from rlcore.lifecycle.notify import request_target
from rlcore.redact import redact_secret

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

log = logging.getLogger(__name__)

HEARTBEAT_ENV = "RLCORE_HEARTBEAT_S"  # set by `pipeline serve` for the flow-run processes it starts
SERVE_PID_ENV = "RLCORE_SERVE_PID"  # likewise: the serving process, which its runs watch (`ServeWatch`)
DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_UNRESPONSIVE_AFTER_S = 90.0  # three missed heartbeats, as Prefect's zombie-detection guide has it
TERMINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                   "prefect.flow-run.Crashed")
LIVENESS_PREFIX = "rlcore liveness:"

# Rendered by the server's sandboxed Jinja with the triggering event and the flow run, flow and
# deployment it names; tojson keeps messages with quotes or newlines valid JSON. `PREFECT_UI`
# is filled in when the automation is made (the server does not know its public UI address).
PAYLOAD_TEMPLATE = """{
  "source": "rlcore",
  "event": "crashed",
  "id": {{ (flow_run.id | string ~ ":crashed") | tojson }},
  "time": {{ event.occurred.timestamp() }},
  "pipeline_run": {{ flow_run.name | tojson }},
  "error": {{ event.resource["prefect.state-message"] | tojson }},
  "state": {{ event.resource["prefect.state-name"] | tojson }},
  "flow": {{ flow.name | tojson }},
  "deployment": {{ deployment.name | tojson }},
  "flow_run_id": {{ flow_run.id | string | tojson }},
  "prefect_ui": PREFECT_UI,
  "detected_by": "prefect-server"
}"""


def liveness_message(unresponsive_after_s: float) -> str:
    return (f"{LIVENESS_PREFIX} no heartbeat for {unresponsive_after_s:g} s: the process running this flow run "
            "and the process serving it died or hang")


def payload_template(ui_url: str | None) -> str:
    link = f'{{{{ ("{ui_url.rstrip("/")}/runs/flow-run/" ~ flow_run.id | string) | tojson }}}}' if ui_url else "null"
    return PAYLOAD_TEMPLATE.replace("PREFECT_UI", link)


def heartbeat_interval() -> float | None:
    """The heartbeat interval `pipeline serve` gave this flow-run process (None: not served with
    liveness, no heartbeats)."""
    value = os.environ.get(HEARTBEAT_ENV)
    return float(value) if value else None


class Heartbeat:
    """`rlcore.pipeline.heartbeat` events for one flow run of a deployment, from a daemon thread,
    every `interval_s` seconds while the context is open. Each event is a POST to the server's
    `/events` that returns once the event is on the server's event bus; leaving the context waits
    for a heartbeat in flight, so none is delivered after the run's final state. A heartbeat that
    cannot be sent is logged and skipped (the run must not fail for it)."""

    def __init__(self, flow_run_id: str, deployment_id: str, interval_s: float) -> None:
        self.flow_run_id = flow_run_id
        self.deployment_id = deployment_id
        self.interval_s = interval_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlcore-heartbeat", daemon=True)

    def event(self, name: str = HEARTBEAT_EVENT) -> dict[str, object]:
        return pipeline_event(name, self.flow_run_id, self.deployment_id)

    def beat(self, client: SyncPrefectClient) -> None:
        try:
            response = client.request("POST", "/events", json=[self.event()])
            response.raise_for_status()
            self.sent += 1
        except Exception as err:  # noqa: BLE001 - a missed heartbeat is the automation's to judge
            log.warning("rlcore heartbeat for flow run %s not sent: %s", self.flow_run_id, err)

    def _run(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not self._stop.is_set():
                self.beat(client)
                self._stop.wait(self.interval_s)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No heartbeat after this returns (one in flight is waited for); idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        from prefect.client.orchestration import get_client

        try:  # closes the liveness countdown now, whenever the run's state events are evaluated
            with get_client(sync_client=True) as client:
                client.request("POST", "/events", json=[self.event(ENDED_EVENT)]).raise_for_status()
        except Exception as err:  # noqa: BLE001 - the final state closes it too, later
            log.warning("rlcore: end of flow run %s not sent: %s", self.flow_run_id, err)


class ServeWatch:
    """While open, a daemon thread checks every `interval_s` that this flow-run process's parent
    (the `pipeline serve` that started it) lives. When it has died, this process ends its run
    itself, from that thread, and exits: Prefect's runner, which would have reported the run, died
    with the parent (and had turned off crash handling in this process). In order: its output goes
    to `orphaned-run-<flow run id>.log` in the working folder (it was a pipe to the dead process:
    the next write would kill the run with a BrokenPipeError), the run's `heartbeat` stops (a beat
    sent after `rlcore.pipeline.ended` would restart the liveness countdown, and the automation would
    then fail on a run already Crashed), the run is set Crashed with the
    reason, `rlcore.pipeline.ended` closes its liveness countdown, `run_end` ends its MLflow runs
    KILLED and notifies `crashed` once, then its child processes are killed and it exits. Done
    from the thread, not by a signal to the main thread, so a run blocked in native code ends as
    promptly. Also ignores SIGINT while open (see the module's doc)."""

    def __init__(self, serve_pid: int, flow_run_id: str, deployment_id: str, interval_s: float = 0.5,
                 heartbeat: Heartbeat | None = None) -> None:
        self.serve_pid = serve_pid
        self.flow_run_id = flow_run_id
        self.deployment_id = deployment_id
        self.interval_s = interval_s
        self.heartbeat = heartbeat  # stopped before the run's end is reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlcore-serve-watch", daemon=True)
        self._sigint: object = None

    def serve_alive(self) -> bool:
        return os.getppid() == self.serve_pid

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.serve_alive():
                self._end_orphaned_run()
                return

    def _end_orphaned_run(self) -> None:
        out = os.open(f"orphaned-run-{self.flow_run_id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd in (1, 2):
            os.dup2(out, fd)
        os.close(out)
        try:
            self._report_crash()
        finally:
            _kill_children()
            os._exit(1)

    def _report_crash(self) -> None:
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        from rlcore.lifecycle import run_end

        if self.heartbeat is not None:
            self.heartbeat.stop()
        message = (f"rlcore: the serving process (pid {self.serve_pid}) died; the run's process (pid {os.getpid()}) "
                   "ended itself")
        log.error("%s", message)
        state: Any = Crashed(message=message)
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(UUID(self.flow_run_id))
            client.set_flow_run_state(flow_run.id, state, force=True)
        send_ended(self.flow_run_id, self.deployment_id)
        run_end.run_ended(flow_run, state, "crashed", "flow")

    def __enter__(self) -> ServeWatch:
        import signal

        if threading.current_thread() is threading.main_thread():
            self._sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        self._stop.set()
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)  # type: ignore[arg-type]


def _kill_children() -> None:
    """SIGKILL every process this one started (and theirs): none outlives the run."""
    import psutil  # type: ignore[import-untyped]  # no stubs in the lock

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


def served_heartbeat() -> contextlib.AbstractContextManager[object]:
    """What a flow run that `pipeline serve` started keeps up while it runs: its heartbeat (a
    deployment's run on a server, when serve asked for one) and the watch on its serving process;
    else nothing."""
    interval = heartbeat_interval()
    serve_pid = os.environ.get(SERVE_PID_ENV)
    from prefect.runtime import deployment, flow_run

    stack = contextlib.ExitStack()
    if not flow_run.id or not deployment.id:
        return stack
    heartbeat = Heartbeat(str(flow_run.id), str(deployment.id), interval) if interval is not None else None
    if serve_pid:
        stack.enter_context(ServeWatch(int(serve_pid), str(flow_run.id), str(deployment.id), heartbeat=heartbeat))
    if heartbeat is not None:
        stack.enter_context(heartbeat)
    return stack


@dataclass(frozen=True)
class FailureNotifications:
    """What was set up on the server for one deployment."""

    block_id: UUID
    crashed_automation_id: UUID
    unresponsive_automation_id: UUID


def automation_names(flow_name: str, deployment_name: str) -> tuple[str, str]:
    """The names of the two automations for a deployment (how a re-run of serve finds them)."""
    where = f"rlcore {flow_name}/{deployment_name}"
    return f"{where}: crashed (unresponsive) -> webhook", f"{where}: unresponsive -> crashed"


def _legacy_names(flow_name: str, deployment_name: str) -> tuple[str, ...]:
    """Names earlier rlcore versions gave them (removed when serving again)."""
    return (f"rlcore {flow_name}/{deployment_name}: failed or crashed -> webhook",)


def _block_name(deployment_id: UUID) -> str:
    return f"rlcore-failure-webhook-{deployment_id}"  # block names: lowercase letters, digits, dashes


def _delete_automations(client: SyncPrefectClient, names: tuple[str, ...]) -> None:
    for name in names:
        for automation in client.read_automations_by_name(name):
            client.delete_automation(automation.id)


def install_failure_notifications(webhook_url: str | None, deployment_id: UUID, flow_name: str, deployment_name: str,
                                  unresponsive_after_s: float = DEFAULT_UNRESPONSIVE_AFTER_S,
                                  heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> FailureNotifications | None:
    """Create (or replace) the liveness automation for `deployment_id` on the Prefect server in use
    (PREFECT_API_URL) and, with a webhook, the webhook block and the automation that reports the
    crashes it makes. Idempotent: a second call leaves one of each."""
    from prefect.blocks.webhook import Webhook
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import CallWebhook, ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.settings import PREFECT_UI_URL
    from prefect.types import SecretDict
    from pydantic import SecretStr

    if unresponsive_after_s <= heartbeat_s:
        raise ValueError(f"unresponsive_after_s ({unresponsive_after_s:g}) must exceed the heartbeat interval ({heartbeat_s:g} s)")
    ours: dict[str, str | list[str]] = {"prefect.resource.id": f"prefect.deployment.{deployment_id}",
                                        "prefect.resource.role": "deployment"}
    crashed_name, unresponsive_name = automation_names(flow_name, deployment_name)
    message = liveness_message(unresponsive_after_s)
    unresponsive = AutomationCore(
        name=unresponsive_name,
        description=f"Mark runs of {flow_name}/{deployment_name} crashed after {unresponsive_after_s:g} s without an "
                    "rlcore heartbeat or a final state",
        trigger=EventTrigger(after={HEARTBEAT_EVENT}, expect={HEARTBEAT_EVENT, ENDED_EVENT, *TERMINAL_EVENTS},
                             match={"prefect.resource.id": "prefect.flow-run.*"}, match_related=ours,
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=unresponsive_after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)],
    )
    with get_client(sync_client=True) as client:
        _delete_automations(client, (crashed_name, unresponsive_name, *_legacy_names(flow_name, deployment_name)))
        unresponsive_id = client.create_automation(unresponsive)
        if not webhook_url:
            _delete_block(client, deployment_id)
            log.info("runs of %s/%s are marked crashed after %g s without a heartbeat", flow_name, deployment_name,
                     unresponsive_after_s)
            return None
        target, auth = request_target(webhook_url)  # credentials in the URL -> Basic authorization
        block = Webhook(method="POST", url=SecretStr(target), headers=SecretDict({"Content-Type": "application/json", **auth}))
        block_id = cast(UUID, block.save(_block_name(deployment_id), overwrite=True))  # sync here: a UUID
        crashed = AutomationCore(
            name=crashed_name,
            description=f"POST a crashed notification for runs of {flow_name}/{deployment_name} marked crashed for "
                        f"want of heartbeats ({redact_secret(webhook_url)})",
            # one per run: a repeat of the event within the hour is dropped by the trigger
            trigger=EventTrigger(expect={"prefect.flow-run.Crashed"},
                                 match={"prefect.resource.id": "prefect.flow-run.*",
                                        "prefect.state-message": f"{LIVENESS_PREFIX}*"},
                                 match_related=ours, for_each={"prefect.resource.id"}, posture=Posture.Reactive,
                                 threshold=1, within=timedelta(hours=1)),
            actions=[CallWebhook(block_document_id=block_id, payload=payload_template(PREFECT_UI_URL.value()))],
        )
        found = FailureNotifications(block_id, client.create_automation(crashed), unresponsive_id)
    log.info("runs of %s/%s that crash unseen (no heartbeat for %g s) are notified at %s", flow_name, deployment_name,
             unresponsive_after_s, redact_secret(webhook_url))
    return found


def _delete_block(client: SyncPrefectClient, deployment_id: UUID) -> None:
    from prefect.blocks.webhook import Webhook

    try:
        block = client.read_block_document_by_name(_block_name(deployment_id), Webhook.get_block_type_slug())
    except Exception:  # noqa: BLE001 - none there (ObjectNotFound)
        return
    client.delete_block_document(block.id)


def remove_failure_notifications(deployment_id: UUID, flow_name: str, deployment_name: str) -> None:
    """Remove what install_failure_notifications set up for the deployment."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        _delete_automations(client, (*automation_names(flow_name, deployment_name), *_legacy_names(flow_name, deployment_name)))
        _delete_block(client, deployment_id)
