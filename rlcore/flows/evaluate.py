"""evaluate: held-out accuracy, mean reward, KL to the reference and response length, for a
candidate and for the current champion (or the base model) on the same data."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rlcore.config import config_from_dict
from rlcore.lifecycle import pipeline_run, ray_job, stages
from rlcore.lifecycle.results import Evaluation, PipelineContext
from rlcore.lifecycle.retry import STAGE_RETRIES, retry_if_transient
from rlcore.redact import redacts_errors  # a failed task's or flow's message is stored by Prefect


@task(name="evaluate", retries=STAGE_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, timeout_seconds=3600,
      cache_policy=NO_CACHE)
@redacts_errors
def evaluate_task(config: dict[str, Any], candidate_dir: str, baseline_dir: str, baseline_name: str,
                  reference_dir: str, val_file: str, workdir: str, ctx: PipelineContext | None = None,
                  start_dir: str | None = None, reward_model_dir: str | None = None,
                  ray_address: str | None = None) -> Evaluation:
    """`ray_address` (a cluster's job server): the stage runs there as a Ray job, its log in this task's."""
    if ray_address is not None:  # "" is refused by run_stage_as_job, not read as "run here"
        return ray_job.run_stage_as_job(ray_address, "evaluate", config, dict(  # type: ignore[return-value]
            candidate_dir=candidate_dir, baseline_dir=baseline_dir, baseline_name=baseline_name,
            reference_dir=reference_dir, val_file=val_file, workdir=workdir, ctx=ctx, start_dir=start_dir,
            reward_model_dir=reward_model_dir), workdir=workdir, ctx=ctx, log_line=get_run_logger().info)
    return stages.evaluate_stage(config_from_dict(config), candidate_dir, baseline_dir, baseline_name,
                                 reference_dir, val_file, workdir, ctx, start_dir=start_dir, reward_model_dir=reward_model_dir)


@flow(name="evaluate")
@redacts_errors
def evaluate(candidate_dir: str, val_file: str, config_path: str | None = None, overrides: list[str] | None = None,
             workdir: str = "runs/pipeline") -> Evaluation:
    """Candidate vs the registry's champion (or `model.path` when there is none)."""
    config = pipeline_run.load_pipeline_config(config_path, overrides or [])
    tree = config.model_dump(mode="json")
    champion = stages.champion_stage(config, workdir)
    baseline_dir, name = (champion["path"], "champion") if champion else (config.model.path, "base")
    return evaluate_task(tree, candidate_dir, baseline_dir, name, config.model.path, val_file, workdir)
