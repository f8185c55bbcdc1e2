"""promote: register the candidate as a new model version; move `champion` to it only when it
beats the champion by the margin within the KL/length budget, else tag it `challenger` with the
reason. Notifies the webhook either way."""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from rlcore.config import config_from_dict
from rlcore.lifecycle import stages
from rlcore.lifecycle.data_prep import retry_if_transient


@task(name="promote", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_if_transient, cache_policy=None)
def promote_task(config: dict[str, Any], train: dict[str, Any], evaluation: dict[str, Any], prepared: dict[str, Any],
                 workdir: str, ctx: dict[str, Any]) -> dict[str, Any]:
    return stages.promote_stage(config_from_dict(config), train, evaluation, prepared, workdir, ctx)


@flow(name="promote")
def promote(config: dict[str, Any], train: dict[str, Any], evaluation: dict[str, Any], prepared: dict[str, Any],
            workdir: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """The stage on its own, given the outputs of the train and evaluate stages."""
    return promote_task(config, train, evaluation, prepared, workdir, ctx)
