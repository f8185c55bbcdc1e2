"""Soak: `rlcore pipeline serve` on a cron of every minute plus data drops, against a Prefect server
and an MLflow tracking server that both keep their stores in PostgreSQL, then the accounting.

    ./dev python benchmarks/soak_postgres.py [--minutes 15] [--drop-every 3] [--drain-minutes 20]
        [--out DIR] [--tracking-only]

A throwaway PostgreSQL cluster from the distribution's binaries (tests/postgres.py; `apt-get
install postgresql`), databases `prefect` (Prefect's server, asyncpg) and `mlflow` (MLflow's
server, psycopg2; artifacts proxied to a folder). One `pipeline serve --cron "* * * * *" --watch
DIR --limit 1` with the tiny example's smallest pipeline (one training step), and every
`--drop-every` minutes a copy of the example's train file renamed into DIR (a data event). Runs
queue behind `--limit 1` (cron runs fall late; that is the load). After `--minutes` the deployment
is paused (Prefect deletes the cron runs that never started), no more files are dropped, and what
was started is waited for (at most `--drain-minutes`); then the serving process is stopped and
the stores are read:

- flow runs of the deployment by state; MLflow pipeline runs by status; registered versions by
  the gate's decision (promoted / rejected); failures (flow runs FAILED or CRASHED);
- lines naming a database error in the Prefect server's, the MLflow server's and PostgreSQL's logs
  (tests/postgres.py `DB_ERROR`, `PG_ERROR`), counted before the servers are stopped;
- automation errors: the server's `prefect.automation.action.failed` events and its log's "Action
  failed" lines (none may follow a run that completed);
- whether every dropped file made one flow run, every flow run that started has exactly one MLflow
  pipeline run, and flow runs = MLflow runs = promoted + rejected + failures.

Exit status 0 when that balance holds and no database or automation error was logged, 1 otherwise. Logs and the
stores' files stay in `--out` (default: a new folder under /tmp)."""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the servers' harness: tests/postgres.py, tests/conftest.py

from conftest import PREFECT_HTTP, prefect_server, stop_process_group  # noqa: E402
from postgres import PG_ERROR, db_errors, mlflow_server, postgres_cluster  # noqa: E402

# The tiny example's smallest pipeline: one training step on few prompts.
QUICK = ["trainer.total_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128"]
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
MODEL = "rlcore-tiny"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="how long runs are made (cron + drops)")
    ap.add_argument("--drop-every", type=float, default=3.0, help="minutes between data drops")
    ap.add_argument("--drain-minutes", type=float, default=20.0, help="at most this long for started runs to end")
    ap.add_argument("--out", type=Path, default=None, help="folder for logs and stores (default: new under /tmp)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-pg-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    from rlcore.example import build_tiny_example

    example = build_tiny_example(seed=0)
    train_file = Path(example.train_file)
    print(f"soak: {args.minutes:g} min, cron every minute, a data drop every {args.drop_every:g} min; logs in {out}", flush=True)
    with postgres_cluster(log_dir=out) as pg:
        with mlflow_server(pg.url("mlflow", "psycopg2"), out / "artifacts", out / "mlflow-server.log") as tracking:
            with prefect_server(out / "prefect", PREFECT_SERVER_DATABASE_CONNECTION_URL=pg.url("prefect", "asyncpg")) as (
                    api, env, prefect_log):
                print(f"servers: PostgreSQL 127.0.0.1:{pg.port}, MLflow {tracking}, Prefect {api}", flush=True)
                flow_runs, late, drops = soak(args, out, api, env, tracking, train_file)
                errors = {"Prefect server": db_errors(prefect_log), "MLflow server": db_errors(out / "mlflow-server.log"),
                          "PostgreSQL": db_errors(pg.log, PG_ERROR)}
                errors["Prefect automations"] = automation_errors(api, prefect_log)
                mlflow = mlflow_accounting(tracking)
    return report(flow_runs, late, drops, mlflow, errors, out)


def automation_errors(api: str, prefect_log: Path) -> list[str]:
    """Every action an automation failed to take: the server's `prefect.automation.action.failed`
    events and its log's "Action failed" lines (the liveness automation acting on a run that had
    already completed was issue 41's cron-run symptom)."""
    body = {"filter": {"event": {"prefix": ["prefect.automation.action.failed"]}}, "limit": 50}  # the API's page
    got = PREFECT_HTTP.post(f"{api}/events/filter", json=body, timeout=30)
    got.raise_for_status()
    page = got.json()
    failed = [f"event {e['occurred']}: {e.get('payload', {}).get('reason', '')}" for e in page["events"]]
    failed += [f"(and {page['total'] - len(failed)} more events)"] * (page["total"] > len(failed))
    text = prefect_log.read_text(errors="replace") if prefect_log.is_file() else ""
    return failed + [line for line in text.splitlines() if "Action failed" in line]


def soak(args: argparse.Namespace, out: Path, api: str, env: dict[str, str], tracking: str,
         train_file: Path) -> tuple[list[dict[str, Any]], int, int]:
    """Serve, drop files, pause, drain; the deployment's flow runs at the end, how many cron runs
    were due but never started (deleted by the pause), and how many files were dropped."""
    work, watch = out / "work", out / "watch"
    work.mkdir(exist_ok=True)
    watch.mkdir(exist_ok=True)
    serve_env = dict(env, MLFLOW_TRACKING_URI=tracking, PREFECT_RUNNER_POLL_FREQUENCY="5", OMP_NUM_THREADS="1",
                     PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(out / "serve.log", "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "rlcore.cli", "pipeline", "serve", "--cron", "* * * * *",
                                  "--watch", str(watch), "--limit", "1", *QUICK],
                                 cwd=work, env=serve_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        dep = wait_deployment(api, serve)
        start = time.monotonic()
        end = args.minutes * 60
        drops, next_drop = 0, 30.0  # the first after the watcher has taken stock of the folder
        while (elapsed := time.monotonic() - start) < end:
            if serve.poll() is not None:
                raise SystemExit(f"pipeline serve exited with {serve.returncode}: see {out / 'serve.log'}")
            if elapsed >= next_drop:
                drops += 1
                staged = watch / f".drop-{drops}.parquet"  # written aside, renamed into place (the watcher's rule)
                shutil.copyfile(train_file, staged)
                staged.rename(watch / f"drop-{drops}.parquet")
                next_drop += args.drop_every * 60
            progress(elapsed, runs(api, dep["id"]), drops)
            time.sleep(max(1.0, min(60.0, next_drop - elapsed, end - elapsed)))
        before = runs(api, dep["id"])
        PREFECT_HTTP.post(f"{api}/deployments/{dep['id']}/pause_deployment", timeout=30).raise_for_status()
        kept = {r["id"] for r in runs(api, dep["id"])}
        gone = [r for r in before if r["id"] not in kept]
        late = sum(1 for r in gone if is_due(r))
        print(f"[{clock(time.monotonic() - start)}] paused the deployment: Prefect deleted the cron runs not started, "
              f"{late} due (late) and {len(gone) - late} not yet due; draining what remains", flush=True)
        deadline = time.monotonic() + args.drain_minutes * 60
        while time.monotonic() < deadline and serve.poll() is None:
            now = runs(api, dep["id"])
            if all(state(r) in FINAL for r in now):
                break
            progress(time.monotonic() - start, now, drops)
            time.sleep(15)
        return runs(api, dep["id"]), late, drops
    finally:
        stop_process_group(serve)


def wait_deployment(api: str, serve: subprocess.Popen) -> dict[str, Any]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise SystemExit(f"pipeline serve exited with {serve.returncode} before deploying")
        got = PREFECT_HTTP.get(f"{api}/deployments/name/rl_pipeline/rl-pipeline", timeout=30)
        if got.ok:
            return got.json()
        time.sleep(2)
    raise SystemExit("the deployment did not appear within 600 s")


def runs(api: str, deployment_id: str) -> list[dict[str, Any]]:
    body = {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200}
    got = PREFECT_HTTP.post(f"{api}/flow_runs/filter", json=body, timeout=30)
    got.raise_for_status()
    return list(got.json())


def state(run: dict[str, Any]) -> str:
    return str((run.get("state") or {}).get("type") or "NONE")


def started(run: dict[str, Any]) -> bool:
    """The run reached a worker: it ran (or runs) and so owes an MLflow run."""
    return state(run) in FINAL and (run.get("run_count") or 0) > 0 or state(run) in ("RUNNING", "PENDING")


def clock(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def progress(elapsed: float, flow_runs: list[dict[str, Any]], drops: int) -> None:
    states = collections.Counter(state(r) if state(r) != "SCHEDULED" else (r["state"].get("name") or "Scheduled")
                                 for r in flow_runs if state(r) != "SCHEDULED" or is_due(r))
    print(f"[{clock(elapsed)}] flow runs due: {dict(sorted(states.items()))}; data drops {drops}", flush=True)


def is_due(run: dict[str, Any]) -> bool:
    from datetime import UTC, datetime

    expected = run.get("expected_start_time") or run.get("next_scheduled_start_time")
    return expected is not None and datetime.fromisoformat(expected.replace("Z", "+00:00")) <= datetime.now(UTC)


def mlflow_accounting(tracking: str) -> dict[str, Any]:
    """Pipeline runs (stage `pipeline`) by status and flow run, registered versions by decision."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    pipeline_runs = []
    for experiment in client.search_experiments():
        pipeline_runs += [r for r in client.search_runs([experiment.experiment_id], "tags.`rlcore.stage` = 'pipeline'",
                                                         max_results=1000)]
    versions = client.search_model_versions(f"name = '{MODEL}'", max_results=1000)
    return {"runs": pipeline_runs, "versions": versions}


def report(flow_runs: list[dict[str, Any]], late: int, drops: int, mlflow: dict[str, Any], errors: dict[str, list[str]],
           out: Path) -> int:
    ran = [r for r in flow_runs if started(r)]
    by_state = collections.Counter(state(r) for r in flow_runs)
    failures = [r for r in ran if state(r) in ("FAILED", "CRASHED")]
    ml_runs = mlflow["runs"]
    ml_by_status = collections.Counter(r.info.status for r in ml_runs)
    ml_by_flow = collections.Counter(r.data.tags.get("prefect.flow_run_id") for r in ml_runs)
    decisions = collections.Counter((v.tags or {}).get("rlcore.decision", "none") for v in mlflow["versions"])
    promoted, rejected = decisions.get("promoted", 0), decisions.get("rejected", 0)
    ran_ids = {r["id"] for r in ran}
    unmatched_flow = sorted(i for i in ran_ids if ml_by_flow.get(i, 0) != 1)
    unmatched_ml = sorted(str(i) for i in ml_by_flow if i not in ran_ids)
    n_errors = sum(len(v) for v in errors.values())
    event_runs = sum(1 for r in ran if not r.get("auto_scheduled"))
    balanced = event_runs == drops and len(ran) == len(ml_runs) == promoted + rejected + len(failures) and not unmatched_flow and not unmatched_ml
    print("\n== accounting ==")
    print(f"flow runs of the deployment by state: {dict(sorted(by_state.items()))} "
          f"(+ {late} cron runs due but never started, deleted by the pause)")
    print(f"flow runs that ran: {len(ran)} (cron {len(ran) - event_runs}, data events {event_runs} for {drops} files "
          f"dropped)")
    print(f"MLflow pipeline runs by status: {dict(sorted(ml_by_status.items()))}")
    print(f"registered versions of {MODEL}: {len(mlflow['versions'])} by decision {dict(sorted(decisions.items()))}")
    print(f"gate rejections: {rejected}; failures (flow runs FAILED/CRASHED): {len(failures)}")
    for name, lines in errors.items():
        print(f"{'errors in' if name == 'Prefect automations' else 'database errors in the'} {name}"
              f"{'' if name == 'Prefect automations' else ' log'}: {len(lines)}")
        for line in lines[:5]:
            print(f"    {line[:200]}")
    if unmatched_flow or unmatched_ml:
        print(f"flow runs without exactly one MLflow pipeline run: {unmatched_flow}; MLflow runs of no such flow run: "
              f"{unmatched_ml}")
    print(f"flow runs ({len(ran)}) = MLflow runs ({len(ml_runs)}) = promoted ({promoted}) + rejected ({rejected}) + "
          f"failures ({len(failures)}): {'yes' if balanced else 'NO'}")
    print(f"logs and stores: {out}")
    return 0 if balanced and n_errors == 0 else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the servers on `kill` too
    sys.exit(main())
