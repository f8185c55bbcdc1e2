"""`rlcore pipeline serve` against a Prefect server and an MLflow tracking server that keep their
stores in PostgreSQL (a throwaway cluster from the distribution's binaries, tests/postgres.py):
one run made through the API completes, its MLflow runs and registered version are in the
PostgreSQL store (read through MLflow's client, from the server and from the database itself),
nothing went to a SQLite file, and no server logged a database error. Under SQLite a session of
cron + data events logged "database is locked" 17 times (issue 41); benchmarks/soak_postgres.py is
the long version of this test (cron every minute plus data drops, then the accounting)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PREFECT_HTTP, prefect_server, stop_process_group, tree_progress, wait_for
from postgres import (  # noqa: F401 - pg_cluster_fixture registers the fixture `pg_cluster` here
    DB_ERROR,
    INSTALL_HINT,
    PG_ERROR,
    Postgres,
    db_errors,
    mlflow_server,
    pg_bin_dir,
    pg_cluster_fixture,
)
from timing import scaled

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128", "registry.promotion_margin=-1"]


def test_missing_postgresql_binaries_are_named_with_the_package_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("RLCORE_PG_BIN", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError) as refused:
        pg_bin_dir()
    assert str(tmp_path / "nowhere") in str(refused.value) and INSTALL_HINT in str(refused.value)


def test_a_refusal_prefect_retries_is_not_counted_but_any_other_is(tmp_path: Path) -> None:
    log = tmp_path / "postgresql.log"
    log.write_text('2026-12-05 05:06:16.974 UTC [21136] ERROR:  duplicate key value violates unique constraint "pk_task_run"\n'
                   '2026-12-05 05:06:16.974 UTC [21136] STATEMENT:  INSERT INTO task_run ...\n'
                   '2026-12-05 05:06:17.001 UTC [21137] ERROR:  duplicate key value violates unique constraint "pk_flow_run"\n'
                   '2026-12-05 05:06:18.000 UTC [21138] FATAL:  too many connections for role "rlcore"\n')
    assert [line.split("] ")[1] for line in db_errors(log, PG_ERROR)] == [
        'ERROR:  duplicate key value violates unique constraint "pk_flow_run"',
        'FATAL:  too many connections for role "rlcore"']


class Servers:
    def __init__(self, pg: Postgres, tracking: str, api: str, env: dict[str, str], logs: dict[str, Path]) -> None:
        self.pg, self.tracking, self.api, self.env, self.logs = pg, tracking, api, env, logs


@pytest.fixture(scope="module")
def servers(pg_cluster: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """MLflow's server on database `mlflow` (psycopg2), Prefect's on `prefect` (asyncpg)."""
    home = tmp_path_factory.mktemp("servers")
    with mlflow_server(pg_cluster.url("mlflow", "psycopg2"), home / "artifacts", home / "mlflow.log") as tracking:
        with prefect_server(home / "prefect", PREFECT_SERVER_DATABASE_CONNECTION_URL=pg_cluster.url("prefect", "asyncpg")) as (
                api, env, prefect_log):
            yield Servers(pg_cluster, tracking, api, env,
                          {"prefect": prefect_log, "mlflow": home / "mlflow.log", "postgres": pg_cluster.log})


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.pipeline
@pytest.mark.timeout(900)  # three servers start, then the serving process and one whole (short) pipeline run
def test_a_served_run_completes_with_both_stores_in_postgresql(servers: Servers, tiny_example: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = dict(servers.env, MLFLOW_TRACKING_URI=servers.tracking, PREFECT_RUNNER_POLL_FREQUENCY="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    api = servers.api
    with open(tmp_path / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", "", *QUICK],
                                 cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def deployment() -> dict[str, Any] | None:
            got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=scaled(5))
            return got.json() if got.ok else None

        dep = wait_for("the deployment", deployment, 180, procs=[serve])
        created = PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/create_flow_run", json={"parameters": {}},
                                    timeout=scaled(10))
        assert created.ok, created.text
        run_id = created.json()["id"]

        def final() -> str | None:
            got = PREFECT_HTTP.get(f"{api}/flow_runs/{run_id}", timeout=scaled(5)).json()
            state = (got.get("state") or {}).get("type")
            return state if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        state = wait_for("the flow run to end", final, 300, procs=[serve], interval=2,
                         progress=tree_progress(work, tmp_path / "serve.log"))
        # read before the servers stop: a shutdown's dropped connections are not the run's errors
        errors = {name: db_errors(path, PG_ERROR if name == "postgres" else DB_ERROR) for name, path in servers.logs.items()}
    finally:
        stop_process_group(serve)
    assert state == "COMPLETED", f"see {tmp_path / 'serve.log'}"
    assert errors == {"prefect": [], "mlflow": [], "postgres": []}
    assert not list(work.rglob("*.db")), "a SQLite file was written: the MLflow server was not used"

    from mlflow.tracking import MlflowClient

    # through the tracking server, then from PostgreSQL itself (MLflow's SQLAlchemy store on the database)
    # each client's registry named too: an earlier test of this process may have set MLflow's global
    # registry URI (`mlflow.set_registry_uri`), which a client given only a tracking URI would read
    for uri in (servers.tracking, servers.pg.url("mlflow", "psycopg2")):
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        experiment = client.get_experiment_by_name("rlcore")
        assert experiment is not None
        runs = [r for r in client.search_runs([experiment.experiment_id], max_results=100)
                if r.data.tags.get("prefect.flow_run_id") == run_id]
        stages = {r.data.tags.get("rlcore.stage"): r.info.status for r in runs}
        assert stages.get("pipeline") == "FINISHED" and stages.get("train") == "FINISHED", stages
        version = client.get_model_version_by_alias("rlcore-tiny", "champion")
        assert str(version.version) == "1" and version.run_id in {r.info.run_id for r in runs}
