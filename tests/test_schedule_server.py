"""The cron schedule makes runs: against a real Prefect server on 127.0.0.1 (its scheduler service
every 5 s), `rlcore pipeline serve --cron '* * * * *'` deploys rl_pipeline, the server's scheduler
creates flow runs for it, and the first one runs to a completed pipeline and a registered model
version. With SQLAlchemy 2.1 under Prefect 3.7.7 the scheduler failed every loop ("Can't evaluate
bulk DML statement") and no run was ever made, though the deployment's schedule read back fine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (  # tests/ is on sys.path (pytest rootdir conftest)
    PREFECT_HTTP,
    PrefectServer,
    stop_process_group,
    tree_progress,
    wait_for,
)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
# As short as the pipeline allows: one training step on few prompts, a negative promotion margin
# so that the one candidate becomes champion whatever the step did.
QUICK = ["trainer.total_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128", "registry.promotion_margin=-1"]

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]


def test_cron_schedule_creates_runs_that_register_a_model_version(
        prefect_api: tuple[str, dict[str, str]], shared_prefect_server: PrefectServer, tiny_example: Any,
        tmp_path: Path) -> None:
    api, env = prefect_api  # the session's server: its scheduler service runs every 5 s (default 60 s)
    server_log = shared_prefect_server.log
    log_start = server_log.stat().st_size  # what the server logs from here on is this test's
    work = tmp_path / "work"
    work.mkdir()
    env = dict(env, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", "* * * * *", *QUICK],
            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def deployment() -> dict[str, Any] | None:
                got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=scaled(5))
                return got.json() if got.ok else None

            dep = wait_for("the deployment", deployment, 180, procs=[serve])  # the serving process imports torch first
            assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["* * * * *"]

            def runs() -> list[dict[str, Any]]:
                body = {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"}
                return PREFECT_HTTP.post(f"{api}/flow_runs/filter", json=body, timeout=scaled(5)).json()

            # the server's scheduler, not anyone here, makes the runs: one a minute, ahead of time
            scheduled = wait_for("runs made by the scheduler", lambda: [r for r in runs() if r["auto_scheduled"]],
                              60, procs=[serve])
            assert len(scheduled) >= 2

            def first_finished() -> dict[str, Any] | None:
                first = runs()[0]
                state = first["state"]["type"] if first.get("state") else None
                if state in ("FAILED", "CRASHED", "CANCELLED"):
                    raise AssertionError(f"scheduled pipeline run {state}: see {tmp_path / 'serve.log'}")
                return first if state == "COMPLETED" else None

            # the first run is due at the next whole minute, then runs the (short) pipeline
            run = wait_for("the first scheduled run to complete", first_finished, 240, procs=[serve], interval=2,
                           progress=tree_progress(work, tmp_path / "serve.log"))
        finally:
            stop_process_group(serve)
    assert run["auto_scheduled"] and run["id"] == scheduled[0]["id"]
    assert b"Can't evaluate bulk DML" not in server_log.read_bytes()[log_start:]

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    registry = ModelRegistry(MlflowStore(f"sqlite:///{work / 'mlflow.db'}"), "rlcore-tiny")
    champion = registry.by_alias("champion")
    assert champion is not None and champion.version == "1"
    mv_run = registry.store.client.get_run(champion.run_id)
    parent = registry.store.client.get_run(mv_run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["rlcore.stage"] == "pipeline" and "trigger.data_path" not in parent.data.tags
    assert parent.info.status == "FINISHED"
