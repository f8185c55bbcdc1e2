"""`rlcore pipeline run` end to end on the tiny example (the session's Prefect server, SQLite MLflow
in the working directory; Prefect's ephemeral mode, with no server, is test_wheel's), twice: the
second run warm-starts from the first one's champion. Both runs happen once, in the module's
`runs` fixture; each test reads them for one thing a user then finds: the summaries and UI links;
the warm start and the promotion decision in the log; versions described, with a few `rlcore.*`
tags; the champion loading with transformers and as an MLflow model that generates; one MLflow run
per stage, the train run's steps logged while training ran; the data as MLflow datasets; Prefect
and MLflow runs pointing at each other. (Every full pipeline run of the suite: tests/pipeline_runs.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import PREFECT_HTTP  # tests/ is on sys.path (pytest rootdir conftest)
from pipeline_runs import QUICK, module_prefect, pipeline_env, run_cli  # tests/ is on sys.path (pytest rootdir conftest)
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]


@dataclasses.dataclass(frozen=True)
class Runs:
    """What the two runs left: their `--json` summaries, the second's log, the working directory
    (and its MLflow store), the Prefect API and the `mlflow-run` artifacts it held after them."""

    work: Path
    first: dict[str, Any]
    second: dict[str, Any]
    second_log: str
    api: str
    artifacts: list[dict[str, Any]]

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.work / 'mlflow.db'}"


@pytest.fixture(scope="module")
def runs(tiny_example, shared_prefect_server, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("pipeline_run")
    work = root / "work"
    work.mkdir()
    with module_prefect(shared_prefect_server, root / "prefect_client") as prefect:
        env = pipeline_env(prefect)
        # A negative margin makes the first candidate the champion whatever 2 steps did to it.
        first = json.loads(run_cli(["pipeline", "run", "--json", *QUICK, "registry.promotion_margin=-1"], work, env).stdout)
        second = run_cli(["pipeline", "run", "--json", *QUICK, "registry.promotion_margin=0.5"], work, env)
        body = {"artifacts": {"key": {"any_": ["mlflow-run"]}}}
        artifacts = PREFECT_HTTP.post(f"{prefect[0]}/artifacts/filter", json=body, timeout=scaled(10)).json()
        return Runs(work, first, json.loads(second.stdout), second.stderr, prefect[0], artifacts)


def test_the_first_run_trains_the_base_model_into_the_first_champion(runs, tiny_example):
    first = runs.first
    assert (runs.work / "mlflow.db").is_file()  # the default store: a SQLite file in the working directory
    assert first["version"] == "1" and first["champion"] is True and first["baseline"] == "base"
    assert first["warm_start"] is None and first["steps"] == 2
    # Same val data, greedy, exactly: the example's greedy choices lead by > 1e-3 logits (test_example_build),
    # so this process's kernels cannot flip an answer of the pinned build's evaluation.
    assert first["accuracy_before"] == pytest.approx(tiny_example.sft_greedy_accuracy)
    assert first["mlflow_ui"].startswith(
        f"mlflow ui --backend-store-uri {runs.uri}  (UI at http://127.0.0.1:5000/#/experiments/")
    assert first["prefect_ui"] == f"Prefect UI at {runs.api.removesuffix('/api')}"  # the server in use, not :4200
    assert first["links"]["mlflow_run"].endswith(f"/runs/{first['mlflow_run_id']}?workflowType=machine_learning")


def test_the_second_run_warm_starts_from_the_champion_and_logs_why_it_is_not_promoted(runs):
    first, second = runs.first, runs.second
    assert second["warm_start"] == "models:/rlcore-tiny/1"
    assert second["baseline"] == "champion"
    assert second["accuracy_before"] == pytest.approx(first["accuracy_after"])  # the champion, re-evaluated
    assert second["version"] == "2" and second["champion"] is False
    assert "does not beat the champion" in second["reason"]
    assert second["dataset_fingerprint"] == first["dataset_fingerprint"]
    assert "Cached" in runs.second_log  # data_prep reused by input fingerprint
    assert (f"rlcore-tiny version 2 not promoted (challenger): accuracy {second['accuracy_after']:.4f} vs the "
            f"champion's {second['accuracy_before']:.4f}: {second['reason']}") in runs.second_log


def test_the_versions_are_described_and_tagged(runs):
    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    registry = ModelRegistry(MlflowStore(runs.uri), "rlcore-tiny")
    assert registry.by_alias("champion").version == "1"
    challenger = registry.by_alias("challenger")
    assert challenger.version == "2" and challenger.tags["rlcore.check"] == "margin"
    assert challenger.tags["rlcore.decision"] == "rejected"
    assert challenger.tags["rlcore.parent_model"] == "models:/rlcore-tiny/1"
    assert challenger.tags["rlcore.dataset_fingerprint"] == runs.first["dataset_fingerprint"]
    assert challenger.tags["rlcore.algorithm"] == "grpo" and "compute_score@" in challenger.tags["rlcore.reward"]
    assert len(challenger.tags) <= 10 and all(k.startswith("rlcore.") for k in challenger.tags)
    assert challenger.description.startswith("Not promoted: **challenger**. accuracy ")
    assert runs.second["reason"] in challenger.description and "grpo from `models:/rlcore-tiny/1`" in challenger.description
    assert registry.get("1").description.startswith("Promoted to **champion**. accuracy ")


def test_the_champion_loads_with_transformers_and_as_an_mlflow_model_that_generates(runs, tiny_example, tmp_path):
    import mlflow
    from transformers import AutoModelForCausalLM

    from rlcore.lifecycle.hf_pyfunc import TextGenerator
    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    champion_dir = ModelRegistry(MlflowStore(runs.uri), "rlcore-tiny").download("champion", tmp_path / "champion")
    model = AutoModelForCausalLM.from_pretrained(champion_dir)
    assert model.config.vocab_size == tiny_example.vocab_size

    # Loaded by its registry URI, it answers prompts (greedy, so exactly what transformers
    # generates from the same folder).
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(runs.uri)
    mlflow.set_registry_uri(runs.uri)
    try:
        served = mlflow.pyfunc.load_model("models:/rlcore-tiny@champion")
    finally:
        mlflow.set_tracking_uri(previous[0])
        mlflow.set_registry_uri(previous[1])
    answers = served.predict(["12+34=", "57+68="], params={"max_new_tokens": 8})
    assert answers == TextGenerator(str(champion_dir)).generate(["12+34=", "57+68="], max_new_tokens=8)
    assert all(isinstance(a, str) and a.strip() for a in answers)


def _stage_runs(runs: Runs):
    """The MLflow client, the second pipeline run's parent run and its stage runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(runs.uri)
    parent = client.get_run(runs.second["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return client, parent, children


def test_one_mlflow_run_per_stage_with_the_steps_logged_while_training_ran(runs):
    client, parent, children = _stage_runs(runs)
    assert sorted(r.data.tags["rlcore.stage"] for r in children) == ["evaluate", "promote", "train"]  # data_prep cached
    train = next(r for r in children if r.data.tags["rlcore.stage"] == "train")
    assert train.data.params["trainer.total_steps"] == "2"
    history = client.get_metric_history(train.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2]
    # Logged while training ran: step 1 reached MLflow before the step-2 checkpoint was written.
    step1_ms = next(m.timestamp for m in history if m.step == 1)
    assert step1_ms < (Path(runs.second["run_dir"]) / "checkpoints" / "step_00000002" / "COMPLETE.json").stat().st_mtime * 1000
    # One MLflow run per stage and pipeline run, nothing else (no run of the training's own).
    everything = client.search_runs([parent.info.experiment_id])
    assert sorted(r.data.tags["rlcore.stage"] for r in everything) == sorted(
        ["pipeline", "data_prep", "train", "evaluate", "promote"] + ["pipeline", "train", "evaluate", "promote"])
    assert all(r.data.tags.get("mlflow.parentRunId") or r.data.tags["rlcore.stage"] == "pipeline" for r in everything)
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model-training view


def test_the_data_is_logged_as_mlflow_datasets_with_rlcore_fingerprints(runs):
    client, _, children = _stage_runs(runs)
    train = next(r for r in children if r.data.tags["rlcore.stage"] == "train")
    inputs = {d.dataset.name: d for d in client.get_run(train.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"train", "val"}
    assert {t.key: t.value for t in inputs["train"].tags}["rlcore.dataset_fingerprint"] == runs.second["dataset_fingerprint"]
    assert {t.key: t.value for t in inputs["train"].tags}["mlflow.data.context"] == "training"


def test_prefect_and_mlflow_runs_point_at_each_other(runs):
    """The MLflow runs carry the flow run's id, the flow run an artifact naming its MLflow run."""
    _, parent, children = _stage_runs(runs)
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    assert flow_run_id == runs.second["prefect_flow_run_id"]
    assert {r.data.tags["prefect.flow_run_id"] for r in children} == {flow_run_id}
    mlflow_run = runs.second["mlflow_run_id"]
    assert f"mlflow_run_id={mlflow_run}" in [a["description"] for a in runs.artifacts]
    assert {str(a["flow_run_id"]).replace("-", "") for a in runs.artifacts if a["description"].endswith(mlflow_run)} == {
        flow_run_id.replace("-", "")}
