"""The reward model's tasks of the pipeline (`rl_pipeline(reward="model")`): train a reward model,
evaluate it against the champion reward model, register and gate it, and fetch the champion the
policy then trains against. Thin over `rlcore.lifecycle.rm_stages`."""

from __future__ import annotations

from typing import Any

from prefect import task

from rlcore.config import config_from_dict
from rlcore.lifecycle import rm_stages
from rlcore.lifecycle.data_prep import retry_if_transient


@task(name="train_reward_model", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_if_transient,
      timeout_seconds=6 * 3600, cache_policy=None)
def train_reward_model_task(config: dict[str, Any], workdir: str, ctx: dict[str, Any],
                            champion: dict[str, Any] | None = None) -> dict[str, Any]:
    return rm_stages.train_reward_model_stage(config_from_dict(config), workdir, ctx, champion)


@task(name="evaluate_reward_model", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_if_transient,
      timeout_seconds=3600, cache_policy=None)
def evaluate_reward_model_task(config: dict[str, Any], candidate_dir: str, champion: dict[str, Any] | None,
                               workdir: str, ctx: dict[str, Any]) -> dict[str, Any]:
    return rm_stages.evaluate_reward_model_stage(config_from_dict(config), candidate_dir, champion, workdir, ctx)


@task(name="promote_reward_model", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=None)
def promote_reward_model_task(config: dict[str, Any], train: dict[str, Any], evaluation: dict[str, Any], workdir: str,
                              ctx: dict[str, Any]) -> dict[str, Any]:
    return rm_stages.promote_reward_model_stage(config_from_dict(config), train, evaluation, workdir, ctx)


@task(name="reward_model_in_use", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=None)
def reward_model_in_use_task(config: dict[str, Any], workdir: str) -> dict[str, Any]:
    return rm_stages.reward_model_in_use(config_from_dict(config), workdir)
