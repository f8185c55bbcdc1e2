"""Against a real Prefect server on 127.0.0.1: `rlcore pipeline serve` creates the deployment
with its cron schedule, and a new data file in the watched directory (an `rlcore.data.arrived`
event) leads to a completed pipeline run on that file and a new registered model version."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from rlcore.data import read_rows, write_rows

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128", "registry.promotion_margin=-1"]

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen | None) -> None:
    """SIGINT, then SIGKILL, to the process group this test started."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _wait(what: str, fn, timeout: float, interval: float = 1.0, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a helper process exited with {p.returncode}")
        try:
            value = fn()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait("the Prefect server", lambda: requests.get(f"{api}/health", timeout=2).ok, 90, procs=[proc])
        yield api, env
    finally:
        _stop(proc)
        log.close()


def test_data_event_runs_pipeline_and_registers_version(prefect_server, tiny_example, tmp_path):
    api, env = prefect_server
    work, watch = tmp_path / "work", tmp_path / "incoming"
    work.mkdir()
    watch.mkdir()
    env = dict(env, PREFECT_API_URL=api, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--watch", str(watch), "--watch-interval", "1",
         "--cron", "0 3 * * *", *QUICK], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def deployment():
            got = requests.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=5)
            return got.json() if got.ok else None

        dep = _wait("the deployment", deployment, 120, procs=[serve])
        assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 3 * * *"]
        time.sleep(3)  # the watcher has taken its first look at the (empty) directory

        rows = read_rows(tiny_example.train_file)[:64]
        partial = watch / ".new.parquet"
        write_rows(rows, partial)
        arrived = watch / "batch-001.parquet"
        partial.rename(arrived)

        def finished_run():
            body = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}
            runs = requests.post(f"{api}/flow_runs/filter", json=body, timeout=5).json()
            for run in runs:
                if run["parameters"].get("data_path") != str(arrived.resolve()):
                    continue
                state = run["state"]["type"] if run.get("state") else None
                if state in ("FAILED", "CRASHED", "CANCELLED"):
                    raise AssertionError(f"pipeline run {state}: see {tmp_path / 'serve.log'}")
                if state == "COMPLETED":
                    return run
            return None

        run = _wait("the triggered pipeline run", finished_run, 300, interval=2, procs=[serve])
    finally:
        _stop(serve)
        log.close()
    assert run["parameters"]["data_path"] == str(arrived.resolve())

    import json

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    registry = ModelRegistry(MlflowStore(f"sqlite:///{work / 'mlflow.db'}"), "rlcore-tiny")
    champion = registry.by_alias("champion")
    assert champion is not None and champion.version == "1"
    mv_run = registry.store.client.get_run(champion.run_id)
    parent = registry.store.client.get_run(mv_run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["trigger.data_path"] == str(arrived.resolve())
    [report] = list((work / "runs" / "pipeline" / "data").glob("*/prep_report.json"))
    prep = json.loads(report.read_text())
    assert prep["counts"]["train"] == 64  # trained on the arrived file, not the configured data
    assert champion.tags["lineage.dataset_fingerprint"] == prep["fingerprint"]
