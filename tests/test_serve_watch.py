"""A served run's heartbeat stops before the run's end is reported. The CI run of
`test_serve_crash` at 5101ce5 caught the race: `ServeWatch` ended a run whose serving process had
died (Crashed, then `rlcore.pipeline.ended`) while the run's heartbeat thread still ran; a beat that
reached the server after the ended event restarted the liveness countdown, and 20 s later the
server's automation failed on the run already Crashed ("prefect.automation.action.failed").
The Prefect client is a recording stand-in here (no server: the real path is test_serve_crash)."""

from __future__ import annotations

import threading

import pytest

from rlcore.lifecycle import automations
from rlcore.lifecycle.automations import Heartbeat, ServeWatch


def _recording_heartbeat(log: list[str], interval_s: float = 0.001) -> Heartbeat:
    heartbeat = Heartbeat("run-id", "deployment-id", interval_s)
    two = threading.Event()

    def beat(client: object) -> None:
        log.append("beat")
        if log.count("beat") >= 2:
            two.set()

    heartbeat.beat = beat  # type: ignore[method-assign]
    heartbeat.two_beats = two  # type: ignore[attr-defined]
    return heartbeat


def test_no_beat_after_stop_returns_and_stop_is_idempotent() -> None:
    log: list[str] = []
    heartbeat = _recording_heartbeat(log)
    heartbeat._thread.start()
    assert heartbeat.two_beats.wait(60)  # type: ignore[attr-defined]
    heartbeat.stop()
    beats = len(log)
    heartbeat._stop.wait(0.05)
    heartbeat.stop()
    assert len(log) == beats and not heartbeat._thread.is_alive()


class _Stop(Exception):
    pass


def test_the_orphaned_run_stops_its_heartbeat_before_it_reports_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    heartbeat = _recording_heartbeat(log)
    heartbeat._thread.start()
    assert heartbeat.two_beats.wait(60)  # type: ignore[attr-defined]

    def client(**_: object) -> object:  # the first thing the report asks the server
        log.append("report")
        raise _Stop

    monkeypatch.setattr("prefect.client.orchestration.get_client", client)
    monkeypatch.setattr(automations, "send_ended", lambda *a: log.append("ended"))
    watch = ServeWatch(serve_pid=1, flow_run_id="run-id", deployment_id="deployment-id", heartbeat=heartbeat)
    with pytest.raises(_Stop):
        watch._report_crash()
    assert log[-1] == "report" and "beat" not in log[log.index("report"):]
    assert not heartbeat._thread.is_alive()
