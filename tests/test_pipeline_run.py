"""`rlcore pipeline run` end to end on the tiny example (ephemeral Prefect, SQLite MLflow in the
working directory), twice: the second run warm-starts from the first one's champion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import prefect_env  # tests/ is on sys.path (pytest rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "data.val_batch_size=128"]


def pipeline_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(prefect_env(tmp_path / "prefect"), PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rlcore.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow
def test_pipeline_run_twice_warm_starts_from_champion(tiny_example, tmp_path):
    env = pipeline_env(tmp_path)
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
    assert "mlflow ui --backend-store-uri sqlite:///" in first["mlflow_ui"]

    second_proc = run_cli(["pipeline", "run", "--json", *QUICK, "registry.promotion_margin=0.5"], work, env)
    second = json.loads(second_proc.stdout)
    assert second["warm_start"] == "models:/rlcore-tiny/1"
    assert second["baseline"] == "champion"
    assert second["accuracy_before"] == pytest.approx(first["accuracy_after"])  # the champion, re-evaluated
    assert second["version"] == "2" and second["champion"] is False
    assert "does not beat the champion" in second["reason"]
    assert second["dataset_fingerprint"] == first["dataset_fingerprint"]
    assert "Cached" in second_proc.stderr  # data_prep reused by input fingerprint

    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    uri = f"sqlite:///{work / 'mlflow.db'}"
    registry = ModelRegistry(MlflowStore(uri), "rlcore-tiny")
    assert registry.by_alias("champion").version == "1"
    challenger = registry.by_alias("challenger")
    assert challenger.version == "2" and challenger.tags["promotion.check"] == "margin"
    assert challenger.tags["lineage.parent_model"] == "models:/rlcore-tiny/1"
    assert challenger.tags["lineage.dataset_fingerprint"] == first["dataset_fingerprint"]
    model = AutoModelForCausalLM.from_pretrained(registry.download("champion", tmp_path / "champion"))
    assert model.config.vocab_size == tiny_example.vocab_size

    client = MlflowClient(uri)
    parent = client.get_run(second["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.data.tags["rlcore.stage"] for r in children} == {"train", "evaluate", "promote"}  # data_prep was cached
    train = next(r for r in children if r.data.tags["rlcore.stage"] == "train")
    assert train.data.params["trainer.total_steps"] == "2"
    assert {m.step for m in client.get_metric_history(train.info.run_id, "reward/mean")} == {1, 2}
