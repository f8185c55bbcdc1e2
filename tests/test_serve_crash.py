"""Every way a served run can end badly is reported once, with the event its final Prefect state
names, its MLflow runs closed with that status and a reason, and no process of it left behind.
Against a real Prefect server on 127.0.0.1, a webhook receiver (given to `pipeline serve` as
RLCORE_WEBHOOK_URL, so runs started with their own `overrides` have it too) and the SQLite MLflow
store the runs write (tests/test_failure_notify.py covers a run that raises, a SIGKILL of the run's
process, and a run killed together with its serving process):

- the OOM killer: it SIGKILLs the process with the highest /proc/PID/oom_score; here the test
  picks that process among `serve`'s descendants and SIGKILLs it (a simulation: the kernel's
  choice made the same way, not real memory pressure);
- SIGKILL of `serve` alone: the run's process sees its parent gone and ends itself Crashed
  (`rlcore.lifecycle.automations.ServeWatch`) - before, it ran on as an orphan with no alert;
- SIGINT to `serve`'s whole process group (a Ctrl-C in its terminal) and SIGTERM to `serve`: the
  runs in progress end Cancelled and are notified `cancelled` - before, a Ctrl-C sent a false
  `crashed` and left the train run FAILED with an empty reason;
- cron-scheduled runs that complete: no notification, and no `prefect.automation.action.failed`
  in the server's events after the liveness window (before: "already in terminal state
  COMPLETED" ~91 s after the last heartbeat on cron runs).

Each closed run prints one line (`pytest -s`): kind, notifications, state, MLflow statuses and
reasons, seconds from the event to all closed, processes left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import PREFECT_HTTP, stop_process_group, tree_progress, wait_for  # tests/ is on sys.path
from test_failure_notify import (
    HEARTBEAT,
    LONG,
    QUICK,
    SETTLE_S,
    Receiver,
    deployment,
    events,
    flow_run,
    mlflow_runs,
    run_process,
    training,
)
from timing import scaled

ROOT = Path(__file__).resolve().parents[1]
EVENT_OF = {"FAILED": "failed", "CRASHED": "crashed", "CANCELLED": "cancelled"}
MLFLOW_OF = {"FAILED": "FAILED", "CRASHED": "KILLED", "CANCELLED": "KILLED"}
CLOSE_BOUND_S = 120  # from the kill or signal to the run's final state, notification and MLflow runs closed

# two or three served runs each, to their train stage on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline, pytest.mark.timeout(1200)]


@pytest.fixture
def receiver():
    rec = Receiver()
    yield rec
    rec.close()


def start_serve(api: str, env: dict[str, str], work: Path, log: Path, webhook: str, cron: str,
                *overrides: str) -> subprocess.Popen:
    env = dict(env, PREFECT_API_URL=api, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               RLCORE_WEBHOOK_URL=webhook, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    work.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", cron, "--limit", "2",
                             *HEARTBEAT, *overrides], cwd=work, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_long_run(api: str, dep: dict) -> str:
    created = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/create_flow_run",
                                json={"parameters": {"overrides": LONG}}, timeout=scaled(10))
    assert created.ok, created.text
    return created.json()["id"]


def tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def oom_victim(root: psutil.Process) -> psutil.Process:
    """The process among `root`'s descendants the kernel's OOM killer would pick: the highest
    /proc/PID/oom_score (its share of memory, adjusted by oom_score_adj)."""
    def score(p: psutil.Process) -> int:
        try:
            return int(Path(f"/proc/{p.pid}/oom_score").read_text())
        except OSError:
            return -1

    return max(root.children(recursive=True), key=score)


def ends(receiver: Receiver, run_id: str) -> list[dict]:
    """The notifications about how a run ended (not its `promoted` and the like)."""
    return [n for n in receiver.about(run_id) if n["event"] in EVENT_OF.values()]


def closed_once(kind: str, api: str, receiver: Receiver, run_id: str, since: float, procs: list[psutil.Process],
                work: Path, expect_state: str | None = None) -> dict:
    """The run ended badly exactly once: its final state, one notification naming it, its MLflow
    runs (data_prep aside, which had finished) ended with the matching status and a non-empty
    reason, all within CLOSE_BOUND_S of `since`; and none of `procs` (the run's process tree) left."""
    def closed():
        state = (flow_run(api, run_id).get("state") or {}).get("type")
        if state not in EVENT_OF or not ends(receiver, run_id):
            return None
        runs = [r for r in mlflow_runs(work, run_id) if r.data.tags.get("rlcore.stage") != "data_prep"]
        return state if runs and all(r.info.status != "RUNNING" for r in runs) else None

    try:
        state = wait_for(f"{kind}: run {run_id} closed", closed, CLOSE_BOUND_S, interval=1)
    except AssertionError as err:
        seen = {"state": flow_run(api, run_id).get("state"), "notifications": receiver.about(run_id),
                "mlflow": [(r.data.tags.get("rlcore.stage"), r.info.status) for r in mlflow_runs(work, run_id)],
                "alive": [(p.pid, p.cmdline()[:3]) for p in alive(procs)]}
        raise AssertionError(f"{err}: {seen}") from None
    took = time.monotonic() - since
    wait_for(f"{kind}: the run's processes to exit", lambda: not alive(procs), 60, interval=1)
    left = [p.pid for p in alive(procs)]
    time.sleep(SETTLE_S)  # a repeat notification would have arrived by now (seen: within 2 s)
    notes = ends(receiver, run_id)
    runs = [r for r in mlflow_runs(work, run_id) if r.data.tags.get("rlcore.stage") != "data_prep"]
    report = {"kind": kind, "notifications": [(n["event"], n["detected_by"]) for n in notes], "state": state,
              "mlflow": [(r.data.tags["rlcore.stage"], r.info.status, r.data.tags.get("failure")) for r in runs],
              "closed_s": round(took, 1), "processes_left": left}
    print(f"\n[crash-report] {report}")
    assert expect_state is None or state == expect_state, report
    assert len(notes) == 1 and notes[0]["event"] == EVENT_OF[state], report
    assert notes[0]["id"] == f"{run_id}:{EVENT_OF[state]}", report
    assert {"pipeline", "train"} <= {r.data.tags["rlcore.stage"] for r in runs}, report
    for run in runs:
        assert run.info.status == MLFLOW_OF[state] and run.info.end_time is not None, report
        assert run.data.tags.get("failure"), report
    assert took < scaled(CLOSE_BOUND_S), report
    return report


def wait_training(api: str, work: Path, log: Path, run_id: str, serve: subprocess.Popen) -> list[psutil.Process]:
    """The run's process tree once its train stage runs. The MLflow store is read only after a
    data_prep stage finished (the store's tables exist then): a reader opening a SQLite store while
    the run creates it can race its migration ("table _alembic_tmp_metrics already exists")."""
    wait_for("a data_prep stage", lambda: "Task run 'data_prep" in log.read_text(errors="replace"), 400, procs=[serve],
             interval=2, progress=tree_progress(work, log))
    wait_for("the run's train stage", lambda: training(work, run_id), 400, procs=[serve], interval=2,
             progress=tree_progress(work, log))
    return tree(run_process(serve, run_id))


def kill_group(serve: subprocess.Popen) -> None:
    """What a test's serving process left (its group), killed; the serving process reaped."""
    try:
        os.killpg(serve.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    stop_process_group(serve)


def test_the_oom_killer_and_a_sigkill_of_serve_each_give_one_crashed_and_leave_no_process(
        prefect_api, receiver, tiny_example, tmp_path):
    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    serve = start_serve(api, env, work, log, receiver.url, "", *LONG)
    try:
        dep = deployment(api, serve)

        # The OOM killer's choice, SIGKILLed (serve lives on and reports it).
        first = start_long_run(api, dep)
        procs = wait_training(api, work, log, first, serve)
        victim = oom_victim(psutil.Process(serve.pid))
        print(f"\n[crash-report] oom victim: pid {victim.pid} {' '.join(victim.cmdline()[:4])}"
              f" (the run's process: {victim.pid == procs[0].pid})")
        since = time.monotonic()
        victim.kill()
        closed_once("oom-killer (simulated)", api, receiver, first, since, procs, work)

        # SIGKILL of the serving process alone: its run ends itself, crashed, at once.
        second = start_long_run(api, dep)
        procs = wait_training(api, work, log, second, serve)
        since = time.monotonic()
        serve.kill()
        serve.wait(timeout=scaled(30))
        report = closed_once("SIGKILL of serve", api, receiver, second, since, procs, work, "CRASHED")
        assert report["notifications"] == [("crashed", "flow")]
        assert "serving process" in report["mlflow"][0][2]
        assert list(work.glob(f"orphaned-run-{second}.log"))  # what the run wrote after serve died

        # The liveness window (20 s) has passed for both: the automation never failed on them.
        wait_for("the liveness window", lambda: time.monotonic() > since + 30, 60)
        assert events(api, ["prefect.automation.action.failed"], since=began) == []
    finally:
        kill_group(serve)


def test_a_ctrl_c_or_sigterm_of_serve_cancels_its_runs_once_and_completed_cron_runs_raise_no_automation_error(
        prefect_api, receiver, tiny_example, tmp_path):
    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    serve = start_serve(api, env, work, log, receiver.url, "* * * * *", *QUICK)
    try:
        dep = deployment(api, serve)

        def runs() -> list[dict]:
            body = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"}
            return PREFECT_HTTP.post(f"{api}/flow_runs/filter", json=body, timeout=scaled(5)).json()

        def cron_completed() -> dict | None:
            done = [r for r in runs() if r["auto_scheduled"] and (r.get("state") or {}).get("type") == "COMPLETED"]
            return done[0] if done else None

        cron = wait_for("a cron run to complete", cron_completed, 400, procs=[serve], interval=2,
                        progress=tree_progress(work, log))
        assert ends(receiver, cron["id"]) == []

        # Ctrl-C in serve's terminal: SIGINT to its whole process group, its runs included.
        first = start_long_run(api, dep)
        procs = wait_training(api, work, log, first, serve)
        since = time.monotonic()
        os.killpg(serve.pid, signal.SIGINT)
        assert serve.wait(timeout=scaled(90)) == 0, log.read_text()[-3000:]
        closed_once("SIGINT (Ctrl-C) of serve", api, receiver, first, since, procs, work, "CANCELLED")
        for run in runs():  # a cron run in flight then was cancelled too, and notified once as such
            state = (run.get("state") or {}).get("type")
            assert state != "CRASHED", run
            if state in ("COMPLETED", "CANCELLED"):
                assert [n["event"] for n in ends(receiver, run["id"])] == (["cancelled"] if state == "CANCELLED" else [])

        # The liveness window has passed since the completed cron run(s): no automation error.
        assert events(api, ["prefect.automation.action.failed"], since=began) == []

        # SIGTERM (a service manager's stop) to the serving process alone.
        serve = start_serve(api, env, work, log, receiver.url, "", *QUICK)
        dep = deployment(api, serve)
        second = start_long_run(api, dep)
        procs = wait_training(api, work, log, second, serve)
        since = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=scaled(90)) == 0, log.read_text()[-3000:]
        closed_once("SIGTERM of serve", api, receiver, second, since, procs, work, "CANCELLED")
        assert events(api, ["prefect.automation.action.failed"], since=began) == []
    finally:
        kill_group(serve)
