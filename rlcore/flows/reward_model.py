"""The reward model's tasks of the pipeline (`rl_pipeline(reward="model")`): train a reward model,
evaluate it against the champion reward model, and fetch the champion the policy then trains
against. Thin over `rlcore.lifecycle.rm_stages`; it is registered and gated by the policy's
`promote` task (`rlcore.flows.promote`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlcore.config import config_from_dict
from rlcore.lifecycle import rm_stages
from rlcore.lifecycle.results import Evaluation, PipelineContext, RegisteredVersion, RewardModelInUse, TrainResult
from rlcore.lifecycle.retry import LOOKUP_RETRIES, STAGE_RETRIES, retry_if_transient
from rlcore.redact import redacts_errors  # a failed task's or flow's message is stored by Prefect


@task(name="train_reward_model", retries=STAGE_RETRIES, retry_delay_seconds=5, retry_condition_fn=retry_if_transient,
      timeout_seconds=6 * 3600, cache_policy=NO_CACHE)
@redacts_errors
def train_reward_model_task(config: dict[str, Any], workdir: str, ctx: PipelineContext,
                            champion: RegisteredVersion | None = None) -> TrainResult:
    return rm_stages.train_reward_model_stage(config_from_dict(config), workdir, ctx, champion)


@task(name="evaluate_reward_model", retries=STAGE_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient,
      timeout_seconds=3600, cache_policy=NO_CACHE)
@redacts_errors
def evaluate_reward_model_task(config: dict[str, Any], candidate_dir: str, champion: RegisteredVersion | None,
                               workdir: str, ctx: PipelineContext) -> Evaluation:
    return rm_stages.evaluate_reward_model_stage(config_from_dict(config), candidate_dir, champion, workdir, ctx)


@task(name="reward_model_in_use", retries=LOOKUP_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
@redacts_errors
def reward_model_in_use_task(config: dict[str, Any], workdir: str) -> RewardModelInUse:
    return rm_stages.reward_model_in_use(config_from_dict(config), workdir)
