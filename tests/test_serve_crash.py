"""Every way a served run can end badly is reported once, with the event its final Prefect state
names, its MLflow runs closed with that status and a reason, and no process of it left behind: on
runs the server's cron scheduler started as well as on runs started through the API. Against a real
Prefect server on 127.0.0.1 keeping its database in PostgreSQL (as production servers do: on SQLite
its trigger service dropped an end-of-run event with "database is locked" when two runs ended in the
same 100 ms, and the liveness automation then failed on a run already ended; tests/postgres.py
starts the cluster), a webhook receiver (given to `pipeline serve` as RLCORE_WEBHOOK_URL, so runs
started with their own `overrides` have it too) and the SQLite MLflow store the runs write
(tests/test_failure_notify.py covers a run that raises, a SIGKILL of the run's process, and a run
killed together with its serving process, on API-started runs):

- the OOM killer: it SIGKILLs the process with the highest /proc/PID/oom_score; here the test
  picks that process among the run's processes and SIGKILLs it (a simulation: the kernel's
  choice made the same way, as if that run held the most memory, not real memory pressure);
- SIGKILL of `serve` alone: the run's process sees its parent gone and ends itself Crashed
  (`rlcore.lifecycle.automations.ServeWatch`) - before, it ran on as an orphan with no alert;
- SIGINT to `serve`'s whole process group (a Ctrl-C in its terminal) and SIGTERM to `serve`: the
  runs in progress end Cancelled and are notified `cancelled` - before, a Ctrl-C sent a false
  `crashed` and left the train run FAILED with an empty reason;
- a cron run that fails (its train stage refuses a missing checkpoint): one `failed`, FAILED;
- cron-scheduled runs that complete: no notification, and no `prefect.automation.action.failed`
  in the server's events after the liveness window (before: "already in terminal state
  COMPLETED" ~91 s after the last heartbeat on cron runs).

Each kill hits a cron run and an API run in flight together. Nothing here waits on the clock for a
run to be in flight: the targets are ENDLESS (a million steps, no health guard, each in a train
folder of its own flow run, never resumed), killed as soon as their train stage runs. The cron
(`* * * * *`) makes a run each minute; the deployment is paused (Prefect deletes the runs it had
scheduled) as soon as the one the test needs has started, and resumed for the next, so that no
other run takes a slot or CPU; a cron run's parameters are the deployment's, set between two runs.

Each closed run prints one line (`pytest -s`): kind, notifications, state, MLflow statuses and
reasons, seconds from the event to all closed, seconds its processes outlived its final state,
processes left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import (  # tests/ is on sys.path
    PREFECT_HTTP,
    prefect_env,
    prefect_keys,
    prefect_server,
    reset_prefect,
    stop_process_group,
    tree_progress,
    wait_for,
)
from postgres import Postgres, pg_cluster_fixture  # noqa: F401 - pg_cluster_fixture registers the fixture `pg_cluster`
from test_failure_notify import (
    ENDLESS,
    HEARTBEAT,
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
CLOSE_BOUND_S = 120  # from the kill or signal (a failing run: its start) to its final state, notification and MLflow runs closed
EXIT_BOUND_S = 60  # from then to the run's last process gone

# four served runs each to their train stage (and a cron run to completion), waiting up to a minute
# for each cron firing, on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def pg_prefect_server(pg_cluster: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[str, dict[str, str], dict[str, set[str]]]]:
    """A Prefect server of this file's own on PostgreSQL (the scheduler looping every 5 s, as the
    shared server's): its API URL, client environment and what it held at start."""
    with prefect_server(tmp_path_factory.mktemp("prefect_pg"), PREFECT_API_SERVICES_SCHEDULER_LOOP_SECONDS="5",
                        PREFECT_SERVER_DATABASE_CONNECTION_URL=pg_cluster.url("prefect", "asyncpg")) as (api, env, _log):
        yield api, env, prefect_keys(api)


@pytest.fixture
def prefect_api(pg_prefect_server: tuple[str, dict[str, str], dict[str, set[str]]],
                tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """conftest's `prefect_api` on this file's PostgreSQL-backed server: emptied before and after."""
    api, env, start = pg_prefect_server
    reset_prefect(api, start)
    try:
        yield api, dict(env, **prefect_env(tmp_path / "prefect_client"), PREFECT_API_URL=api)
    finally:
        reset_prefect(api, start)


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


def start_endless_run(api: str, dep: dict) -> str:
    created = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/create_flow_run",
                                json={"parameters": {"overrides": ENDLESS}}, timeout=scaled(10))
    assert created.ok, created.text
    return created.json()["id"]


# ----------------------------------------------------------------------------- cron runs
def state_of(run: dict) -> str | None:
    return (run.get("state") or {}).get("type")


def deployment_runs(api: str, dep: dict) -> list[dict]:
    body = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return PREFECT_HTTP.post(f"{api}/flow_runs/filter", json=body, timeout=scaled(5)).json()


def pause(api: str, dep: dict) -> None:
    """No more cron runs of the deployment: Prefect deletes those it scheduled and did not start."""
    done = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/pause_deployment", timeout=scaled(30))
    assert done.ok, done.text


def resume(api: str, dep: dict) -> None:
    done = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/resume_deployment", timeout=scaled(30))
    assert done.ok, done.text


def set_overrides(api: str, dep: dict, overrides: list[str]) -> None:
    """The `overrides` of the cron runs scheduled from now on (the deployment's parameters)."""
    parameters = dict(PREFECT_HTTP.get(f"{api}/deployments/{dep['id']}", timeout=scaled(5)).json()["parameters"],
                      overrides=overrides)
    done = PREFECT_HTTP.patch(f"{api}/deployments/{dep['id']}", json={"parameters": parameters}, timeout=scaled(30))
    assert done.ok, done.text


TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def next_cron_run(api: str, dep: dict, serve: subprocess.Popen, work: Path, log: Path, used: set[str]) -> str:
    """The next run the server's cron scheduler makes (a minute at most) once `serve` took it (one
    that started earlier and is still in flight will do), not one of `used`: its id, added to
    `used`. The deployment is then paused, so no other cron run starts."""
    ended = {r["id"] for r in deployment_runs(api, dep) if state_of(r) in TERMINAL}
    resume(api, dep)

    def started() -> str | None:
        return next((r["id"] for r in deployment_runs(api, dep) if r["auto_scheduled"] and r["id"] not in used | ended
                     and state_of(r) not in ("SCHEDULED", None)), None)

    run_id = wait_for("a cron run to start", started, 180, procs=[serve], interval=1, progress=tree_progress(work, log))
    pause(api, dep)
    used.add(run_id)
    return run_id


# ----------------------------------------------------------------------------- processes
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


def processes_of(run_id: str) -> list[psutil.Process]:
    """Every live process on the machine that belongs to flow run `run_id` (its environment names
    it: the run's own and its children, orphans included)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == run_id:
                found.append(p)
        except psutil.Error:
            pass
    return alive(found)


def oom_victim(procs: list[psutil.Process]) -> psutil.Process:
    """The process among `procs` (a run's tree) the kernel's OOM killer would pick: the highest
    /proc/PID/oom_score (its share of memory, adjusted by oom_score_adj)."""
    def score(p: psutil.Process) -> int:
        try:
            return int(Path(f"/proc/{p.pid}/oom_score").read_text())
        except OSError:
            return -1

    return max(procs, key=score)


# ----------------------------------------------------------------------------- the checks
def ends(receiver: Receiver, run_id: str) -> list[dict]:
    """The notifications about how a run ended (not its `promoted` and the like)."""
    return [n for n in receiver.about(run_id) if n["event"] in EVENT_OF.values()]


def closed_once(kind: str, api: str, receiver: Receiver, run_id: str, since: float, procs: list[psutil.Process],
                work: Path, expect_state: str) -> dict:
    """The run ended badly exactly once: its final state, one notification naming it, its MLflow
    runs (data_prep aside, which had finished) ended with the matching status and a non-empty
    reason, all within CLOSE_BOUND_S of `since`; and no process of it left (`procs`, its process
    tree as the test saw it, and any process that names the run) within EXIT_BOUND_S after."""
    def closed():
        state = state_of(flow_run(api, run_id))
        if state not in EVENT_OF or not ends(receiver, run_id):
            return None
        runs = [r for r in mlflow_runs(work, run_id) if r.data.tags.get("rlcore.stage") != "data_prep"]
        return state if runs and all(r.info.status != "RUNNING" for r in runs) else None

    try:
        state = wait_for(f"{kind}: run {run_id} closed", closed, CLOSE_BOUND_S, interval=1)
    except AssertionError as err:
        seen = {"state": flow_run(api, run_id).get("state"), "notifications": receiver.about(run_id),
                "mlflow": [(r.data.tags.get("rlcore.stage"), r.info.status) for r in mlflow_runs(work, run_id)],
                "alive": [(p.pid, p.cmdline()[:3]) for p in alive(procs) + processes_of(run_id)]}
        raise AssertionError(f"{err}: {seen}") from None
    closed_at = time.monotonic()
    took = closed_at - since
    wait_for(f"{kind}: the run's processes to exit", lambda: not alive(procs) and not processes_of(run_id), EXIT_BOUND_S,
             interval=1)
    lingered = time.monotonic() - closed_at
    left = [p.pid for p in alive(procs) + processes_of(run_id)]
    time.sleep(SETTLE_S)  # a repeat notification would have arrived by now (seen: within 2 s)
    notes = ends(receiver, run_id)
    runs = [r for r in mlflow_runs(work, run_id) if r.data.tags.get("rlcore.stage") != "data_prep"]
    report = {"kind": kind, "notifications": [(n["event"], n["detected_by"]) for n in notes], "state": state,
              "mlflow": [(r.data.tags["rlcore.stage"], r.info.status, r.data.tags.get("failure")) for r in runs],
              "closed_s": round(took, 1), "exited_after_s": round(lingered, 1), "processes_left": left}
    print(f"\n[crash-report] {report}")
    assert state == expect_state, report
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
    def trains() -> bool:
        if (state := state_of(flow_run(api, run_id))) in TERMINAL:  # not waited for on the other run's progress
            raise AssertionError(f"run {run_id} ended {state} before its train stage: {log.read_text()[-3000:]}")
        return training(work, run_id)

    wait_for(f"run {run_id}'s train stage", trains, 400, procs=[serve], interval=2, progress=tree_progress(work, log))
    return tree(run_process(serve, run_id))


def starts_afresh(api: str, dep: dict, work: Path, run_id: str) -> None:
    """The run trains in a folder named after its flow run, a name no other run of the deployment
    has, with no checkpoint in it: it cannot have resumed a finished one (and ENDLESS never resumes)."""
    name = flow_run(api, run_id)["name"]
    assert name not in {r["name"] for r in deployment_runs(api, dep) if r["id"] != run_id}, name
    assert not list((work / "runs" / "pipeline" / name / "train" / "checkpoints").glob("step_*")), name


def kill_group(serve: subprocess.Popen) -> None:
    """What a test's serving process left (its group), killed; the serving process reaped."""
    try:
        os.killpg(serve.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    stop_process_group(serve)


def in_flight(api: str, dep: dict, work: Path, log: Path, serve: subprocess.Popen, used: set[str]) -> tuple[
        tuple[str, list[psutil.Process]], tuple[str, list[psutil.Process]]]:
    """A cron run and an API-started run (both ENDLESS: the deployment's overrides), both in their
    train stage: each one's id and process tree."""
    cron = next_cron_run(api, dep, serve, work, log, used)
    api_run = start_endless_run(api, dep)  # after the cron run took its slot: `--limit 2` has one left
    cron_procs = wait_training(api, work, log, cron, serve)
    api_procs = wait_training(api, work, log, api_run, serve)
    for run_id in (cron, api_run):
        starts_afresh(api, dep, work, run_id)
    return (cron, cron_procs), (api_run, api_procs)


def test_the_oom_killer_and_a_sigkill_of_serve_each_give_one_crashed_on_cron_and_api_runs_and_leave_no_process(
        prefect_api, receiver, tiny_example, tmp_path):
    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    serve = start_serve(api, env, work, log, receiver.url, "* * * * *", *ENDLESS)
    try:
        dep = deployment(api, serve)
        pause(api, dep)  # no cron run before the test asks for one
        used: set[str] = set()
        # serve creates the MLflow store before any run: two runs starting at once on a fresh SQLite
        # store raced its migration ("table evaluation_datasets already exists" failed one)
        wait_for("serve to create the MLflow store", lambda: (work / "mlflow.db").is_file(), 180, procs=[serve])

        # The OOM killer's choice, SIGKILLed (serve lives on and reports it): in a cron run, then
        # in an API-started one, both in flight.
        (cron, cron_procs), (first, procs) = in_flight(api, dep, work, log, serve, used)
        for kind, run_id, run_procs in (("oom-killer (simulated), cron run", cron, cron_procs),
                                        ("oom-killer (simulated), API run", first, procs)):
            victim = oom_victim(run_procs)
            print(f"\n[crash-report] oom victim: pid {victim.pid} {' '.join(victim.cmdline()[:4])}"
                  f" (the run's process: {victim.pid == run_procs[0].pid})")
            since = time.monotonic()
            victim.kill()
            closed_once(kind, api, receiver, run_id, since, run_procs, work, "CRASHED")

        # SIGKILL of the serving process alone: its runs (cron and API-started) end themselves,
        # crashed, at once.
        (cron, cron_procs), (second, procs) = in_flight(api, dep, work, log, serve, used)
        since = time.monotonic()
        serve.kill()
        serve.wait(timeout=scaled(30))
        for kind, run_id, run_procs in (("SIGKILL of serve, cron run", cron, cron_procs),
                                        ("SIGKILL of serve, API run", second, procs)):
            report = closed_once(kind, api, receiver, run_id, since, run_procs, work, "CRASHED")
            assert report["notifications"] == [("crashed", "flow")]
            assert "serving process" in report["mlflow"][0][2]
            assert list(work.glob(f"orphaned-run-{run_id}.log"))  # what the run wrote after serve died

        # The liveness window (20 s) has passed for all: the automation never failed on them.
        wait_for("the liveness window", lambda: time.monotonic() > since + 30, 60)
        assert events(api, ["prefect.automation.action.failed"], since=began) == []
    finally:
        kill_group(serve)


def test_a_failing_cron_run_and_a_ctrl_c_or_sigterm_of_serve_end_cron_and_api_runs_once_and_completed_cron_runs_raise_no_automation_error(
        prefect_api, receiver, tiny_example, tmp_path):
    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    serve = start_serve(api, env, work, log, receiver.url, "* * * * *", *QUICK)
    try:
        dep = deployment(api, serve)
        pause(api, dep)
        used: set[str] = set()

        # A cron run that completes: no notification (and, below, no automation error).
        done = next_cron_run(api, dep, serve, work, log, used)
        wait_for("the cron run to complete", lambda: state_of(flow_run(api, done)) in ("COMPLETED", "FAILED", "CRASHED"),
                 400, procs=[serve], interval=2, progress=tree_progress(work, log))
        assert state_of(flow_run(api, done)) == "COMPLETED", flow_run(api, done)["state"]
        assert ends(receiver, done) == []

        # A cron run that fails: its train stage refuses a checkpoint that is not there.
        set_overrides(api, dep, [*QUICK, f"trainer.resume={tmp_path / 'no-such-checkpoint'}"])
        failing = next_cron_run(api, dep, serve, work, log, used)
        since = time.monotonic()
        procs = processes_of(failing)
        report = closed_once("failure, cron run", api, receiver, failing, since, procs, work, "FAILED")
        assert report["notifications"] == [("failed", "flow")]
        assert all("no-such-checkpoint" in reason for _, _, reason in report["mlflow"]), report

        # Ctrl-C in serve's terminal: SIGINT to its whole process group, its runs included.
        set_overrides(api, dep, ENDLESS)
        (cron, cron_procs), (first, procs) = in_flight(api, dep, work, log, serve, used)
        since = time.monotonic()
        os.killpg(serve.pid, signal.SIGINT)
        assert serve.wait(timeout=scaled(90)) == 0, log.read_text()[-3000:]
        closed_once("SIGINT (Ctrl-C) of serve, cron run", api, receiver, cron, since, cron_procs, work, "CANCELLED")
        closed_once("SIGINT (Ctrl-C) of serve, API run", api, receiver, first, since, procs, work, "CANCELLED")
        assert [state_of(r) for r in deployment_runs(api, dep) if state_of(r) == "CRASHED"] == []

        # The liveness window has passed since the completed cron run: no automation error.
        assert events(api, ["prefect.automation.action.failed"], since=began) == []

        # SIGTERM (a service manager's stop) to the serving process alone. The deployment, applied
        # again, is active: its cron makes runs again.
        serve = start_serve(api, env, work, log, receiver.url, "* * * * *", *ENDLESS)
        dep = deployment(api, serve)
        pause(api, dep)
        (cron, cron_procs), (second, procs) = in_flight(api, dep, work, log, serve, used)
        since = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=scaled(90)) == 0, log.read_text()[-3000:]
        closed_once("SIGTERM of serve, cron run", api, receiver, cron, since, cron_procs, work, "CANCELLED")
        closed_once("SIGTERM of serve, API run", api, receiver, second, since, procs, work, "CANCELLED")
        wait_for("the liveness window", lambda: time.monotonic() > since + 30, 60)
        assert events(api, ["prefect.automation.action.failed"], since=began) == []
    finally:
        kill_group(serve)
