"""Against a real Prefect server on 127.0.0.1: `rlcore pipeline serve` creates the deployment
with its cron schedule, and a new data file in the watched directory (an `rlcore.data.arrived`
event) leads to a completed pipeline run on that file and a new registered model version."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PREFECT_HTTP, stop_process_group, tree_progress, wait_for  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.data import read_rows, write_rows

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128", "registry.promotion_margin=-1"]

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]


def test_data_event_runs_pipeline_and_registers_version(prefect_api, tiny_example, tmp_path):
    api, env = prefect_api
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
            got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=scaled(5))
            return got.json() if got.ok else None

        dep = wait_for("the deployment", deployment, 180, procs=[serve])  # the serving process imports torch first
        assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 3 * * *"]
        # The watcher takes its first look at the (empty) directory before the runner starts polling.
        wait_for("the serving process to poll", lambda: PREFECT_HTTP.get(
            f"{api}/deployments/{dep['id']}", timeout=scaled(5)).json().get("last_polled"), 180, procs=[serve])

        rows = read_rows(tiny_example.train_file)[:64]
        partial = watch / ".new.parquet"
        write_rows(rows, partial)
        arrived = watch / "batch-001.parquet"
        partial.rename(arrived)

        def finished_run():
            body = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}}
            runs = PREFECT_HTTP.post(f"{api}/flow_runs/filter", json=body, timeout=scaled(5)).json()
            for run in runs:
                if run["parameters"].get("data_path") != str(arrived.resolve()):
                    continue
                state = run["state"]["type"] if run.get("state") else None
                if state in ("FAILED", "CRASHED", "CANCELLED"):
                    raise AssertionError(f"pipeline run {state}: see {tmp_path / 'serve.log'}")
                if state == "COMPLETED":
                    return run
            return None

        run = wait_for("the triggered pipeline run", finished_run, 300, interval=2, procs=[serve],
                       progress=tree_progress(work, tmp_path / "serve.log"))
    finally:
        stop_process_group(serve)
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
    assert champion.tags["rlcore.dataset_fingerprint"] == prep["fingerprint"]
    # The promotion decision is in the serve log: version, metric and why.
    assert "rlcore-tiny version 1 promoted to champion: accuracy " in (tmp_path / "serve.log").read_text()


def _prefect(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


def test_prefect_deploy_runs_a_flow_on_a_process_work_pool(prefect_api, tiny_example, tmp_path):
    """prefect.yaml as a user deploys it: `prefect deploy --all` against the server creates every
    deployment on the work pool (cron schedule and data trigger included), and a process worker
    runs a flow run of one of them in the repository (the pull step's RLCORE_ROOT)."""
    api, env = prefect_api
    env = dict(env, PREFECT_API_URL=api, RLCORE_ROOT=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    _prefect(["work-pool", "create", "rlcore-process", "--type", "process"], env)
    _prefect(["--no-prompt", "deploy", "--all"], env)

    deployments = {d["name"]: d for d in PREFECT_HTTP.post(f"{api}/deployments/filter", json={}, timeout=scaled(5)).json()}
    assert set(deployments) == {"rl-pipeline", "data-prep", "evaluate"}
    assert {d["work_pool_name"] for d in deployments.values()} == {"rlcore-process"}
    assert [s["schedule"]["cron"] for s in deployments["rl-pipeline"]["schedules"]] == ["0 3 * * *"]
    automations = PREFECT_HTTP.post(f"{api}/automations/filter", json={}, timeout=scaled(5)).json()
    trigger = next(a["trigger"] for a in automations if a["name"] == "rlcore-data-arrived")
    assert trigger["expect"] == ["rlcore.data.arrived"]

    rows = read_rows(tiny_example.train_file)[:40]
    data = tmp_path / "arrived.parquet"
    write_rows(rows + rows[:1], data)  # one duplicate row, which data_prep must drop
    work = tmp_path / "prep"
    params = {
        "config_path": "rlcore/configs/tiny_grpo.yaml", "data_path": str(data), "workdir": str(work),
        "overrides": [f"model.path={tiny_example.model_dir}", f"data.val_files=[{tiny_example.val_file}]"],
    }
    created = PREFECT_HTTP.post(f"{api}/deployments/{deployments['data-prep']['id']}/create_flow_run",
                            json={"parameters": params}, timeout=scaled(10))
    assert created.ok, created.text
    _prefect(["worker", "start", "--pool", "rlcore-process", "--run-once"], env, timeout=300)

    run = PREFECT_HTTP.get(f"{api}/flow_runs/{created.json()['id']}", timeout=scaled(5)).json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    [report] = list((work / "data").glob("*/prep_report.json"))
    import json

    counts = json.loads(report.read_text())["counts"]
    assert counts["duplicates"] == 1 and counts["train"] == 40
    assert len(read_rows(report.parent / "train.parquet")) == 40
