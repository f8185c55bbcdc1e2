"""The reward model's stages of the pipeline (`rlcore pipeline run --reward model`): train a reward
model on preference pairs (a config with `algorithm.name: rm`), evaluate it and the registered
champion reward model on the same held-out pairs, register it as its own MLflow model
(`registry.model_name` of its config) and move `champion` by the same gate as a policy's, on
pairwise accuracy. The policy is then trained against the champion reward model, and its
version's lineage names that reward-model version (`stages.train_stage`'s `reward_model`).

Plain functions like `stages`; `rlcore.flows.rl_pipeline` runs them as Prefect tasks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config import Config
from rlcore.lifecycle.evaluation import evaluate_reward_model
from rlcore.lifecycle.fingerprint import files_fingerprint
from rlcore.lifecycle.gate import GatePolicy, decide
from rlcore.lifecycle.lineage import build_lineage, lineage_tags
from rlcore.lifecycle.mlflow_store import CHALLENGER, CHAMPION, ModelRegistry
from rlcore.lifecycle.notify import notify
from rlcore.lifecycle.rm_plan import RewardModelStageError, champion_alias_uri, check_reward_model_config
from rlcore.lifecycle.stages import (
    PIPELINE_TAG,
    _announce,
    _existing_version,
    champion_stage,
    open_store,
    stage_tags,
    train_stage,
)

METRIC = "pairwise_accuracy"
CHANCE = {METRIC: 0.5}  # the baseline of a first reward model: it must beat coin flips by the margin


def reward_model_data(config: Config) -> dict[str, Any]:
    """The reward model's preference files as the train stage reads them (logged as its datasets)
    and their content fingerprint."""
    files = list(config.data.train_files) + list(config.data.val_files)
    return {"train_file": config.data.train_files[0], "val_file": config.data.val_files[0],
            "fingerprint": files_fingerprint(files, extra={"algorithm": "rm"})}


def train_reward_model_stage(config: Config, workdir: str | Path, ctx: dict[str, Any],
                             champion: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train the reward model (warm-started from the champion reward model when
    `registry.warm_start`); its candidate is the newest checkpoint's `reward_model/` folder."""
    return train_stage(config, reward_model_data(config), workdir, ctx, champion,
                       stage="train_reward_model", role="reward_model", keep_data=True)


def evaluate_reward_model_stage(config: Config, candidate_dir: str, champion: dict[str, Any] | None,
                                workdir: str | Path, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """The candidate and the champion reward model (or chance) on the same held-out pairs."""
    files = list(config.data.val_files)
    candidate = evaluate_reward_model(candidate_dir, files, config)
    baseline, name = (evaluate_reward_model(champion["path"], files, config), "champion") if champion else (dict(CHANCE), "chance")
    out = {"candidate": candidate, "baseline": baseline, "baseline_name": name, "candidate_dir": candidate_dir,
           "val_files": files}
    if ctx is not None:
        store = open_store(config, workdir)
        run_id = store.start_run("evaluate_reward_model", ctx["run_id"], {**stage_tags(ctx, "evaluate_reward_model"),
                                                                          "baseline": name})
        store.log_metrics(run_id, {**{f"candidate/{k}": v for k, v in candidate.items()},
                                   **{f"{name}/{k}": v for k, v in baseline.items()}})
        store.log_json(run_id, out, "evaluation.json")
        store.end_run(run_id)
        out["run_id"] = run_id
    return out


def promote_reward_model_stage(config: Config, train: dict[str, Any], evaluation: dict[str, Any],
                               workdir: str | Path, ctx: dict[str, Any]) -> dict[str, Any]:
    """Register the candidate reward model as a new version of its own registered model;
    `champion` when it beats the champion's pairwise accuracy by `registry.promotion_margin`,
    else `challenger`."""
    policy = GatePolicy.from_config(config.registry)
    policy = GatePolicy(metric=METRIC, margin=policy.margin, max_kl=policy.max_kl, max_length_ratio=policy.max_length_ratio)
    decision = decide(evaluation["candidate"], evaluation["baseline"], policy, evaluation["baseline_name"])
    store = open_store(config, workdir)
    registry = ModelRegistry(store, config.registry.model_name)
    data = reward_model_data(config)
    lineage = build_lineage(config=train["config"], dataset_fingerprint=data["fingerprint"], data_sources=[],
                            parent_model=train["parent_model"],
                            extra={"pipeline_run": ctx["run_name"], "evaluation": {k: evaluation[k] for k in (
                                "candidate", "baseline", "baseline_name")}})
    store.log_json(train["run_id"], lineage, "lineage.json")
    run_id = store.start_run("promote_reward_model", ctx["run_id"], stage_tags(ctx, "promote_reward_model"))
    store.log_json(run_id, lineage, "lineage.json")
    alias = CHAMPION if decision.promote else CHALLENGER
    decision_tags = {"rlcore.decision": "promoted" if decision.promote else "rejected", "rlcore.check": decision.check}
    cand, base = evaluation["candidate"][METRIC], evaluation["baseline"][METRIC]
    description = (f"{'Promoted to **champion**' if decision.promote else 'Not promoted: **challenger**'}. Reward model: "
                   f"held-out pairwise accuracy {cand:.4f} vs the {evaluation['baseline_name']}'s {base:.4f} "
                   f"({cand - base:+.4f}) on {int(evaluation['candidate']['num_pairs'])} pairs.\n\nWhy: {decision.reason}.\n\n"
                   f"Trained from `{train['parent_model']}`, pipeline run `{ctx['run_name']}`; the full lineage is "
                   f"`lineage.json` of MLflow run `{train['run_id']}`.")
    version = _existing_version(registry, ctx["run_name"])
    if version is None:
        tags = {**lineage_tags(lineage), PIPELINE_TAG: ctx["run_name"], **decision_tags}
        version = registry.register(train["run_id"], "model", tags=tags, description=description).version
    else:  # a retried promote: the version this pipeline run registered, decided again
        registry.set_tags(version, decision_tags)
        registry.describe(version, description)
    registry.set_alias(alias, version)
    store.set_tags(run_id, {"version": version, "alias": alias, "decision": decision.check, "reason": decision.reason})
    store.end_run(run_id)
    _announce(f"{config.registry.model_name} version {version} "
              f"{'promoted to champion' if decision.promote else 'not promoted (challenger)'}: {METRIC} "
              f"{cand:.4f} vs the {evaluation['baseline_name']}'s {base:.4f}: {decision.reason}")
    result = {"version": version, "alias": alias, "promoted": decision.promote, "reason": decision.reason,
              "check": decision.check, "model": config.registry.model_name, "uri": registry.uri(alias),
              "pairwise_accuracy": cand}
    notify(config.registry.webhook_url, "promoted" if decision.promote else "rejected", {
        "pipeline_run": ctx["run_name"], **result, "evaluation": {k: evaluation[k] for k in ("candidate", "baseline", "baseline_name")}})
    return result


def reward_model_in_use(config: Config, workdir: str | Path) -> dict[str, Any]:
    """The champion reward model (downloaded): what the policy trains against, with the name,
    version and `models:/` uri its lineage records."""
    champion = champion_stage(config, workdir)
    if champion is None:
        raise RewardModelStageError(f"no champion version of the reward model {config.registry.model_name!r} to train "
                                    "the policy against: the first candidate was not promoted (see the "
                                    "promote_reward_model stage), or training it stopped before a checkpoint")
    name = config.registry.model_name
    return {**champion, "name": name, "uri": f"models:/{name}/{champion['version']}"}


__all__ = [
    "METRIC", "RewardModelStageError", "champion_alias_uri", "check_reward_model_config", "evaluate_reward_model_stage",
    "promote_reward_model_stage", "reward_model_data", "reward_model_in_use", "train_reward_model_stage",
]
