"""`rlcore runs`: what a user sees of the pipeline runs and versions in a local MLflow store,
written by the pipeline's own functions (start/finish a pipeline run, a promote stage's run and
tags, a registered version) — no Prefect, no training."""

from __future__ import annotations

import json

import pytest

from rlcore.cli import main
from rlcore.config import load_config
from rlcore.lifecycle.mlflow_store import CHALLENGER, CHAMPION, ModelRegistry
from rlcore.lifecycle.pipeline_run import end_open_runs, finish_pipeline, open_store, stage_tags, start_pipeline


def _config(uri: str):
    return load_config(None, [f"tracking.mlflow_uri={uri}", "model.path=/m", "data.train_files=[/t.parquet]"])  # never read


def _pipeline(config, workdir, name: str, after: float | None, promote: bool | None, loss: float = 0.5) -> None:
    """One pipeline run as the flow records it: train run (the version's source), promote stage, summary."""
    ctx = start_pipeline(config, workdir, name)
    store = open_store(config, workdir)
    if promote is None:  # a run that failed before promote
        end_open_runs(config, {"rlcore.pipeline_run": name}, "FAILED", "train: CUDA out of memory\nTraceback ...")
        return
    train = store.start_run("train", ctx["run_id"], stage_tags(ctx, "train"))
    store.log_metrics(train, {"acc/mean": after, "actor/loss": loss})
    store.end_run(train)
    check = "promoted" if promote else "margin"  # gate.decide's checks
    registry = ModelRegistry(store, config.registry.model_name)
    version = registry.register(train, "model", tags={"rlcore.pipeline_run": name,
                                                      "rlcore.decision": "promoted" if promote else "rejected",
                                                      "rlcore.check": check}).version
    alias = CHAMPION if promote else CHALLENGER
    registry.set_alias(alias, version)
    promote_run = store.start_run("promote", ctx["run_id"], stage_tags(ctx, "promote"))
    store.set_tags(promote_run, {"version": version, "alias": alias, "decision": check, "reason": "why"})
    store.end_run(promote_run)
    finish_pipeline(config, ctx, {"pipeline_run": name, "accuracy_before": 0.25, "accuracy_after": after,
                                  "version": version, "champion": promote, "reason": "why"})


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runs")
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    config = _config(uri)
    _pipeline(config, workdir, "run-a", 0.5, True)
    _pipeline(config, workdir, "run-b", 0.4, False, loss=0.5)
    _pipeline(config, workdir, "run-c", None, None)
    return uri


def test_lists_runs_newest_first_with_version_and_decision(store_uri, capsys):
    assert main(["runs", "--tracking-uri", store_uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["STARTED", "(UTC)", "RUN"]
    assert [line.split()[2] for line in lines[1:]] == ["run-c", "run-b", "run-a"]
    c, b, a = lines[1:]
    assert "FAILED" in c and "train: CUDA out of memory" in c and "Traceback" not in c
    assert "0.250 -> 0.400" in b and " 2 " in b and "rejected (margin)" in b
    assert "0.250 -> 0.500" in a and " 1 " in a and "promoted" in a and "(promoted)" not in a


def test_limit_and_json(store_uri, capsys):
    assert main(["runs", "--tracking-uri", store_uri, "--limit", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["version"], r["decision"]) for r in rows] == [
        ("run-c", "FAILED", None, None), ("run-b", "FINISHED", "2", "rejected")]


def test_compare_marks_what_differs(store_uri, capsys):
    assert main(["runs", "--tracking-uri", store_uri, "--compare", "1", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line[2:].split()[0]: line for line in out.splitlines()[1:]}
    assert rows["acc/mean"].startswith("*") and "0.5" in rows["acc/mean"] and "0.4" in rows["acc/mean"]
    assert not rows["actor/loss"].startswith("*")  # the same in both
    assert rows["rlcore.decision"].startswith("*") and "promoted" in rows["rlcore.decision"]
    assert "champion" in rows["aliases"] and "challenger" in rows["aliases"]


@pytest.mark.parametrize("argv, says", [
    (["--compare", "1", "9"], "--compare: 'rlcore-tiny' has no version '9' (versions: 1, 2)"),
    (["--compare", "1", "2", "--model", "nope"], "--model: no registered model 'nope'"),
    (["--experiment", "other"], "--experiment: no experiment 'other'"),
])
def test_errors_are_one_line_naming_the_argument(store_uri, capsys, argv, says):
    assert main(["runs", "--tracking-uri", store_uri, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: ") and says in err and len(err.strip().splitlines()) == 1


def test_no_store_and_empty_store(tmp_path, capsys):
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    assert main(["runs", "--tracking-uri", missing]) == 2
    assert "--tracking-uri: no MLflow store at" in capsys.readouterr().err
    assert not (tmp_path / "none.db").exists()  # read only: nothing created
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    open_store(_config(empty), tmp_path)  # the experiment, no runs
    assert main(["runs", "--tracking-uri", empty]) == 2
    assert "--experiment: no pipeline runs in experiment 'rlcore'" in capsys.readouterr().err


def test_default_store_is_pipeline_runs(tmp_path, monkeypatch, store_uri, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    assert main(["runs", "--limit", "1"]) == 0
    assert "run-c" in capsys.readouterr().out
