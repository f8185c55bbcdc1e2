"""rl_pipeline: data_prep -> [sft] -> [reward model] -> train -> evaluate -> promote, one MLflow run with a nested run
per stage. With `sft` (an SFT data file and/or config), the base model is first fine-tuned on it
(`rlcore sft`'s recipe) and RL starts from, and measures KL against, that warm start. Task
retries (train resumes from its newest checkpoint), timeouts, and data_prep cached by input
fingerprint. Runs on any data file an `rlcore.data.arrived` event names (`data_path`).

`reward="model"` is classic RLHF: after data_prep, a reward model is trained on preference pairs
(`reward_config_path`, a config with `algorithm.name: rm`), evaluated against the champion reward
model, registered as its own MLflow model and gated on pairwise accuracy; the policy is then
trained against the champion reward model (`reward_model.path`), and its version's lineage names it.
Its evaluation scores the answers of the start model and the candidate by that reward model too.

`ray_address` (a Ray cluster's job server, `http://head:8265`) runs the train and evaluate stages
as Ray jobs on that cluster (`rlcore.lifecycle.ray_job`): each job's log streams into its task's
log, its id is tagged on the stage's MLflow run, and a failed or stopped job fails the task with
its reason (a failed train job is retried: the next job resumes from the newest intact
checkpoint). Without it, every stage runs in this process.

The flow run is named after the pipeline run (`run_name`, else a fresh `pipeline-<time>-<hex>`),
so Prefect, MLflow and every webhook notification, the server's crash ones included
(rlcore.lifecycle.automations), name a run the same way. A run that fails or crashes is recorded
by the flow's hooks (rlcore.lifecycle.run_end): its open MLflow runs end FAILED or KILLED with the
reason, and the webhook gets one `failed` or `crashed`. Served, the run sends rlcore's heartbeats
while it runs (`served_heartbeat`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.utilities.annotations import NotSet

from rlcore.example.overrides import example_overrides, example_rm_overrides
from rlcore.flows.data_prep import prepare_data
from rlcore.flows.evaluate import evaluate_task
from rlcore.flows.promote import promote_task
from rlcore.flows.reward_model import evaluate_reward_model_task, reward_model_in_use_task, train_reward_model_task
from rlcore.flows.train import champion_task, sft_task, train_task
from rlcore.lifecycle import flow_secrets, pipeline_run, rm_plan, run_end, stages
from rlcore.lifecycle.automations import served_heartbeat
from rlcore.lifecycle.job_server import job_server_url
from rlcore.lifecycle.results import Evaluation, Promotion, RewardModelInUse, Summary
from rlcore.redact import redacts_errors


def pipeline_run_name() -> str:
    """The flow run's name: the `run_name` parameter, else a new pipeline run name (Prefect calls
    this as the run starts, inside its flow-run context)."""
    from prefect.runtime import flow_run

    return flow_run.parameters.get("run_name") or pipeline_run.new_run_name()


def _current_run_name() -> str:
    """The name pipeline_run_name gave this flow run (a new one when called outside Prefect)."""
    from prefect.runtime import flow_run

    return flow_run.name or pipeline_run.new_run_name()


@flow(name="rl_pipeline", flow_run_name=pipeline_run_name, on_failure=[run_end.on_failure], on_crashed=[run_end.on_crashed],
      on_cancellation=[run_end.on_cancellation])
@redacts_errors  # a failed run's message is kept by Prefect and sent to the webhook
def rl_pipeline(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    data_path: str | None = None,
    example: bool = False,
    workdir: str = "runs/pipeline",
    val_fraction: float = 0.1,
    run_name: str | None = None,
    sft: dict[str, Any] | None = None,
    reward: str = "rule",
    reward_config_path: str | None = None,
    reward_overrides: list[str] | None = None,
    ray_address: str | None = None,
    retries: int | None = None,
) -> Summary:
    """`example=True` points the config at the built-in tiny example (before `overrides`; and the
    reward model's config at its preference set).
    `sft`: {"data_path", "config_path", "overrides"} of a supervised warm start (see
    `rlcore.lifecycle.stages.sft_stage`); None: RL starts from `model.path` as given.
    `reward`: "rule" (the config's reward) or "model" (train and gate a reward model first, see the
    module's doc).
    `retries`: how many times each stage is tried again after a transient failure (None:
    rlcore.lifecycle.retry.STAGE_RETRIES; `pipeline run/serve --retries`); a data/config error or a
    process death is never retried."""
    # the secrets among the parameters come from this process's environment: Prefect stores them redacted
    config_path, overrides, data_path, sft, reward_config_path, reward_overrides, ray_address = flow_secrets.unseal({
        "config_path": config_path, "overrides": overrides, "data_path": data_path, "sft": sft,
        "reward_config_path": reward_config_path, "reward_overrides": reward_overrides, "ray_address": ray_address,
    }).values()
    with served_heartbeat():  # served: liveness events until this returns or raises, none after
        if ray_address is not None:  # before any stage: "" or a malformed address is one line, not a local run
            job_server_url(ray_address)
        if retries is not None and retries < 0:
            raise ValueError(f"retries={retries}: expected 0 or more")
        tries = NotSet if retries is None else retries  # each stage task's (NotSet: the task's own)
        base = example_overrides() if example else []
        rm_config = None
        if reward == "model":
            rm_config = pipeline_run.load_pipeline_config(reward_config_path, (example_rm_overrides() if example else [])
                                                    + list(reward_overrides or []))
            base.append(f"reward_model.path={rm_plan.champion_alias_uri(rm_config)}")  # resolved below
        elif reward != "rule":
            raise ValueError(f"reward={reward!r}: expected 'rule' or 'model'")
        config = pipeline_run.load_pipeline_config(config_path, base + list(overrides or []), data_path)
        if rm_config is not None:
            rm_plan.check_reward_model_config(rm_config, config)
        tree = config.model_dump(mode="json")
        workdir = str(Path(workdir).resolve())
        ctx = pipeline_run.start_pipeline(config, workdir, run_name or _current_run_name(),
                                    trigger={"data_path": data_path} if data_path else None)
        prepared = prepare_data(tree, workdir, val_fraction, ctx, retries=retries)
        if not (Path(prepared["train_file"]).is_file() and Path(prepared["val_file"]).is_file()):
            prepared = prepare_data(tree, workdir, val_fraction, ctx, refresh=True, retries=retries)
        if sft:
            warm = sft_task.with_options(retries=tries)(tree, sft, workdir, ctx)
            tree = {**tree, "model": {**tree["model"], "path": warm["model_dir"]}}
        reward_model: RewardModelInUse | None = None
        rm_promotion: Promotion | None = None
        if rm_config is not None:
            rm_tree = rm_config.model_dump(mode="json")
            rm_champion = champion_task(rm_tree, workdir)
            rm_train = train_reward_model_task.with_options(retries=tries)(rm_tree, workdir, ctx, rm_champion)
            if rm_train["candidate_dir"] and rm_train["model_logged"]:
                rm_eval = evaluate_reward_model_task.with_options(retries=tries)(rm_tree, rm_train["candidate_dir"], rm_champion, workdir, ctx)
                rm_promotion = promote_task.with_options(name="promote_reward_model", retries=tries)(rm_tree, rm_train, rm_eval, workdir, ctx)
            reward_model = reward_model_in_use_task(rm_tree, workdir)  # the champion, this run's or an earlier one
        champion = champion_task(tree, workdir)
        train = train_task.with_options(retries=tries)(tree, prepared, workdir, ctx, champion, reward_model, ray_address=ray_address)
        evaluation: Evaluation | None = None
        promotion: Promotion | None = None
        if train["candidate_dir"]:  # None: stopped by the health guard before any checkpoint
            baseline_dir, baseline_name = (champion["path"], "champion") if champion else (train["reference_model"], "base")
            evaluation = evaluate_task.with_options(retries=tries)(tree, train["candidate_dir"], baseline_dir, baseline_name,
                                       train["reference_model"], prepared["val_file"], workdir, ctx,
                                       start_dir=train["start_model"],
                                       reward_model_dir=reward_model["path"] if reward_model else None,
                                       ray_address=ray_address)
            if train["model_logged"]:  # a version's files are the train run's `model` artifact
                promotion = promote_task.with_options(retries=tries)(tree, train, evaluation, workdir, ctx)
        summary = stages.summarize(ctx, prepared, train, evaluation, promotion, champion, workdir)
        if sft:
            summary["sft_model"] = warm["model_dir"]
        if rm_config is not None:
            summary["reward_model"] = reward_model["uri"] if reward_model else None
            summary["reward_model_version"] = rm_promotion["version"] if rm_promotion else None
            summary["reward_model_champion"] = rm_promotion["promoted"] if rm_promotion else False
            summary["reward_model_pairwise_accuracy"] = rm_promotion["candidate_score"] if rm_promotion else None
            summary["reward_model_reason"] = rm_promotion["reason"] if rm_promotion else None
        pipeline_run.finish_pipeline(config, ctx, summary)
    return summary
