"""promote: register the candidate (a policy or a reward model) as a new model version; move
`champion` to it only when it beats the champion by the margin (a policy: within the KL/length
budget), else tag it `challenger` with the reason. Notifies the webhook either way."""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from rlcore.config import config_from_dict
from rlcore.lifecycle import promotion
from rlcore.lifecycle.results import Evaluation, PipelineContext, Promotion, TrainResult
from rlcore.lifecycle.retry import STAGE_RETRIES, retry_if_transient
from rlcore.redact import redacts_errors  # a failed task's or flow's message is stored by Prefect


@task(name="promote", retries=STAGE_RETRIES, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
@redacts_errors
def promote_task(config: dict[str, Any], train: TrainResult, evaluation: Evaluation, workdir: str,
                 ctx: PipelineContext) -> Promotion:
    return promotion.promote_stage(config_from_dict(config), train, evaluation, workdir, ctx)


@flow(name="promote")
@redacts_errors
def promote(config: dict[str, Any], train: TrainResult, evaluation: Evaluation, workdir: str,
            ctx: PipelineContext) -> Promotion:
    """The stage on its own, given the outputs of the train and evaluate stages."""
    return promote_task(config, train, evaluation, workdir, ctx)
