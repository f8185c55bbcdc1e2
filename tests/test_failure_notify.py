"""A served pipeline run that does not complete is notified exactly once and leaves no MLflow run
open; the liveness automation acts only on runs whose processes are gone; `pipeline serve` stops
cleanly on one signal and the next one resumes its deployment. Against a real Prefect server on
127.0.0.1 (`rlcore pipeline serve` with registry.webhook_url), a webhook receiver on 127.0.0.1
counting every POST, and the SQLite MLflow store the runs write:

- a run that raises: one `failed` (from the flow), its MLflow run FAILED with the reason;
- a run that completes, then the heartbeat window: no automation error in the server's events;
- a run whose process is SIGKILLed: one `crashed` (from the serving process), its MLflow runs
  KILLED with an end time and the reason;
- a run killed with its serving process: marked crashed by the server's liveness automation, one
  `crashed` (from the server); the next `serve` ends its MLflow runs KILLED;

each notification's `id` is "<flow run id>:<event>", and `prefect_ui` links the flow run's page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from conftest import PREFECT_HTTP, stop_process_group, tree_progress, wait_for  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled

from rlcore.lifecycle.automations import LIVENESS_PREFIX, automation_names

ROOT = Path(__file__).resolve().parents[1]
# A run that cannot end on its own within a test, whatever the machine's speed, so that it is still in
# flight when killed: a million steps, no health guard to stop it early, no validation or checkpoint
# on the way, and never a checkpoint resumed (its train folder is its own flow run's: always new).
# Small batches, so that each step is quick.
ENDLESS = ["trainer.total_steps=1000000", "trainer.val_every=1000000", "trainer.save_every=1000000",
           "trainer.val_before_train=false", "trainer.resume=disable", "health.enabled=false",
           "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.val_batch_size=128"]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128"]
HEARTBEAT = ["--heartbeat", "5", "--unresponsive-after", "20"]
SETTLE_S = 10  # after a first notification, how long a repeat would take to arrive (seen: within 2 s)

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]


class Receiver:
    """A webhook receiver on 127.0.0.1: every POST's path and JSON body, in arrival order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []
        lock = threading.Lock()
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    got.append((self.path, json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook?token=s3cret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def about(self, flow_run_id: str) -> list[dict]:
        return [body for _, body in list(self.got) if body.get("flow_run_id") == flow_run_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    rec = Receiver()
    yield rec
    rec.close()


def start_serve(api: str, env: dict[str, str], work: Path, log: Path, webhook: str, *extra: str) -> subprocess.Popen:
    env = dict(env, PREFECT_API_URL=api, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    work.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", "", *HEARTBEAT, *extra,
                             *ENDLESS, f"registry.webhook_url={webhook}"],
                            cwd=work, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def deployment(api: str, serve: subprocess.Popen) -> dict:
    def found():
        got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=scaled(5))
        return got.json() if got.ok else None

    return wait_for("the deployment", found, 180, procs=[serve])


def automations(api: str) -> dict[str, dict]:
    return {a["name"]: a for a in PREFECT_HTTP.post(f"{api}/automations/filter", json={}, timeout=scaled(5)).json()}


def start_run(api: str, dep: dict, parameters: dict | None = None) -> str:
    created = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={"parameters": parameters or {}},
                                timeout=scaled(10))
    assert created.ok, created.text
    return created.json()["id"]


def flow_run(api: str, run_id: str) -> dict:
    return PREFECT_HTTP.get(f"{api}/flow_runs/{run_id}", timeout=scaled(5)).json()


def final_state(api: str, run_id: str, serve: subprocess.Popen, work: Path, log: Path, timeout: float = 400) -> str:
    """The run's final state; waited for while the run advances (`work` and the serving `log` change)."""
    def final():
        state = (flow_run(api, run_id).get("state") or {}).get("type")
        return state if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    return wait_for(f"flow run {run_id} to end", final, timeout, procs=[serve], interval=2,
                    progress=tree_progress(work, log))


def mlflow_runs(work: Path, flow_run_id: str) -> list:
    """The MLflow runs (pipeline and stages) of one flow run, in the store the served runs write."""
    from mlflow.tracking import MlflowClient

    db = work / "mlflow.db"
    if not db.is_file():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    found = []
    for experiment in client.search_experiments():
        found += [r for r in client.search_runs([experiment.experiment_id], max_results=1000)
                  if r.data.tags.get("prefect.flow_run_id") == flow_run_id]
    return found


def training(work: Path, flow_run_id: str) -> bool:
    """The run's train stage has its MLflow run (started, still running). Polled while the run may
    be creating the store's tables, which a reader meanwhile cannot open: not yet, then."""
    try:
        runs = mlflow_runs(work, flow_run_id)
    except Exception:  # noqa: BLE001 - alembic/sqlalchemy errors of a store being created
        return False
    return any(r.data.tags.get("rlcore.stage") == "train" and r.info.status == "RUNNING" for r in runs)


def run_process(serve: subprocess.Popen, run_id: str) -> psutil.Process:
    """The process the serving process started for this flow run (its environment names the run)."""
    def environ(p: psutil.Process) -> dict[str, str]:
        try:
            return p.environ()
        except psutil.Error:
            return {}

    procs = psutil.Process(serve.pid).children(recursive=True)
    mine = [p for p in procs if environ(p).get("PREFECT__FLOW_RUN_ID") == run_id]
    [top] = [p for p in mine if p.ppid() not in {q.pid for q in mine}]
    return top


def events(api: str, names: list[str], resource_id: str | None = None, since: str | None = None) -> list[dict]:
    """The server's events whose names start with one of `names` (about `resource_id`, after `since`)."""
    body: dict = {"filter": {"event": {"prefix": names}}, "limit": 50}
    if since:
        body["filter"]["occurred"] = {"since": since}
    if resource_id:
        body["filter"]["resource"] = {"id": [resource_id]}
    got = PREFECT_HTTP.post(f"{api}/events/filter", json=body, timeout=scaled(5))
    return got.json()["events"] if got.ok else []


def one_notification(receiver: Receiver, flow_run_id: str, event: str, serve: subprocess.Popen | None,
                     timeout: float) -> dict:
    """The single notification about a run: waits for the first, then SETTLE_S for any repeat."""
    wait_for(f"the {event} notification", lambda: receiver.about(flow_run_id), timeout,
             procs=[serve] if serve is not None else [], interval=1)
    time.sleep(SETTLE_S)
    notes = receiver.about(flow_run_id)
    assert len(notes) == 1, notes
    [note] = notes
    assert note["event"] == event and note["id"] == f"{flow_run_id}:{event}" and note["source"] == "rlcore"
    return note


def serving(api: str, dep: dict, since: float, serve: subprocess.Popen) -> None:
    """Wait until the serving process polls the server for the deployment's runs (after `since`)."""
    from datetime import datetime

    def polled():
        last = PREFECT_HTTP.get(f"{api}/deployments/{dep['id']}", timeout=scaled(5)).json().get("last_polled")
        return last and datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() > since

    wait_for("the serving process to poll", polled, 180, procs=[serve])


def stop_cleanly(serve: subprocess.Popen, sig: signal.Signals, log: Path) -> None:
    """One signal to the serving process alone: it exits 0 within the timeout, and what it writes
    from then on has no traceback."""
    before = len(log.read_bytes())
    serve.send_signal(sig)
    assert serve.wait(timeout=scaled(60)) == 0, log.read_text()[-3000:]
    after = log.read_bytes()[before:].decode(errors="replace")
    assert "stopping `pipeline serve`" in after
    assert "Traceback" not in after and "was never awaited" not in after and "Error" not in after, after


def test_each_run_that_does_not_complete_is_notified_once_and_closed_in_mlflow(prefect_api, receiver, tiny_example,
                                                                                tmp_path):
    api, env = prefect_api
    work, log = tmp_path / "work", tmp_path / "serve.log"
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    serve = start_serve(api, env, work, log, receiver.url)
    try:
        dep = deployment(api, serve)
        crashed_name, unresponsive_name = automation_names("rl_pipeline", "rl-pipeline")
        found = wait_for("the automations", lambda: (lambda a: a if {crashed_name, unresponsive_name} <= set(a) else None)(
            automations(api)), 60, procs=[serve])
        liveness = found[unresponsive_name]
        assert liveness["trigger"]["within"] == 20 and liveness["trigger"]["after"] == ["rlcore.pipeline.heartbeat"]
        assert found[crashed_name]["trigger"]["expect"] == ["prefect.flow-run.Crashed"]
        assert f"{LIVENESS_PREFIX}*" in json.dumps(found[crashed_name]["trigger"]["match"])

        # A run that raises: data_prep cannot read the file.
        bad = start_run(api, dep, {"data_path": str(tmp_path / "missing.parquet")})
        assert final_state(api, bad, serve, work, log) == "FAILED"
        note = one_notification(receiver, bad, "failed", serve, 60)
        assert note["pipeline_run"] == flow_run(api, bad)["name"] and "missing.parquet" in note["error"]
        assert note["detected_by"] == "flow" and note["prefect_ui"] == f"{api.removesuffix('/api')}/runs/flow-run/{bad}"
        [pipeline] = mlflow_runs(work, bad)
        assert pipeline.info.status == "FAILED" and pipeline.info.end_time is not None
        assert "missing.parquet" in pipeline.data.tags["failure"]

        # A run that completes; its heartbeats reached the server.
        good = start_run(api, dep, {"overrides": QUICK})
        assert final_state(api, good, serve, work, log) == "COMPLETED"
        completed_at = time.monotonic()
        assert events(api, ["rlcore.pipeline.heartbeat"], f"prefect.flow-run.{good}")

        # A run whose process is SIGKILLed mid-training.
        killed = start_run(api, dep)
        wait_for("the run's train stage", lambda: training(work, killed), 400, procs=[serve], interval=2,
                 progress=tree_progress(work, log))
        run_process(serve, killed).send_signal(signal.SIGKILL)
        note = one_notification(receiver, killed, "crashed", serve, 120)
        assert note["detected_by"] == "rlcore pipeline serve" and note["state"] == "Crashed"
        assert flow_run(api, killed)["state"]["type"] == "CRASHED"
        runs = mlflow_runs(work, killed)
        assert {"pipeline", "train"} <= {r.data.tags["rlcore.stage"] for r in runs}
        for run in runs:  # data_prep (if not cached) had finished; the pipeline and its train stage died with it
            assert run.info.end_time is not None, run.data.tags["rlcore.stage"]
            if run.data.tags["rlcore.stage"] != "data_prep":
                assert run.info.status == "KILLED" and run.data.tags["failure"] == note["error"], run.data.tags

        # The heartbeat window has long passed for the completed run (and the killed one): the
        # liveness automation never acted on either.
        time.sleep(max(0.0, completed_at + 40 - time.monotonic()))
        assert events(api, ["prefect.automation.action", "prefect.automation.triggered"],
                      f"prefect.automation.{liveness['id']}") == []
        assert events(api, ["prefect.automation.action.failed"], since=began) == []
        assert flow_run(api, good)["state"]["type"] == "COMPLETED"
        assert serve.poll() is None  # the serving process lives on
        stop_cleanly(serve, signal.SIGTERM, log)
    finally:
        stop_process_group(serve)
    assert {path for path, _ in receiver.got} == {"/hook?token=s3cret"}  # the configured URL, query included
    assert [n["event"] for _, n in receiver.got if n["event"] in ("failed", "crashed")] == ["failed", "crashed"]
    assert PREFECT_HTTP.get(f"{api}/deployments/{dep['id']}", timeout=scaled(5)).json()["paused"] is False


def test_a_run_killed_with_its_serving_process_is_crashed_by_the_server_once_and_closed_by_the_next_serve(
        prefect_api, receiver, tiny_example, tmp_path):
    api, env = prefect_api
    work = tmp_path / "work"
    serve_log = tmp_path / "serve.log"
    serve = start_serve(api, env, work, serve_log, receiver.url)
    try:
        dep = deployment(api, serve)
        killed = start_run(api, dep)
        # the MLflow store is read only once a data_prep stage finished (its tables exist then): a
        # reader opening the SQLite store while the run creates it races its migration ("table
        # _alembic_tmp_model_versions already exists" failed the run)
        wait_for("a data_prep stage", lambda: "Task run 'data_prep" in serve_log.read_text(errors="replace"), 400,
                 procs=[serve], interval=2, progress=tree_progress(work, serve_log))
        wait_for("the run's train stage", lambda: training(work, killed), 400, procs=[serve], interval=2,
                 progress=tree_progress(work, serve_log))
        # a heartbeat every 5 s; the server stores events asynchronously (its event persister), so
        # on a loaded machine the first may be readable only after the train stage has begun
        wait_for("the run's heartbeat event", lambda: events(api, ["rlcore.pipeline.heartbeat"], f"prefect.flow-run.{killed}"),
                 60, procs=[serve], interval=1)
        everyone = [run_process(serve, killed), *psutil.Process(serve.pid).children(recursive=True)]
        os.killpg(serve.pid, signal.SIGKILL)  # the serving process first: nobody is left to report
        for proc in everyone:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        serve.wait(timeout=scaled(30))
    finally:
        stop_process_group(serve)
    note = one_notification(receiver, killed, "crashed", None, 120)
    assert note["detected_by"] == "prefect-server" and note["error"].startswith(LIVENESS_PREFIX)
    assert note["prefect_ui"] == f"{api.removesuffix('/api')}/runs/flow-run/{killed}"
    assert note["pipeline_run"] == flow_run(api, killed)["name"]
    assert flow_run(api, killed)["state"]["type"] == "CRASHED"
    assert {r.info.status for r in mlflow_runs(work, killed) if r.data.tags["rlcore.stage"] != "data_prep"} == {"RUNNING"}

    # The next serve (same store) ends the MLflow runs the dead one left open, and serves the same
    # deployment, active; one SIGINT stops it cleanly.
    log = tmp_path / "serve-again.log"
    restarted = time.time()
    again = start_serve(api, env, work, log, receiver.url)
    try:
        wait_for("the orphaned MLflow runs to end", lambda: all(
            r.info.status != "RUNNING" for r in mlflow_runs(work, killed)), 180, procs=[again], interval=2,
            progress=tree_progress(work, log))
        for run in mlflow_runs(work, killed):
            if run.data.tags["rlcore.stage"] != "data_prep":
                assert run.info.status == "KILLED" and run.data.tags["failure"].startswith(LIVENESS_PREFIX)
        assert PREFECT_HTTP.get(f"{api}/deployments/{dep['id']}", timeout=scaled(5)).json()["paused"] is False
        serving(api, dep, restarted, again)
        stop_cleanly(again, signal.SIGINT, log)
    finally:
        stop_process_group(again)
    assert len(receiver.about(killed)) == 1
