"""`rlcore pipeline run` end to end on the tiny example (the session's Prefect server, SQLite MLflow
in the working directory; Prefect's ephemeral mode, with no server, is test_wheel's), twice: the
second run warm-starts from the first one's champion. What a user then finds: the champion loads
with `mlflow.pyfunc.load_model` and generates, and with transformers; versions described, with a
few `rlcore.*` tags; the data as MLflow datasets; one MLflow run per stage, the train run's steps
logged while training ran; Prefect and MLflow runs pointing at each other; the promotion decision
in the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PREFECT_HTTP  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128"]


def pipeline_env(prefect_api: tuple[str, dict[str, str]]) -> dict[str, str]:
    """A pipeline's environment: a client of the session's Prefect server (`prefect_api`, with this
    test's own Prefect home), MLflow's default store (./mlflow.db)."""
    _, env = prefect_api
    env = dict(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout))
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.pipeline
def test_pipeline_run_twice_warm_starts_from_champion(tiny_example, tmp_path, prefect_api):
    env = pipeline_env(prefect_api)
    work = tmp_path / "work"
    work.mkdir()
    # A negative margin makes the first candidate the champion whatever 2 steps did to it.
    first = json.loads(run_cli(["pipeline", "run", "--json", *QUICK, "registry.promotion_margin=-1"], work, env).stdout)
    assert (work / "mlflow.db").is_file()  # the default store: a SQLite file in the working directory
    assert first["version"] == "1" and first["champion"] is True and first["baseline"] == "base"
    assert first["warm_start"] is None and first["steps"] == 2
    # Same val data, greedy, exactly: the example's greedy choices lead by > 1e-3 logits (test_example_build),
    # so this process's kernels cannot flip an answer of the pinned build's evaluation.
    assert first["accuracy_before"] == pytest.approx(tiny_example.sft_greedy_accuracy)
    assert first["mlflow_ui"].startswith(f"mlflow ui --backend-store-uri sqlite:///{work / 'mlflow.db'}  (UI at http://127.0.0.1:5000/#/experiments/")
    assert first["prefect_ui"] == f"Prefect UI at {prefect_api[0].removesuffix('/api')}"  # the server in use, not :4200
    assert first["links"]["mlflow_run"].endswith(f"/runs/{first['mlflow_run_id']}?workflowType=machine_learning")

    second_proc = run_cli(["pipeline", "run", "--json", *QUICK, "registry.promotion_margin=0.5"], work, env)
    second = json.loads(second_proc.stdout)
    assert second["warm_start"] == "models:/rlcore-tiny/1"
    assert second["baseline"] == "champion"
    assert second["accuracy_before"] == pytest.approx(first["accuracy_after"])  # the champion, re-evaluated
    assert second["version"] == "2" and second["champion"] is False
    assert "does not beat the champion" in second["reason"]
    assert second["dataset_fingerprint"] == first["dataset_fingerprint"]
    assert "Cached" in second_proc.stderr  # data_prep reused by input fingerprint
    assert (f"rlcore-tiny version 2 not promoted (challenger): accuracy {second['accuracy_after']:.4f} vs the "
            f"champion's {second['accuracy_before']:.4f}: {second['reason']}") in second_proc.stderr

    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    uri = f"sqlite:///{work / 'mlflow.db'}"
    registry = ModelRegistry(MlflowStore(uri), "rlcore-tiny")
    assert registry.by_alias("champion").version == "1"
    challenger = registry.by_alias("challenger")
    assert challenger.version == "2" and challenger.tags["rlcore.check"] == "margin"
    assert challenger.tags["rlcore.decision"] == "rejected"
    assert challenger.tags["rlcore.parent_model"] == "models:/rlcore-tiny/1"
    assert challenger.tags["rlcore.dataset_fingerprint"] == first["dataset_fingerprint"]
    assert challenger.tags["rlcore.algorithm"] == "grpo" and "compute_score@" in challenger.tags["rlcore.reward"]
    assert len(challenger.tags) <= 10 and all(k.startswith("rlcore.") for k in challenger.tags)
    assert challenger.description.startswith("Not promoted: **challenger**. accuracy ")
    assert second["reason"] in challenger.description and "grpo from `models:/rlcore-tiny/1`" in challenger.description
    assert registry.get("1").description.startswith("Promoted to **champion**. accuracy ")
    champion_dir = registry.download("champion", tmp_path / "champion")
    model = AutoModelForCausalLM.from_pretrained(champion_dir)
    assert model.config.vocab_size == tiny_example.vocab_size

    # The champion is an MLflow model: loaded by its registry URI, it answers prompts (greedy, so
    # exactly what transformers generates from the same folder).
    import mlflow

    from rlcore.lifecycle.hf_pyfunc import TextGenerator

    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        served = mlflow.pyfunc.load_model("models:/rlcore-tiny@champion")
    finally:
        mlflow.set_tracking_uri(previous[0])
        mlflow.set_registry_uri(previous[1])
    answers = served.predict(["12+34=", "57+68="], params={"max_new_tokens": 8})
    assert answers == TextGenerator(str(champion_dir)).generate(["12+34=", "57+68="], max_new_tokens=8)
    assert all(isinstance(a, str) and a.strip() for a in answers)

    client = MlflowClient(uri)
    parent = client.get_run(second["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.data.tags["rlcore.stage"] for r in children) == ["evaluate", "promote", "train"]  # data_prep cached
    train = next(r for r in children if r.data.tags["rlcore.stage"] == "train")
    assert train.data.params["trainer.total_steps"] == "2"
    history = client.get_metric_history(train.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2]
    # Logged while training ran: step 1 reached MLflow before the step-2 checkpoint was written.
    step1_ms = next(m.timestamp for m in history if m.step == 1)
    assert step1_ms < (Path(second["run_dir"]) / "checkpoints" / "step_00000002" / "COMPLETE.json").stat().st_mtime * 1000
    # One MLflow run per stage and pipeline run, nothing else (no run of the training's own).
    everything = client.search_runs([parent.info.experiment_id])
    assert sorted(r.data.tags["rlcore.stage"] for r in everything) == sorted(
        ["pipeline", "data_prep", "train", "evaluate", "promote"] + ["pipeline", "train", "evaluate", "promote"])
    assert all(r.data.tags.get("mlflow.parentRunId") or r.data.tags["rlcore.stage"] == "pipeline" for r in everything)
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model-training view

    # The data as MLflow datasets, rlcore's fingerprints as digests.
    inputs = {d.dataset.name: d for d in client.get_run(train.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"train", "val"}
    assert {t.key: t.value for t in inputs["train"].tags}["rlcore.dataset_fingerprint"] == second["dataset_fingerprint"]
    assert {t.key: t.value for t in inputs["train"].tags}["mlflow.data.context"] == "training"

    # Prefect and MLflow point at each other: the runs carry the flow run's id, the flow run an
    # artifact naming its MLflow run.
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert flow_run_id == second["prefect_flow_run_id"]
    assert {r.data.tags["prefect.flow_run_id"] for r in children} == {flow_run_id}
    api, _ = prefect_api
    body = {"artifacts": {"key": {"any_": ["mlflow-run"]}}}
    artifacts = [(a["key"], a["description"], a["flow_run_id"])
                 for a in PREFECT_HTTP.post(f"{api}/artifacts/filter", json=body, timeout=scaled(10)).json()]
    assert (f"mlflow_run_id={second['mlflow_run_id']}" in [a[1] for a in artifacts])
    assert {str(a[2]).replace("-", "") for a in artifacts if a[1].endswith(second["mlflow_run_id"])} == {
        flow_run_id.replace("-", "")}
