"""train: one rlcore training run under the health guard, warm-started from the champion when
configured. A retry resumes from the newest complete checkpoint of the same run directory."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlcore.config import config_from_dict
from rlcore.lifecycle import pipeline_run, ray_job, stages
from rlcore.lifecycle.results import PipelineContext, PreparedData, RegisteredVersion, RewardModelInUse, SftResult, TrainResult
from rlcore.lifecycle.retry import LOOKUP_RETRIES, STAGE_RETRIES, retry_if_transient
from rlcore.redact import redacts_errors  # a failed task's or flow's message is stored by Prefect


@task(name="train", retries=STAGE_RETRIES, retry_delay_seconds=5, retry_condition_fn=retry_if_transient, timeout_seconds=6 * 3600,
      cache_policy=NO_CACHE)
@redacts_errors
def train_task(config: dict[str, Any], prepared: PreparedData, workdir: str, ctx: PipelineContext,
               champion: RegisteredVersion | None = None, reward_model: RewardModelInUse | None = None,
               ray_address: str | None = None) -> TrainResult:
    """`ray_address` (a cluster's job server): the stage runs there as a Ray job, its log in this task's."""
    if ray_address is not None:  # "" is refused by run_stage_as_job, not read as "run here"
        return ray_job.run_stage_as_job(ray_address, "train", config, dict(  # type: ignore[return-value]
            prepared=prepared, workdir=workdir, ctx=ctx, champion=champion, reward_model=reward_model),
            workdir=workdir, ctx=ctx, log_line=get_run_logger().info)
    return stages.train_stage(config_from_dict(config), prepared, workdir, ctx, champion, reward_model)


@task(name="sft", retries=STAGE_RETRIES, retry_delay_seconds=5, retry_condition_fn=retry_if_transient, timeout_seconds=6 * 3600,
      cache_policy=NO_CACHE)
@redacts_errors
def sft_task(config: dict[str, Any], sft: dict[str, Any], workdir: str, ctx: PipelineContext) -> SftResult:
    """The supervised warm start (reused when its inputs were trained on before; a retry resumes)."""
    return stages.sft_stage(config_from_dict(config), sft, workdir, ctx)


@task(name="champion", retries=LOOKUP_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
@redacts_errors
def champion_task(config: dict[str, Any], workdir: str) -> RegisteredVersion | None:
    return stages.champion_stage(config_from_dict(config), workdir)


@flow(name="train")
@redacts_errors
def train(config_path: str | None = None, overrides: list[str] | None = None, workdir: str = "runs/pipeline",
          run_name: str | None = None) -> TrainResult:
    """Train on the config's data as given (no prep), recorded as its own MLflow run."""
    config = pipeline_run.load_pipeline_config(config_path, overrides or [])
    run_name = run_name or pipeline_run.new_run_name()
    ctx = pipeline_run.start_pipeline(config, workdir, run_name)
    prepared: PreparedData = {"train_file": config.data.train_files[0],
                              "val_file": (config.data.val_files or config.data.train_files)[0],
                              "fingerprint": stages.data_prep_key(config)}
    tree = config.model_dump(mode="json")
    result = train_task(tree, prepared, workdir, ctx, champion_task(tree, workdir))
    pipeline_run.finish_pipeline(config, ctx, {"steps": result["steps"], "candidate_dir": result["candidate_dir"]})
    return result
