"""Promotion, for policies and reward models alike: record the candidate's lineage, decide at the
gate, register it as a new version (or re-tag the one a retried stage registered), move
`champion` to it or tag it `challenger`, announce the decision and notify the webhook.

What differs between a policy and a reward model is data, not control flow: a `VersionKind`
says which gate metric decides, what the lineage records, how a version is described and
tagged, and the name of the stage's MLflow run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.config import Config, RegistryConfig
from rlcore.lifecycle.gate import GatePolicy, decide
from rlcore.lifecycle.lineage import build_lineage, lineage_tags, reward_functions, reward_model_tags, reward_record, reward_tag
from rlcore.lifecycle.mlflow_store import CHALLENGER, CHAMPION, ModelRegistry
from rlcore.lifecycle.notify import notify
from rlcore.lifecycle.pipeline_run import PIPELINE_TAG, announce, notification_fields, open_store, stage_tags
from rlcore.lifecycle.results import Evaluation, PipelineContext, Promotion, Role, TrainResult

PAIRWISE_ACCURACY = "pairwise_accuracy"  # the reward model's gate metric (`held_out_pair_metrics`)


@dataclass(frozen=True)
class VersionKind:
    """What a registered version of one kind of model is decided on and described by."""

    stage: str  # the promote stage's MLflow run name
    registered_description: str  # of the registered model (all its versions)
    gate: Callable[[RegistryConfig], GatePolicy]
    lineage: Callable[[Config, TrainResult, Evaluation, PipelineContext], dict[str, Any]]
    tags: Callable[[dict[str, Any]], dict[str, str]]
    describe: Callable[[str, Evaluation, str, str, dict[str, Any], str], str]


def policy_lineage(config: Config, train: TrainResult, evaluation: Evaluation, ctx: PipelineContext) -> dict[str, Any]:
    data = train["data"]
    sources = data_sources(data["train_file"])
    ref = train["reward_model"]
    rm = {"name": ref["name"], "version": ref["version"], "uri": ref["uri"]} if ref else None
    return build_lineage(config=train["config"], dataset_fingerprint=data["fingerprint"], data_sources=sources,
                         parent_model=train["parent_model"], reward_function=config.reward.function,
                         extra={"pipeline_run": ctx["run_name"], "reference_model": train["reference_model"],
                                "evaluation": _evaluation_record(evaluation),
                                # what it optimised: the reward model version it was trained against, the rule scorers
                                "reward": reward_record(train["config"], reward_functions(config.reward.function, sources), rm),
                                **({"reward_model": rm} if rm else {})})


def reward_model_lineage(config: Config, train: TrainResult, evaluation: Evaluation, ctx: PipelineContext) -> dict[str, Any]:
    data = train["data"]
    return build_lineage(config=train["config"], dataset_fingerprint=data["fingerprint"], data_sources=[],
                         parent_model=train["parent_model"],
                         extra={"pipeline_run": ctx["run_name"], "evaluation": _evaluation_record(evaluation),
                                "preference_data": {"train": train["config"]["data"]["train_files"],
                                                    "held_out": evaluation["held_out"]}})


def _evaluation_record(evaluation: Evaluation) -> dict[str, Any]:
    return {"candidate": evaluation["candidate"], "baseline": evaluation["baseline"],
            "baseline_name": evaluation["baseline_name"]}


def _verdict(alias: str) -> str:
    return "Promoted to **champion**" if alias == CHAMPION else "Not promoted: **challenger**"


def version_description(metric: str, evaluation: Evaluation, alias: str, reason: str, lineage: dict[str, Any],
                        train_run_id: str) -> str:
    """A policy version's description (markdown, on its MLflow page): the metric against the
    baseline, the decision and why, and where it came from."""
    cand, base = evaluation["candidate"], evaluation["baseline"]
    name = evaluation["baseline_name"]
    algorithm = lineage.get("config", {}).get("algorithm", {}).get("name", "?")
    reward = lineage.get("reward")
    if reward and reward["reward_model"]:
        scored = (f" Reward model score {cand['reward_model_score']:.3f}." if "reward_model_score" in cand else "")
        against = (f"Trained against reward model `{reward_tag(reward)}` (accuracy is judged by the rule scorer, which "
                   f"{'also weighs in' if float(reward['rule']['weight']) > 0 else 'is not in the reward'}).{scored}\n\n")
    else:
        against = f"Reward: `{reward_tag(reward)}`.\n\n" if reward else ""
    return (f"{_verdict(alias)}. {metric} {cand[metric]:.4f} vs the {name}'s {base[metric]:.4f} "
            f"({cand[metric] - base[metric]:+.4f}) on the same {int(cand.get('num_prompts', 0))} held-out prompts.\n\n"
            f"Why: {reason}.\n\n"
            f"Candidate: accuracy {cand['accuracy']:.4f}, mean reward {cand['mean_reward']:.4f}, KL to the reference "
            f"{cand['kl_to_reference']:.4g}, mean response length {cand['response_length']:.3g} tokens.\n\n"
            f"{against}"
            f"Trained with {algorithm} from `{lineage.get('parent_model')}` on dataset "
            f"`{str(lineage.get('dataset_fingerprint'))[:16]}`, pipeline run `{lineage.get('pipeline_run')}`; the full "
            f"lineage is `lineage.json` of MLflow run `{train_run_id}`.")


def reward_model_description(metric: str, evaluation: Evaluation, alias: str, reason: str, lineage: dict[str, Any],
                             train_run_id: str) -> str:
    """A reward model version's description: held-out pairwise accuracy against the baseline
    (the champion reward model, or chance), the decision and why, and where it came from."""
    cand, base = evaluation["candidate"][metric], evaluation["baseline"][metric]
    candidate = evaluation["candidate"]
    data = lineage.get("preference_data", {})
    files = ", ".join(f"`{Path(f).name}`" for f in data.get("train", [])) or "?"
    held_out = ", ".join(f"`{Path(f).name}`" for f in data.get("held_out", [])) or "?"
    algorithm = lineage.get("config", {}).get("algorithm", {})
    margin = lineage.get("config", {}).get("reward_model", {}).get("margin", 0.0)
    return (f"{_verdict(alias)}. Reward model (a sequence classifier scoring a prompt and a response): held-out "
            f"pairwise accuracy {cand:.4f} vs the {evaluation['baseline_name']}'s {base:.4f} ({cand - base:+.4f}) on the "
            f"same {int(candidate['num_pairs'])} pairs ({held_out}).\n\nWhy: {reason}.\n\n"
            f"Candidate: pairwise accuracy {cand:.4f}, Bradley-Terry loss {candidate.get('rm_loss', float('nan')):.4f} "
            f"(margin {margin:g}), mean score gap chosen - rejected {candidate.get('score_margin', float('nan')):.3f}.\n\n"
            f"Trained ({algorithm.get('name', 'rm')}) from `{lineage.get('parent_model')}` on preference pairs {files} "
            f"(data `{str(lineage.get('dataset_fingerprint'))[:16]}`), pipeline run `{lineage.get('pipeline_run')}`; the "
            f"full lineage is `lineage.json` of MLflow run `{train_run_id}`.")


def _reward_model_gate(registry: RegistryConfig) -> GatePolicy:
    """The policy's margin, on pairwise accuracy (a reward model generates nothing: no KL or length budget)."""
    policy = GatePolicy.from_config(registry)
    return GatePolicy(metric=PAIRWISE_ACCURACY, margin=policy.margin, max_kl=policy.max_kl,
                      max_length_ratio=policy.max_length_ratio)


KINDS: dict[Role, VersionKind] = {
    "actor": VersionKind("promote", "rlcore RL post-trained policies (causal LMs)", GatePolicy.from_config,
                         policy_lineage, lineage_tags, version_description),
    "reward_model": VersionKind("promote_reward_model", "rlcore reward models: one-label sequence classifiers that score "
                                "a prompt and a response, trained on preference pairs", _reward_model_gate,
                                reward_model_lineage, reward_model_tags, reward_model_description),
}


def existing_version(registry: ModelRegistry, run_name: str) -> str | None:
    """A version this pipeline run already registered (a retried promote must not register twice)."""
    try:
        versions = registry.client.search_model_versions(f"name='{registry.name}'")
    except Exception:  # noqa: BLE001 - no registered model yet
        return None
    for mv in versions:
        if (mv.tags or {}).get(PIPELINE_TAG) == run_name:
            return str(mv.version)
    return None


def data_sources(train_file: str) -> list[str]:
    from rlcore.data.io import read_rows

    return sorted({str(r.get("data_source")) for r in read_rows(train_file)})


def promote_stage(config: Config, train: TrainResult, evaluation: Evaluation, workdir: str | Path,
                  ctx: PipelineContext) -> Promotion:
    """Register the candidate of `train` (a policy or a reward model, by its role) as a new version
    of `registry.model_name`: `champion` if it passes the gate against `evaluation`'s baseline,
    else `challenger`, with the reason on the version and in the notification."""
    kind = KINDS[train["role"]]
    policy = kind.gate(config.registry)
    decision = decide(evaluation["candidate"], evaluation["baseline"], policy, evaluation["baseline_name"])
    reason = decision.reason
    if train["stopped"]:  # a health-stopped run may still be promoted on its last healthy checkpoint, but say so
        reason = f"{reason} (training stopped early: {train['stopped']['reason']})"
    store = open_store(config, workdir)
    registry = ModelRegistry(store, config.registry.model_name, description=kind.registered_description)
    lineage = kind.lineage(config, train, evaluation, ctx)
    store.log_json(train["run_id"], lineage, "lineage.json")
    run_id = store.start_run(kind.stage, ctx["run_id"], stage_tags(ctx, kind.stage))
    store.log_json(run_id, lineage, "lineage.json")
    alias = CHAMPION if decision.promote else CHALLENGER
    decision_tags = {"rlcore.decision": "promoted" if decision.promote else "rejected", "rlcore.check": decision.check}
    description = kind.describe(policy.metric, evaluation, alias, reason, lineage, train["run_id"])
    version = existing_version(registry, ctx["run_name"])
    if version is None:
        tags = {**kind.tags(lineage), PIPELINE_TAG: ctx["run_name"], **decision_tags}
        version = registry.register(train["run_id"], "model", tags=tags, description=description).version
    else:  # a retried promote: the version this pipeline run registered, decided again
        registry.set_tags(version, decision_tags)
        registry.describe(version, description)
    registry.set_alias(alias, version)
    store.set_tags(run_id, {"version": version, "alias": alias, "decision": decision.check, "reason": reason})
    store.end_run(run_id)
    announce(f"{config.registry.model_name} version {version} "
             f"{'promoted to champion' if decision.promote else 'not promoted (challenger)'}: {policy.metric} "
             f"{decision.candidate_score:.4f} vs the {evaluation['baseline_name']}'s {decision.baseline_score:.4f}: {reason}")
    result: Promotion = {
        "model": config.registry.model_name, "version": version, "alias": alias, "promoted": decision.promote,
        "reason": reason, "check": decision.check, "metric": policy.metric, "candidate_score": decision.candidate_score,
        "baseline_score": decision.baseline_score, "uri": registry.uri(alias), "version_uri": registry.uri(version)}
    event = "promoted" if decision.promote else "rejected"
    notify(config.registry.webhook_url, event, {
        **notification_fields(ctx, event, config.registry.model_name), **result, "evaluation": _evaluation_record(evaluation),
        "dataset_fingerprint": train["data"]["fingerprint"]})
    return result


__all__ = [
    "KINDS", "PAIRWISE_ACCURACY", "VersionKind", "data_sources", "existing_version", "policy_lineage", "promote_stage",
    "reward_model_description", "reward_model_lineage", "version_description",
]
