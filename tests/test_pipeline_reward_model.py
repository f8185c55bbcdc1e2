"""`rlcore pipeline run --reward model` on the tiny example: data_prep -> reward-model training ->
policy training (PPO against the champion reward model) -> evaluation -> promotion, in one run
(the session's Prefect server, SQLite MLflow in the working directory). The reward model is registered as its
own MLflow model (a folder transformers loads, an MLflow model that scores pairs), the policy
version's lineage names the reward-model version it was trained against, and a later reward-model
candidate goes through the same champion/challenger gate on pairwise accuracy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pipeline_runs import module_prefect, pipeline_env, run_cli  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import CONFIG_DIR

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.pipeline]

POLICY = ["trainer.total_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
          "data.val_batch_size=400"]
RM = ["trainer.total_steps=30", "trainer.val_every=30", "trainer.save_every=30", "trainer.val_before_train=false",
      "registry.promotion_margin=-1"]  # the first reward model becomes champion whatever 30 steps did


@dataclasses.dataclass(frozen=True)
class RMRun:
    """The run's `--json` summary, its log, and its working directory (and MLflow store)."""

    summary: dict[str, Any]
    log: str
    work: Path

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.work / 'mlflow.db'}"


@pytest.fixture(scope="module")
def rm_run(tiny_example, shared_prefect_server, tmp_path_factory) -> RMRun:
    root = tmp_path_factory.mktemp("pipeline_rm")
    work = root / "work"
    work.mkdir()
    args = ["pipeline", "run", "--json", "--algorithm", "ppo", "--reward", "model"]
    args += [a for o in RM for a in ("--reward-override", o)]
    with module_prefect(shared_prefect_server, root / "prefect_client") as prefect:
        done = run_cli([*args, *POLICY], work, pipeline_env(prefect), timeout=400)
    return RMRun(json.loads(done.stdout), done.stderr, work)


def test_the_pipeline_trains_a_reward_model_then_ppo_against_it(rm_run):
    summary = rm_run.summary
    assert summary["reward_model"] == "models:/rlcore-tiny-rm/1"
    assert summary["reward_model_version"] == "1" and summary["reward_model_champion"] is True
    assert summary["reward_model_pairwise_accuracy"] > 0.5
    assert summary["version"] == "1" and summary["steps"] == 2
    # RLHF from the start (no champion here: the baseline is the base model, where training began), with
    # the reward model's score of the greedy answers before and after beside the rule-judged accuracy
    assert summary["warm_start"] is None and summary["baseline"] == "base" and summary["accuracy_start"] is None
    assert isinstance(summary["reward_model_score_start"], float) and isinstance(summary["reward_model_score_after"], float)
    assert summary["links"]["model_version"].endswith("/#/models/rlcore-tiny/versions/1?workflowType=machine_learning")
    assert "rlcore: critic: a new value head (score, one value per token" in rm_run.log
    assert "MISSING" not in rm_run.log and "\x1b[" not in rm_run.log


def test_the_reward_model_is_registered_as_a_model_that_loads_and_scores_pairs(rm_run, tiny_example, tmp_path):
    import mlflow
    from transformers import AutoModelForSequenceClassification

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    summary, uri = rm_run.summary, rm_run.uri
    rm_registry = ModelRegistry(MlflowStore(uri), "rlcore-tiny-rm")
    rm_v1 = rm_registry.by_alias("champion")
    assert rm_v1.version == "1" and rm_v1.tags["rlcore.algorithm"] == "rm" and rm_v1.tags["rlcore.decision"] == "promoted"
    # described and tagged as a reward model: pairwise accuracy, its data and base; no policy reward
    assert rm_v1.tags["rlcore.kind"] == "reward_model" and "rlcore.reward" not in rm_v1.tags
    assert float(rm_v1.tags["rlcore.pairwise_accuracy"]) == pytest.approx(summary["reward_model_pairwise_accuracy"], abs=1e-4)
    assert rm_v1.description.startswith("Promoted to **champion**. Reward model (a sequence classifier scoring a prompt "
                                        "and a response): held-out pairwise accuracy ")
    assert "dpo_train.parquet" in rm_v1.description and str(tiny_example.model_dir) in rm_v1.description
    assert rm_registry.client.get_registered_model("rlcore-tiny-rm").description.startswith("rlcore reward models")
    rm_dir = rm_registry.download("1", tmp_path / "rm")
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir)  # as is
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tiny_example.pad_token_id
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:  # the registered reward model is an MLflow model that scores (prompt, response) pairs
        served = mlflow.pyfunc.load_model("models:/rlcore-tiny-rm@champion")
    finally:
        mlflow.set_tracking_uri(previous[0])
        mlflow.set_registry_uri(previous[1])
    import pandas as pd

    scores = served.predict(pd.DataFrame({"prompt": ["57+68=", "57+68="], "response": ["#### 125", "#### 115"]}))
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)


def test_the_policy_version_names_the_reward_model_it_was_trained_against(rm_run, tmp_path):
    from mlflow.tracking import MlflowClient

    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    summary, uri = rm_run.summary, rm_run.uri
    policy = ModelRegistry(MlflowStore(uri), "rlcore-tiny").get("1")
    assert policy.tags["rlcore.reward_model"] == "models:/rlcore-tiny-rm/1"  # the lineage names the reward model
    assert policy.tags["rlcore.reward"] == "models:/rlcore-tiny-rm/1"  # what it optimised (rule_weight 0: not the rule)
    assert policy.tags["rlcore.kind"] == "policy" and "Trained against reward model `models:/rlcore-tiny-rm/1`" in policy.description
    client = MlflowClient(uri)
    lineage_path = client.download_artifacts(policy.run_id, "lineage.json", str(tmp_path))
    lineage = json.loads(open(lineage_path).read())
    assert lineage["reward_model"] == {"name": "rlcore-tiny-rm", "version": "1", "uri": "models:/rlcore-tiny-rm/1"}
    assert lineage["reward"]["reward_model"] == {**lineage["reward_model"], "weight": 1.0}
    assert lineage["reward"]["rule"]["weight"] == 0.0 and "tiny_arith" in lineage["reward"]["rule"]["functions"]
    assert lineage["config"]["reward_model"]["path"].endswith("registry/rlcore-tiny-rm/v1")
    parent = client.get_run(summary["mlflow_run_id"])
    stages = sorted(r.data.tags["rlcore.stage"] for r in client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"))
    assert stages == ["data_prep", "evaluate", "evaluate_reward_model", "promote", "promote_reward_model", "train",
                      "train_reward_model"]


def test_a_second_reward_model_goes_through_the_same_gate_on_pairwise_accuracy(rm_run):
    """Its stages in this process, on the run's working directory and store: judged against the
    champion's pairwise accuracy on the same pairs."""
    from rlcore.config import load_config
    from rlcore.example.overrides import example_rm_overrides
    from rlcore.lifecycle import pipeline_run, promotion, rm_stages
    from rlcore.lifecycle import stages as lifecycle
    from rlcore.lifecycle.mlflow_store import MlflowStore, ModelRegistry

    summary, uri, work = rm_run.summary, rm_run.uri, rm_run.work
    rm_config = load_config(CONFIG_DIR / "tiny_rm.yaml", example_rm_overrides() + [
        "trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=2", "trainer.val_before_train=false",
        "registry.promotion_margin=0.5", f"tracking.mlflow_uri={uri}", "registry.warm_start=false"])
    rm_registry = ModelRegistry(MlflowStore(uri), "rlcore-tiny-rm")
    ctx = pipeline_run.start_pipeline(rm_config, work, "second-rm")
    champion = lifecycle.champion_stage(rm_config, work)
    train = rm_stages.train_reward_model_stage(rm_config, work, ctx, champion)
    evaluation = rm_stages.evaluate_reward_model_stage(rm_config, train["candidate_dir"], champion, work, ctx)
    assert evaluation["baseline_name"] == "champion"
    assert evaluation["baseline"]["pairwise_accuracy"] == pytest.approx(summary["reward_model_pairwise_accuracy"])
    decided = promotion.promote_stage(rm_config, train, evaluation, work, ctx)  # the policy's promotion, by the trained role
    assert decided["version"] == "2" and decided["promoted"] is False and decided["check"] == "margin"
    assert rm_registry.by_alias("champion").version == "1" and rm_registry.by_alias("challenger").version == "2"
    assert rm_stages.reward_model_in_use(rm_config, work)["uri"] == "models:/rlcore-tiny-rm/1"
