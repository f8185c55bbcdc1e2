"""rl_pipeline: data_prep -> train -> evaluate -> promote, one MLflow run with a nested run per
stage. Task retries (train resumes from its newest checkpoint), timeouts, and data_prep cached by
input fingerprint. Runs on any data file an `rlcore.data.arrived` event names (`data_path`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # flows/ is not an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefect import flow

from flows.data_prep import prepare_data_task
from flows.evaluate import evaluate_task
from flows.promote import promote_task
from flows.train import champion_task, train_task
from rlcore.example.overrides import example_overrides
from rlcore.lifecycle import stages


@flow(name="rl_pipeline")
def rl_pipeline(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    data_path: str | None = None,
    example: bool = False,
    workdir: str = "runs/pipeline",
    val_fraction: float = 0.1,
    run_name: str | None = None,
) -> dict[str, Any]:
    """`example=True` points the config at the built-in tiny example (before `overrides`)."""
    base = example_overrides() if example else []
    config = stages.load_pipeline_config(config_path, base + list(overrides or []), data_path)
    tree = config.model_dump(mode="json")
    workdir = str(Path(workdir).resolve())
    ctx = stages.start_pipeline(config, workdir, run_name or stages.new_run_name(),
                                trigger={"data_path": data_path} if data_path else None)
    try:
        prepared = prepare_data_task(tree, workdir, val_fraction, ctx)
        if not (Path(prepared["train_file"]).is_file() and Path(prepared["val_file"]).is_file()):
            prepared = prepare_data_task.with_options(refresh_cache=True)(tree, workdir, val_fraction, ctx)
        champion = champion_task(tree, workdir)
        train = train_task(tree, prepared, workdir, ctx, champion)
        evaluation = promotion = None
        if train["candidate_dir"]:  # None: stopped by the health guard before any checkpoint
            baseline_dir, baseline_name = (champion["path"], "champion") if champion else (train["reference_model"], "base")
            evaluation = evaluate_task(tree, train["candidate_dir"], baseline_dir, baseline_name,
                                       train["reference_model"], prepared["val_file"], workdir, ctx)
            if train["model_logged"]:  # a version's files are the train run's `model` artifact
                promotion = promote_task(tree, train, evaluation, prepared, workdir, ctx)
        summary = stages.summarize(ctx, prepared, train, evaluation, promotion, champion, workdir)
    except BaseException as err:
        stages.fail_pipeline(config, ctx, err)
        raise
    stages.finish_pipeline(config, ctx, summary)
    return summary
