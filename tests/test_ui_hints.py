"""Where the pipeline's summary sends a person, for each kind of store (#41): a tracking server's own
UI (never `mlflow ui --backend-store-uri http://...`), `mlflow ui` over a store written directly,
the Prefect server in use (never ":4200" for a remote one), and every MLflow link opening the
model-training view. Also MLflow's own "View run" lines against a server: replaced by rlcore's
link on stderr (stdout stays the summary or its JSON)."""

from __future__ import annotations

import pytest

from rlcore.lifecycle.pipeline_run import prefect_ui_hint
from rlcore.pipeline_summary import format_summary
from rlcore.tracking import mlflow_run_url, mlflow_ui_hint, model_version_url

VIEW = "?workflowType=machine_learning"


@pytest.mark.parametrize(("uri", "hint"), [
    ("http://mlflow.internal:5000", f"http://mlflow.internal:5000/#/experiments/7{VIEW}"),
    ("https://ml.example.com/mlflow/", f"https://ml.example.com/mlflow/#/experiments/7{VIEW}"),
    ("sqlite:////work/mlflow.db",
     f"mlflow ui --backend-store-uri sqlite:////work/mlflow.db  (UI at http://127.0.0.1:5000/#/experiments/7{VIEW})"),
    ("postgresql://mlflow@db:5432/mlflow",
     f"mlflow ui --backend-store-uri postgresql://mlflow@db:5432/mlflow  (UI at http://127.0.0.1:5000/#/experiments/7{VIEW})"),
    ("/work/mlruns", f"mlflow ui --backend-store-uri /work/mlruns  (UI at http://127.0.0.1:5000/#/experiments/7{VIEW})"),
    ("databricks", "the experiment 7 in the Databricks workspace of databricks"),
])
def test_mlflow_hint_for_each_store_kind(uri: str, hint: str) -> None:
    assert mlflow_ui_hint(uri, "7") == hint
    if uri.startswith("http"):
        assert "mlflow ui" not in hint


def test_mlflow_links_open_the_model_training_view() -> None:
    server, local = "https://ml.example.com/", "sqlite:////w/mlflow.db"
    assert mlflow_run_url(server, "3", "abc") == f"https://ml.example.com/#/experiments/3/runs/abc{VIEW}"
    assert mlflow_run_url(local, "3", "abc") == f"http://127.0.0.1:5000/#/experiments/3/runs/abc{VIEW}"
    assert model_version_url(server, "rlcore-tiny", "2") == f"https://ml.example.com/#/models/rlcore-tiny/versions/2{VIEW}"


def test_prefect_hint_for_each_api_kind() -> None:
    remote = prefect_ui_hint("https://prefect.example.com/api", "https://prefect.example.com", "/h")
    assert remote == "Prefect UI at https://prefect.example.com" and "4200" not in remote
    assert prefect_ui_hint("http://10.0.0.5:4200/api", None, "/h") == "Prefect UI at http://10.0.0.5:4200"  # UI URL unset
    cloud = prefect_ui_hint("https://api.prefect.cloud/api/accounts/a/workspaces/w",
                            "https://app.prefect.cloud/account/a/workspace/w", "/h")
    assert cloud == "Prefect UI at https://app.prefect.cloud/account/a/workspace/w"
    assert prefect_ui_hint(None, None, "/h/.prefect") == ("prefect server start  (UI at http://127.0.0.1:4200; flow runs "
                                                           "are stored under /h/.prefect)")  # ephemeral: a local server
    assert prefect_ui_hint(None, None, "/h", "sqlite+aiosqlite:////w/prefect.db") == (
        "PREFECT_SERVER_DATABASE_CONNECTION_URL=sqlite+aiosqlite:////w/prefect.db prefect server start  "
        "(UI at http://127.0.0.1:4200)")


def test_the_summary_prints_the_hints_it_is_given() -> None:
    summary = {"pipeline_run": "p", "dataset_fingerprint": "f" * 64, "steps": 2, "accuracy_before": 0.5,
               "accuracy_after": 0.6, "baseline": "base", "version": None, "reason": "r", "run_dir": "/w/r",
               "links": {"mlflow_run": mlflow_run_url("https://ml.example.com", "1", "abc")},
               "mlflow_ui": mlflow_ui_hint("https://ml.example.com", "1"),
               "prefect_ui": prefect_ui_hint("https://prefect.example.com/api", "https://prefect.example.com", "/h")}
    text = format_summary(summary)
    assert f"  MLflow run       https://ml.example.com/#/experiments/1/runs/abc{VIEW}" in text.splitlines()
    assert text.splitlines()[-2:] == [f"  open the UIs     https://ml.example.com/#/experiments/1{VIEW}",
                                      "                   Prefect UI at https://prefect.example.com"]
    assert "--backend-store-uri" not in text and "4200" not in text


@pytest.mark.slow  # a real `mlflow server` (~20 s to answer on a loaded machine)
def test_runs_ended_on_a_tracking_server_print_rlcore_s_link_not_mlflow_s(
        tmp_path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import subprocess
    import sys
    import urllib.request

    from conftest import wait_for  # tests/ is on sys.path (pytest rootdir conftest)
    from net import free_port

    from rlcore.tracking import MLFLOW_LINKS_VAR, MlflowStore

    port = free_port()
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'm.db'}", "--default-artifact-root",
                               str(tmp_path / "artifacts"), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        def healthy() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                return False

        wait_for("the MLflow server", healthy, 120, procs=[server])
        monkeypatch.delenv(MLFLOW_LINKS_VAR, raising=False)
        uri = f"http://127.0.0.1:{port}"
        store = MlflowStore(uri, experiment="hints")
        run_id = store.start_run("train")
        capfd.readouterr()
        store.end_run(run_id)
        out, err = capfd.readouterr()
        assert out == ""  # MLflow's own "View run ... at" lines (GenAI view) would land in `pipeline run --json`'s output
        assert err.splitlines() == [f"rlcore: MLflow run train (FINISHED): {uri}/#/experiments/{store.experiment_id}/runs/"
                                    f"{run_id}{VIEW}"]
        assert MLFLOW_LINKS_VAR not in os.environ
        monkeypatch.setenv(MLFLOW_LINKS_VAR, "false")  # the user's choice: MLflow's lines, not rlcore's
        other = store.start_run("evaluate")
        capfd.readouterr()
        store.end_run(other, "FAILED")
        out, err = capfd.readouterr()
        assert "View run evaluate at" in out and "rlcore: MLflow run" not in err
    finally:
        server.terminate()
        server.wait(timeout=60)
